"""The operator variants memcc ships (registered in ``variants.VARIANTS``).

Each rule says in its docstring what it saves instead of the default rule and why that can
free memory; its tier (``exact`` / ``equivalent``) is checked by tests/test_variants.py
against the default rule on CPU at more than one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import onnx
from onnx import TensorProto

from memcc.errors import GradientError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.elementwise import (
    clip_inside,
    compare,
    keep_where,
    scalar_like,
    scale,
    select,
)
from memcc.frontend.gradients.nn import (
    Normalised,
    _channel_view,
    _conv_input_grad,
    _conv_weight_grad,
    _spatial_sum,
    _window,
    batchnorm_train_backward,
    layernorm_backward,
)
from memcc.frontend.gradients.registry import RULES, GradContext
from memcc.frontend.gradients.shape_ops import norm_axis, slice_axis, tail
from memcc.frontend.gradients.variant_registry import (
    EQUIVALENT,
    EXACT,
    LOSSY,
    Applies,
    VariantContext,
    VariantRule,
    register_variant,
)
from memcc.graph import attr, node_label

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
    return _first_only(node, keep_where(ctx, _relu_forward_mask(ctx, node), g))


def _relu_forward_mask(ctx: VariantContext, node: onnx.NodeProto) -> str:
    """y > 0, taken in the forward pass right after the Relu (one byte per element)."""
    y = node.output[0]
    fctx = _forward_ctx(ctx)
    return compare(fctx, "Greater", y, scalar_like(fctx, 0.0, y))


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
    return _clip_backward(ctx, node, gouts[0], from_mask=True, product=False)


def _clip_backward(ctx: VariantContext, node: onnx.NodeProto, g: str | None, *,
                   from_mask: bool, product: bool) -> Grads:
    """The Clip variants' input gradient: g where min <= x <= max (taken in the forward
    pass as a 1-byte mask where ``from_mask``), by Where or, where ``product``, as
    g * float(inside)."""
    if g is None or not ctx.needs_grad(node.input[0]):
        return _first_only(node, None)
    inside = clip_inside(_forward_ctx(ctx) if from_mask else ctx, node)
    if inside is None:
        return _first_only(node, g)
    return _first_only(node, _times_condition(ctx, inside, g) if product
                       else keep_where(ctx, inside, g))


# ---------------------------------------------------------------------------- as products
# Where(cond, g, 0) builds both broadcast selections before merging them (ORT's kernel:
# liveness.scratch_bytes), so the default Relu (and Clip) backward holds the gradient, its
# result and two activation-sized selections at once. g * float(cond) holds one float
# factor instead. Values are equal; where g < 0 and the unit is off the product is -0.0
# where Where gives +0.0, and an infinite g gives NaN there instead of 0: hence
# "equivalent", not "exact".
RELU_PRODUCT_TOLERANCE = 1e-6


def _times_condition(ctx: GradContext, cond: str, g: str) -> str:
    factor = ctx.emit.cast(cond, ctx.info(g).dtype)
    return ctx.emit.mul(g, factor)


@register_variant("Relu", name="product", tier=EQUIVALENT, tolerance=RELU_PRODUCT_TOLERANCE)
def _relu_product(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward as g * float(y > 0) from the output, as the default reads it, without
    Where's two activation-sized selections: a smaller working set at the same saved
    values."""
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return _first_only(node, None)
    y = node.output[0]
    return _first_only(node, _times_condition(
        ctx, compare(ctx, "Greater", y, scalar_like(ctx, 0.0, y)), g))


@register_variant("Relu", name="mask_product", tier=EQUIVALENT,
                  tolerance=RELU_PRODUCT_TOLERANCE)
def _relu_mask_product(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward as g * float(mask) from a 1-byte mask taken in the forward pass: frees the
    output early (as ``mask``) and avoids Where's selections (as ``product``)."""
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return _first_only(node, None)
    return _first_only(node, _times_condition(ctx, _relu_forward_mask(ctx, node), g))


@register_variant("Clip", name="product", tier=EQUIVALENT, tolerance=RELU_PRODUCT_TOLERANCE,
                  applies=_clip_bounds_constant)
def _clip_product(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward as g * float(min <= x <= max) from the input, as the default reads it,
    without Where's two activation-sized selections (ReLU6 at MobileNetV2's stem: the
    smallest plan of a train-mode transformers export, batch 16 at 128 px, peaked there)."""
    return _clip_backward(ctx, node, gouts[0], from_mask=False, product=True)


@register_variant("Clip", name="mask_product", tier=EQUIVALENT,
                  tolerance=RELU_PRODUCT_TOLERANCE, applies=_clip_bounds_constant)
def _clip_mask_product(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward as g * float(mask) from the 1-byte mask the ``mask`` variant takes in the
    forward pass: frees the input early and avoids Where's selections."""
    return _clip_backward(ctx, node, gouts[0], from_mask=True, product=True)


# ---------------------------------------------------------------------------- shared
def _available(ctx: GradContext, name: str) -> bool:
    """A value the backward can read without keeping an activation: a parameter (graph
    input or initializer) or a Constant node's output."""
    if name in ctx.graph.initializers or name in ctx.graph.inputs:
        return True
    producer = ctx.producers().get(name)
    return producer is not None and producer.op_type == "Constant"


def _tiny(dtype: int) -> float:
    """The magnitude below which a divisor counts as zero: far below any trained scale, far
    above the underflow of the type (16-bit floats get their smallest normal number)."""
    if dtype == TensorProto.FLOAT16:
        return float(np.finfo(np.float16).tiny)
    return 1e-20


def _guarded(ctx: GradContext, s: str) -> str:
    """``s`` with every entry of magnitude below ``_tiny`` replaced by that tiny value with
    the entry's sign (+ for 0), so that dividing by it never gives inf or NaN."""
    tiny = _tiny(ctx.info(s).dtype)
    small = compare(ctx, "Less", ctx.emit.unary("Abs", s), scalar_like(ctx, tiny, s))
    negative = compare(ctx, "Less", s, scalar_like(ctx, 0.0, s))
    signed = select(ctx, negative, scalar_like(ctx, -tiny, s), scalar_like(ctx, tiny, s))
    return select(ctx, small, signed, s)


# ---------------------------------------------------------------------------- conv chunks
def _conv_chunks_apply(k: int) -> Applies:
    def applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
        if len(node.input) < 2 or not ctx.needs_grad(node.input[1]):
            return False  # no weight gradient: nothing to chunk
        shape = ctx.info(node.input[0]).shape
        return len(shape) >= 3 and int(shape[0]) >= k

    return applies


def _chunk_bounds(n: int, k: int) -> list[int]:
    """``k + 1`` batch offsets: chunks of n // k or n // k + 1 samples, none empty (n >= k)."""
    return [i * n // k for i in range(k + 1)]


def _before_last_transpose(emit: Emitter, part: str) -> tuple[str, bool]:
    """The default weight gradient ends by swapping its first two axes; summing the chunks
    before that swap (once, at the end) saves a weight-sized temporary per chunk. Returns
    the value to sum and whether it still needs the swap."""
    last = emit.nodes[-1] if emit.nodes else None
    rank = len(emit.info(part).shape)
    if (last is not None and last.op_type == "Transpose"
            and last.output[0] == part
            and list(attr(last, "perm", [])) == [1, 0] + list(range(2, rank))):
        emit.nodes.pop()
        return last.input[0], True
    return part, False


def _conv_chunked(k: int) -> VariantRule:
    def rule(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
        emit = ctx.emit
        x, w = node.input[0], node.input[1]
        x_info, w_info = ctx.info(x), ctx.info(w)
        gy = gouts[0]
        if gy is None:
            return [None] * len(node.input)
        group = int(attr(node, "group", 1))
        win = _window(node, w_info.shape[2:], x_info.shape[2:],
                      ctx.info(node.output[0]).shape[2:])
        gw = None
        if ctx.needs_grad(w):
            # One chunk after the other: a chunk's slices and transposes die at its Conv,
            # before the next chunk's are made; only the running sum is carried over.
            bounds = _chunk_bounds(int(x_info.shape[0]), k)
            swapped = True
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                xs = slice_axis(emit, x, 0, lo, hi)
                gs = slice_axis(emit, gy, 0, lo, hi)
                part = _conv_weight_grad(emit, xs, gs, win, group, w_info)
                part, unswapped = _before_last_transpose(emit, part)
                if gw is None:
                    swapped = unswapped
                elif unswapped != swapped:
                    raise RuntimeError(f"{node_label(node)}: chunks disagree on their layout")
                gw = part if gw is None else emit.add(gw, part)
            if gw is not None and swapped:
                gw = emit.transpose(gw, [1, 0] + list(range(2, len(w_info.shape))))
        # After the weight gradient, so x may already be dead when gx is allocated.
        gx = _conv_input_grad(emit, gy, w, win, group, x_info) if ctx.needs_grad(x) else None
        grads: Grads = [gx, gw]
        if len(node.input) > 2 and node.input[2]:
            grads.append(_spatial_sum(emit, gy) if ctx.needs_grad(node.input[2]) else None)
        return grads

    rule.__doc__ = (
        f"Weight gradient as a sum over {k} batch chunks: the default transposes the whole "
        f"input and output gradient at once (two activation-sized temporaries; for a 1x1 "
        f"convolution, a MatMul, at most one of them); here at most three 1/{k}-batch "
        f"slices are live at a time.\n\n"
        f"The chunks are summed before the default's final axis swap, which runs once; the "
        f"sum costs up to three weight-sized buffers (partial, running sum, new sum), so the "
        f"variant pays where activations outweigh the weight (early, wide layers), not in "
        f"late layers of many channels and few pixels. "
        f"Input and bias gradients are the default's. The batch N must be at least {k}; "
        f"chunks hold N // {k} or N // {k} + 1 samples (uneven last chunks are fine). The sum "
        f"over chunks adds the same products in another order (tolerance 1e-5 relative).")
    return rule


CONV_CHUNKS = (2, 4, 8)
for _k in CONV_CHUNKS:
    register_variant("Conv", name=f"chunks{_k}", tier=EQUIVALENT, tolerance=1e-5,
                     applies=_conv_chunks_apply(_k))(_conv_chunked(_k))


# ---------------------------------------------------------------------------- inverted norms
def _norm_params_available(ctx: GradContext, node: onnx.NodeProto) -> bool:
    """Scale (and bias) are parameters or constants, so the backward can read them without
    keeping anything of the forward pass alive; the output y exists."""
    if not node.output or not node.output[0]:
        return False
    params = [i for i in node.input[1:3] if i]
    return (len(params) >= 1 and all(_available(ctx, p) for p in params)
            and _well_conditioned(ctx, node))


# Rebuilding xhat = (y - bias) / scale multiplies float rounding by |bias / scale|; a channel
# with a scale near zero (zero-initialised residual BatchNorm, a pruned channel) cannot be
# inverted at all. The variants are offered only where every channel of the step's weights
# has |scale| >= SCALE_FLOOR * max(1, |bias|), i.e. the amplification stays below 1/SCALE_FLOOR
# (float32: relative error about 6e-6, inside the stated tolerances). Checked on the weights
# the step carries when it is compiled: a scale that drifts toward zero during training makes
# that channel's gradient inexact (docs/VARIANTS.md).
SCALE_FLOOR = 1e-2


def _well_conditioned(ctx: GradContext, node: onnx.NodeProto) -> bool:
    scale = _value_of(ctx, node.input[1])
    if scale is None:
        return False
    bias_name = node.input[2] if len(node.input) > 2 else ""
    bias = _value_of(ctx, bias_name) if bias_name else np.zeros(1)
    if bias is None:
        return False
    s, b = np.abs(scale.astype(np.float64)), np.abs(bias.astype(np.float64))
    try:
        floor = SCALE_FLOOR * np.maximum(1.0, np.broadcast_to(b, np.broadcast_shapes(
            s.shape, b.shape)))
        return bool(np.all(np.broadcast_to(s, floor.shape) >= floor))
    except ValueError:
        return False


def _value_of(ctx: GradContext, name: str):
    if name in ctx.graph.initializers:
        return np.asarray(ctx.graph.initializers[name])
    value = ctx.constant_value(name)
    return None if value is None else np.asarray(value)


def _layernorm_inverted_applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
    """Also: the node outputs InvStdDev (the default rule adds it when the model did not)."""
    if not _norm_params_available(ctx, node) or not ctx.info(node.input[0]).is_float:
        return False
    if len(node.output) < 3 or not node.output[2]:
        return False
    x_shape = ctx.info(node.input[0]).shape
    axis = norm_axis(int(attr(node, "axis", -1)), len(x_shape))
    norm_shape = tuple(x_shape[axis:])
    for p in node.input[1:3]:
        if p and tuple(np.broadcast_shapes(ctx.info(p).shape, norm_shape)) != norm_shape:
            return False
    return True


# The rebuilt xhat carries a rounding error of about eps * (|xhat| + |bias / scale|) per
# element. Measured against the default on GPT-2 steps (width 64-128, scale ~ N(1, 0.3-0.5),
# bias ~ N(0, 0.2-1)): at most 6.5e-7 relative per gradient tensor; bit-exact at the initial
# scale 1, bias 0.
LAYERNORM_INVERTED_TOLERANCE = 1e-5


@register_variant("LayerNormalization", name="inverted", tier=EQUIVALENT,
                  tolerance=LAYERNORM_INVERTED_TOLERANCE, applies=_layernorm_inverted_applies)
def _layernorm_inverted(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from the output y and the saved InvStdDev instead of the input x: xhat is
    rebuilt as (y - bias) / scale, so x can be freed once its forward readers are done
    (the next layer's backward usually keeps y anyway).

    Then the default's formulas. Where |scale| is below a tiny threshold (``_tiny``) the
    division uses that tiny value with scale's sign: no inf or NaN, but that channel's xhat
    is lost (its output carries no information about x), so its scale gradient and the input
    gradient at its positions (x still reaches the other channels through mean and variance)
    are then inexact. The rebuilt xhat is off by about eps * |bias / scale| per element, so
    the tolerance holds while |bias| is not far larger than |scale|. The Mean output the
    default rule added is dropped from the forward node with the default's nodes.
    """
    if any(g is not None for g in gouts[1:]):
        raise GradientError(f"{node_label(node)}: gradient flows into its Mean/InvStdDev outputs")
    gy = gouts[0]
    if gy is None:
        return tail(node, [None] * min(len(node.input), 3))
    emit = ctx.emit
    x, s = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 else ""
    x_info = ctx.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    axis = norm_axis(int(attr(node, "axis", -1)), rank)
    inv = emit.cast(node.output[2], dtype)  # InvStdDev, added by the default rule at build
    gamma = emit.cast(s, dtype)
    y = node.output[0]
    shifted = emit.sub(y, emit.cast(bias, dtype)) if bias else y
    xhat = emit.div(shifted, _guarded(ctx, gamma))
    return layernorm_backward(ctx, node, gy, Normalised(xhat, inv, gamma), axis)


def _batchnorm_inverted_applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
    training = ctx.opset >= 14 and int(attr(node, "training_mode", 0)) == 1
    return (training and len(node.input) >= 3 and _norm_params_available(ctx, node)
            and ctx.info(node.input[0]).is_float and len(ctx.info(node.input[0]).shape) >= 2)


# Measured against the default on ResNet-18/50 steps (batch 16, 64x64, scale ~ N(1, 0.3-0.5),
# bias ~ N(0, 0.2-1)): at most 4.3e-6 relative per gradient tensor. But on the zoo's
# MobileNetV2 (batch 8, 64x64, scale 1, bias 0) one inverted BatchNorm moves other layers'
# weight gradients by up to 3.5e-2 relative to the default, at every reduction size measured
# (32 to 8192 values per channel). The rebuilt xhat is ORT's BatchNormalization output where
# the default recomputes the normalisation with ONNX ops, and which of the two is nearer the
# exact gradient is not established. Until it is, the variant is tiered "lossy": the planner
# never offers it by default (docs/VARIANTS.md).
BATCHNORM_INVERTED_TOLERANCE = 5e-2


@register_variant("BatchNormalization", name="inverted", tier=LOSSY,
                  tolerance=BATCHNORM_INVERTED_TOLERANCE, applies=_batchnorm_inverted_applies)
def _batchnorm_inverted(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Training-mode backward from the output y and a per-channel 1/std taken in the forward
    pass instead of the input x: xhat is rebuilt as (y - bias) / scale, so x can be freed
    once its forward readers are done.

    The forward extras compute 1/sqrt(var + eps) from x right after the node (x is live
    then; one activation-sized temporary, freed at once) and keep only the [1, C, 1, ...]
    result. The backward is the default's. Zero scales are guarded as in LayerNormalization's
    ``inverted`` (that channel's scale gradient is then inexact).
    """
    emit = ctx.emit
    x, s, b = node.input[:3]
    x_info = ctx.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    eps = float(attr(node, "epsilon", 1e-5))
    axes = [0] + list(range(2, rank))
    n = float(np.prod([x_info.shape[a] for a in axes]))
    gy = gouts[0]
    if gy is None:
        return [None] * len(node.input)
    fe = _forward_ctx(ctx).emit
    centered = fe.sub(x, fe.reduce_mean(x, axes, keepdims=True))
    # ReduceSumSquare squares inside the reduction: one activation-sized temporary, not two
    # (the Emitter's reducer spells axes as the opset wants them).
    var = fe._reduce("ReduceSumSquare", centered, axes, True, None, 18)
    var = fe.mul(var, fe.scalar(1.0 / n, dtype))
    inv = fe.unary("Reciprocal", fe.unary("Sqrt", fe.add(var, fe.scalar(eps, dtype))))
    gamma = _channel_view(emit, s, rank, dtype)
    beta = _channel_view(emit, b, rank, dtype)
    xhat = emit.div(emit.sub(node.output[0], beta), _guarded(ctx, gamma))
    return batchnorm_train_backward(ctx, node, gy, Normalised(xhat, inv, gamma), axes, n)


# ---------------------------------------------------------------------------- from input
@register_variant("Sigmoid", "Tanh", "Exp", "Softmax", name="from_input", tier=EXACT)
def _from_input(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from the input x instead of the output y: y is recomputed in the backward
    with the same op (same kernel, same bits), then the default formula runs on it. Frees y
    where x is kept for the backward anyway (the producer's own rule reads it)."""
    g = gouts[0]
    x = node.input[0]
    if g is None or not ctx.needs_grad(x):
        return [None] * len(node.input)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    y = ctx.emit.op(node.op_type, [x], info=ctx.info(node.output[0]), **attrs)
    twin = onnx.NodeProto()
    twin.CopyFrom(node)
    twin.output[0] = y
    return RULES[node.op_type](ctx, twin, gouts)


# ---------------------------------------------------------------------------- 16-bit storage
# bfloat16 keeps float32's exponent (no overflow to inf, unlike float16) and 8 bits of
# mantissa: each stored element is off by at most 2^-9 relative, and the products summed in
# a weight gradient average much of that out. The stated bounds are for the gradients
# (measured: benchmarks/variant_checks.py bf16, docs/VARIANTS.md). BatchNormalization's is
# wider: on the zoo's MobileNetV2 the scale gradients of the BatchNorms in front of a
# depthwise convolution (and its own batch-statistics BatchNorm) are small sums of large
# terms of both signs, and moved by up to 3.2e-2 relative; at most 6.3e-3 on ResNets.
BF16_SAVED_TOLERANCE = 2e-2
BF16_SAVED_BATCHNORM_TOLERANCE = 5e-2


@dataclass(frozen=True)
class _Saved:
    """A float value the default rule reads: ``node.input[index]`` (or ``node.output[index]``
    when ``output``), and the inputs whose gradients read it: the default rule leaves it
    unread when none of them is wanted, and there is nothing to store."""

    index: int
    readers: tuple[int, ...]
    output: bool = False
    centred: bool = False   # a normalisation's input: see ``_bf16_copy``

    def name(self, node: onnx.NodeProto) -> str:
        names = node.output if self.output else node.input
        return names[self.index] if self.index < len(names) else ""


_PRODUCT = (_Saved(0, (1,)), _Saved(1, (0,)))   # each operand for the other's gradient
_FROM_OUTPUT = (_Saved(0, (0,), output=True),)   # y * (g - sum(g * y)), g * y (1 - y), ...
# What each op's default rule reads (memcc/frontend/gradients/elementwise.py and nn.py).
# Left out: Relu, LeakyRelu and Clip (the exact 1-byte ``mask`` is smaller still); Max, Min
# and GlobalMaxPool (they compare x with y for equality, which rounding would break); ops
# whose rule reads no activation-sized float (pools, Dropout, Where, shape ops).
_SAVED_FOR: dict[str, tuple[_Saved, ...]] = {
    "Conv": (_Saved(0, (1,)),),                  # x, for the weight gradient
    "ConvTranspose": (_Saved(0, (1,)),),
    "MatMul": _PRODUCT,
    "Gemm": _PRODUCT,
    "Mul": _PRODUCT,
    "Div": (_Saved(1, (0, 1)), _Saved(0, (1,), output=True)),   # g / b, and y for db
    "Pow": (_Saved(0, (0, 1)), _Saved(0, (1,), output=True)),   # x^(p-1); y log x for dp
    "LayerNormalization": (_Saved(0, (0, 1), centred=True),),   # x (Mean, InvStdDev: exact)
    "Softmax": _FROM_OUTPUT,
    "LogSoftmax": _FROM_OUTPUT,
    "Sigmoid": _FROM_OUTPUT,
    "Tanh": _FROM_OUTPUT,
    "Exp": _FROM_OUTPUT,
    "Erf": (_Saved(0, (0,)),),                   # exp(-x^2)
    "Gelu": (_Saved(0, (0,)),),
}


def _saved_for(ctx: GradContext, node: onnx.NodeProto) -> tuple[_Saved, ...]:
    """``_SAVED_FOR``, and BatchNormalization's x: in training mode the default recomputes
    the batch statistics from it (for every gradient but the bias's); in inference mode it
    reads x only for the scale gradient."""
    if node.op_type != "BatchNormalization":
        return _SAVED_FOR.get(node.op_type, ())
    training = ctx.opset >= 14 and int(attr(node, "training_mode", 0)) == 1
    return (_Saved(0, (0, 1) if training else (1,), centred=True),)


def _normalised_axes(ctx: GradContext, node: onnx.NodeProto) -> list[int]:
    """The axes a BatchNormalization (all but channels) or LayerNormalization (``axis``
    on) takes its mean over."""
    rank = len(ctx.info(node.input[0]).shape)
    if node.op_type == "BatchNormalization":
        return [0] + list(range(2, rank))
    return list(range(norm_axis(int(attr(node, "axis", -1)), rank), rank))


def _activation(ctx: GradContext, name: str) -> bool:
    """A float32 value the forward pass computes (not a weight, input or constant)."""
    producer = ctx.producers().get(name)
    ti = ctx.graph.info.get(name)
    return (producer is not None and producer.op_type != "Constant" and ti is not None
            and ti.dtype == TensorProto.FLOAT)


def _stored_in_bf16(ctx: GradContext, node: onnx.NodeProto) -> list[_Saved]:
    """The values the default backward reads that the variant keeps in 16 bits."""
    return [s for s in _saved_for(ctx, node)
            if s.name(node) and _activation(ctx, s.name(node))
            and any(r < len(node.input) and ctx.needs_grad(node.input[r]) for r in s.readers)]


def _bf16_copy(ctx: VariantContext, name: str, centre_axes: list[int] | None) -> str:
    """``name`` cast to bfloat16 right after the forward node and back to float32 in the
    backward. With ``centre_axes`` the copy is of ``name`` minus its mean over them, the
    mean (one float32 per channel or row) added back after the cast: a normalisation
    divides the offset out, so rounding the offset with the values would cost it
    |mean| / std times the precision (measured: 1.4e-2 on a BatchNorm scale gradient at
    mean = 10 std); centred, the rounding scales with the spread alone."""
    fe = _forward_ctx(ctx).emit
    mean = fe.reduce_mean(name, centre_axes, keepdims=True) if centre_axes else None
    half = fe.cast(fe.sub(name, mean) if mean else name, TensorProto.BFLOAT16)
    back = ctx.emit.cast(half, TensorProto.FLOAT)
    return ctx.emit.add(back, mean) if mean else back


def _bf16_saved(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """The activations the backward reads (a convolution's or normalisation's input, a
    product's operands, an activation function's output) are kept as bfloat16 copies taken
    right after the forward node, half the bytes of the float32 originals, which are then
    freed once their forward readers are done; the backward casts them back and runs the
    default rule on a twin of the node that reads the copies. Lossy: only with
    ``--allow-lossy``."""
    restored: dict[str, str] = {}
    twin = onnx.NodeProto()
    twin.CopyFrom(node)
    for s in _stored_in_bf16(ctx, node):
        name = s.name(node)
        if name not in restored:  # x * x: one copy
            restored[name] = _bf16_copy(ctx, name, _normalised_axes(ctx, node)
                                        if s.centred else None)
        (twin.output if s.output else twin.input)[s.index] = restored[name]
    wanted = {r for r, o in zip(twin.input, node.input, strict=True)
              if r != o and ctx.needs_grad(o)}
    return RULES[node.op_type](replace(ctx, requires_grad=ctx.requires_grad | wanted), twin,
                               gouts)


def _bf16_applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
    return bool(_stored_in_bf16(ctx, node))


# One rule, one name; BatchNormalization states its own, wider bound (see above).
register_variant(*_SAVED_FOR, name="bf16_saved", tier=LOSSY, tolerance=BF16_SAVED_TOLERANCE,
                 applies=_bf16_applies)(_bf16_saved)
register_variant("BatchNormalization", name="bf16_saved", tier=LOSSY,
                 tolerance=BF16_SAVED_BATCHNORM_TOLERANCE, applies=_bf16_applies)(_bf16_saved)
