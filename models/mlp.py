"""Deep multi-layer perceptron: the simplest chain, where activation memory grows with depth."""

from __future__ import annotations

import onnx

from models._builder import GraphBuilder, batch_dim, float_input, logits_output, metadata


def build(batch: int = 4, in_features: int = 32, width: int = 64, depth: int = 3,
          num_classes: int = 10, linear: str = "gemm", seed: int = 0,
          dynamic_batch: bool = False) -> onnx.ModelProto:
    """A ``torch.nn.Sequential`` of ``depth`` hidden ``Linear(width) + ReLU`` layers and a
    ``Linear(num_classes)`` head.

    Options: ``batch``, ``in_features``, ``width`` (hidden size), ``depth`` (hidden layers),
    ``num_classes``, ``linear`` ("gemm": Gemm with torch's [out, in] weights, "matmul":
    MatMul + Add with [in, out] weights), ``seed``, ``dynamic_batch`` (symbolic "batch" dim).
    Input ``input`` [batch, in_features] float32; output ``logits`` [batch, num_classes].
    Large: ``batch=512, in_features=4096, width=4096, depth=16`` (about 270M parameters).
    """
    if linear not in ("gemm", "matmul"):
        raise ValueError(f"linear must be 'gemm' or 'matmul', not {linear!r}")
    options = dict(batch=batch, in_features=in_features, width=width, depth=depth,
                   num_classes=num_classes, linear=linear, seed=seed)
    b = GraphBuilder("mlp", seed)
    n = batch_dim(batch, dynamic_batch)
    x = float_input(b, [n, in_features])
    fin = in_features
    for i in range(depth):
        x = _layer(b, x, f"layers.{i}", fin, width, linear, std=(2.0 / fin) ** 0.5)
        x = b.op("Relu", [x], name=f"layers.{i}.relu")
        fin = width
    x = _layer(b, x, "head", fin, num_classes, linear, std=fin ** -0.5)
    logits_output(b, x, [n, num_classes])
    return b.model(build.__doc__ or "", metadata("mlp", options, num_classes=num_classes))


def _layer(b: GraphBuilder, x: str, name: str, fin: int, fout: int, linear: str,
           std: float) -> str:
    if linear == "gemm":
        w = b.normal(f"{name}.weight", [fout, fin], std)
        bias = b.zeros(f"{name}.bias", [fout])
        return b.op("Gemm", [x, w, bias], name=name, transB=1)
    w = b.normal(f"{name}.weight", [fin, fout], std)
    bias = b.zeros(f"{name}.bias", [fout])
    y = b.op("MatMul", [x, w], name=f"{name}.matmul")
    return b.op("Add", [y, bias], name=name)
