"""Elementwise, matrix, softmax and dropout gradient rules against torch autograd."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from gradcheck import FLOAT, assert_close, make_model, onnx_grads, torch_grads, upstream_weight
from onnx import TensorProto, helper

from memcc.errors import GradientError
from memcc.frontend.autodiff import differentiate
from memcc.frontend.emit import Emitter
from memcc.frontend.load import load_graph

RNG = np.random.default_rng(0)


def rand(*shape, lo=-2.0, hi=2.0) -> np.ndarray:
    return RNG.uniform(lo, hi, size=shape).astype(np.float32)


def check(nodes, feeds, fn, wrt, *, opset=17, inits=None, rtol=1e-3):
    """Build a model whose output ``y`` is made by ``nodes`` and compare with torch."""
    with torch.no_grad():
        ref = fn(**{k: torch.tensor(v) for k, v in feeds.items()})
    out_type = helper.np_dtype_to_tensor_dtype(ref.numpy().dtype)
    inputs = [(k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape))
              for k, v in feeds.items()]
    model = make_model(nodes, inputs, [("y", out_type, list(ref.shape))], inits or {}, opset)
    loss_o, got = onnx_grads(model, feeds, wrt)
    loss_t, want = torch_grads(fn, feeds, wrt)
    assert abs(loss_o - loss_t) <= rtol * max(1.0, abs(loss_t)), (loss_o, loss_t)
    for k in wrt:
        assert_close(got[k], want[k], rtol=rtol, name=k)


def node(op, inputs, **attrs):
    return helper.make_node(op, inputs, ["y"], **attrs)


# ---------------------------------------------------------------------- binary arithmetic
@pytest.mark.parametrize("op,fn", [
    ("Add", lambda a, b: a + b),
    ("Sub", lambda a, b: a - b),
    ("Mul", lambda a, b: a * b),
    ("Div", lambda a, b: a / b),
])
@pytest.mark.parametrize("sa,sb", [((2, 3), (2, 3)), ((2, 3, 4), (3, 1)), ((4,), (2, 3, 1))])
def test_binary_broadcast(op, fn, sa, sb):
    feeds = {"a": rand(*sa), "b": rand(*sb, lo=0.5, hi=2.0)}
    check([node(op, ["a", "b"])], feeds, fn, ["a", "b"])


def test_binary_only_one_side_needs_grad():
    feeds = {"a": rand(2, 3), "b": rand(3)}
    check([node("Mul", ["a", "b"])], feeds, lambda a, b: a * b, ["b"])


def test_same_input_twice_accumulates():
    feeds = {"a": rand(2, 3)}
    check([node("Mul", ["a", "a"])], feeds, lambda a: a * a, ["a"])


# ---------------------------------------------------------------------- Pow
@pytest.mark.parametrize("p", [3.0, 2.0, 0.5, -1.5, 1.0])
def test_pow_constant_exponent(p):
    feeds = {"x": rand(2, 3, lo=0.5, hi=2.0)}
    check([node("Pow", ["x", "p"])], feeds, lambda x: x ** p, ["x"],
          inits={"p": np.float32(p)})


def test_pow_int_exponent():
    feeds = {"x": rand(2, 3)}
    check([node("Pow", ["x", "p"])], feeds, lambda x: x ** 3, ["x"],
          inits={"p": np.int64(3)})


def test_pow_tensor_exponent_broadcast():
    feeds = {"x": rand(2, 3, lo=0.5, hi=2.0), "p": rand(3, lo=-1.0, hi=2.0)}
    check([node("Pow", ["x", "p"])], feeds, lambda x, p: x ** p, ["x", "p"])


def test_pow_exponent_grad_zero_base():
    x = rand(2, 3, lo=0.5, hi=2.0)
    x[0, 1] = 0.0
    feeds = {"x": x, "p": rand(2, 3, lo=1.0, hi=2.0)}
    check([node("Pow", ["x", "p"])], feeds, lambda x, p: x ** p, ["p"])


# ---------------------------------------------------------------------- unary ops
UNARY = [
    ("Neg", {}, lambda x: -x, (-2, 2), 17),
    ("Sqrt", {}, torch.sqrt, (0.5, 2), 17),
    ("Exp", {}, torch.exp, (-2, 2), 17),
    ("Log", {}, torch.log, (0.5, 2), 17),
    ("Reciprocal", {}, torch.reciprocal, (0.5, 2), 17),
    ("Abs", {}, torch.abs, (-2, 2), 17),
    ("Tanh", {}, torch.tanh, (-2, 2), 17),
    ("Sigmoid", {}, torch.sigmoid, (-2, 2), 17),
    ("Relu", {}, torch.relu, (-2, 2), 17),
    ("LeakyRelu", {"alpha": 0.1}, lambda x: F.leaky_relu(x, 0.1), (-2, 2), 17),
    ("LeakyRelu", {}, F.leaky_relu, (-2, 2), 17),
    ("Elu", {"alpha": 0.7}, lambda x: F.elu(x, 0.7), (-2, 2), 17),
    ("Selu", {}, F.selu, (-2, 2), 17),
    ("Celu", {"alpha": 0.7}, lambda x: F.celu(x, 0.7), (-2, 2), 17),
    ("Celu", {}, F.celu, (-2, 2), 20),
    ("Atan", {}, torch.atan, (-3, 3), 17),
    ("Softplus", {}, F.softplus, (-3, 3), 17),
    ("HardSigmoid", {"alpha": 1.0 / 6.0}, F.hardsigmoid, (-4, 4), 17),
    ("HardSigmoid", {}, lambda x: torch.clamp(0.2 * x + 0.5, 0, 1), (-4, 4), 17),
    ("HardSwish", {}, F.hardswish, (-4, 4), 14),
    ("Erf", {}, torch.erf, (-2, 2), 17),
    ("Gelu", {}, F.gelu, (-3, 3), 20),
    ("Gelu", {"approximate": "tanh"}, lambda x: F.gelu(x, approximate="tanh"), (-3, 3), 20),
    ("Identity", {}, lambda x: x, (-2, 2), 17),
]


@pytest.mark.parametrize("x_shape,slope_shape", [((3, 4), (1,)), ((3, 4), (4,)),
                                                 ((2, 3, 4, 5), (3, 1, 1))])
def test_prelu(x_shape, slope_shape):
    """torch.nn.PReLU, one slope or one per channel (the dynamo exporter writes PRelu at
    opsets whose function body onnx cannot inline)."""
    feeds = {"x": rand(*x_shape), "slope": rand(*slope_shape, lo=0.05, hi=0.5)}
    check([node("PRelu", ["x", "slope"])], feeds,
          lambda x, slope: torch.where(x > 0, x, slope * x), ["x", "slope"], opset=20)


@pytest.mark.parametrize("op,attrs,fn,dom,opset", UNARY,
                         ids=[f"{u[0]}-{i}" for i, u in enumerate(UNARY)])
def test_unary(op, attrs, fn, dom, opset):
    x = rand(3, 4, lo=dom[0], hi=dom[1])
    check([node(op, ["x"], **attrs)], {"x": x}, lambda x: fn(x), ["x"], opset=opset)


def test_relu_at_zero_matches_torch():
    x = np.array([[-1.0, 0.0, 2.0]], dtype=np.float32)
    check([node("Relu", ["x"])], {"x": x}, torch.relu, ["x"])


# ---------------------------------------------------------------------- Clip
def test_clip_constant_bounds_opset13():
    x = rand(3, 4)
    x[0, 0], x[0, 1] = -0.5, 1.0  # exactly on the bounds: gradient passes (torch.clamp)
    check([node("Clip", ["x", "lo", "hi"])], {"x": x},
          lambda x: torch.clamp(x, -0.5, 1.0), ["x"],
          inits={"lo": np.float32(-0.5), "hi": np.float32(1.0)}, opset=13)


def test_clip_only_max():
    check([node("Clip", ["x", "", "hi"])], {"x": rand(3, 4)},
          lambda x: torch.clamp(x, max=0.3), ["x"], inits={"hi": np.float32(0.3)})


def test_clip_no_bounds_is_identity():
    check([node("Clip", ["x"])], {"x": rand(3, 4)}, lambda x: x, ["x"])


def test_clip_tensor_bounds_get_gradient():
    feeds = {"x": rand(3, 4), "lo": np.array(-0.5, np.float32), "hi": np.array(0.7, np.float32)}
    check([node("Clip", ["x", "lo", "hi"])], feeds,
          lambda x, lo, hi: torch.clamp(x, lo, hi), ["x", "lo", "hi"])


def test_clip_attribute_bounds_opset10():
    check([node("Clip", ["x"], min=-0.5, max=0.8)], {"x": rand(3, 4)},
          lambda x: torch.clamp(x, -0.5, 0.8), ["x"], opset=10)


# ---------------------------------------------------------------------- Max / Min
@pytest.mark.parametrize("op,fn", [("Max", torch.maximum), ("Min", torch.minimum)])
def test_max_min_two_inputs_with_ties(op, fn):
    a = rand(2, 3)
    b = rand(3)
    a[1, 2] = b[2]
    a[0, 0] = b[0]
    check([node(op, ["a", "b"])], {"a": a, "b": b}, lambda a, b: fn(a, b), ["a", "b"])


@pytest.mark.parametrize("op,fn", [("Max", torch.maximum), ("Min", torch.minimum)])
def test_max_min_variadic(op, fn):
    feeds = {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)}
    check([node(op, ["a", "b", "c"])], feeds, lambda a, b, c: fn(fn(a, b), c),
          ["a", "b", "c"])


def test_max_single_input():
    check([node("Max", ["a"])], {"a": rand(2, 3)}, lambda a: a, ["a"])


def test_variadic_max_three_way_tie_splits_evenly():
    a = np.ones((1, 2), np.float32)
    feeds = {"a": a, "b": a.copy(), "c": np.array([[1.0, 0.0]], np.float32)}
    m = make_model([node("Max", ["a", "b", "c"])],
                   [(k, FLOAT, [1, 2]) for k in feeds], [("y", FLOAT, [1, 2])])
    _, got = onnx_grads(m, feeds, ["a", "b", "c"])
    w = upstream_weight((1, 2))
    np.testing.assert_allclose(got["a"], w * np.array([[1 / 3, 1 / 2]]), rtol=1e-5)
    np.testing.assert_allclose(got["c"], w * np.array([[1 / 3, 0]]), rtol=1e-5)


# ---------------------------------------------------------------------- Where / Cast / Sum
def test_where_broadcast():
    feeds = {"c": RNG.random((2, 1, 4)) > 0.5, "x": rand(3, 4), "y0": rand(4)}
    check([node("Where", ["c", "x", "y0"])], feeds,
          lambda c, x, y0: torch.where(c, x, y0), ["x", "y0"])


def test_cast_float_to_double_and_back():
    check([node("Cast", ["x"], to=TensorProto.DOUBLE)], {"x": rand(2, 3)},
          lambda x: x.double(), ["x"])


def test_cast_to_int_blocks_gradient():
    nodes = [helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
             helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
             node("Mul", ["x", "f"])]
    check(nodes, {"x": rand(2, 3, lo=-3, hi=3)},
          lambda x: x * x.to(torch.int64).float(), ["x"])


@pytest.mark.parametrize("op,scale", [("Sum", 1.0), ("Mean", 1.0 / 3.0)])
def test_sum_mean_variadic(op, scale):
    feeds = {"a": rand(2, 3), "b": rand(3), "c": rand(2, 1)}
    check([node(op, ["a", "b", "c"])], feeds, lambda a, b, c: (a + b + c) * scale,
          ["a", "b", "c"])


# ---------------------------------------------------------------------- MatMul
MATMUL_SHAPES = [
    ((2, 3), (3, 4)),
    ((2, 5, 3), (3, 4)),        # batched @ weight
    ((2, 5, 3), (1, 3, 4)),     # weight with a unit batch dim
    ((3,), (3, 4)),
    ((2, 3), (3,)),
    ((3,), (3,)),
    ((2, 5, 3), (3,)),
    ((3,), (2, 3, 4)),
    ((2, 1, 3, 4), (5, 4, 2)),  # both batched, broadcast both ways
    ((4, 3), (2, 3, 5)),        # 2-D @ batched
    ((2, 4, 3), (2, 3, 5)),
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=[f"{a}@{b}" for a, b in MATMUL_SHAPES])
def test_matmul(sa, sb):
    feeds = {"a": rand(*sa), "b": rand(*sb)}
    check([node("MatMul", ["a", "b"])], feeds, lambda a, b: a @ b, ["a", "b"])


def test_matmul_double_uses_gemm_path():
    feeds = {"a": rand(2, 5, 3).astype(np.float64), "b": rand(3, 4).astype(np.float64)}
    check([node("MatMul", ["a", "b"])], feeds, lambda a, b: a @ b, ["a", "b"])


# ---------------------------------------------------------------------- Gemm
@pytest.mark.parametrize("ta", [0, 1])
@pytest.mark.parametrize("tb", [0, 1])
@pytest.mark.parametrize("cshape", [None, (4,), (3, 1), (3, 4), ()])
def test_gemm(ta, tb, cshape):
    m, k, n = 3, 5, 4
    feeds = {"a": rand(*((k, m) if ta else (m, k))), "b": rand(*((n, k) if tb else (k, n)))}
    ins = ["a", "b"]
    wrt = ["a", "b"]
    if cshape is not None:
        feeds["c"] = rand(*cshape)
        ins.append("c")
        wrt.append("c")
    alpha, beta = 0.7, 1.3

    def fn(a, b, c=None):
        y = alpha * ((a.T if ta else a) @ (b.T if tb else b))
        return y if c is None else y + beta * c

    check([node("Gemm", ins, transA=ta, transB=tb, alpha=alpha, beta=beta)], feeds, fn, wrt)


# ---------------------------------------------------------------------- Einsum
@pytest.mark.parametrize("eq,sa,sb", [
    ("bij,bjk->bik", (2, 3, 4), (2, 4, 5)),
    ("ij,kj->ik", (3, 4), (5, 4)),
    ("...ij,jk->...ik", (2, 3, 4), (4, 5)),
    ("ij,jk", (3, 4), (4, 5)),
    ("bhqd,bhkd->bhqk", (1, 2, 3, 4), (1, 2, 5, 4)),
])
def test_einsum(eq, sa, sb):
    feeds = {"a": rand(*sa), "b": rand(*sb)}
    check([node("Einsum", ["a", "b"], equation=eq)], feeds,
          lambda a, b: torch.einsum(eq, a, b), ["a", "b"])


def test_einsum_trace_is_refused():
    m = make_model([node("Einsum", ["a", "b"], equation="ii,j->j")],
                   [("a", FLOAT, [3, 3]), ("b", FLOAT, [2])], [("y", FLOAT, [2])])
    with pytest.raises(GradientError, match="Einsum"):
        onnx_grads(m, {"a": rand(3, 3), "b": rand(2)}, ["a"])


# ---------------------------------------------------------------------- Softmax family
@pytest.mark.parametrize("op,tfn", [("Softmax", torch.softmax),
                                    ("LogSoftmax", torch.log_softmax)])
@pytest.mark.parametrize("axis", [None, 1, 0, -1])
def test_softmax_opset13(op, tfn, axis):
    attrs = {} if axis is None else {"axis": axis}
    dim = -1 if axis is None else axis
    check([node(op, ["x"], **attrs)], {"x": rand(2, 3, 4)}, lambda x: tfn(x, dim), ["x"],
          opset=13)


@pytest.mark.parametrize("op,tfn", [("Softmax", torch.softmax),
                                    ("LogSoftmax", torch.log_softmax)])
@pytest.mark.parametrize("axis", [None, 2, 0])
def test_softmax_opset11_coerces_to_2d(op, tfn, axis):
    attrs = {} if axis is None else {"axis": axis}
    a = 1 if axis is None else axis

    def fn(x):
        flat = x.reshape(math.prod(x.shape[:a]), -1)
        return tfn(flat, -1).reshape(x.shape)

    check([node(op, ["x"], **attrs)], {"x": rand(2, 3, 4)}, fn, ["x"], opset=11)


# ---------------------------------------------------------------------- Dropout
def _dropout_run(nodes, x, inits, feeds_extra=None, opset=17):
    """Return (y, dx) from one ORT run of forward + memcc backward."""
    inputs = [("x", FLOAT, list(x.shape))]
    for k, v in (feeds_extra or {}).items():
        inputs.append((k, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
    model = make_model(nodes, inputs, [("y", FLOAT, list(x.shape))], inits, opset)
    graph = load_graph(model)
    emit = Emitter(graph, prefix="loss/")
    w = emit.const(upstream_weight(x.shape), FLOAT, name="w")
    loss = emit.reduce_sum(emit.mul("y", w), None, keepdims=False)
    grads = differentiate(graph, loss, ["x"])
    graph.outputs = ["y", grads["x"]]
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(graph.to_model().SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    y, dx = sess.run(None, {"x": x, **(feeds_extra or {})})
    return y, dx, graph


@pytest.mark.parametrize("with_mask", [False, True])
def test_dropout_training_uses_forward_mask(with_mask):
    x = rand(4, 8, lo=0.5, hi=2.0)
    outs = ["y", "mask"] if with_mask else ["y"]
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], outs)]
    y, dx, graph = _dropout_run(nodes, x, {"r": np.float32(0.25), "t": np.bool_(True)})
    kept = y != 0
    assert 0 < kept.sum() < kept.size
    np.testing.assert_allclose(y[kept], x[kept] / 0.75, rtol=1e-5)
    np.testing.assert_allclose(dx, upstream_weight(x.shape) * kept / 0.75, rtol=1e-5)
    assert len(graph.nodes[0].output) == 2  # mask output was added when absent


def test_dropout_training_mode_as_runtime_input():
    x = rand(4, 8, lo=0.5, hi=2.0)
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["y"])]
    for flag in (True, False):
        y, dx, _ = _dropout_run(nodes, x, {"r": np.float32(0.5)}, {"t": np.array(flag)})
        factor = 2.0 if flag else 1.0
        np.testing.assert_allclose(dx, upstream_weight(x.shape) * (y != 0) * factor, rtol=1e-5)


def test_dropout_inference_is_identity():
    x = rand(4, 8)
    nodes = [helper.make_node("Dropout", ["x", "r"], ["y"])]
    y, dx, graph = _dropout_run(nodes, x, {"r": np.float32(0.5)})
    np.testing.assert_allclose(y, x)
    np.testing.assert_allclose(dx, upstream_weight(x.shape), rtol=1e-6)
    assert len(graph.nodes[0].output) == 1


def test_dropout_ratio_as_runtime_input():
    x = rand(4, 8, lo=0.5, hi=2.0)
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["y"])]
    extra = {"r": np.array(0.25, np.float32), "t": np.array(True)}
    y, dx, _ = _dropout_run(nodes, x, {}, extra)
    np.testing.assert_allclose(dx, upstream_weight(x.shape) * (y != 0) / 0.75, rtol=1e-5)


@pytest.mark.parametrize("op,fn", [("Sin", "sin"), ("Cos", "cos")])
def test_sin_cos(op, fn):
    import torch

    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    m = make_model([helper.make_node(op, ["x"], ["y"])], [("x", FLOAT, [3, 4])],
                   [("y", FLOAT, [3, 4])])
    _, got = onnx_grads(m, {"x": x}, ["x"])
    _, ref = torch_grads(lambda x: getattr(torch, fn)(x), {"x": x}, ["x"])
    assert_close(got["x"], ref["x"], name=op)
