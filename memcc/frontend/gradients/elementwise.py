"""Gradient rules for elementwise, matrix-product, softmax and dropout ops.

Every rule undoes numpy broadcasting with ``Emitter.sum_to_shape`` and emits only what the
inputs that need a gradient require. Where the backward formula can be written with either
the forward input or the forward output, it uses whichever torch uses, so that results match
torch autograd (the reference the tests compare against), including at ties and kinks.

Public helpers (``compare``, ``select``, ``unbroadcast``, ``matmul_2d`` ...) are shared with
the reduction rules and may be used by other rule modules.
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto

from memcc.errors import GradientError
from memcc.frontend.gradients.registry import GradContext, GradRule, register
from memcc.graph import TensorInfo, attr, node_label

Grads = list[str | None]
UnaryFn = Callable[[GradContext, onnx.NodeProto, str, str, str], str]
# (ctx, node, gradient of the output, one None per input) -> the inputs' gradients
OutputGradFn = Callable[[GradContext, onnx.NodeProto, str, Grads], Grads]

# Types ORT's CPU Gemm kernel takes; other float types fall back to Transpose + MatMul.
_GEMM_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE})


# ---------------------------------------------------------------------- shared helpers
def scalar_like(ctx: GradContext, value: float, ref: str) -> str:
    """A scalar constant in ``ref``'s element type, so that binary ops type-check."""
    return ctx.emit.scalar(value, ctx.info(ref).dtype)


def unbroadcast(ctx: GradContext, g: str, name: str) -> str:
    """Reduce a gradient computed at the broadcast shape back to ``name``'s own shape."""
    return ctx.emit.sum_to_shape(g, ctx.info(name).shape)


def _bshape(ctx: GradContext, *names: str) -> tuple[int, ...]:
    return tuple(np.broadcast_shapes(*(ctx.info(n).shape for n in names)))


def compare(ctx: GradContext, op: str, a: str, b: str) -> str:
    """A broadcasting comparison with a BOOL result; spells >= and <= for opsets < 12."""
    info = TensorInfo(TensorProto.BOOL, _bshape(ctx, a, b))
    if ctx.opset < 12 and op in ("GreaterOrEqual", "LessOrEqual"):
        strict = "Less" if op == "GreaterOrEqual" else "Greater"
        return ctx.emit.op("Not", [ctx.emit.op(strict, [a, b], info=info)], info=info)
    return ctx.emit.op(op, [a, b], info=info)


def logical(ctx: GradContext, op: str, a: str, b: str) -> str:
    return ctx.emit.op(op, [a, b], info=TensorInfo(TensorProto.BOOL, _bshape(ctx, a, b)))


def select(ctx: GradContext, cond: str, a: str, b: str) -> str:
    """``Where(cond, a, b)``; the element type is taken from ``a``."""
    info = TensorInfo(ctx.info(a).dtype, _bshape(ctx, cond, a, b))
    return ctx.emit.op("Where", [cond, a, b], info=info)


def keep_where(ctx: GradContext, cond: str, g: str) -> str:
    """``g`` where ``cond`` holds, else 0: how kinked functions pass gradients through."""
    return select(ctx, cond, g, scalar_like(ctx, 0.0, g))


def scale(ctx: GradContext, g: str, factor: float) -> str:
    if factor == 1.0:
        return g
    if factor == -1.0:
        return ctx.emit.neg(g)
    return ctx.emit.mul(g, scalar_like(ctx, factor, g))


def matmul_2d(ctx: GradContext, a: str, b: str, trans_a: bool = False, trans_b: bool = False,
              alpha: float = 1.0) -> str:
    """``alpha * op(a) @ op(b)`` for 2-D operands without materializing a transpose.

    Gemm folds the transposes and the scale into one kernel; types Gemm lacks on CPU go
    through Transpose + MatMul.
    """
    ia, ib = ctx.info(a), ctx.info(b)
    m = ia.shape[1] if trans_a else ia.shape[0]
    n = ib.shape[0] if trans_b else ib.shape[1]
    info = TensorInfo(ia.dtype, (m, n))
    if ia.dtype in _GEMM_TYPES:
        return ctx.emit.op("Gemm", [a, b], info=info, transA=int(trans_a) or None,
                           transB=int(trans_b) or None,
                           alpha=float(alpha) if alpha != 1.0 else None)
    if trans_a:
        a = ctx.emit.transpose(a, [1, 0])
    if trans_b:
        b = ctx.emit.transpose(b, [1, 0])
    return scale(ctx, ctx.emit.op("MatMul", [a, b], info=info), alpha)


def swap_last_two(ctx: GradContext, x: str) -> str:
    rank = len(ctx.info(x).shape)
    return ctx.emit.transpose(x, list(range(rank - 2)) + [rank - 1, rank - 2])


def _none(node: onnx.NodeProto) -> Grads:
    return [None] * len(node.input)


def _wants(ctx: GradContext, node: onnx.NodeProto, i: int) -> bool:
    return i < len(node.input) and ctx.needs_grad(node.input[i])


def _on_output_grad(fn: OutputGradFn) -> GradRule:
    """The opening every rule with several inputs shares: without a gradient into the first
    output no input gets one; with it, ``fn(ctx, node, g, out)`` fills ``out``, which starts
    as one ``None`` per input."""

    @functools.wraps(fn)
    def rule(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
        out = _none(node)
        if gouts[0] is None:
            return out
        return fn(ctx, node, gouts[0], out)

    return rule


# ---------------------------------------------------------------------- arithmetic
@register("Add", "Sub")
@_on_output_grad
def _add_sub(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    if _wants(ctx, node, 0):
        out[0] = unbroadcast(ctx, g, node.input[0])
    if _wants(ctx, node, 1):
        gb = unbroadcast(ctx, g, node.input[1])
        out[1] = ctx.emit.neg(gb) if node.op_type == "Sub" else gb
    return out


@register("Mul")
@_on_output_grad
def _mul(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    a, b = node.input[0], node.input[1]
    if _wants(ctx, node, 0):
        out[0] = unbroadcast(ctx, ctx.emit.mul(g, b), a)
    if _wants(ctx, node, 1):
        out[1] = unbroadcast(ctx, ctx.emit.mul(g, a), b)
    return out


@register("Mod")
@_on_output_grad
def _mod(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """Float Mod (ONNX requires ``fmod=1`` for floats: torch.fmod): ``y = a - b * q`` with
    ``q = trunc(a/b)``, piecewise constant, so ``da = g`` and ``db = -g * q``. (``fmod=0``
    would use floor; ORT refuses it on floats, the rule spells it anyway.)"""
    a, b = node.input[0], node.input[1]
    emit = ctx.emit
    if _wants(ctx, node, 0):
        out[0] = unbroadcast(ctx, g, a)
    if _wants(ctx, node, 1):
        ratio = emit.div(a, b)
        if attr(node, "fmod", 0):
            q = emit.mul(emit.unary("Sign", ratio), emit.unary("Floor", emit.unary("Abs", ratio)))
        else:
            q = emit.unary("Floor", ratio)
        out[1] = emit.neg(unbroadcast(ctx, emit.mul(g, q), b))
    return out


@register("Div")
@_on_output_grad
def _div(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """d(a/b)/db = -y/b: uses the output, so ``a`` need not stay alive for this."""
    a, b = node.input[0], node.input[1]
    g_over_b = ctx.emit.div(g, b)
    if _wants(ctx, node, 0):
        out[0] = unbroadcast(ctx, g_over_b, a)
    if _wants(ctx, node, 1):
        gb = unbroadcast(ctx, ctx.emit.mul(g_over_b, node.output[0]), b)
        out[1] = ctx.emit.neg(gb)
    return out


@register("Pow")
@_on_output_grad
def _pow(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    if _wants(ctx, node, 0):
        out[0] = _pow_grad_base(ctx, node, g)
    if _wants(ctx, node, 1):
        out[1] = _pow_grad_exponent(ctx, node, g)
    return out


def _pow_grad_base(ctx: GradContext, node: onnx.NodeProto, g: str) -> str:
    """g * p * x^(p-1), with a constant exponent folded at compile time."""
    x, p = node.input[0], node.input[1]
    e = ctx.emit
    pval = ctx.constant_value(p)
    if pval is not None and pval.size == 1:
        pv = float(pval.reshape(-1)[0])
        if pv == 0.0:
            return e.zeros_like(x)
        if pv == 1.0:
            return unbroadcast(ctx, g, x)
        if pv == 2.0:
            return unbroadcast(ctx, e.mul(e.mul(g, x), scalar_like(ctx, 2.0, x)), x)
        powed = e.binary("Pow", x, scalar_like(ctx, pv - 1.0, x), info=ctx.info(x))
        return unbroadcast(ctx, e.mul(e.mul(g, powed), scalar_like(ctx, pv, x)), x)
    pf = e.cast(p, ctx.info(x).dtype)
    pm1 = e.sub(pf, scalar_like(ctx, 1.0, x))
    powed = e.binary("Pow", x, pm1, info=TensorInfo(ctx.info(x).dtype, _bshape(ctx, x, pm1)))
    return unbroadcast(ctx, e.mul(g, e.mul(powed, pf)), x)


def _pow_grad_exponent(ctx: GradContext, node: onnx.NodeProto, g: str) -> str:
    """g * y * log(x), zero where x == 0 and p >= 0 (as torch does, avoiding 0 * -inf)."""
    x, p = node.input[0], node.input[1]
    e = ctx.emit
    y = node.output[0]
    ylog = e.mul(y, e.unary("Log", x))
    zero = scalar_like(ctx, 0.0, x)
    pf = e.cast(p, ctx.info(x).dtype)
    bad = logical(ctx, "And", compare(ctx, "Equal", x, zero),
                  compare(ctx, "GreaterOrEqual", pf, zero))
    safe = select(ctx, bad, scalar_like(ctx, 0.0, ylog), ylog)
    gp = unbroadcast(ctx, e.mul(g, safe), p)
    return e.cast(gp, ctx.info(p).dtype)


@register("Sum", "Mean")
@_on_output_grad
def _sum_mean(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    if node.op_type == "Mean":
        g = scale(ctx, g, 1.0 / len(node.input))
    for i, name in enumerate(node.input):
        if ctx.needs_grad(name):
            out[i] = unbroadcast(ctx, g, name)
    return out


@register("Max", "Min")
@_on_output_grad
def _max_min(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """Gradient goes to the inputs equal to the result, split evenly among ties.

    For two inputs this is exactly torch.maximum/minimum (half to each on a tie); for more it
    is the same rule generalized (1/k to each of k tied inputs).
    """
    if len(node.input) == 1:
        out[0] = g if ctx.needs_grad(node.input[0]) else None
        return out
    e = ctx.emit
    y = node.output[0]
    dtype = ctx.info(y).dtype
    masks = [e.cast(compare(ctx, "Equal", name, y), dtype) for name in node.input]
    count = masks[0]
    for m in masks[1:]:
        count = e.add(count, m)
    g_share = e.div(g, count)
    for i, name in enumerate(node.input):
        if ctx.needs_grad(name):
            out[i] = unbroadcast(ctx, e.mul(g_share, masks[i]), name)
    return out


@register("Where")
@_on_output_grad
def _where(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    cond = node.input[0]
    zero = scalar_like(ctx, 0.0, g)
    if _wants(ctx, node, 1):
        out[1] = unbroadcast(ctx, select(ctx, cond, g, zero), node.input[1])
    if _wants(ctx, node, 2):
        out[2] = unbroadcast(ctx, select(ctx, cond, zero, g), node.input[2])
    return out


@register("Identity")
def _identity(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    return [gouts[0] if ctx.needs_grad(node.input[0]) else None]


@register("Cast")
def _cast(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Float-to-float casts pass the gradient back in the source type; others block it."""
    g = gouts[0]
    x = node.input[0]
    if g is None or not ctx.needs_grad(x):
        return [None]
    if not (ctx.info(x).is_float and ctx.info(node.output[0]).is_float):
        return [None]
    return [ctx.emit.cast(g, ctx.info(x).dtype)]


# ---------------------------------------------------------------------- unary ops
def _unary(*op_types: str) -> Callable[[UnaryFn], UnaryFn]:
    """Register ``fn(ctx, node, x, y, g) -> dx`` for ops whose first input is the only
    differentiable one (extra inputs, like Clip bounds, are handled by the op's own rule)."""

    def deco(fn: UnaryFn) -> UnaryFn:
        def rule(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
            out = _none(node)
            if gouts[0] is not None and ctx.needs_grad(node.input[0]):
                out[0] = fn(ctx, node, node.input[0], node.output[0], gouts[0])
            return out

        register(*op_types)(rule)
        return fn

    return deco


@_unary("Neg")
def _neg(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.neg(g)


@_unary("Sqrt")
def _sqrt(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.div(scale(ctx, g, 0.5), y)


@_unary("Exp")
def _exp(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.mul(g, y)


@_unary("Log")
def _log(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.div(g, x)


@_unary("Reciprocal")
def _reciprocal(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    e = ctx.emit
    return e.neg(e.mul(g, e.mul(y, y)))


@_unary("Abs")
def _abs(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.mul(g, ctx.emit.unary("Sign", x))


@_unary("Sin")
def _sin(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.mul(g, ctx.emit.unary("Cos", x))


@_unary("Cos")
def _cos(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.neg(ctx.emit.mul(g, ctx.emit.unary("Sin", x)))


@_unary("Tanh")
def _tanh(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    e = ctx.emit
    return e.mul(g, e.sub(scalar_like(ctx, 1.0, y), e.mul(y, y)))


@_unary("Sigmoid")
def _sigmoid(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    e = ctx.emit
    return e.mul(g, e.mul(y, e.sub(scalar_like(ctx, 1.0, y), y)))


@_unary("Relu")
def _relu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    """Pass-through where y > 0 (torch's threshold_backward on the result: 0 at x == 0)."""
    return keep_where(ctx, compare(ctx, "Greater", y, scalar_like(ctx, 0.0, y)), g)


@_unary("LeakyRelu")
def _leaky_relu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    alpha = float(attr(node, "alpha", 0.01))
    pos = compare(ctx, "Greater", x, scalar_like(ctx, 0.0, x))
    return select(ctx, pos, g, scale(ctx, g, alpha))


@_unary("Elu")
def _elu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    """For x <= 0, dy/dx = alpha * exp(x) = y + alpha, read off the saved output."""
    alpha = float(attr(node, "alpha", 1.0))
    e = ctx.emit
    pos = compare(ctx, "Greater", x, scalar_like(ctx, 0.0, x))
    neg_branch = e.mul(g, e.add(y, scalar_like(ctx, alpha, y)))
    return select(ctx, pos, g, neg_branch)


@_unary("Celu")
def _celu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    """For x <= 0, dy/dx = exp(x / alpha) = y / alpha + 1, read off the saved output (as
    torch's celu backward: 1 where x > 0)."""
    alpha = float(attr(node, "alpha", 1.0))
    pos = compare(ctx, "Greater", x, scalar_like(ctx, 0.0, x))
    neg_branch = ctx.emit.mul(g, ctx.emit.add(scale(ctx, y, 1.0 / alpha),
                                              scalar_like(ctx, 1.0, y)))
    return select(ctx, pos, g, neg_branch)


@_unary("Atan")
def _atan(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    e = ctx.emit
    return e.div(g, e.add(scalar_like(ctx, 1.0, x), e.mul(x, x)))


@register("PRelu")
@_on_output_grad
def _prelu(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """y = x where x > 0, else slope * x (torch.nn.PReLU; the slope broadcasts over x)."""
    x, slope = node.input[0], node.input[1]
    e = ctx.emit
    pos = compare(ctx, "Greater", x, scalar_like(ctx, 0.0, x))
    if _wants(ctx, node, 0):
        out[0] = select(ctx, pos, g, e.mul(g, slope))
    if _wants(ctx, node, 1):
        out[1] = unbroadcast(ctx, select(ctx, pos, scalar_like(ctx, 0.0, g), e.mul(g, x)),
                             slope)
    return out


@_unary("Selu")
def _selu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    alpha = float(attr(node, "alpha", 1.67326319217681884765625))
    gamma = float(attr(node, "gamma", 1.05070102214813232421875))
    e = ctx.emit
    pos = compare(ctx, "Greater", x, scalar_like(ctx, 0.0, x))
    neg_branch = e.mul(g, e.add(y, scalar_like(ctx, alpha * gamma, y)))
    return select(ctx, pos, scale(ctx, g, gamma), neg_branch)


@_unary("Softplus")
def _softplus(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    return ctx.emit.mul(g, ctx.emit.unary("Sigmoid", x))


@_unary("HardSigmoid")
def _hard_sigmoid(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    """alpha inside the linear part, 0 on the flat parts and at the corners (as torch)."""
    alpha = float(attr(node, "alpha", 0.2))
    inside = logical(ctx, "And", compare(ctx, "Greater", y, scalar_like(ctx, 0.0, y)),
                     compare(ctx, "Less", y, scalar_like(ctx, 1.0, y)))
    return keep_where(ctx, inside, scale(ctx, g, alpha))


@_unary("HardSwish")
def _hard_swish(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    """torch's hardswish_backward: 0 below -3, g*(x/3 + 1/2) up to 3 inclusive, g above."""
    e = ctx.emit
    slope = e.add(scale(ctx, x, 1.0 / 3.0), scalar_like(ctx, 0.5, x))
    mid = select(ctx, compare(ctx, "LessOrEqual", x, scalar_like(ctx, 3.0, x)),
                 e.mul(g, slope), g)
    return select(ctx, compare(ctx, "Less", x, scalar_like(ctx, -3.0, x)),
                  scalar_like(ctx, 0.0, g), mid)


@_unary("Erf")
def _erf(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    e = ctx.emit
    gauss = e.unary("Exp", e.neg(e.mul(x, x)))
    return e.mul(g, scale(ctx, gauss, 2.0 / math.sqrt(math.pi)))


@_unary("Gelu")
def _gelu(ctx: GradContext, node: onnx.NodeProto, x: str, y: str, g: str) -> str:
    approx = attr(node, "approximate", b"none")
    approx = approx.decode() if isinstance(approx, bytes) else str(approx)
    if approx == "tanh":
        return ctx.emit.mul(g, _gelu_tanh_slope(ctx, x))
    if approx != "none":
        raise GradientError(f"{node_label(node)}: unknown approximate='{approx}'")
    e = ctx.emit
    # d/dx [x * Phi(x)] = Phi(x) + x * phi(x)
    cdf = e.mul(e.add(e.unary("Erf", scale(ctx, x, 1.0 / math.sqrt(2.0))),
                      scalar_like(ctx, 1.0, x)), scalar_like(ctx, 0.5, x))
    pdf = scale(ctx, e.unary("Exp", scale(ctx, e.mul(x, x), -0.5)),
                1.0 / math.sqrt(2.0 * math.pi))
    return e.mul(g, e.add(cdf, e.mul(x, pdf)))


def _gelu_tanh_slope(ctx: GradContext, x: str) -> str:
    """d/dx of 0.5 x (1 + tanh(k (x + c x^3))) with k = sqrt(2/pi), c = 0.044715."""
    e = ctx.emit
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    x2 = e.mul(x, x)
    inner = scale(ctx, e.mul(x, e.add(scale(ctx, x2, c), scalar_like(ctx, 1.0, x))), k)
    t = e.unary("Tanh", inner)
    one = scalar_like(ctx, 1.0, x)
    dinner = scale(ctx, e.add(scale(ctx, x2, 3.0 * c), one), k)
    left = scale(ctx, e.add(t, one), 0.5)
    right = e.mul(scale(ctx, x, 0.5), e.mul(e.sub(one, e.mul(t, t)), dinner))
    return e.add(left, right)


# ---------------------------------------------------------------------- Clip
@register("Clip")
@_on_output_grad
def _clip(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """Pass-through where min <= x <= max (torch.clamp); a tensor bound collects the
    gradient of the elements it clipped."""
    x = node.input[0]
    inside = clip_inside(ctx, node)
    if ctx.needs_grad(x):
        out[0] = g if inside is None else keep_where(ctx, inside, g)
    for i, op in ((1, "Less"), (2, "Greater")):
        if _wants(ctx, node, i):
            bound = node.input[i]
            clipped = keep_where(ctx, compare(ctx, op, x, bound), g)
            out[i] = unbroadcast(ctx, clipped, bound)
    return out


def clip_inside(ctx: GradContext, node: onnx.NodeProto) -> str | None:
    """min <= x <= max as a BOOL value (None: Clip has no bounds), emitted through ``ctx``
    (the default rule's backward, or the ``mask`` variant's forward extras)."""
    x = node.input[0]
    lo, hi = _clip_bounds(ctx, node)
    conds = []
    if lo is not None:
        conds.append(compare(ctx, "GreaterOrEqual", x, lo))
    if hi is not None:
        conds.append(compare(ctx, "LessOrEqual", x, hi))
    if not conds:
        return None
    return conds[0] if len(conds) == 1 else logical(ctx, "And", *conds)


def _clip_bounds(ctx: GradContext, node: onnx.NodeProto) -> tuple[str | None, str | None]:
    """min/max as value names: inputs since opset 11, attributes before."""
    if len(node.input) > 1 or ctx.opset >= 11:
        lo = node.input[1] if len(node.input) > 1 and node.input[1] else None
        hi = node.input[2] if len(node.input) > 2 and node.input[2] else None
        return lo, hi
    x = node.input[0]
    lo_v, hi_v = attr(node, "min", None), attr(node, "max", None)
    lo = scalar_like(ctx, lo_v, x) if lo_v is not None else None
    hi = scalar_like(ctx, hi_v, x) if hi_v is not None else None
    return lo, hi


# ---------------------------------------------------------------------- MatMul / Gemm
@register("MatMul")
@_on_output_grad
def _matmul(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """numpy matmul semantics: 1-D operands are promoted to matrices and broadcast batch
    dimensions are summed away. When one side has no batch (a weight), its gradient is one
    2-D product over the flattened batch instead of a batched product then a sum."""
    a, b = node.input[0], node.input[1]
    sa, sb = ctx.info(a).shape, ctx.info(b).shape
    a2s = (1,) + sa if len(sa) == 1 else sa
    b2s = sb + (1,) if len(sb) == 1 else sb
    batch = tuple(np.broadcast_shapes(a2s[:-2], b2s[:-2]))
    n, m = a2s[-2], b2s[-1]
    g2 = ctx.emit.reshape(g, batch + (n, m))
    if _wants(ctx, node, 0):
        out[0] = _matmul_grad_a(ctx, a, b, g2, a2s, b2s)
    if _wants(ctx, node, 1):
        out[1] = _matmul_grad_b(ctx, a, b, g2, a2s, b2s)
    return out


def _matmul_grad_a(ctx: GradContext, a: str, b: str, g2: str, a2s: tuple[int, ...],
                   b2s: tuple[int, ...]) -> str:
    """dA = g @ B^T, summed over the batch dimensions A was broadcast along."""
    e = ctx.emit
    b2 = e.reshape(b, b2s)
    gs = ctx.info(g2).shape
    if math.prod(b2s[:-2]) == 1:
        g_flat = e.reshape(g2, (math.prod(gs[:-1]), gs[-1]))
        ga = matmul_2d(ctx, g_flat, e.reshape(b2, b2s[-2:]), trans_b=True)
        return e.reshape(ga, ctx.info(a).shape)
    bt = swap_last_two(ctx, b2)
    shape = tuple(np.broadcast_shapes(gs[:-2], b2s[:-2])) + (gs[-2], b2s[-2])
    ga = e.op("MatMul", [g2, bt], info=TensorInfo(ctx.info(g2).dtype, shape))
    return e.reshape(e.sum_to_shape(ga, a2s), ctx.info(a).shape)


def _matmul_grad_b(ctx: GradContext, a: str, b: str, g2: str, a2s: tuple[int, ...],
                   b2s: tuple[int, ...]) -> str:
    """dB = A^T @ g, summed over the batch dimensions B was broadcast along."""
    e = ctx.emit
    a2 = e.reshape(a, a2s)
    gs = ctx.info(g2).shape
    if math.prod(b2s[:-2]) == 1:
        rows = math.prod(gs[:-1])
        a_flat = e.reshape(a2, (rows, a2s[-1]))
        g_flat = e.reshape(g2, (rows, gs[-1]))
        gb = matmul_2d(ctx, a_flat, g_flat, trans_a=True)
        return e.reshape(gb, ctx.info(b).shape)
    at = swap_last_two(ctx, a2)
    shape = tuple(np.broadcast_shapes(a2s[:-2], gs[:-2])) + (a2s[-1], gs[-1])
    gb = e.op("MatMul", [at, g2], info=TensorInfo(ctx.info(g2).dtype, shape))
    return e.reshape(e.sum_to_shape(gb, b2s), ctx.info(b).shape)


@register("Gemm")
@_on_output_grad
def _gemm(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """Y = alpha op(A) op(B) + beta C; each case is one Gemm with the right trans flags."""
    a, b = node.input[0], node.input[1]
    ta, tb = bool(attr(node, "transA", 0)), bool(attr(node, "transB", 0))
    alpha, beta = float(attr(node, "alpha", 1.0)), float(attr(node, "beta", 1.0))
    if _wants(ctx, node, 0):
        if ta:  # dA = alpha * op(B) @ g^T
            out[0] = matmul_2d(ctx, b, g, trans_a=tb, trans_b=True, alpha=alpha)
        else:  # dA = alpha * g @ op(B)^T
            out[0] = matmul_2d(ctx, g, b, trans_b=not tb, alpha=alpha)
    if _wants(ctx, node, 1):
        if tb:  # dB = alpha * g^T @ op(A)
            out[1] = matmul_2d(ctx, g, a, trans_a=True, trans_b=ta, alpha=alpha)
        else:  # dB = alpha * op(A)^T @ g
            out[1] = matmul_2d(ctx, a, g, trans_a=not ta, alpha=alpha)
    if _wants(ctx, node, 2):
        c = node.input[2]
        out[2] = scale(ctx, unbroadcast(ctx, g, c), beta)
    return out


# ---------------------------------------------------------------------- Einsum
@register("Einsum")
@_on_output_grad
def _einsum(ctx: GradContext, node: onnx.NodeProto, g: str, out: Grads) -> Grads:
    """d(operand i) = einsum(g, other operands -> term i).

    Valid when no term repeats a letter (no traces/diagonals), every letter of an operand
    also appears in another term (no letter summed inside one operand alone), and ellipsis
    dimensions are not broadcast; other equations raise GradientError.
    """
    terms, result = _parse_einsum(ctx, node)
    for i, name in enumerate(node.input):
        if not ctx.needs_grad(name):
            continue
        others = [t for j, t in enumerate(terms) if j != i]
        _check_einsum_term(node, terms[i], [result] + others, name)
        out[i] = _einsum_operand_grad(ctx, node, g, i, terms, result)
    return out


def _einsum_operand_grad(ctx: GradContext, node: onnx.NodeProto, g: str, i: int,
                         terms: list[str], result: str) -> str:
    """Einsum gradient for operand ``i``; ellipsis dimensions that operand lacks (a weight
    shared across a batch) are kept in the Einsum, as ONNX requires, then summed away."""
    name = node.input[i]
    target, shape = terms[i], ctx.info(name).shape
    ell: tuple[int, ...] = ()
    if "..." in result and "..." not in target:
        ell = _ellipsis_dims(result, ctx.info(node.output[0]).shape)
        target, shape = "..." + target, ell + shape
    others = [t for j, t in enumerate(terms) if j != i]
    eq = ",".join([result] + others) + "->" + target
    ins = [g] + [n for j, n in enumerate(node.input) if j != i]
    gi = ctx.emit.op("Einsum", ins, equation=eq, info=TensorInfo(ctx.info(name).dtype, shape))
    return ctx.emit.reduce_sum(gi, list(range(len(ell))), keepdims=False)


def _parse_einsum(ctx: GradContext, node: onnx.NodeProto) -> tuple[list[str], str]:
    """Operand terms and the explicit result term (implicit mode spelled out)."""
    eq = attr(node, "equation")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if not arrow:
        letters = [c for c in lhs if c in string.ascii_letters]
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    out_ell = _ellipsis_dims(rhs, ctx.info(node.output[0]).shape)
    for t, name in zip(terms, node.input, strict=True):
        ell = _ellipsis_dims(t, ctx.info(name).shape)
        if ell and ell != out_ell:
            raise GradientError(
                f"{node_label(node)}: no Einsum gradient when ellipsis dimensions are "
                f"broadcast or summed ('{eq}')")
    return terms, rhs


def _ellipsis_dims(term: str, shape: Sequence[int]) -> tuple[int, ...]:
    if "..." not in term:
        return ()
    pos = term.index("...")
    count = len(shape) - (len(term) - 3)
    return tuple(shape[pos:pos + count])


def _check_einsum_term(node: onnx.NodeProto, term: str, others: Sequence[str],
                       name: str) -> None:
    letters = term.replace("...", "")
    elsewhere = set("".join(others))
    if len(set(letters)) != len(letters) or not set(letters) <= elsewhere:
        raise GradientError(
            f"{node_label(node)}: no Einsum gradient for operand '{name}' with term '{term}' "
            "(repeated or operand-only index); rewrite the equation with MatMul/ReduceSum")


# ---------------------------------------------------------------------- Softmax family
def _softmax_axes(ctx: GradContext, node: onnx.NodeProto) -> list[int]:
    """The axes one softmax normalizes over.

    From opset 13 that is the single ``axis``; before, the input is coerced to 2-D at
    ``axis`` (default 1), so the softmax runs over all of axes ``axis..rank-1`` together.
    """
    rank = len(ctx.info(node.input[0]).shape)
    if ctx.opset >= 13:
        return [int(attr(node, "axis", -1)) % rank]
    axis = int(attr(node, "axis", 1)) % rank
    return list(range(axis, rank))


@register("Softmax")
def _softmax(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return [None]
    e = ctx.emit
    y = node.output[0]
    dot = e.reduce_sum(e.mul(g, y), _softmax_axes(ctx, node), keepdims=True)
    return [e.mul(y, e.sub(g, dot))]


@register("LogSoftmax")
def _log_softmax(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return [None]
    e = ctx.emit
    total = e.reduce_sum(g, _softmax_axes(ctx, node), keepdims=True)
    return [e.sub(g, e.mul(e.unary("Exp", node.output[0]), total))]


# ---------------------------------------------------------------------- Dropout
@register("Dropout")
def _dropout(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Identity in inference mode; in training, g * mask / (1 - ratio).

    The rule needs the forward mask. When the forward node does not output it, the mask
    output is added to the (already emitted) forward node in place: it costs one byte per
    element and is the only way to reproduce the forward's random draw.
    """
    g = gouts[0]
    out = _none(node)
    x = node.input[0]
    if g is None or not ctx.needs_grad(x):
        return out
    training = _dropout_training(ctx, node)
    if training is False:
        out[0] = g
        return out
    mask = _dropout_mask(ctx, node)
    factor = _dropout_scale(ctx, node, training)
    out[0] = keep_where(ctx, mask, ctx.emit.mul(g, factor))
    return out


def _dropout_training(ctx: GradContext, node: onnx.NodeProto) -> bool | str:
    """True/False when known at compile time, else the name of the bool input."""
    if ctx.opset < 12:
        return False  # no training_mode before opset 12: ORT runs it as identity
    tm = node.input[2] if len(node.input) > 2 and node.input[2] else ""
    if not tm:
        return False
    val = ctx.constant_value(tm)
    if val is None:
        return tm
    return bool(np.asarray(val).reshape(-1)[0])


def _dropout_mask(ctx: GradContext, node: onnx.NodeProto) -> str:
    if len(node.output) > 1 and node.output[1]:
        return node.output[1]
    name = ctx.emit.fresh(f"{node.output[0]}.mask")
    if len(node.output) > 1:
        node.output[1] = name
    else:
        node.output.append(name)
    ctx.graph.info[name] = TensorInfo(TensorProto.BOOL, ctx.info(node.input[0]).shape)
    return name


def _dropout_scale(ctx: GradContext, node: onnx.NodeProto, training: bool | str) -> str:
    x = node.input[0]
    e = ctx.emit
    ratio_name = node.input[1] if len(node.input) > 1 and node.input[1] else ""
    ratio_val = ctx.constant_value(ratio_name) if ratio_name else np.asarray(0.5)
    if ratio_val is not None:
        r = float(np.asarray(ratio_val).reshape(-1)[0])
        factor = scalar_like(ctx, 1.0 / (1.0 - r) if r < 1.0 else 0.0, x)
    else:
        one = scalar_like(ctx, 1.0, x)
        factor = e.div(one, e.sub(one, e.cast(ratio_name, ctx.info(x).dtype)))
    if isinstance(training, str):
        factor = select(ctx, training, factor, scalar_like(ctx, 1.0, x))
    return factor
