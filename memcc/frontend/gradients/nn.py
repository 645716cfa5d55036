"""Gradient rules for convolution, pooling, normalization and resizing.

ORT ships no gradient kernels, so each adjoint is spelled with forward ops: a Conv's input
gradient is a ConvTranspose, its weight gradient a Conv over transposed tensors (a MatMul
for 1x1 convolutions), pooling
gradients scatter through MaxPool's own argmax indices or spread through a depthwise
ConvTranspose. Padding, output sizes and averaging divisors are resolved from static shapes
at compile time so the backward graph carries no shape arithmetic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from memcc.errors import GradientError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients import batchnorm_backward
from memcc.frontend.gradients.registry import GradContext, register
from memcc.frontend.gradients.shape_ops import (
    Grads,
    norm_axis,
    scatter_add_flat,
    slice_values,
    static_value,
    tail,
)
from memcc.graph import TensorInfo, attr, node_label, text_attr
from memcc.step import tag_node


def _text(value, default: str) -> str:
    if value is None:
        return default
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------- geometry
@dataclass
class Window:
    """Sliding-window geometry of one Conv/Pool node, all spatial axes resolved."""

    kernel: list[int]
    strides: list[int]
    dilations: list[int]
    begins: list[int]
    ends: list[int]

    @property
    def effective(self) -> list[int]:
        """Extent of the dilated kernel."""
        return [(k - 1) * d + 1 for k, d in zip(self.kernel, self.dilations, strict=True)]

    def pads(self) -> list[int]:
        return list(self.begins) + list(self.ends)


def _window(node: onnx.NodeProto, kernel: Sequence[int], in_sp: Sequence[int],
            out_sp: Sequence[int]) -> Window:
    """Read strides/dilations/pads; auto_pad SAME_* pads are derived from the output size."""
    nd = len(kernel)
    strides = list(attr(node, "strides", [1] * nd))
    dilations = list(attr(node, "dilations", [1] * nd))
    auto_pad = text_attr(node, "auto_pad", "NOTSET")
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begins, ends = [], []
        for i in range(nd):
            eff = (kernel[i] - 1) * dilations[i] + 1
            total = max(0, (out_sp[i] - 1) * strides[i] + eff - in_sp[i])
            small, big = total // 2, total - total // 2
            begins.append(small if auto_pad == "SAME_UPPER" else big)
            ends.append(big if auto_pad == "SAME_UPPER" else small)
    elif auto_pad == "VALID":
        begins, ends = [0] * nd, [0] * nd
    else:
        pads = list(attr(node, "pads", [0] * 2 * nd))
        begins, ends = pads[:nd], pads[nd:]
    return Window(list(kernel), strides, dilations, begins, ends)


def _spatial_sum(emit: Emitter, g: str) -> str:
    """Bias-style gradient: sum over every axis but channels (axis 1)."""
    rank = len(emit.info(g).shape)
    return emit.reduce_sum(g, [0] + list(range(2, rank)), keepdims=False)


# ---------------------------------------------------------------------------- conv
def _conv_input_grad(emit: Emitter, gy: str, w: str, win: Window, group: int,
                     x_info: TensorInfo) -> str:
    """ConvTranspose with the same weight; output_padding restores floor-dropped cells."""
    in_sp = x_info.shape[2:]
    out_sp = emit.info(gy).shape[2:]
    out_pad = [
        i - ((o - 1) * s + e - b - p)
        for i, o, s, e, b, p in zip(in_sp, out_sp, win.strides, win.effective, win.begins,
                                    win.ends, strict=True)
    ]
    return emit.op(
        "ConvTranspose", [gy, w], kernel_shape=win.kernel, strides=win.strides,
        dilations=win.dilations, pads=win.pads(), group=group,
        output_padding=out_pad if any(out_pad) else None, info=x_info,
    )


def _is_pointwise(win: Window, group: int, in_sp: Sequence[int],
                  out_sp: Sequence[int]) -> bool:
    """A 1x1 convolution without padding or groups: every output pixel reads one input
    pixel (the ``stride``-th), so its weight gradient is a plain matrix product."""
    return (group == 1 and all(k == 1 for k in win.kernel)
            and not any(win.begins) and not any(win.ends)
            and all(len(range(0, i, s)) == o
                    for i, s, o in zip(in_sp, win.strides, out_sp, strict=True)))


_TO_THE_END = int(np.iinfo(np.int64).max)  # a Slice end past every axis (ONNX clamps it)


def _shared_view(emit: Emitter, x: str, shape: Sequence[int], spelled: Sequence[int]) -> str:
    """Reshape ``x`` to ``shape`` through a shape constant that says it without sizes
    (``0``: the input's size on that axis, ``-1``: the rest), so every layer of the step
    shares one Constant node for the same kind of view (issue 30: the 1x1 weight gradients
    of the zoo ResNet-50 had 34 shape constants, one per layer size)."""
    return emit.op("Reshape", [x, emit.ints(spelled)],
                   info=TensorInfo(emit.info(x).dtype, tuple(shape)))


def _flat_view(emit: Emitter, x: str, axis: int) -> str:
    """``x`` as a matrix, the axes before ``axis`` as its rows: a Flatten, which needs no
    shape constant."""
    shape = emit.info(x).shape
    rows = int(np.prod(shape[:axis], dtype=np.int64))
    return emit.op("Flatten", [x], axis=axis,
                   info=TensorInfo(emit.info(x).dtype, (rows, int(np.prod(shape)) // rows)))


def _every_stride(emit: Emitter, x: str, strides: Sequence[int]) -> str:
    """The pixels a strided 1x1 convolution reads: every stride-th "to the end", spelled so
    that all such layers share the Slice's constants."""
    nd = len(strides)
    return slice_values(emit, x, [0] * nd, [_TO_THE_END] * nd, list(range(2, nd + 2)),
                        list(strides))


def _pointwise_weight_grad(emit: Emitter, x: str, gy: str, win: Window,
                           w_info: TensorInfo) -> str:
    """dW[m, c] = sum_{n,p} gy[n, m, p] * x[n, c, p*s] as a MatMul over pixels.

    The Conv over transposed tensors has the input channels as its batch and one output
    pixel per filter, so it multiplies image by image: a matrix-vector product per input
    channel, each over the whole output gradient. On the zoo ResNet-50's 1x1 layers it took
    1.6-10x the time of this MatMul (``benchmarks/variant_checks.py pointwise-conv``), and
    its two transposed copies are activation-sized. Here, where
    the smaller channel count is below the pixel count, a batched MatMul transposes only the
    smaller operand and its per-sample products (N x M x C) are smaller than that copy; the
    sum over the batch follows. Otherwise both operands are flattened, x to [N * pixels, C]
    and gy to [M, N * pixels] (one copy each, as the default's two), and one MatMul
    contracts them.

    Every view here is spelled without sizes (``Flatten``, or a Reshape to ``[0, 0, -1]``
    and ``[0, 0, 1, 1]``), so the step holds one shape constant per kind of view, not one
    per layer. One Einsum (``nmhw,nchw->mc``) would be two nodes instead of five or six, and
    the same bits as the flattened form, but ORT's CPU kernel was 4-36% slower on every
    flattened ResNet-50 layer at one thread and 13-60% on the batched ones, and its two
    transposed copies are buffers of its own that liveness does not see (BENCHMARKS.md,
    "Fewer nodes for a convolution's backward"; ``benchmarks/pointwise_grad_forms.py``).
    """
    xi, gi = emit.info(x), emit.info(gy)
    nd = len(xi.shape) - 2
    if any(s != 1 for s in win.strides):
        x = _every_stride(emit, x, win.strides)
    n, c = xi.shape[:2]
    m = gi.shape[1]
    pixels = int(np.prod(gi.shape[2:], dtype=np.int64))
    if min(m, c) < pixels:
        xr = _shared_view(emit, x, [n, c, pixels], [0, 0, -1])
        gr = _shared_view(emit, gy, [n, m, pixels], [0, 0, -1])
        if c <= m:
            prod = emit.op("MatMul", [gr, emit.transpose(xr, [0, 2, 1])],
                           info=TensorInfo(xi.dtype, (n, m, c)))
            dw = emit.reduce_sum(prod, [0], keepdims=False)
        else:
            prod = emit.op("MatMul", [xr, emit.transpose(gr, [0, 2, 1])],
                           info=TensorInfo(xi.dtype, (n, c, m)))
            dw = emit.transpose(emit.reduce_sum(prod, [0], keepdims=False), [1, 0])
    else:
        # One copy of each operand: x as [N * pixels, C], gy as [M, N * pixels]; gy's
        # first, so that gy (usually read last here) is freed before x's copy is made.
        # Transposed with their pixel axes as they are, then viewed flat: the same copies
        # as through a [N, C, pixels] view, one Reshape fewer each (issue 30).
        spatial = list(range(2, nd + 2))
        gf = _flat_view(emit, emit.transpose(gy, [1, 0] + spatial), 1)
        xf = _flat_view(emit, emit.transpose(x, [0] + spatial + [1]), nd + 1)
        dw = emit.op("MatMul", [gf, xf], info=TensorInfo(xi.dtype, (m, c)))
    return _shared_view(emit, dw, list(w_info.shape), [0, 0] + [1] * nd)


def _conv_weight_grad(emit: Emitter, x: str, gy: str, win: Window, group: int,
                      w_info: TensorInfo) -> str:
    """dW[m, c, k] = sum_{n,o} gy[n, m, o] * x[n, g*Cg + c, o*s + k*d - pad].

    That is a Conv with batch and channels swapped: x as [Cg, G*N, *sp] (batch Cg), gy as
    weights [M, N, *osp] with group G, stride = forward dilation, dilation = forward stride.
    A 1x1 convolution takes a MatMul instead (``_pointwise_weight_grad``).
    """
    xi, gi = emit.info(x), emit.info(gy)
    if _is_pointwise(win, group, xi.shape[2:], gi.shape[2:]):
        return _pointwise_weight_grad(emit, x, gy, win, w_info)
    n, c = xi.shape[:2]
    in_sp, out_sp = xi.shape[2:], gi.shape[2:]
    cg = c // group
    nd = len(in_sp)
    # gy's copy first: gy is usually read last here (the input gradient and the bias
    # gradient come before), so it is freed before x's copy is made, and the two
    # activation-sized originals and their two copies are never live together.
    gt = emit.transpose(gy, [1, 0] + list(range(2, nd + 2)))
    if group == 1:
        xt = emit.transpose(x, [1, 0] + list(range(2, nd + 2)))
    else:
        xr = emit.reshape(x, [n, group, cg] + list(in_sp))
        xr = emit.transpose(xr, [2, 1, 0] + list(range(3, nd + 3)))
        xt = emit.reshape(xr, [cg, group * n] + list(in_sp))
    # End pads just large enough that the last kernel tap is computed; pad never negative.
    ends = [max(0, (k - 1) * d + (o - 1) * s + 1 - i - b)
            for k, d, o, s, i, b in zip(win.kernel, win.dilations, out_sp, win.strides, in_sp,
                                        win.begins, strict=True)]
    got = [(i + b + e - (o - 1) * s - 1) // d + 1
           for i, b, e, o, s, d in zip(in_sp, win.begins, ends, out_sp, win.strides,
                                       win.dilations, strict=True)]
    m = gi.shape[1]
    dw = emit.op(
        "Conv", [xt, gt], kernel_shape=list(out_sp), strides=win.dilations,
        dilations=win.strides, pads=list(win.begins) + ends, group=group,
        info=TensorInfo(xi.dtype, (cg, m, *got)),
    )
    conv = emit.nodes[-1]
    if got != list(win.kernel):
        dw = slice_values(emit, dw, [0] * nd, win.kernel, list(range(2, nd + 2)))
    # What a provider rewrite needs to compute the same dW (swapped, [Cg, M, *kernel]) in
    # another form from the original x and gy (passes/providers/conv_weight_grad_cuda.py).
    tag_node(conv, conv_weight_grad=json.dumps({
        "x": x, "gy": gy, "dw": dw, "group": group, "kernel": win.kernel,
        "strides": win.strides, "dilations": win.dilations, "begins": win.begins}))
    return emit.transpose(dw, [1, 0] + list(range(2, nd + 2)))


@register("Conv")
def _conv_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    emit = ctx.emit
    x, w = node.input[0], node.input[1]
    x_info, w_info = ctx.info(x), ctx.info(w)
    gy = gouts[0]
    group = int(attr(node, "group", 1))
    win = _window(node, w_info.shape[2:], x_info.shape[2:], ctx.info(node.output[0]).shape[2:])
    # The bias and input gradients before the weight gradient, so that the weight
    # gradient's copy of gy is gy's last read (see _conv_weight_grad).
    gb = None
    if len(node.input) > 2 and node.input[2] and ctx.needs_grad(node.input[2]):
        gb = _spatial_sum(emit, gy)
    gx = _conv_input_grad(emit, gy, w, win, group, x_info) if ctx.needs_grad(x) else None
    gw = _conv_weight_grad(emit, x, gy, win, group, w_info) if ctx.needs_grad(w) else None
    grads: Grads = [gx, gw]
    if len(node.input) > 2 and node.input[2]:
        grads.append(gb)
    return grads


def _conv_transpose_window(node: onnx.NodeProto, kernel: Sequence[int], in_sp: Sequence[int],
                           out_sp: Sequence[int]) -> Window:
    """ConvTranspose pads: explicit, or derived from output_shape/auto_pad as the spec does."""
    nd = len(kernel)
    strides = list(attr(node, "strides", [1] * nd))
    dilations = list(attr(node, "dilations", [1] * nd))
    out_pad = list(attr(node, "output_padding", [0] * nd))
    auto_pad = text_attr(node, "auto_pad", "NOTSET")
    pads = attr(node, "pads")
    if auto_pad == "VALID":
        begins = [0] * nd
    elif pads is not None and attr(node, "output_shape") is None and auto_pad == "NOTSET":
        begins = list(pads)[:nd]
    else:
        begins = []
        for i in range(nd):
            total = (strides[i] * (in_sp[i] - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i]
                     + 1 - out_sp[i])
            begins.append(total // 2 if auto_pad == "SAME_UPPER" else total - total // 2)
    # Whatever the spelling, the static output size fixes the end side.
    ends = [strides[i] * (in_sp[i] - 1) + (kernel[i] - 1) * dilations[i] + 1 - begins[i]
            - out_sp[i] for i in range(nd)]
    return Window(list(kernel), strides, dilations, begins, ends)


@register("ConvTranspose")
def _conv_transpose_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """The adjoint of a ConvTranspose is the Conv it transposes (and its weight gradient is
    that Conv's weight gradient with input and output roles swapped)."""
    emit = ctx.emit
    x, w = node.input[0], node.input[1]
    x_info, w_info = ctx.info(x), ctx.info(w)
    gy = gouts[0]
    group = int(attr(node, "group", 1))
    in_sp, out_sp = x_info.shape[2:], ctx.info(node.output[0]).shape[2:]
    win = _conv_transpose_window(node, w_info.shape[2:], in_sp, out_sp)
    # As a Conv from gy (size out) to x (size in): end pads must keep every tap in range.
    conv_win = Window(win.kernel, win.strides, win.dilations, win.begins,
                      [max(0, e) for e in win.ends])
    gx = gw = None
    if ctx.needs_grad(x):
        gx = _conv_from_grad(emit, gy, w, conv_win, group, x_info)
    if ctx.needs_grad(w):
        gw = _conv_weight_grad(emit, gy, x, conv_win, group, w_info)
    grads: Grads = [gx, gw]
    if len(node.input) > 2 and node.input[2]:
        grads.append(_spatial_sum(emit, gy) if ctx.needs_grad(node.input[2]) else None)
    return grads


def _conv_from_grad(emit: Emitter, gy: str, w: str, win: Window, group: int,
                    x_info: TensorInfo) -> str:
    gi = emit.info(gy)
    nd = len(win.kernel)
    got = [(o + b + e - k) // s + 1 for o, b, e, k, s in
           zip(gi.shape[2:], win.begins, win.ends, win.effective, win.strides, strict=True)]
    out = emit.op(
        "Conv", [gy, w], kernel_shape=win.kernel, strides=win.strides,
        dilations=win.dilations, pads=win.pads(), group=group,
        info=TensorInfo(gi.dtype, tuple(x_info.shape[:2]) + tuple(got)),
    )
    if got != list(x_info.shape[2:]):
        out = slice_values(emit, out, [0] * nd, list(x_info.shape[2:]), list(range(2, nd + 2)))
    return out


# ---------------------------------------------------------------------------- pooling
def _pool_window(node: onnx.NodeProto, x_info: TensorInfo, y_info: TensorInfo) -> Window:
    return _window(node, list(attr(node, "kernel_shape")), x_info.shape[2:], y_info.shape[2:])


@register("MaxPool")
def _maxpool_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Route each output gradient to its argmax, read from MaxPool's optional Indices output
    (added to the forward node when the model did not ask for it)."""
    if int(attr(node, "storage_order", 0)) != 0:
        raise GradientError(f"{node_label(node)}: storage_order=1 is not supported")
    if len(gouts) > 1 and gouts[1] is not None:
        raise GradientError(f"{node_label(node)}: gradient flows into the Indices output")
    x_info, y_info = ctx.info(node.input[0]), ctx.info(node.output[0])
    indices = _ensure_output(ctx, node, 1, "indices", TensorInfo(TensorProto.INT64, y_info.shape))
    if x_info.numel < 2**31:
        # Saved from forward to backward: int32 halves what the step keeps alive.
        indices = _emit_after(ctx, node, lambda: ctx.emit.cast(indices, TensorProto.INT32))
    return [scatter_to_argmax(ctx, node, indices, gouts[0])]


def scatter_to_argmax(ctx: GradContext, node: onnx.NodeProto, indices: str, g: str) -> str:
    """MaxPool's input gradient: ``g`` added at the flat positions ``indices`` name (each
    written once where the windows do not overlap)."""
    x_info = ctx.info(node.input[0])
    win = _pool_window(node, x_info, ctx.info(node.output[0]))
    disjoint = all(e <= s for e, s in zip(win.effective, win.strides, strict=True))
    return scatter_add_flat(ctx, node, x_info.shape, indices, g, unique=disjoint)


def _emit_after(ctx: GradContext, node: onnx.NodeProto, build) -> str:
    """Run ``build`` (which emits nodes) and move what it emitted to just after ``node``,
    so a small forward-side conversion runs before the forward value could be freed."""
    nodes = ctx.emit.nodes
    start = len(nodes)
    out = build()
    if nodes is ctx.graph.nodes and len(nodes) > start:
        new = nodes[start:]
        del nodes[start:]
        at = next(i for i, n in enumerate(nodes) if n is node) + 1
        nodes[at:at] = new
    return out


def _ensure_output(ctx: GradContext, node: onnx.NodeProto, index: int, base: str,
                   info: TensorInfo) -> str:
    """Make the forward node also produce its optional output ``index``; return its name."""
    if len(node.output) > index and node.output[index]:
        return node.output[index]
    name = ctx.emit.fresh(f"{node.output[0]}.{base}")
    while len(node.output) < index:
        node.output.append("")
    if len(node.output) == index:
        node.output.append(name)
    else:
        node.output[index] = name
    ctx.graph.info[name] = info
    return name


def _avg_divisors(win: Window, in_sp: Sequence[int], out_sp: Sequence[int],
                  include_pad: bool) -> np.ndarray:
    """How many cells each output window averages (product of per-axis counts).

    Windows count real cells, or with count_include_pad also the explicit pads, never the
    overhang ceil_mode adds past the padded input (as ORT and torch do).
    """
    total = np.ones((), dtype=np.float64)
    for i in range(len(in_sp)):
        lo = -win.begins[i] if include_pad else 0
        hi = in_sp[i] + win.ends[i] if include_pad else in_sp[i]
        counts = []
        for o in range(out_sp[i]):
            taps = o * win.strides[i] - win.begins[i] + np.arange(win.kernel[i]) * win.dilations[i]
            counts.append(int(np.count_nonzero((taps >= lo) & (taps < hi))))
        total = np.multiply.outer(total, np.asarray(counts, dtype=np.float64))
    return total


@register("AveragePool")
def _avgpool_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Divide by each window's divisor, then spread over the window with a depthwise
    ConvTranspose whose kernel is all ones."""
    emit = ctx.emit
    x_info, y_info = ctx.info(node.input[0]), ctx.info(node.output[0])
    win = _pool_window(node, x_info, y_info)
    in_sp, out_sp = x_info.shape[2:], y_info.shape[2:]
    include = bool(attr(node, "count_include_pad", 0))
    inv = 1.0 / np.maximum(_avg_divisors(win, in_sp, out_sp, include), 1.0)
    g = emit.mul(gouts[0], emit.const(inv.reshape((1, 1) + inv.shape), x_info.dtype))
    return [_spread_windows(emit, g, win, x_info)]


def _spread_windows(emit: Emitter, g: str, win: Window, x_info: TensorInfo) -> str:
    """Sum each output cell's value into every input cell of its window."""
    c = x_info.shape[1]
    in_sp, out_sp = x_info.shape[2:], emit.info(g).shape[2:]
    ones = emit.const(np.ones([c, 1] + win.kernel), x_info.dtype)
    ends, out_pad = [], []
    for i, o, s, e, b in zip(in_sp, out_sp, win.strides, win.effective, win.begins,
                             strict=True):
        end = (o - 1) * s + e - b - i  # < 0 when floor mode dropped trailing cells
        ends.append(max(end, 0))
        out_pad.append(max(-end, 0))
    return emit.op(
        "ConvTranspose", [g, ones], kernel_shape=win.kernel, strides=win.strides,
        dilations=win.dilations, pads=list(win.begins) + ends, group=c,
        output_padding=out_pad if any(out_pad) else None, info=x_info,
    )


@register("GlobalAveragePool")
def _global_avgpool_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    emit = ctx.emit
    x_info = ctx.info(node.input[0])
    count = int(np.prod(x_info.shape[2:], dtype=np.int64))
    g = emit.mul(gouts[0], emit.scalar(1.0 / count, x_info.dtype))
    return [emit.expand(g, x_info.shape)]


@register("GlobalMaxPool")
def _global_maxpool_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Gradient to the cells equal to the maximum (ties all receive it)."""
    emit = ctx.emit
    x, y = node.input[0], node.output[0]
    x_info = ctx.info(x)
    hit = emit.op("Equal", [x, y], info=TensorInfo(TensorProto.BOOL, x_info.shape))
    mask = emit.op("Cast", [hit], to=x_info.dtype, info=x_info)
    return [emit.mul(mask, gouts[0])]


# ---------------------------------------------------------------------------- normalization
def _stats(emit: Emitter, x: str, axes: list[int], eps: float) -> tuple[str, str]:
    """Mean and 1/sqrt(var + eps) over ``axes`` (biased variance), kept as broadcast shapes."""
    dtype = emit.info(x).dtype
    mean = emit.reduce_mean(x, axes, keepdims=True)
    centered = emit.sub(x, mean)
    var = emit.reduce_mean(emit.mul(centered, centered), axes, keepdims=True)
    std = emit.unary("Sqrt", emit.add(var, emit.scalar(eps, dtype)))
    return mean, emit.unary("Reciprocal", std)


def _norm_input_grad(emit: Emitter, gxhat: str, xhat: str, inv: str, axes: list[int]) -> str:
    """dx = inv * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat)) over the stats axes."""
    m1 = emit.reduce_mean(gxhat, axes, keepdims=True)
    m2 = emit.reduce_mean(emit.mul(gxhat, xhat), axes, keepdims=True)
    inner = emit.sub(emit.sub(gxhat, m1), emit.mul(xhat, m2))
    return emit.mul(inner, inv)


def _channel_view(emit: Emitter, v: str, rank: int, dtype: int) -> str:
    """A per-channel vector [C] as [1, C, 1, ...] in the activation's dtype."""
    c = emit.info(v).shape[0]
    return emit.reshape(emit.cast(v, dtype), [1, c] + [1] * (rank - 2))


@register("BatchNormalization")
def _batchnorm_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Training mode (opset 14+, training_mode=1) differentiates through the batch statistics,
    recomputed here from x (which the backward keeps anyway); otherwise mean and var are
    constants where they are (running statistics), and get their gradients where the
    forward computes them (``_statistics_grads``). Running-statistics outputs carry no
    gradient."""
    emit = ctx.emit
    x, scale, bias, mean_in, var_in = node.input[:5]
    x_info = ctx.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    eps = float(attr(node, "epsilon", 1e-5))
    training = ctx.opset >= 14 and int(attr(node, "training_mode", 0)) == 1
    axes = [0] + list(range(2, rank))
    gy = gouts[0]
    if training:
        return _batchnorm_train_grad(ctx, node, gy, axes, eps)
    else:
        mean = _channel_view(emit, mean_in, rank, dtype)
        var = _channel_view(emit, var_in, rank, dtype)
        inv = emit.unary("Reciprocal", emit.unary("Sqrt", emit.add(var, emit.scalar(eps, dtype))))
    xhat = emit.mul(emit.sub(x, mean), inv)
    gamma = _channel_view(emit, scale, rank, dtype)
    gx = None
    if ctx.needs_grad(x):
        gxhat = emit.mul(gy, gamma)
        gx = (_norm_input_grad(emit, gxhat, xhat, inv, axes) if training
              else emit.mul(gxhat, inv))
    s_dtype = ctx.info(scale).dtype
    gs = gb = None
    if ctx.needs_grad(scale):
        gs = emit.cast(emit.reduce_sum(emit.mul(gy, xhat), axes, keepdims=False), s_dtype)
    if ctx.needs_grad(bias):
        gb = emit.cast(emit.reduce_sum(gy, axes, keepdims=False), ctx.info(bias).dtype)
    if training:
        return [gx, gs, gb, None, None]
    return [gx, gs, gb, *_statistics_grads(ctx, node, emit.mul(emit.mul(gy, gamma), inv),
                                           Normalised(xhat, inv))]


def _statistics_grads(ctx: GradContext, node: onnx.NodeProto, g_centred: str,
                      norm: Normalised) -> tuple[str | None, str | None]:
    """The gradients of an inference-form BatchNormalization's mean and variance inputs,
    where they are values the forward computes: the dynamo exporter writes torch's
    ``BatchNorm(track_running_stats=False)`` (``_native_batch_norm_legit.no_stats``) as the
    inference form over the batch's mean and biased variance computed before it, and with
    them taken for constants its input's gradient lacked their terms (0.59 relative off
    torch in the linear layer before it after 2 SGD steps). y = (x - m) * inv * gamma + b
    with inv = (v + eps)^-1/2, and ``g_centred`` = gy * gamma * inv = dy/d(x - m):
    dm = -sum(g_centred), dv = -1/2 * sum(g_centred * xhat * inv)."""
    emit = ctx.emit
    mean_in, var_in = node.input[3:5]
    axes = [0] + list(range(2, len(ctx.info(node.input[0]).shape)))
    gm = gv = None
    if ctx.needs_grad(mean_in):
        gm = emit.cast(emit.neg(emit.reduce_sum(g_centred, axes, keepdims=False)),
                       ctx.info(mean_in).dtype)
    if ctx.needs_grad(var_in):
        dtype = ctx.info(node.input[0]).dtype
        spread = emit.reduce_sum(emit.mul(g_centred, emit.mul(norm.xhat, norm.inv)), axes,
                                 keepdims=False)
        gv = emit.cast(emit.mul(spread, emit.scalar(-0.5, dtype)), ctx.info(var_in).dtype)
    return gm, gv


def _batchnorm_train_grad(ctx: GradContext, node: onnx.NodeProto, gy: str, axes: list[int],
                          eps: float) -> Grads:
    """dx = gamma * inv / N * (N * gy - sum(gy) - xhat * sum(gy * xhat)), with the channel
    sums computed first: they are also the scale and bias gradients, and once they exist
    xhat and gy can be freed one subtraction at a time. Written this way the backward holds
    at most about three activation-sized temporaries besides x and gy, where the textbook
    form (gxhat, its mean, its product with xhat, ...) holds five; that working set is what
    recomputation cannot remove, so it sets the smallest budget a plan can reach. float32
    steps take the same arithmetic in 9 nodes instead of 21 (``gradients/batchnorm_backward``:
    the per-channel factors applied by inference-mode BatchNormalization nodes)."""
    if batchnorm_backward.applies(ctx, node):  # the fewest nodes (issue 30)
        return batchnorm_backward.batchnorm_train_grad_affine(ctx, node, gy, axes, eps)
    emit = ctx.emit
    x, scale, bias = node.input[:3]
    x_info = ctx.info(x)
    dtype = x_info.dtype
    n = float(np.prod([x_info.shape[a] for a in axes]))
    mean = emit.reduce_mean(x, axes, keepdims=True)
    centered = emit.sub(x, mean)
    var = emit.reduce_mean(emit.mul(centered, centered), axes, keepdims=True)
    inv = emit.unary("Reciprocal", emit.unary("Sqrt", emit.add(var, emit.scalar(eps, dtype))))
    xhat = emit.mul(centered, inv)
    return batchnorm_train_backward(ctx, node, gy, Normalised(xhat, inv), axes, n)


@dataclass(frozen=True)
class Normalised:
    """What the normalisation backward rules start from: the normalised input ``xhat``,
    ``inv`` = 1/std, and ``gamma``, the scale already in the shape and dtype the rule wants
    when the caller has it (None: the rule makes it)."""

    xhat: str
    inv: str
    gamma: str | None = None


def batchnorm_train_backward(ctx: GradContext, node: onnx.NodeProto, gy: str,
                             norm: Normalised, axes: list[int], n: float) -> Grads:
    """The input, scale and bias gradients of training-mode BatchNormalization from the
    normalised input and 1/std (shared by the default rule, which recomputes both from x,
    and the ``inverted`` variant, which rebuilds them from y). ``norm.gamma``: the scale as
    [1, C, 1, ...] when the caller has it already."""
    xhat, inv, gamma = norm.xhat, norm.inv, norm.gamma
    emit = ctx.emit
    x, scale, bias = node.input[:3]
    x_info = ctx.info(x)
    dtype = x_info.dtype
    sum_gy = emit.reduce_sum(gy, axes, keepdims=True)
    sum_gy_xhat = emit.reduce_sum(emit.mul(gy, xhat), axes, keepdims=True)
    gx = None
    if ctx.needs_grad(x):
        if gamma is None:
            gamma = _channel_view(emit, scale, len(x_info.shape), dtype)
        inv_n = emit.scalar(1.0 / n, dtype)
        centred_gy = emit.sub(gy, emit.mul(xhat, emit.mul(sum_gy_xhat, inv_n)))
        gx = emit.mul(emit.sub(centred_gy, emit.mul(sum_gy, inv_n)), emit.mul(gamma, inv))
    c = ctx.info(scale).shape[0]
    gs = emit.cast(emit.reshape(sum_gy_xhat, [c]), ctx.info(scale).dtype) \
        if ctx.needs_grad(scale) else None
    gb = emit.cast(emit.reshape(sum_gy, [c]), ctx.info(bias).dtype) \
        if ctx.needs_grad(bias) else None
    return [gx, gs, gb] + [None] * (len(node.input) - 3)


@register("Col2Im")
def _col2im_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Col2Im sums each column into the image patch it came from (``nn.Fold``; VOLO's
    outlook attention); its adjoint takes the patches apart again (``nn.Unfold``): a
    Conv with one-hot kernels, one output channel per kernel position, grouped by image
    channel, so channel ``c * kH * kW + k`` of the result is the image's channel ``c`` seen
    at kernel position ``k``, as the columns are laid out. Each output is one input value
    times 1: exact."""
    cols = node.input[0]
    if gouts[0] is None or not ctx.needs_grad(cols):
        return [None] * len(node.input)
    block = ctx.constant_value(node.input[2])
    if block is None:
        raise GradientError(f"{node_label(node)}: Col2Im's block shape must be a constant "
                            "for its gradient")
    kernel = [int(k) for k in np.asarray(block).reshape(-1)]
    c_info, g_info = ctx.info(cols), ctx.info(gouts[0])
    channels, positions, dims = g_info.shape[1], int(np.prod(kernel)), len(kernel)
    eye = np.eye(positions, dtype=onnx.helper.tensor_dtype_to_np_dtype(g_info.dtype))
    one_hot = np.tile(eye.reshape(positions, 1, *kernel), (channels, 1) + (1,) * dims)
    strides = list(attr(node, "strides", [1] * dims))
    dilations = list(attr(node, "dilations", [1] * dims))
    pads = list(attr(node, "pads", [0] * 2 * dims))
    spatial = tuple((n + pads[i] + pads[i + dims] - dilations[i] * (k - 1) - 1) // strides[i] + 1
                    for i, (n, k) in enumerate(zip(g_info.shape[2:], kernel, strict=True)))
    emit = ctx.emit
    patches = emit.op(
        "Conv", [gouts[0], emit.const(one_hot, g_info.dtype, name="col2im_unfold")],
        group=channels, kernel_shape=kernel, strides=strides, dilations=dilations, pads=pads,
        info=TensorInfo(g_info.dtype, (g_info.shape[0], channels * positions, *spatial)))
    return [emit.reshape(patches, list(c_info.shape))] + [None] * (len(node.input) - 1)


@register("InstanceNormalization")
def _instancenorm_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    emit = ctx.emit
    x, scale, bias = node.input[:3]
    x_info = ctx.info(x)
    rank = len(x_info.shape)
    axes = list(range(2, rank))
    mean, inv = _stats(emit, x, axes, float(attr(node, "epsilon", 1e-5)))
    xhat = emit.mul(emit.sub(x, mean), inv)
    gy = gouts[0]
    gamma = _channel_view(emit, scale, rank, x_info.dtype)
    gx = (_norm_input_grad(emit, emit.mul(gy, gamma), xhat, inv, axes)
          if ctx.needs_grad(x) else None)
    outer = [0] + axes
    gs = emit.reduce_sum(emit.mul(gy, xhat), outer, keepdims=False) if ctx.needs_grad(
        scale) else None
    gb = emit.reduce_sum(gy, outer, keepdims=False) if ctx.needs_grad(bias) else None
    return [gx, gs, gb]


@register("LayerNormalization")
def _layernorm_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Reuses the forward's Mean and InvStdDev outputs (added to the node when absent)."""
    if any(g is not None for g in gouts[1:]):
        raise GradientError(f"{node_label(node)}: gradient flows into its Mean/InvStdDev outputs")
    emit = ctx.emit
    x = node.input[0]
    x_info = ctx.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    axis = norm_axis(int(attr(node, "axis", -1)), rank)
    stat = TensorInfo(int(attr(node, "stash_type", TensorProto.FLOAT)),
                      tuple(x_info.shape[:axis]) + (1,) * (rank - axis))
    mean = emit.cast(_ensure_output(ctx, node, 1, "mean", stat), dtype)
    inv = emit.cast(_ensure_output(ctx, node, 2, "inv_std", stat), dtype)
    xhat = emit.mul(emit.sub(x, mean), inv)
    return layernorm_backward(ctx, node, gouts[0], Normalised(xhat, inv), axis)


def layernorm_backward(ctx: GradContext, node: onnx.NodeProto, gy: str, norm: Normalised,
                       axis: int) -> Grads:
    """LayerNormalization's input, scale and bias gradients from the normalised input and
    1/std (shared by the default rule, which rebuilds xhat from x, and the ``inverted``
    variant, which rebuilds it from y). ``norm.gamma``: the scale in x's dtype when the
    caller has it already."""
    xhat, inv, gamma = norm.xhat, norm.inv, norm.gamma
    emit = ctx.emit
    x, scale = node.input[0], node.input[1]
    bias = node.input[2] if len(node.input) > 2 else ""
    rank = len(ctx.info(x).shape)
    lead, norm = list(range(axis)), list(range(axis, rank))
    gx = None
    if ctx.needs_grad(x):
        if gamma is None:
            gamma = emit.cast(scale, ctx.info(x).dtype)
        gx = _norm_input_grad(emit, emit.mul(gy, gamma), xhat, inv, norm)
    gs = gb = None
    if ctx.needs_grad(scale):
        gs = _param_grad(emit, emit.mul(gy, xhat), lead, ctx.info(scale))
    if bias and ctx.needs_grad(bias):
        gb = _param_grad(emit, gy, lead, ctx.info(bias))
    return tail(node, [gx, gs, gb][: len(node.input)])


def _param_grad(emit: Emitter, g: str, lead: list[int], p_info: TensorInfo) -> str:
    """Sum over the batch-like axes, then undo the parameter's own broadcasting."""
    summed = emit.reduce_sum(g, lead, keepdims=False)
    return emit.cast(emit.sum_to_shape(summed, p_info.shape), p_info.dtype)


# ---------------------------------------------------------------------------- resize
@register("Resize", "Upsample")
def _resize_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Nearest, (bi/tri)linear and (bi)cubic resizes are separable: each resized axis
    applies a fixed [out, in] matrix, so the gradient applies its transpose, axis by axis.
    (Cubic is what TorchScript writes for Dinov2's position-embedding interpolation.)"""
    emit = ctx.emit
    x_info = ctx.info(node.input[0])
    y_info = ctx.info(node.output[0])
    mode = text_attr(node, "mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise GradientError(f"{node_label(node)}: no gradient for Resize mode '{mode}'")
    if int(attr(node, "antialias", 0)):
        raise GradientError(f"{node_label(node)}: no gradient for antialiased Resize")
    scales = _resize_scales(ctx, node, x_info, y_info)
    g = gouts[0]
    for axis in range(len(x_info.shape)):
        n_in, n_out = x_info.shape[axis], y_info.shape[axis]
        scale = None if scales is None else scales[axis]
        if n_in == n_out and scale in (None, 1.0):
            continue
        matrix = _resize_matrix(node, n_in, n_out, scale, ctx.opset)
        factor = n_out // n_in
        if n_out == factor * n_in and np.array_equal(
                matrix, np.kron(np.eye(n_in), np.ones((factor, 1)))):
            g = _sum_blocks(emit, g, axis, factor)  # integer nearest upsampling: cheap path
        else:
            g = _apply_on_axis(emit, g, matrix.T, axis)
    return tail(node, [g])


def _sum_blocks(emit: Emitter, g: str, axis: int, factor: int) -> str:
    """Each input cell was copied to ``factor`` consecutive cells: sum them back."""
    shape = list(emit.info(g).shape)
    split = shape[:axis] + [shape[axis] // factor, factor] + shape[axis + 1:]
    summed = emit.reduce_sum(emit.reshape(g, split), [axis + 1], keepdims=False)
    return summed


def _resize_scales(ctx: GradContext, node: onnx.NodeProto, x_info: TensorInfo,
                   y_info: TensorInfo) -> list[float] | None:
    """Per-axis scales when the node gives scales (they steer the coordinate transform),
    None when it gives target sizes (the scale is then out/in, as the op computes it)."""
    rank = len(x_info.shape)
    ratio = [o / i for o, i in zip(y_info.shape, x_info.shape, strict=True)]
    name = ""
    if node.op_type == "Upsample" or ctx.opset < 11:
        name = node.input[1] if len(node.input) > 1 else ""
        if not name:
            return [float(s) for s in attr(node, "scales", ratio)]
    elif len(node.input) > 2 and node.input[2]:
        name = node.input[2]
    if name:
        value = static_value(ctx, name)
        if value is not None and value.size:
            values = [float(v) for v in value.reshape(-1)]
            axes = attr(node, "axes")
            if axes is None:
                return values
            full = [1.0] * rank
            for a, v in zip(axes, values, strict=True):
                full[norm_axis(a, rank)] = v
            return full
    policy = text_attr(node, "keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        raise GradientError(f"{node_label(node)}: keep_aspect_ratio_policy '{policy}' unsupported")
    return None


def _resize_matrix(node: onnx.NodeProto, n_in: int, n_out: int, scale: float | None,
                   opset: int) -> np.ndarray:
    """[n_out, n_in] weights of a 1-D resize, computed by the ONNX reference Resize on the
    identity (so every coordinate mode and rounding rule follows the specification)."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    mode = text_attr(node, "mode", "nearest")
    attrs = {"mode": mode}
    for key in ("coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                "exclude_outside", "extrapolation_value"):
        value = attr(node, key)
        if value is not None:
            attrs[key] = _text(value, "") if isinstance(value, bytes | str) else value
    if attrs.get("coordinate_transformation_mode") == "tf_crop_and_resize":
        raise GradientError(f"{node_label(node)}: tf_crop_and_resize has no gradient rule")
    eye = np.eye(n_in, dtype=np.float64)
    if scale is None:
        inputs = ["x", "", "", "sizes"]
        param = onnx.numpy_helper.from_array(np.asarray([n_in, n_out], np.int64), "sizes")
    else:
        inputs = ["x", "", "scales"]
        param = onnx.numpy_helper.from_array(np.asarray([1.0, scale], np.float32), "scales")
    rn = helper.make_node("Resize", inputs, ["y"], **attrs)
    g = helper.make_graph(
        [rn], "m", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [n_in, n_in])],
        [helper.make_empty_tensor_value_info("y")], [param],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", max(opset, 13))])
    y = np.asarray(ReferenceEvaluator(model).run(None, {"x": eye})[0])
    if y.shape != (n_in, n_out):
        raise GradientError(
            f"{node_label(node)}: 1-D resize of {n_in} gives {y.shape[1]}, expected {n_out}")
    return y.T


def _apply_on_axis(emit: Emitter, g: str, matrix: np.ndarray, axis: int) -> str:
    """Contract ``g``'s ``axis`` (length matrix.shape[1]) with ``matrix`` [new, old]."""
    gi = emit.info(g)
    rank = len(gi.shape)
    perm = [a for a in range(rank) if a != axis] + [axis]
    gt = emit.transpose(g, perm)
    m = emit.const(matrix.T, gi.dtype)  # [old, new]
    shape = tuple(emit.info(gt).shape[:-1]) + (matrix.shape[0],)
    out = emit.op("MatMul", [gt, m], info=TensorInfo(gi.dtype, shape))
    return emit.transpose(out, [int(i) for i in np.argsort(perm)])
