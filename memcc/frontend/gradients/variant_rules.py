"""The operator variants memcc ships (registered in ``variants.VARIANTS``).

Each rule says in its docstring what it saves instead of the default rule and why that can
free memory; its tier (``exact`` / ``equivalent``) is checked by tests/test_variants.py
against the default rule on CPU at more than one thread.
"""

from __future__ import annotations

from dataclasses import replace

import onnx

from memcc.frontend.gradients.elementwise import (
    _clip_bounds,
    compare,
    keep_where,
    logical,
    scalar_like,
    scale,
    select,
)
from memcc.frontend.gradients.registry import GradContext
from memcc.frontend.gradients.variants import EXACT, VariantContext, register_variant
from memcc.graph import attr

Grads = list[str | None]


def _forward_ctx(ctx: VariantContext) -> GradContext:
    """The same context, emitting into the nodes that run right after the forward node."""
    if ctx.forward is None:
        raise RuntimeError("a variant that emits forward nodes needs ctx.forward")
    return replace(ctx, emit=ctx.forward)


def _first_only(node: onnx.NodeProto, gx: str | None) -> Grads:
    out: Grads = [None] * len(node.input)
    out[0] = gx
    return out


# ---------------------------------------------------------------------------- masks
@register_variant("Relu", name="mask", tier=EXACT)
def _relu_mask(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from a 1-byte mask (y > 0) taken in the forward pass instead of the float
    output: the output can then be freed once its forward readers are done."""
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return _first_only(node, None)
    y = node.output[0]
    fctx = _forward_ctx(ctx)
    mask = compare(fctx, "Greater", y, scalar_like(fctx, 0.0, y))
    return _first_only(node, keep_where(ctx, mask, g))


@register_variant("LeakyRelu", name="mask", tier=EXACT)
def _leaky_relu_mask(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from a 1-byte mask (x > 0) instead of the float input."""
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return _first_only(node, None)
    x = node.input[0]
    alpha = float(attr(node, "alpha", 0.01))
    fctx = _forward_ctx(ctx)
    pos = compare(fctx, "Greater", x, scalar_like(fctx, 0.0, x))
    return _first_only(node, select(ctx, pos, g, scale(ctx, g, alpha)))


def _clip_bounds_constant(ctx: GradContext, node: onnx.NodeProto) -> bool:
    """The mask variant covers Clip whose bounds take no gradient (ReLU6 and the like)."""
    return not any(i < len(node.input) and node.input[i] and ctx.needs_grad(node.input[i])
                   for i in (1, 2))


@register_variant("Clip", name="mask", tier=EXACT, applies=_clip_bounds_constant)
def _clip_mask(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from a 1-byte mask (min <= x <= max) instead of the float input."""
    g = gouts[0]
    x = node.input[0]
    if g is None or not ctx.needs_grad(x):
        return _first_only(node, None)
    fctx = _forward_ctx(ctx)
    lo, hi = _clip_bounds(fctx, node)
    conds = []
    if lo is not None:
        conds.append(compare(fctx, "GreaterOrEqual", x, lo))
    if hi is not None:
        conds.append(compare(fctx, "LessOrEqual", x, hi))
    if not conds:
        return _first_only(node, g)
    inside = conds[0] if len(conds) == 1 else logical(fctx, "And", *conds)
    return _first_only(node, keep_where(ctx, inside, g))
