"""Shared helpers for gradient tests: differentiate a small forward graph and run it in ORT.

``onnx_grads`` takes a forward model with one floating-point output ``y``, makes the scalar
loss ``sum(y * w)`` with a fixed random ``w`` (so every output element gets a distinct
upstream gradient), differentiates with memcc, runs forward and backward in ORT and returns
the loss and the gradients. ``torch_grads`` does the same with a torch function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from memcc.frontend.autodiff import differentiate
from memcc.frontend.emit import Emitter
from memcc.frontend.load import load_graph


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    """inputs/outputs: (name, elem_type, shape) triples; initializers: {name: ndarray}."""
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def upstream_weight(shape, seed: int = 123) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def grad_graph(model: onnx.ModelProto, wrt: Sequence[str], output: str | None = None,
               seed: int = 123):
    """The graph whose outputs are ``[loss, *grads of wrt]``, ready for ORT."""
    graph = load_graph(model)
    y = output or graph.outputs[0]
    yi = graph.info[y]
    emit = Emitter(graph, prefix="loss/")
    w = emit.const(upstream_weight(yi.shape, seed), yi.dtype, name="upstream_w")
    prod = emit.mul(y, w)
    loss = emit.reduce_sum(prod, None, keepdims=False)
    # Inputs we differentiate with respect to must be graph inputs for ORT to take feeds.
    grads = differentiate(graph, loss, list(wrt))
    missing = [n for n in wrt if n not in grads]
    assert not missing, f"no gradient produced for {missing}"
    graph.outputs = [loss] + [grads[n] for n in wrt]
    # Gradient values can alias each other or the seed; name outputs distinctly via Identity.
    seen: set[str] = set()
    outs = []
    for name in graph.outputs:
        if name in seen or name in graph.inputs or name in graph.initializers:
            name = Emitter(graph).unary("Identity", name)
        seen.add(name)
        outs.append(name)
    graph.outputs = outs
    return graph


def onnx_grads(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: Sequence[str],
               output: str | None = None, seed: int = 123):
    """Return (loss, {name: grad}) computed by memcc's backward graph in ORT (CPU)."""
    graph = grad_graph(model, wrt, output, seed)
    m = graph.to_model()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    res = sess.run(graph.outputs, feeds)
    return float(res[0]), dict(zip(wrt, res[1:], strict=True))


def torch_grads(fn: Callable, feeds: dict[str, np.ndarray], wrt: Sequence[str],
                seed: int = 123):
    """Same loss as ``onnx_grads`` for a torch function ``fn(**tensors) -> y``."""
    import torch

    tensors = {}
    for k, v in feeds.items():
        t = torch.tensor(v)
        if k in wrt:
            t.requires_grad_(True)
        tensors[k] = t
    y = fn(**tensors)
    w = torch.tensor(upstream_weight(tuple(y.shape), seed))
    loss = (y * w).sum()
    loss.backward()
    return float(loss), {k: tensors[k].grad.numpy() for k in wrt}


def assert_close(a: np.ndarray, b: np.ndarray, rtol: float = 1e-3, name: str = "") -> None:
    """Relative error measured against the reference's scale: |a-b|max / max(|b|max, tiny)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"{name}: shape {a.shape} != {b.shape}"
    scale = max(float(np.abs(b).max(initial=0.0)), 1e-6)
    err = float(np.abs(a - b).max(initial=0.0)) / scale
    assert err <= rtol, f"{name}: relative error {err:.2e} > {rtol:.0e}"


def check_against_torch(model: onnx.ModelProto, feeds: dict[str, np.ndarray], fn: Callable,
                        wrt: Sequence[str], rtol: float = 1e-3) -> None:
    """memcc's gradients of ``model`` equal torch autograd's of ``fn`` (same loss)."""
    loss, got = onnx_grads(model, feeds, wrt)
    ref_loss, ref = torch_grads(fn, feeds, wrt)
    assert abs(loss - ref_loss) <= 1e-3 * max(1.0, abs(ref_loss)), (loss, ref_loss)
    for name in wrt:
        assert_close(got[name], ref[name], rtol, name)


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
