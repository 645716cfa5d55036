"""Reduce* gradient rules against torch autograd, across axes spellings and keepdims."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gradcheck import FLOAT, INT64, assert_close, make_model, onnx_grads, torch_grads
from onnx import helper

from memcc.errors import GradientError

RNG = np.random.default_rng(1)
SHAPE = (2, 3, 4)


def _prod(x, dims, keep):
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, d, keepdim=keep)
    return x


# op -> (torch fn(x, dims, keepdim), input domain)
REFS = {
    "ReduceSum": (lambda x, d, k: x.sum(d, keepdim=k), (-2, 2)),
    "ReduceMean": (lambda x, d, k: x.mean(d, keepdim=k), (-2, 2)),
    "ReduceMax": (lambda x, d, k: x.amax(d, keepdim=k), (-2, 2)),
    "ReduceMin": (lambda x, d, k: x.amin(d, keepdim=k), (-2, 2)),
    "ReduceSumSquare": (lambda x, d, k: (x * x).sum(d, keepdim=k), (-2, 2)),
    "ReduceL1": (lambda x, d, k: x.abs().sum(d, keepdim=k), (-2, 2)),
    "ReduceL2": (lambda x, d, k: torch.linalg.vector_norm(x, 2, d, keepdim=k), (-2, 2)),
    "ReduceLogSumExp": (lambda x, d, k: torch.logsumexp(x, d, keepdim=k), (-2, 2)),
    "ReduceLogSum": (lambda x, d, k: x.sum(d, keepdim=k).log(), (0.5, 2)),
    "ReduceProd": (_prod, (0.5, 1.5)),
}


def reduce_node(op: str, opset: int, axes, keepdims: int, **attrs):
    """The node and initializers spelling ``axes`` the way ``opset`` wants for ``op``."""
    inits = {}
    ins = ["x"]
    axes_as_input = opset >= 18 or (op == "ReduceSum" and opset >= 13)
    if axes is not None and axes_as_input:
        inits["axes"] = np.asarray(axes, dtype=np.int64)
        ins.append("axes")
    elif axes is not None:
        attrs["axes"] = list(axes)
    return helper.make_node(op, ins, ["y"], keepdims=keepdims, **attrs), inits


def check_reduce(op, opset, axes, keepdims, x):
    fn, _ = REFS[op]
    dims = tuple(range(x.ndim)) if axes is None else tuple(a % x.ndim for a in axes)

    def tfn(x):
        return fn(x, dims, bool(keepdims))

    with torch.no_grad():
        ref = tfn(torch.tensor(x))
    nd, inits = reduce_node(op, opset, axes, keepdims)
    model = make_model([nd], [("x", FLOAT, list(x.shape))], [("y", FLOAT, list(ref.shape))],
                       inits, opset)
    loss_o, got = onnx_grads(model, {"x": x}, ["x"])
    loss_t, want = torch_grads(tfn, {"x": x}, ["x"])
    assert abs(loss_o - loss_t) <= 1e-3 * max(1.0, abs(loss_t))
    assert_close(got["x"], want["x"], name=op)


@pytest.mark.parametrize("op", sorted(REFS))
@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axes", [(1,), (0, 2), (-1,), None])
def test_reduce(op, opset, keepdims, axes):
    lo, hi = REFS[op][1]
    x = RNG.uniform(lo, hi, SHAPE).astype(np.float32)
    check_reduce(op, opset, axes, keepdims, x)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
def test_reduce_opset11_attribute_axes(op):
    x = RNG.uniform(-2, 2, SHAPE).astype(np.float32)
    check_reduce(op, 11, (0, 2), 0, x)


@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_max_min_ties_split_evenly(op, opset):
    x = RNG.integers(-1, 2, SHAPE).astype(np.float32)  # many ties
    check_reduce(op, opset, (1,), 1, x)
    check_reduce(op, opset, None, 0, x)


def test_reduce_l2_zero_norm_gives_zero_gradient():
    x = RNG.uniform(-2, 2, SHAPE).astype(np.float32)
    x[:, :, 0] = 0.0
    check_reduce("ReduceL2", 18, (0, 1), 1, x)


NOOP_REFS = {
    "ReduceSum": lambda x: x, "ReduceMean": lambda x: x, "ReduceMax": lambda x: x,
    "ReduceL1": torch.abs, "ReduceL2": torch.abs, "ReduceLogSumExp": lambda x: x,
    "ReduceSumSquare": lambda x: x * x, "ReduceLogSum": torch.log,
}


@pytest.mark.parametrize("op", sorted(NOOP_REFS))
def test_noop_with_empty_axes_matches_ort(op):
    """With no axes and noop_with_empty_axes=1, ORT returns the input (after the op's
    elementwise part: x*x, log x, |x|); the gradient must follow."""
    opset = 13 if op == "ReduceSum" else 18
    x = RNG.uniform(-2, 2, SHAPE).astype(np.float32)
    if op == "ReduceLogSum":
        x = np.abs(x) + 0.5
    nd = helper.make_node(op, ["x", "axes"], ["y"], noop_with_empty_axes=1)
    model = make_model([nd], [("x", FLOAT, list(SHAPE))], [("y", FLOAT, list(SHAPE))],
                       {"axes": np.zeros((0,), np.int64)}, opset)
    loss_o, got = onnx_grads(model, {"x": x}, ["x"])
    loss_t, want = torch_grads(NOOP_REFS[op], {"x": x}, ["x"])
    assert abs(loss_o - loss_t) <= 1e-3 * max(1.0, abs(loss_t))
    assert_close(got["x"], want["x"])


def test_runtime_axes_are_refused():
    x = RNG.uniform(-2, 2, SHAPE).astype(np.float32)
    nd = helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=1)
    model = make_model([nd], [("x", FLOAT, list(SHAPE)), ("axes", INT64, [1])],
                       [("y", FLOAT, [2, 1, 4])], {}, 13)
    with pytest.raises(GradientError, match="axes"):
        onnx_grads(model, {"x": x, "axes": np.array([1], np.int64)}, ["x"])
