"""An independent reference: evaluate an ONNX forward graph node by node with torch ops.

memcc builds backward graphs for models that were never written in torch (the zoo in
``models/`` is plain ONNX). To check those gradients against something that does not share
memcc's code, this module interprets the forward graph with torch, keeping floating
initializers as leaf tensors that require grad, so torch autograd gives the reference
gradients of any loss.

``torch_forward`` covers every op the zoo emits and the common ones ``torch.onnx.export``
produces (opsets 11-20: axes as attributes or inputs, Split sizes or ``num_outputs``, ...).
``torch_loss_and_grads`` applies the same losses as ``memcc build --loss`` and returns the
loss and one gradient per trainable parameter (BatchNormalization running statistics are
excluded, as the contract in DESIGN.md says).

Dropout is the identity unless ``train_dropout=True`` (random masks cannot match ORT's).
``double=True`` evaluates float32 graphs in float64: when ORT and the float32 reference
disagree, it tells which side carries the error.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

Tensor = torch.Tensor
OpFn = Callable[["_Node", list], "Tensor | Sequence[Tensor | None]"]

DTYPES: dict[int, torch.dtype] = {
    TensorProto.FLOAT: torch.float32,
    TensorProto.DOUBLE: torch.float64,
    TensorProto.FLOAT16: torch.float16,
    TensorProto.BFLOAT16: torch.bfloat16,
    TensorProto.INT64: torch.int64,
    TensorProto.INT32: torch.int32,
    TensorProto.INT16: torch.int16,
    TensorProto.INT8: torch.int8,
    TensorProto.UINT8: torch.uint8,
    TensorProto.BOOL: torch.bool,
}

OPS: dict[str, OpFn] = {}


def register(*names: str) -> Callable[[OpFn], OpFn]:
    def deco(fn: OpFn) -> OpFn:
        for n in names:
            OPS[n] = fn
        return fn

    return deco


@dataclass
class _Node:
    """One node being evaluated: its proto, decoded attributes and evaluation settings."""

    proto: onnx.NodeProto
    attrs: dict
    opset: int
    train_dropout: bool
    double: bool = False

    def get(self, name: str, default=None):
        return self.attrs.get(name, default)

    @property
    def n_outputs(self) -> int:
        return len(self.proto.output)

    def wants(self, i: int) -> bool:
        return i < len(self.proto.output) and bool(self.proto.output[i])


# ====================================================================== entry points
def torch_forward(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray | Tensor],
                  params_require_grad: bool = True, *, all_values: bool = False,
                  train_dropout: bool = False, double: bool = False
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Run ``model`` on ``feeds`` with torch. Returns (outputs, params).

    ``outputs`` maps each graph output (every value with ``all_values``) to its tensor;
    ``params`` maps each floating initializer to its leaf tensor (requiring grad when
    ``params_require_grad``). A feed given as a torch tensor is used as is, so a caller can
    make inputs require grad too. ``double``: float32 values are computed in float64.
    """
    graph = model.graph
    opset = _default_opset(model)
    values: dict[str, Tensor] = {}
    params: dict[str, Tensor] = {}
    for init in graph.initializer:
        t = _promote(torch.from_numpy(np.array(numpy_helper.to_array(init))), double)
        if t.is_floating_point():
            t.requires_grad_(params_require_grad)
            params[init.name] = t
        values[init.name] = t
    for name, value in feeds.items():
        values[name] = value if isinstance(value, Tensor) else _promote(
            torch.from_numpy(np.array(value)), double)
    for vi in graph.input:
        if vi.name not in values:
            raise KeyError(f"no feed for graph input {vi.name!r}")
    for proto in graph.node:
        _run_node(proto, values, opset, train_dropout, double)
    if all_values:
        return dict(values), params
    return {o.name: values[o.name] for o in graph.output}, params


def trainable_params(model: onnx.ModelProto) -> list[str]:
    """Floating initializers except BatchNormalization running statistics (DESIGN.md)."""
    running = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization"
               for i in (3, 4) if len(n.input) > i}
    return [t.name for t in model.graph.initializer
            if t.data_type in (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16,
                               TensorProto.BFLOAT16) and t.name not in running]


def torch_loss_and_grads(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                         loss: str = "cross-entropy", labels: np.ndarray | None = None,
                         target: np.ndarray | None = None, output: str | None = None,
                         train_dropout: bool = False, double: bool = False
                         ) -> tuple[float, dict[str, np.ndarray]]:
    """The loss ``memcc build --loss`` adds, and d loss / d P for every trainable P.

    ``cross-entropy``: mean over all positions of torch's cross-entropy over the last axis of
    the first output (``labels`` int64 shaped like it without the last axis); ``mse``:
    mean((y - target)^2); ``none``: the output already is the scalar loss. Parameters that
    do not reach the loss get no entry.
    """
    outputs, params = torch_forward(model, feeds, train_dropout=train_dropout, double=double)
    y = outputs[output or model.graph.output[0].name]
    value = _loss(y, loss, labels, target)
    names = [n for n in trainable_params(model) if n in params]
    grads = torch.autograd.grad(value, [params[n] for n in names], allow_unused=True)
    return float(value.detach()), {n: g.detach().numpy() for n, g in zip(names, grads,
                                                                          strict=True)
                                   if g is not None}


def _loss(y: Tensor, kind: str, labels: np.ndarray | None, target: np.ndarray | None) -> Tensor:
    if kind == "cross-entropy":
        if labels is None:
            raise ValueError("cross-entropy needs labels")
        lab = torch.from_numpy(np.asarray(labels, np.int64)).reshape(-1)
        return F.cross_entropy(y.reshape(-1, y.shape[-1]), lab)
    if kind == "mse":
        if target is None:
            raise ValueError("mse needs target")
        return ((y - torch.from_numpy(np.asarray(target))) ** 2).mean()
    if kind == "none":
        return y.reshape(())
    raise ValueError(f"unknown loss {kind!r}")


def _default_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def _attrs(proto: onnx.NodeProto) -> dict:
    out = {}
    for a in proto.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _run_node(proto: onnx.NodeProto, values: dict[str, Tensor], opset: int,
              train_dropout: bool, double: bool = False) -> None:
    label = f"{proto.op_type} node {proto.name or proto.output[0]!r}"
    if proto.domain not in ("", "ai.onnx"):
        raise NotImplementedError(f"{label}: domain {proto.domain!r} is not supported")
    fn = OPS.get(proto.op_type)
    if fn is None:
        raise NotImplementedError(f"{label}: op not supported by torch_reference")
    inputs = [values[n] if n else None for n in proto.input]
    node = _Node(proto, _attrs(proto), opset, train_dropout, double)
    try:
        result = fn(node, inputs)
    except NotImplementedError as exc:
        raise NotImplementedError(f"{label}: {exc}") from exc
    results = [result] if isinstance(result, Tensor) else list(result)
    if double and proto.op_type in ("Constant", "ConstantOfShape", "Cast", "Range"):
        results = [_promote(r, True) for r in results]
    for name, value in zip(proto.output, results, strict=False):
        if name:
            if value is None:
                raise NotImplementedError(f"{label}: output {name!r} is not computed")
            values[name] = value


# ====================================================================== helpers
def _promote(t: Tensor, double: bool) -> Tensor:
    """float32 -> float64 under ``double`` (sources of float32 values call this)."""
    return t.to(torch.float64) if double and t.dtype == torch.float32 else t


def _ints(t: Tensor | None) -> list[int] | None:
    return None if t is None else [int(v) for v in t.reshape(-1).tolist()]


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _axes(node: _Node, inputs: list, index: int, since: int) -> list[int] | None:
    """Axes from input ``index`` (opset >= ``since``) or from the ``axes`` attribute."""
    if node.opset >= since:
        return _ints(inputs[index]) if len(inputs) > index else None
    axes = node.get("axes")
    return None if axes is None else list(axes)


def _spatial(node: _Node, name: str, n: int, default: int) -> list[int]:
    v = node.get(name)
    return list(v) if v is not None else [default] * n


# ====================================================================== elementwise
def _unary(fn: Callable[[Tensor], Tensor]) -> OpFn:
    return lambda node, x: fn(x[0])


for _name, _fn in {
    "Identity": lambda x: x, "Neg": torch.neg, "Abs": torch.abs, "Exp": torch.exp,
    "Log": torch.log, "Sqrt": torch.sqrt, "Reciprocal": torch.reciprocal, "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid, "Relu": torch.relu, "Erf": torch.erf, "Floor": torch.floor,
    "Ceil": torch.ceil, "Round": torch.round, "Sign": torch.sign, "Sin": torch.sin,
    "Cos": torch.cos, "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos,
    "Atan": torch.atan, "Sinh": torch.sinh, "Cosh": torch.cosh, "Softplus": F.softplus,
    "Softsign": F.softsign, "Not": torch.logical_not, "IsNaN": torch.isnan,
    "Mish": F.mish,
}.items():
    register(_name)(_unary(_fn))


def _binary(fn: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    return lambda node, x: fn(x[0], x[1])


for _name, _fn in {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Equal": torch.eq,
    "Less": torch.lt, "Greater": torch.gt, "LessOrEqual": torch.le, "GreaterOrEqual": torch.ge,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
    "MatMul": torch.matmul,
}.items():
    register(_name)(_binary(_fn))


@register("Div")
def _div(node: _Node, x: list) -> Tensor:
    a, b = x
    if a.is_floating_point():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


@register("Pow")
def _pow(node: _Node, x: list) -> Tensor:
    a, b = x
    return torch.pow(a, b).to(a.dtype)


@register("Mod")
def _mod(node: _Node, x: list) -> Tensor:
    return torch.fmod(x[0], x[1]) if node.get("fmod", 0) else torch.remainder(x[0], x[1])


def _variadic(fn: Callable[[Tensor, Tensor], Tensor]) -> OpFn:
    def run(node: _Node, x: list) -> Tensor:
        out = x[0]
        for t in x[1:]:
            out = fn(out, t)
        return out

    return run


register("Sum")(_variadic(torch.add))
register("Max")(_variadic(torch.maximum))
register("Min")(_variadic(torch.minimum))


@register("Mean")
def _mean(node: _Node, x: list) -> Tensor:
    return _variadic(torch.add)(node, x) / len(x)


@register("IsInf")
def _isinf(node: _Node, x: list) -> Tensor:
    t = x[0]
    pos, neg = node.get("detect_positive", 1), node.get("detect_negative", 1)
    return (torch.isposinf(t) & bool(pos)) | (torch.isneginf(t) & bool(neg))


@register("LeakyRelu")
def _leaky_relu(node: _Node, x: list) -> Tensor:
    return F.leaky_relu(x[0], node.get("alpha", 0.01))


@register("Elu")
def _elu(node: _Node, x: list) -> Tensor:
    return F.elu(x[0], node.get("alpha", 1.0))


@register("Celu")
def _celu(node: _Node, x: list) -> Tensor:
    return F.celu(x[0], node.get("alpha", 1.0))


@register("Selu")
def _selu(node: _Node, x: list) -> Tensor:
    alpha = node.get("alpha", 1.67326319217681884765625)
    gamma = node.get("gamma", 1.05070102214813232421875)
    t = x[0]
    return gamma * torch.where(t > 0, t, alpha * (torch.exp(t) - 1))


@register("ThresholdedRelu")
def _thresholded_relu(node: _Node, x: list) -> Tensor:
    t = x[0]
    return torch.where(t > node.get("alpha", 1.0), t, torch.zeros_like(t))


@register("PRelu")
def _prelu(node: _Node, x: list) -> Tensor:
    t, slope = x
    return torch.where(t < 0, t * slope, t)


@register("HardSigmoid")
def _hard_sigmoid(node: _Node, x: list) -> Tensor:
    return torch.clamp(node.get("alpha", 0.2) * x[0] + node.get("beta", 0.5), 0.0, 1.0)


@register("HardSwish")
def _hard_swish(node: _Node, x: list) -> Tensor:
    return F.hardswish(x[0])


@register("Gelu")
def _gelu(node: _Node, x: list) -> Tensor:
    return F.gelu(x[0], approximate=node.get("approximate", "none"))


@register("Clip")
def _clip(node: _Node, x: list) -> Tensor:
    t = x[0]
    if node.opset < 11:
        lo, hi = node.get("min"), node.get("max")
    else:
        lo = x[1] if len(x) > 1 else None
        hi = x[2] if len(x) > 2 else None
    lo = None if lo is None else torch.as_tensor(lo, dtype=t.dtype)
    hi = None if hi is None else torch.as_tensor(hi, dtype=t.dtype)
    return t if lo is None and hi is None else torch.clamp(t, lo, hi)


@register("Where")
def _where(node: _Node, x: list) -> Tensor:
    return torch.where(x[0].bool(), x[1], x[2])


@register("Cast")
def _cast(node: _Node, x: list) -> Tensor:
    return x[0].to(_torch_dtype(node.get("to")))


@register("CastLike")
def _cast_like(node: _Node, x: list) -> Tensor:
    return x[0].to(x[1].dtype)


def _torch_dtype(onnx_type: int) -> torch.dtype:
    if onnx_type not in DTYPES:
        raise NotImplementedError(f"element type {onnx_type} is not supported")
    return DTYPES[onnx_type]


# ====================================================================== linear algebra
@register("Gemm")
def _gemm(node: _Node, x: list) -> Tensor:
    a, b = x[0], x[1]
    if node.get("transA", 0):
        a = a.t()
    if node.get("transB", 0):
        b = b.t()
    y = torch.matmul(a, b)
    alpha, beta = node.get("alpha", 1.0), node.get("beta", 1.0)
    if alpha != 1.0:
        y = y * alpha
    if len(x) > 2 and x[2] is not None:
        y = y + (x[2] * beta if beta != 1.0 else x[2])
    return y


@register("Einsum")
def _einsum(node: _Node, x: list) -> Tensor:
    return torch.einsum(node.get("equation"), *x)


def _softmax_like(fn: Callable[..., Tensor]) -> OpFn:
    def run(node: _Node, x: list) -> Tensor:
        t = x[0]
        if node.opset >= 13:
            return fn(t, dim=node.get("axis", -1))
        axis = _norm_axis(node.get("axis", 1), t.dim())
        flat = t.reshape(math.prod(t.shape[:axis]), -1)
        return fn(flat, dim=1).reshape(t.shape)

    return run


register("Softmax")(_softmax_like(torch.softmax))
register("LogSoftmax")(_softmax_like(torch.log_softmax))


# ====================================================================== reductions
def _reduce(fn: Callable[[Tensor, list[int], bool], Tensor], since: int = 18) -> OpFn:
    def run(node: _Node, x: list) -> Tensor:
        t = x[0]
        axes = _axes(node, x, 1, since)
        keep = bool(node.get("keepdims", 1))
        if not axes:
            if node.get("noop_with_empty_axes", 0):
                return t
            axes = list(range(t.dim()))
        axes = sorted(_norm_axis(a, t.dim()) for a in axes)
        if t.dim() == 0:
            return fn(t, [], keep)
        return fn(t, axes, keep)

    return run


def _prod(t: Tensor, axes: list[int], keep: bool) -> Tensor:
    for a in reversed(axes):
        t = torch.prod(t, dim=a, keepdim=keep)
    return t


def _sum(t: Tensor, axes: list[int], keep: bool) -> Tensor:
    return torch.sum(t, dim=axes, keepdim=keep) if axes else t


register("ReduceSum")(_reduce(_sum, since=13))
register("ReduceMean")(_reduce(lambda t, a, k: torch.mean(t, dim=a, keepdim=k) if a else t))
register("ReduceMax")(_reduce(lambda t, a, k: torch.amax(t, dim=a, keepdim=k) if a else t))
register("ReduceMin")(_reduce(lambda t, a, k: torch.amin(t, dim=a, keepdim=k) if a else t))
register("ReduceProd")(_reduce(_prod))
register("ReduceL1")(_reduce(lambda t, a, k: _sum(t.abs(), a, k)))
register("ReduceL2")(_reduce(lambda t, a, k: torch.sqrt(_sum(t * t, a, k))))
register("ReduceSumSquare")(_reduce(lambda t, a, k: _sum(t * t, a, k)))
register("ReduceLogSum")(_reduce(lambda t, a, k: torch.log(_sum(t, a, k))))
register("ReduceLogSumExp")(_reduce(
    lambda t, a, k: torch.logsumexp(t, dim=a, keepdim=k) if a else t))


def _arg(fn: Callable[..., Tensor]) -> OpFn:
    def run(node: _Node, x: list) -> Tensor:
        t = x[0]
        axis = _norm_axis(node.get("axis", 0), t.dim())
        keep = bool(node.get("keepdims", 1))
        if node.get("select_last_index", 0):
            idx = fn(torch.flip(t, [axis]), dim=axis, keepdim=keep)
            return t.shape[axis] - 1 - idx
        return fn(t, dim=axis, keepdim=keep)

    return run


register("ArgMax")(_arg(torch.argmax))
register("ArgMin")(_arg(torch.argmin))


@register("CumSum")
def _cumsum(node: _Node, x: list) -> Tensor:
    t = x[0]
    axis = _norm_axis(int(x[1]), t.dim())
    if node.get("reverse", 0):
        t = torch.flip(t, [axis])
    y = torch.cumsum(t, dim=axis)
    if node.get("exclusive", 0):
        y = y - t
    if node.get("reverse", 0):
        y = torch.flip(y, [axis])
    return y


# ====================================================================== shape ops
@register("Reshape")
def _reshape(node: _Node, x: list) -> Tensor:
    t, shape = x[0], _ints(x[1])
    if not node.get("allowzero", 0):
        shape = [t.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return t.reshape(shape)


@register("Flatten")
def _flatten(node: _Node, x: list) -> Tensor:
    t = x[0]
    axis = _norm_axis(node.get("axis", 1), t.dim())
    return t.reshape(math.prod(t.shape[:axis]), math.prod(t.shape[axis:]))


@register("Transpose")
def _transpose(node: _Node, x: list) -> Tensor:
    perm = node.get("perm")
    return x[0].permute(list(perm) if perm is not None else list(range(x[0].dim()))[::-1])


@register("Squeeze")
def _squeeze(node: _Node, x: list) -> Tensor:
    t = x[0]
    axes = _axes(node, x, 1, 13)
    if axes is None:
        return t.squeeze()
    return t.squeeze(tuple(_norm_axis(a, t.dim()) for a in axes)) if axes else t


@register("Unsqueeze")
def _unsqueeze(node: _Node, x: list) -> Tensor:
    t = x[0]
    axes = _axes(node, x, 1, 13) or []
    rank = t.dim() + len(axes)
    for a in sorted(_norm_axis(a, rank) for a in axes):
        t = t.unsqueeze(a)
    return t


@register("Concat")
def _concat(node: _Node, x: list) -> Tensor:
    return torch.cat([t for t in x if t is not None], dim=node.get("axis"))


@register("Split")
def _split(node: _Node, x: list) -> list[Tensor]:
    t = x[0]
    axis = _norm_axis(node.get("axis", 0), t.dim())
    sizes = _ints(x[1]) if node.opset >= 13 and len(x) > 1 and x[1] is not None \
        else node.get("split")
    if sizes is None:
        parts = node.get("num_outputs", node.n_outputs)
        chunk = -(-t.shape[axis] // parts)
        sizes = [min(chunk, t.shape[axis] - i * chunk) for i in range(parts)]
    return list(torch.split(t, list(sizes), dim=axis))


@register("Slice")
def _slice(node: _Node, x: list) -> Tensor:
    t = x[0]
    if node.opset < 10:
        starts, ends = list(node.get("starts")), list(node.get("ends"))
        axes, steps = node.get("axes"), None
    else:
        starts, ends = _ints(x[1]), _ints(x[2])
        axes = _ints(x[3]) if len(x) > 3 else None
        steps = _ints(x[4]) if len(x) > 4 else None
    axes = list(axes) if axes is not None else list(range(len(starts)))
    steps = steps or [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        t = _slice_axis(t, _norm_axis(axis, t.dim()), start, end, step)
    return t


def _slice_axis(t: Tensor, axis: int, start: int, end: int, step: int) -> Tensor:
    """One axis of ONNX Slice: clamp like the spec, negative steps by index_select."""
    dim = t.shape[axis]
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, -1), dim - 1), min(max(end, -1), dim - 1)
    idx = torch.arange(start, end, step, dtype=torch.int64)
    if step == 1:
        return t.narrow(axis, start, max(end - start, 0))
    return torch.index_select(t, axis, idx)


@register("Gather")
def _gather(node: _Node, x: list) -> Tensor:
    t, idx = x
    axis = _norm_axis(node.get("axis", 0), t.dim())
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + t.shape[axis], idx)
    out = torch.index_select(t, axis, idx.reshape(-1))
    return out.reshape(tuple(t.shape[:axis]) + tuple(idx.shape) + tuple(t.shape[axis + 1:]))


@register("GatherElements")
def _gather_elements(node: _Node, x: list) -> Tensor:
    t, idx = x
    axis = _norm_axis(node.get("axis", 0), t.dim())
    idx = idx.to(torch.int64)
    return torch.gather(t, axis, torch.where(idx < 0, idx + t.shape[axis], idx))


@register("GatherND")
def _gather_nd(node: _Node, x: list) -> Tensor:
    t, idx = x
    b = node.get("batch_dims", 0)
    batch = tuple(t.shape[:b])
    nb = math.prod(batch)
    data = t.reshape((nb,) + tuple(t.shape[b:]))
    k = idx.shape[-1]
    ind = idx.to(torch.int64).reshape(nb, -1, k)
    ind = torch.where(ind < 0, ind + torch.tensor(data.shape[1:1 + k]), ind)
    rows = torch.arange(nb).reshape(nb, 1).expand(nb, ind.shape[1])
    picked = data[(rows,) + tuple(ind[..., j] for j in range(k))]
    return picked.reshape(batch + tuple(idx.shape[b:-1]) + tuple(data.shape[1 + k:]))


@register("ScatterElements")
def _scatter_elements(node: _Node, x: list) -> Tensor:
    t, idx, upd = x
    axis = _norm_axis(node.get("axis", 0), t.dim())
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + t.shape[axis], idx)
    red = node.get("reduction", "none")
    if red == "none":
        return t.scatter(axis, idx, upd)
    if red == "add":
        return t.scatter_add(axis, idx, upd)
    return t.scatter_reduce(axis, idx, upd, {"mul": "prod", "max": "amax", "min": "amin"}[red])


@register("ScatterND")
def _scatter_nd(node: _Node, x: list) -> Tensor:
    t, idx, upd = x
    k = idx.shape[-1]
    ind = tuple(idx.to(torch.int64).reshape(-1, k).t())
    flat_upd = upd.reshape((-1,) + tuple(t.shape[k:]))
    red = node.get("reduction", "none")
    if red not in ("none", "add"):
        raise NotImplementedError(f"reduction {red!r}")
    return t.index_put(ind, flat_upd, accumulate=red == "add")


@register("Expand")
def _expand(node: _Node, x: list) -> Tensor:
    t, shape = x[0], _ints(x[1])
    return t.expand(torch.broadcast_shapes(tuple(t.shape), tuple(shape)))


@register("Tile")
def _tile(node: _Node, x: list) -> Tensor:
    return x[0].repeat(*_ints(x[1]))


@register("Shape")
def _shape(node: _Node, x: list) -> Tensor:
    dims = list(x[0].shape)
    start, end = node.get("start", 0), node.get("end", len(dims))
    return torch.tensor(dims[start:end], dtype=torch.int64)


@register("Size")
def _size(node: _Node, x: list) -> Tensor:
    return torch.tensor(x[0].numel(), dtype=torch.int64)


@register("Constant")
def _constant(node: _Node, x: list) -> Tensor:
    a = node.attrs
    if "value" in a:
        return torch.from_numpy(np.array(numpy_helper.to_array(a["value"])))
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    raise NotImplementedError(f"Constant attributes {sorted(a)}")


@register("ConstantOfShape")
def _constant_of_shape(node: _Node, x: list) -> Tensor:
    shape = _ints(x[0])
    value = node.get("value")
    if value is None:
        return torch.zeros(shape, dtype=torch.float32)
    arr = numpy_helper.to_array(value).reshape(-1)
    return torch.full(shape, arr[0].item(), dtype=_torch_dtype(value.data_type))


@register("Range")
def _range(node: _Node, x: list) -> Tensor:
    start, limit, delta = x
    return torch.arange(start.item(), limit.item(), delta.item(), dtype=start.dtype)


@register("Trilu")
def _trilu(node: _Node, x: list) -> Tensor:
    k = int(x[1]) if len(x) > 1 and x[1] is not None else 0
    return torch.triu(x[0], k) if node.get("upper", 1) else torch.tril(x[0], k)


@register("OneHot")
def _one_hot(node: _Node, x: list) -> Tensor:
    idx, depth, vals = x
    d = int(depth.reshape(-1)[0])
    idx = idx.to(torch.int64)
    idx = torch.where(idx < 0, idx + d, idx)
    hot = F.one_hot(idx.clamp(0, d - 1), d) * ((idx >= 0) & (idx < d)).unsqueeze(-1)
    out = torch.where(hot.bool(), vals[1], vals[0])
    axis = node.get("axis", -1)
    return out if axis == -1 else out.movedim(-1, _norm_axis(axis, out.dim()))


@register("Pad")
def _pad(node: _Node, x: list) -> Tensor:
    t = x[0]
    if node.opset < 11:
        pads, value = list(node.get("pads")), node.get("value", 0.0)
        axes = None
    else:
        pads = _ints(x[1])
        value = x[2].item() if len(x) > 2 and x[2] is not None and x[2].numel() else 0
        axes = _ints(x[3]) if len(x) > 3 and x[3] is not None else None
    axes = [_norm_axis(a, t.dim()) for a in axes] if axes else list(range(t.dim()))
    n = len(axes)
    full = [0] * (2 * t.dim())
    for i, a in enumerate(axes):
        full[a], full[t.dim() + a] = pads[i], pads[n + i]
    torch_pads: list[int] = []
    for a in reversed(range(t.dim())):
        torch_pads += [full[a], full[t.dim() + a]]
    mode = node.get("mode", "constant")
    if mode == "constant":
        return F.pad(t, torch_pads, value=value)
    # torch pads only trailing dims in these modes; strip leading zero pairs.
    while len(torch_pads) > 2 and torch_pads[-2:] == [0, 0]:
        torch_pads = torch_pads[:-2]
    mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
    return F.pad(t, torch_pads, mode=mode)


@register("Dropout")
def _dropout(node: _Node, x: list) -> list[Tensor]:
    t = x[0]
    ratio = float(x[1]) if len(x) > 1 and x[1] is not None else node.get("ratio", 0.5)
    training = bool(x[2]) if len(x) > 2 and x[2] is not None else False
    if node.train_dropout and training and ratio > 0:
        mask = torch.rand_like(t) >= ratio
        return [t * mask / (1 - ratio), mask]
    return [t, torch.ones_like(t, dtype=torch.bool)]


# ====================================================================== convolution & pooling
def _explicit_pads(node: _Node, in_shape: Sequence[int], kernel: Sequence[int],
                   strides: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """ONNX pads [b1, b2, ..., e1, e2, ...], resolving auto_pad for Conv/pool ops."""
    n = len(kernel)
    auto = node.get("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        return _spatial(node, "pads", 2 * n, 0)
    if auto == "VALID":
        return [0] * (2 * n)
    begins, ends = [], []
    for size, k, s, d in zip(in_shape, kernel, strides, dilations, strict=True):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, big = total // 2, total - total // 2
        begins.append(small if auto == "SAME_UPPER" else big)
        ends.append(big if auto == "SAME_UPPER" else small)
    return begins + ends


def _symmetric(pads: list[int]) -> list[int] | None:
    n = len(pads) // 2
    return pads[:n] if pads[:n] == pads[n:] else None


def _torch_pad_list(pads: list[int]) -> list[int]:
    """ONNX [b1..bn, e1..en] -> F.pad's (bn, en, ..., b1, e1)."""
    n = len(pads) // 2
    out: list[int] = []
    for i in reversed(range(n)):
        out += [pads[i], pads[n + i]]
    return out


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@register("Conv")
def _conv(node: _Node, x: list) -> Tensor:
    t, w = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    n = w.dim() - 2
    kernel = list(w.shape[2:])
    strides = _spatial(node, "strides", n, 1)
    dil = _spatial(node, "dilations", n, 1)
    pads = _explicit_pads(node, t.shape[2:], kernel, strides, dil)
    sym = _symmetric(pads)
    if sym is None:
        t, sym = F.pad(t, _torch_pad_list(pads)), [0] * n
    return _CONV[n](t, w, bias, strides, sym, dil, node.get("group", 1))


@register("ConvTranspose")
def _conv_transpose(node: _Node, x: list) -> Tensor:
    t, w = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    n = w.dim() - 2
    kernel = list(w.shape[2:])
    strides = _spatial(node, "strides", n, 1)
    dil = _spatial(node, "dilations", n, 1)
    out_pad = _spatial(node, "output_padding", n, 0)
    pads = _conv_transpose_pads(node, t.shape[2:], kernel, strides, dil, out_pad)
    y = _CONV_T[n](t, w, bias, strides, 0, out_pad, node.get("group", 1), dil)
    for i in range(n):
        size = y.shape[2 + i]
        y = y.narrow(2 + i, pads[i], size - pads[i] - pads[n + i])
    return y


def _conv_transpose_pads(node: _Node, in_shape, kernel, strides, dil, out_pad) -> list[int]:
    n = len(kernel)
    auto = node.get("auto_pad", "NOTSET")
    target = node.get("output_shape")
    if target is None and auto in ("SAME_UPPER", "SAME_LOWER"):
        target = [s * st for s, st in zip(in_shape, strides, strict=True)]
    if target is None:
        return [0] * (2 * n) if auto == "VALID" else _spatial(node, "pads", 2 * n, 0)
    target = list(target)[-n:]
    begins, ends = [], []
    for i in range(n):
        total = strides[i] * (in_shape[i] - 1) + out_pad[i] + (kernel[i] - 1) * dil[i] + 1 \
            - target[i]
        if auto == "SAME_UPPER":
            begins.append(total // 2)
            ends.append(total - total // 2)
        else:
            begins.append(total - total // 2)
            ends.append(total // 2)
    return begins + ends


_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


@register("MaxPool")
def _max_pool(node: _Node, x: list) -> list[Tensor]:
    t = x[0]
    kernel = list(node.get("kernel_shape"))
    n = len(kernel)
    strides = _spatial(node, "strides", n, 1)
    dil = _spatial(node, "dilations", n, 1)
    pads = _explicit_pads(node, t.shape[2:], kernel, strides, dil)
    sym = _symmetric(pads)
    if sym is None or any(p > k // 2 for p, k in zip(sym, kernel, strict=True)):
        t = F.pad(t, _torch_pad_list(pads), value=-math.inf)
        sym = [0] * n
    ceil = bool(node.get("ceil_mode", 0))
    y, idx = _MAXPOOL[n](t, kernel, strides, sym, dil, ceil_mode=ceil, return_indices=True)
    if not node.wants(1):
        return [y]
    if node.get("storage_order", 0) or sym != _symmetric(pads):
        raise NotImplementedError("MaxPool Indices with storage_order=1 or large pads")
    plane = math.prod(x[0].shape[2:])
    offset = torch.arange(y.shape[0] * y.shape[1], dtype=torch.int64) * plane
    return [y, idx + offset.reshape(y.shape[:2] + (1,) * n)]


@register("AveragePool")
def _avg_pool(node: _Node, x: list) -> Tensor:
    t = x[0]
    kernel = list(node.get("kernel_shape"))
    n = len(kernel)
    strides = _spatial(node, "strides", n, 1)
    if any(d != 1 for d in _spatial(node, "dilations", n, 1)):
        raise NotImplementedError("AveragePool with dilations")
    pads = _explicit_pads(node, t.shape[2:], kernel, strides, [1] * n)
    ceil = bool(node.get("ceil_mode", 0))
    include = bool(node.get("count_include_pad", 0))
    sym = _symmetric(pads)
    if sym is not None and all(p <= k // 2 for p, k in zip(sym, kernel, strict=True)):
        return _AVGPOOL[n](t, kernel, strides, sym, ceil_mode=ceil, count_include_pad=include)
    padded = F.pad(t, _torch_pad_list(pads))
    total = _AVGPOOL[n](padded, kernel, strides, 0, ceil_mode=ceil) * math.prod(kernel)
    if include:
        return total / math.prod(kernel)
    ones = F.pad(torch.ones_like(t[:1, :1]), _torch_pad_list(pads))
    count = _AVGPOOL[n](ones, kernel, strides, 0, ceil_mode=ceil) * math.prod(kernel)
    return total / count


@register("GlobalAveragePool")
def _global_avg_pool(node: _Node, x: list) -> Tensor:
    t = x[0]
    return t.mean(dim=tuple(range(2, t.dim())), keepdim=True)


@register("GlobalMaxPool")
def _global_max_pool(node: _Node, x: list) -> Tensor:
    t = x[0]
    return t.amax(dim=tuple(range(2, t.dim())), keepdim=True)


@register("Resize")
def _resize(node: _Node, x: list) -> Tensor:
    t = x[0]
    scales = x[2] if len(x) > 2 and x[2] is not None and x[2].numel() else None
    sizes = _ints(x[3]) if len(x) > 3 and x[3] is not None else None
    mode = node.get("mode", "nearest")
    ctm = node.get("coordinate_transformation_mode", "half_pixel")
    kw: dict = {}
    if sizes is not None:
        kw["size"] = sizes[2:]
    else:
        kw["scale_factor"] = [float(s) for s in scales.tolist()[2:]]
    if mode == "nearest":
        if ctm != "asymmetric" or node.get("nearest_mode", "round_prefer_floor") != "floor":
            raise NotImplementedError("nearest Resize other than asymmetric/floor")
        return F.interpolate(t, mode="nearest", **kw)
    if mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        spatial = {1: "linear", 2: "bilinear", 3: "trilinear"}[t.dim() - 2]
        return F.interpolate(t, mode=spatial, align_corners=ctm == "align_corners", **kw)
    raise NotImplementedError(f"Resize mode={mode} coordinate_transformation_mode={ctm}")


# ====================================================================== normalization
@register("BatchNormalization")
def _batch_norm(node: _Node, x: list) -> list[Tensor]:
    t, scale, bias, mean, var = x[:5]
    eps = node.get("epsilon", 1e-5)
    momentum = node.get("momentum", 0.9)
    training = bool(node.get("training_mode", 0)) if node.opset >= 14 else node.n_outputs > 1
    if not training:
        # By hand: F.batch_norm refuses running statistics that require grad.
        shape = [1, -1] + [1] * (t.dim() - 2)
        inv = torch.rsqrt(var.reshape(shape) + eps)
        return [(t - mean.reshape(shape)) * inv * scale.reshape(shape) + bias.reshape(shape)]
    y = F.batch_norm(t, None, None, scale, bias, True, 0.0, eps)
    dims = [0] + list(range(2, t.dim()))
    batch_mean = t.mean(dim=dims)
    # ORT (and the ONNX reference) update the running variance with the biased variance.
    batch_var = t.var(dim=dims, unbiased=False)
    run_mean = mean * momentum + batch_mean * (1 - momentum)
    run_var = var * momentum + batch_var * (1 - momentum)
    return [y, run_mean, run_var, batch_mean, torch.rsqrt(batch_var + eps)]


@register("InstanceNormalization")
def _instance_norm(node: _Node, x: list) -> Tensor:
    return F.instance_norm(x[0], weight=x[1], bias=x[2], eps=node.get("epsilon", 1e-5))


@register("LayerNormalization")
def _layer_norm(node: _Node, x: list) -> list[Tensor]:
    t, scale = x[0], x[1]
    bias = x[2] if len(x) > 2 else None
    axis = _norm_axis(node.get("axis", -1), t.dim())
    eps = node.get("epsilon", 1e-5)
    shape = tuple(t.shape[axis:])
    if tuple(scale.shape) == shape and (bias is None or tuple(bias.shape) == shape):
        y = F.layer_norm(t, shape, scale, bias, eps)
    else:
        y = F.layer_norm(t, shape, None, None, eps) * scale
        y = y + bias if bias is not None else y
    if not (node.wants(1) or node.wants(2)):
        return [y]
    dims = tuple(range(axis, t.dim()))
    mean = t.mean(dim=dims, keepdim=True)
    inv_std = torch.rsqrt(t.var(dim=dims, unbiased=False, keepdim=True) + eps)
    return [y, mean, inv_std]


# ====================================================================== losses
@register("SoftmaxCrossEntropyLoss")
def _softmax_ce(node: _Node, x: list) -> list[Tensor]:
    scores, labels = x[0], x[1]
    weight = x[2] if len(x) > 2 else None
    logp = torch.log_softmax(scores, dim=1)
    loss = _nll(node, logp, labels, weight)
    return [loss, logp]


@register("NegativeLogLikelihoodLoss")
def _nll_loss(node: _Node, x: list) -> Tensor:
    weight = x[2] if len(x) > 2 else None
    return _nll(node, x[0], x[1], weight)


def _nll(node: _Node, logp: Tensor, labels: Tensor, weight: Tensor | None) -> Tensor:
    ignore = node.get("ignore_index", -100)
    return F.nll_loss(logp, labels.to(torch.int64), weight=weight, ignore_index=ignore,
                      reduction=node.get("reduction", "mean"))


def torch_sgd_losses(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], steps: int,
                     lr: float, loss: str = "cross-entropy", labels: np.ndarray | None = None,
                     target: np.ndarray | None = None) -> list[float]:
    """Losses of ``steps`` plain SGD steps (p -= lr * grad) on one fixed batch, in torch.

    The reference for ``memcc run`` with ``--optimizer sgd``: same loss, same update, and
    BatchNormalization running statistics left as they are (they do not affect a
    training-mode forward pass).
    """
    current = onnx.ModelProto()
    current.CopyFrom(model)
    losses = []
    for _ in range(steps):
        value, grads = torch_loss_and_grads(current, feeds, loss, labels, target)
        losses.append(value)
        for init in current.graph.initializer:
            if init.name in grads:
                arr = numpy_helper.to_array(init) - lr * grads[init.name]
                init.CopyFrom(numpy_helper.from_array(arr.astype(grads[init.name].dtype),
                                                      init.name))
    return losses
