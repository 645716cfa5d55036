"""Layers shared by several families, written as plain ONNX ops through ``GraphBuilder``.

Names follow torch/HF module paths: a layer called ``layer1.0.conv1`` owns the parameters
``layer1.0.conv1.weight`` (and ``.bias``), and its output value is called ``layer1.0.conv1``.
"""

from __future__ import annotations

import math

import numpy as np

from models._builder import GraphBuilder


def conv(b: GraphBuilder, x: str, name: str, cin: int, cout: int, kernel: int,
         stride: int = 1, pad: int | None = None, groups: int = 1, bias: bool = False) -> str:
    """Conv2d with He init; ``pad`` defaults to 'same' padding for odd kernels."""
    pad = kernel // 2 if pad is None else pad
    fan_in = cin // groups * kernel * kernel
    w = b.he(f"{name}.weight", [cout, cin // groups, kernel, kernel], fan_in)
    inputs = [x, w]
    if bias:
        inputs.append(b.zeros(f"{name}.bias", [cout]))
    return b.op("Conv", inputs, name=name, kernel_shape=[kernel, kernel],
                strides=[stride, stride], pads=[pad] * 4, group=groups if groups != 1 else None)


def batch_norm(b: GraphBuilder, x: str, name: str, channels: int, training: bool = True) -> str:
    """BatchNormalization; in training mode it normalises with batch statistics (as
    ``torch.nn.BatchNorm2d.train()``) and its extra outputs are the updated running stats."""
    scale = b.ones(f"{name}.weight", [channels])
    bias = b.zeros(f"{name}.bias", [channels])
    mean = b.zeros(f"{name}.running_mean", [channels])
    var = b.ones(f"{name}.running_var", [channels])
    inputs = [x, scale, bias, mean, var]
    if not training:
        return b.op("BatchNormalization", inputs, name=name, epsilon=1e-5, momentum=0.9)
    # ORT requires all three outputs when training_mode=1.
    outs = [name, f"{name}.running_mean_out", f"{name}.running_var_out"]
    return b.op_multi("BatchNormalization", inputs, outputs=outs, epsilon=1e-5, momentum=0.9,
                      training_mode=1)[0]


def relu(b: GraphBuilder, x: str, name: str | None = None) -> str:
    return b.op("Relu", [x], name=name or f"{x}.relu")


def relu6(b: GraphBuilder, x: str, name: str | None = None) -> str:
    """ReLU6 as Clip(x, 0, 6) (min/max are inputs since opset 11)."""
    return b.op("Clip", [x, b.scalar(0.0), b.scalar(6.0)], name=name or f"{x}.relu6")


def linear(b: GraphBuilder, x: str, name: str, fin: int, fout: int, std: float | None = None,
           zero_bias: bool = True) -> str:
    """torch.nn.Linear as Gemm(transB=1) with the weight stored [out, in] like torch."""
    std = math.sqrt(2.0 / fin) if std is None else std
    w = b.normal(f"{name}.weight", [fout, fin], std)
    bias = b.zeros(f"{name}.bias", [fout]) if zero_bias else b.normal(f"{name}.bias", [fout], std)
    return b.op("Gemm", [x, w, bias], name=name, transB=1)


def dense(b: GraphBuilder, x: str, name: str, fin: int, fout: int, std: float) -> str:
    """MatMul + Add with the weight stored [in, out] (HF Conv1D layout): works on any rank."""
    w = b.normal(f"{name}.weight", [fin, fout], std)
    bias = b.zeros(f"{name}.bias", [fout])
    y = b.op("MatMul", [x, w], name=f"{name}.matmul")
    return b.op("Add", [y, bias], name=name)


def layer_norm(b: GraphBuilder, x: str, name: str, width: int, eps: float) -> str:
    scale = b.ones(f"{name}.weight", [width])
    bias = b.zeros(f"{name}.bias", [width])
    return b.op("LayerNormalization", [x, scale, bias], name=name, axis=-1, epsilon=eps)


def gelu_tanh(b: GraphBuilder, x: str, name: str) -> str:
    """GPT-2's GELU: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))), with Pow for the cube."""
    cube = b.op("Pow", [x, b.scalar(3.0)], name=f"{name}.pow")
    inner = b.op("Mul", [cube, b.scalar(0.044715)], name=f"{name}.mul_c")
    inner = b.op("Add", [x, inner], name=f"{name}.add_x")
    inner = b.op("Mul", [inner, b.scalar(math.sqrt(2.0 / math.pi))], name=f"{name}.mul_s")
    t = b.op("Tanh", [inner], name=f"{name}.tanh")
    t = b.op("Add", [t, b.scalar(1.0)], name=f"{name}.add_1")
    half = b.op("Mul", [x, b.scalar(0.5)], name=f"{name}.half")
    return b.op("Mul", [half, t], name=name)


def gelu_erf(b: GraphBuilder, x: str, name: str) -> str:
    """BERT's exact GELU: 0.5*x*(1+erf(x/sqrt(2)))."""
    e = b.op("Div", [x, b.scalar(math.sqrt(2.0))], name=f"{name}.div")
    e = b.op("Erf", [e], name=f"{name}.erf")
    e = b.op("Add", [e, b.scalar(1.0)], name=f"{name}.add_1")
    half = b.op("Mul", [x, b.scalar(0.5)], name=f"{name}.half")
    return b.op("Mul", [half, e], name=name)


def split_heads(b: GraphBuilder, x: str, name: str, heads: int, head_dim: int,
                perm: tuple[int, ...] = (0, 2, 1, 3)) -> str:
    """[B, T, H*D] -> [B, H, T, D] (or [B, H, D, T] with perm (0, 2, 3, 1) for keys).

    Reshape uses 0 to copy B and T, so the graph also works with a symbolic batch."""
    r = b.op("Reshape", [x, b.ints([0, 0, heads, head_dim])], name=f"{name}.reshape")
    return b.op("Transpose", [r], name=name, perm=list(perm))


def merge_heads(b: GraphBuilder, x: str, name: str, width: int) -> str:
    """[B, H, T, D] -> [B, T, H*D]."""
    t = b.op("Transpose", [x], name=f"{name}.transpose", perm=[0, 2, 1, 3])
    return b.op("Reshape", [t, b.ints([0, 0, width])], name=name)


def attention_core(b: GraphBuilder, q: str, k_t: str, v: str, name: str, head_dim: int,
                   causal_len: int | None = None, additive_mask: str | None = None) -> str:
    """softmax(q k^T / sqrt(d) [masked]) v on [B, H, T, D] heads (k given as [B, H, D, T])."""
    scores = b.op("MatMul", [q, k_t], name=f"{name}.scores")
    scores = b.op("Div", [scores, b.scalar(math.sqrt(head_dim))], name=f"{name}.scaled")
    if causal_len is not None:
        mask = np.tril(np.ones((causal_len, causal_len), dtype=bool))
        scores = b.op("Where", [b.const(mask, name="causal_mask"), scores, b.scalar(-1e9)],
                      name=f"{name}.masked")
    if additive_mask is not None:
        scores = b.op("Add", [scores, additive_mask], name=f"{name}.masked")
    probs = b.op("Softmax", [scores], name=f"{name}.probs", axis=-1)
    return b.op("MatMul", [probs, v], name=f"{name}.context")
