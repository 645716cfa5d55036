"""Gradient rules for the Reduce* family.

Axes are resolved at compile time whichever way the opset spells them (attribute before
opset 18, and before 13 for ReduceSum; a constant input after), so every rule works on one
list of axes. The upstream gradient is first reshaped to the ``keepdims=1`` shape, which makes
``keepdims=0`` a free reshape, and then broadcast against the input by the elementwise ops
the formula needs anyway; an explicit Expand is emitted only where nothing else broadcasts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from memcc.errors import GradientError
from memcc.frontend.gradients.elementwise import compare, keep_where, scalar_like, scale
from memcc.frontend.gradients.registry import GradContext, register
from memcc.graph import attr, node_label

Grads = list[str | None]
# fn(ctx, node, x, g_kept, axes) -> dx, where g_kept has the keepdims=1 shape.
ReduceFn = Callable[[GradContext, onnx.NodeProto, str, str, tuple[int, ...]], str]


# With noop_with_empty_axes and no axes, ORT still applies these ops' elementwise part
# (x*x, log x, |x|), which their formulas below already differentiate with a reduction over
# no axes; every other reduction then returns its input unchanged.
_ELEMENTWISE_WHEN_NOOP = frozenset({"ReduceSumSquare", "ReduceLogSum", "ReduceL1", "ReduceL2"})


def reduce_axes(ctx: GradContext, node: onnx.NodeProto) -> tuple[int, ...]:
    """Sorted non-negative axes the node reduces; () when it is a no-op."""
    rank = len(ctx.info(node.input[0]).shape)
    if len(node.input) > 1 and node.input[1]:
        val = ctx.constant_value(node.input[1])
        if val is None:
            raise GradientError(
                f"{node_label(node)}: axes '{node.input[1]}' are computed at run time; "
                "memcc needs them constant (export with static axes)")
        axes = [int(a) for a in np.asarray(val).reshape(-1)]
    else:
        axes = [int(a) for a in attr(node, "axes", None) or []]
    if not axes:
        return () if attr(node, "noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted({a % rank for a in axes}))


def _kept_shape(ctx: GradContext, x: str, axes: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(1 if i in axes else d for i, d in enumerate(ctx.info(x).shape))


def _reduction(*op_types: str) -> Callable[[ReduceFn], ReduceFn]:
    """Register a rule that hands ``fn`` the output gradient at the keepdims shape."""

    def deco(fn: ReduceFn) -> ReduceFn:
        def rule(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
            out: Grads = [None] * len(node.input)
            x = node.input[0]
            if gouts[0] is None or not ctx.needs_grad(x):
                return out
            axes = reduce_axes(ctx, node)
            if not axes and node.op_type not in _ELEMENTWISE_WHEN_NOOP:
                out[0] = gouts[0]
                return out
            kept = _kept_shape(ctx, x, axes)
            gk = ctx.emit.reshape(gouts[0], kept)
            out[0] = fn(ctx, node, x, gk, axes)
            return out

        register(*op_types)(rule)
        return fn

    return deco


def _output_kept(ctx: GradContext, node: onnx.NodeProto, axes: tuple[int, ...]) -> str:
    """The forward output at the keepdims=1 shape, for rules whose formula reads it (only
    those: a Reshape emitted for nothing would keep the output alive)."""
    return ctx.emit.reshape(node.output[0], _kept_shape(ctx, node.input[0], axes))


def _expand_to(ctx: GradContext, g: str, x: str) -> str:
    return ctx.emit.expand(g, ctx.info(x).shape)


@_reduction("ReduceSum")
def _reduce_sum(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                axes: tuple[int, ...]) -> str:
    return _expand_to(ctx, gk, x)


@_reduction("ReduceMean")
def _reduce_mean(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                 axes: tuple[int, ...]) -> str:
    count = int(np.prod([ctx.info(x).shape[a] for a in axes], dtype=np.int64))
    return _expand_to(ctx, scale(ctx, gk, 1.0 / count) if count else gk, x)


@_reduction("ReduceSumSquare")
def _reduce_sum_square(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                       axes: tuple[int, ...]) -> str:
    return ctx.emit.mul(x, scale(ctx, gk, 2.0))


@_reduction("ReduceL1")
def _reduce_l1(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
               axes: tuple[int, ...]) -> str:
    return ctx.emit.mul(ctx.emit.unary("Sign", x), gk)


@_reduction("ReduceL2")
def _reduce_l2(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
               axes: tuple[int, ...]) -> str:
    """x * g / ||x||, and 0 where the norm is 0 (torch's subgradient choice)."""
    yk = _output_kept(ctx, node, axes)
    ratio = ctx.emit.div(gk, yk)
    ratio = keep_where(ctx, compare(ctx, "Greater", yk, scalar_like(ctx, 0.0, yk)), ratio)
    return ctx.emit.mul(x, ratio)


@_reduction("ReduceLogSumExp")
def _reduce_log_sum_exp(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                        axes: tuple[int, ...]) -> str:
    yk = _output_kept(ctx, node, axes)
    e = ctx.emit
    return e.mul(e.unary("Exp", e.sub(x, yk)), gk)


@_reduction("ReduceLogSum")
def _reduce_log_sum(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                    axes: tuple[int, ...]) -> str:
    yk = _output_kept(ctx, node, axes)
    e = ctx.emit
    return _expand_to(ctx, e.div(gk, e.unary("Exp", yk)), x)


@_reduction("ReduceProd")
def _reduce_prod(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                 axes: tuple[int, ...]) -> str:
    """g * prod / x. Exact only for inputs without zeros (a zero gives inf/nan), unlike
    torch, which recomputes products without the zero element."""
    yk = _output_kept(ctx, node, axes)
    e = ctx.emit
    return e.div(e.mul(gk, yk), x)


@_reduction("ReduceMax", "ReduceMin")
def _reduce_max_min(ctx: GradContext, node: onnx.NodeProto, x: str, gk: str,
                    axes: tuple[int, ...]) -> str:
    """Gradient to the positions equal to the extremum, split evenly among ties
    (as torch.amax/amin do; torch.max(dim) would pick one index instead)."""
    yk = _output_kept(ctx, node, axes)
    e = ctx.emit
    mask = e.cast(compare(ctx, "Equal", x, yk), ctx.info(x).dtype)
    count = e.reduce_sum(mask, list(axes), keepdims=True)
    return e.mul(mask, e.div(gk, count))
