"""Gradient rules for ops that move, copy or select elements without arithmetic.

Every shape here is static, so rules read the forward geometry (slice bounds, pads, split
sizes, tile repeats) at compile time and emit only the data-moving ops of the backward
pass: the adjoint of a selection is a scatter or a zero-pad, the adjoint of a copy is a sum.
Parameters that a model computes in the graph (exporters spell ``F.pad`` pads as a chain of
Concat/Reshape/Slice over constants) are folded here, see ``static_value``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memcc.errors import GradientError
from memcc.frontend.constants import constant_node_value, constant_value
from memcc.frontend.emit import Emitter
from memcc.frontend.export_map import FX_NODE_PROP
from memcc.frontend.gradients.registry import GradContext, register
from memcc.graph import Graph, TensorInfo, attr, node_label, text_attr

Grads = list[str | None]

# Folding computes small integer parameters only; anything bigger is real data.
_FOLD_MAX_NODES = 256
_FOLD_MAX_ELEMENTS = 1 << 16
# Largest transient of one chunk of an accumulating row scatter (expanded indices, the
# kernel's copy of them and the slice of the gradient it adds): a few chunks cost a few
# nodes, unchunked indices would cost three times the gradient's own size.
SCATTER_CHUNK_BYTES = 16 << 20
_KERNEL_INDEX_BYTES = 8  # ORT's ScatterElements copies every index into an int64 vector


# ---------------------------------------------------------------------------- static values
def static_value(ctx: GradContext, name: str) -> np.ndarray | None:
    """The compile-time value of ``name``: a constant, or a small computation over constants
    and static shapes (what exporters emit for computed pads, slice bounds, reshape targets).
    """
    if not name:
        return None
    value = ctx.constant_value(name)
    if value is not None:
        return value
    return _fold(ctx, name)


def _fold(ctx: GradContext, name: str) -> np.ndarray | None:
    graph = ctx.graph
    producers = ctx.producers()
    leaves: dict[str, np.ndarray] = {}
    needed: dict[int, onnx.NodeProto] = {}
    stack = [name]
    while stack:
        value = stack.pop()
        if value in leaves or not value:
            continue
        const = constant_value(graph, value, producers)
        if const is not None:
            leaves[value] = const
            continue
        node = producers.get(value)
        if node is None:
            return None  # a runtime graph input
        leaf = _shape_leaf(graph, node)
        if leaf is not None:
            leaves[value] = leaf
            continue
        if id(node) in needed:
            continue
        if node.op_type == "Constant":
            leaves[value] = constant_node_value(node)
            continue
        if any(graph.info.get(o) is None or graph.info[o].numel > _FOLD_MAX_ELEMENTS
               for o in node.output if o):
            return None
        needed[id(node)] = node
        if len(needed) > _FOLD_MAX_NODES:
            return None
        stack.extend(i for i in node.input if i)
    if name in leaves:
        return leaves[name]
    order = [n for n in graph.nodes if id(n) in needed]
    return _evaluate(graph, order, leaves, name)


def _shape_leaf(graph: Graph, node: onnx.NodeProto) -> np.ndarray | None:
    """Shape and Size of a value are known from its static type."""
    src = graph.info.get(node.input[0]) if node.input else None
    if src is None:
        return None
    if node.op_type == "Shape":
        rank = len(src.shape)
        start = attr(node, "start", 0)
        end = attr(node, "end", rank)
        return np.asarray(src.shape[slice(start, end)], dtype=np.int64)
    if node.op_type == "Size":
        return np.asarray(src.numel, dtype=np.int64)
    return None


def _evaluate(graph: Graph, nodes: list[onnx.NodeProto], leaves: dict[str, np.ndarray],
              name: str) -> np.ndarray | None:
    from onnx.reference import ReferenceEvaluator

    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in leaves.items()]
    out = helper.make_empty_tensor_value_info(name)
    g = helper.make_graph(nodes, "fold", [], [out], inits)
    opsets = [helper.make_opsetid(d, v) for d, v in graph.opsets.items()]
    model = helper.make_model(g, opset_imports=opsets)
    try:
        return np.asarray(ReferenceEvaluator(model).run(None, {})[0])
    except Exception:
        return None


def required_ints(ctx: GradContext, node: onnx.NodeProto, name: str, what: str) -> list[int]:
    """A parameter the gradient needs at compile time; a clear error when it is dynamic."""
    value = static_value(ctx, name)
    if value is None:
        raise GradientError(
            f"{node_label(node)}: its {what} ('{name}') is computed at run time from data; "
            "memcc needs it at compile time to build the gradient. Export with static "
            f"{what}."
        )
    return [int(v) for v in np.asarray(value).reshape(-1)]


def slice_range(start: int, end: int, step: int, dim: int) -> range:
    """Indices one Slice axis selects, with ONNX's clamping (not quite Python's for k < 0)."""
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
    else:
        start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return range(start, end, step)


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def tail(node: onnx.NodeProto, first: Grads) -> Grads:
    """Pad a rule's answer with ``None`` for the node's remaining (integer) inputs."""
    return list(first) + [None] * (len(node.input) - len(first))


# ---------------------------------------------------------------------------- emit helpers
def slice_values(emit: Emitter, x: str, starts: Sequence[int], ends: Sequence[int],
                 axes: Sequence[int], steps: Sequence[int] | None = None) -> str:
    """ONNX Slice with its output shape worked out the way the op does (Python semantics)."""
    src = emit.info(x)
    steps = list(steps) if steps is not None else [1] * len(axes)
    shape = list(src.shape)
    for s, e, a, k in zip(starts, ends, axes, steps, strict=True):
        shape[a] = len(slice_range(s, e, k, src.shape[a]))
    if tuple(shape) == tuple(src.shape) and all(k == 1 for k in steps):
        return x
    inputs = [x, emit.ints(starts), emit.ints(ends), emit.ints(axes)]
    if any(k != 1 for k in steps):
        inputs.append(emit.ints(steps))
    return emit.op("Slice", inputs, info=TensorInfo(src.dtype, tuple(shape)))


def slice_axis(emit: Emitter, x: str, axis: int, start: int, end: int) -> str:
    return slice_values(emit, x, [start], [end], [axis])


def reverse_axes(emit: Emitter, x: str, axes: Sequence[int]) -> str:
    """Flip ``x`` along ``axes`` (a Slice with step -1 over the whole extent)."""
    if not axes:
        return x
    shape = emit.info(x).shape
    return slice_values(emit, x, [-1] * len(axes), [-shape[a] - 1 for a in axes], list(axes),
                        [-1] * len(axes))


def pad_values(emit: Emitter, x: str, begins: Sequence[int], ends: Sequence[int]) -> str:
    """Zero-pad (non-negative amounts) on every axis."""
    if not any(begins) and not any(ends):
        return x
    src = emit.info(x)
    shape = tuple(d + b + e for d, b, e in zip(src.shape, begins, ends, strict=True))
    return emit.op("Pad", [x, emit.ints(list(begins) + list(ends))], mode="constant",
                   info=TensorInfo(src.dtype, shape))


def pad_axis(emit: Emitter, x: str, axis: int, before: int, after: int) -> str:
    rank = len(emit.info(x).shape)
    begins = [0] * rank
    ends = [0] * rank
    begins[axis], ends[axis] = before, after
    return pad_values(emit, x, begins, ends)


def split_values(emit: Emitter, x: str, axis: int, sizes: Sequence[int]) -> list[str]:
    """Split with explicit sizes, spelled for the opset (sizes input since 13)."""
    if len(sizes) == 1:
        return [x]
    src = emit.info(x)
    infos = []
    for s in sizes:
        shape = list(src.shape)
        shape[axis] = s
        infos.append(TensorInfo(src.dtype, tuple(shape)))
    if emit.opset >= 13:
        outs = emit.op("Split", [x, emit.ints(sizes)], outputs=len(sizes), axis=axis, info=infos)
    else:
        outs = emit.op("Split", [x], outputs=len(sizes), axis=axis, split=list(sizes),
                       info=infos)
    return list(outs)


def concat_values(emit: Emitter, parts: Sequence[str], axis: int) -> str:
    if len(parts) == 1:
        return parts[0]
    infos = [emit.info(p) for p in parts]
    shape = list(infos[0].shape)
    shape[axis] = sum(i.shape[axis] for i in infos)
    return emit.op("Concat", list(parts), axis=axis, info=TensorInfo(infos[0].dtype, tuple(shape)))


def scatter_add_flat(ctx: GradContext, node: onnx.NodeProto, target_shape: Sequence[int],
                     indices: str, updates: str, *, unique: bool = False) -> str:
    """Sum ``updates`` into a zero tensor of ``target_shape`` at flat ``indices``.

    Accumulating duplicates needs ScatterElements' ``reduction`` (opset 16); older opsets
    can only scatter when the caller knows the indices never repeat.
    """
    emit = ctx.emit
    dtype = ctx.info(updates).dtype
    numel = int(np.prod(target_shape, dtype=np.int64))
    if ctx.info(indices).dtype not in (TensorProto.INT32, TensorProto.INT64):
        indices = emit.cast(indices, TensorProto.INT64)
    flat_idx = emit.reshape(indices, [ctx.info(indices).numel])
    flat_upd = emit.reshape(updates, [ctx.info(updates).numel])
    zeros = emit.zeros([numel], dtype)
    if ctx.opset >= 16:
        out = emit.op("ScatterElements", [zeros, flat_idx, flat_upd], axis=0, reduction="add",
                      info=TensorInfo(dtype, (numel,)))
    elif unique:
        out = emit.op("ScatterElements", [zeros, flat_idx, flat_upd], axis=0,
                      info=TensorInfo(dtype, (numel,)))
    else:
        raise GradientError(
            f"{node_label(node)}: its gradient scatters with accumulation, which ONNX offers "
            f"from opset 16 (ScatterElements reduction='add'); this model uses opset "
            f"{ctx.opset}. Re-export the model with opset 16 or newer."
        )
    return emit.reshape(out, list(target_shape))


# ---------------------------------------------------------------------------- pure reshapes
@register("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def _reshape_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Same elements in the same order: the gradient only takes back the input's shape."""
    g = gouts[0]
    if g is None or not ctx.needs_grad(node.input[0]):
        return tail(node, [None])
    return tail(node, [ctx.emit.reshape(g, ctx.info(node.input[0]).shape)])


@register("Transpose")
def _transpose_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    rank = len(ctx.info(node.input[0]).shape)
    perm = list(attr(node, "perm", list(range(rank))[::-1]))
    inverse = [int(i) for i in np.argsort(perm)]
    return [ctx.emit.transpose(gouts[0], inverse)]


@register("Expand")
def _expand_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    return [ctx.emit.sum_to_shape(gouts[0], ctx.info(node.input[0]).shape), None]


@register("Tile")
def _tile_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Every copy contributes: view the output as [r0, s0, r1, s1, ...] and sum the r axes."""
    emit = ctx.emit
    in_shape = ctx.info(node.input[0]).shape
    out_shape = ctx.info(node.output[0]).shape
    repeats = [o // i if i else 1 for o, i in zip(out_shape, in_shape, strict=True)]
    if all(r == 1 for r in repeats):
        return [gouts[0], None]
    split = [d for r, s in zip(repeats, in_shape, strict=True) for d in (r, s)]
    g = emit.reshape(gouts[0], split)
    axes = [2 * i for i, r in enumerate(repeats) if r != 1]
    g = emit.reduce_sum(g, axes, keepdims=True)
    return [emit.reshape(g, in_shape), None]


# ---------------------------------------------------------------------------- concat / split
@register("Concat")
def _concat_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    rank = len(ctx.info(node.output[0]).shape)
    axis = norm_axis(int(attr(node, "axis", 0)), rank)
    sizes = [ctx.info(i).shape[axis] for i in node.input]
    parts = split_values(ctx.emit, gouts[0], axis, sizes)
    return [p if ctx.needs_grad(i) else None for i, p in zip(node.input, parts, strict=True)]


@register("Split")
def _split_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Concatenate the output gradients; outputs nobody differentiated contribute zeros."""
    emit = ctx.emit
    rank = len(ctx.info(node.input[0]).shape)
    axis = norm_axis(int(attr(node, "axis", 0)), rank)
    parts = []
    for out, g in zip(node.output, gouts, strict=True):
        if g is None:
            ti = ctx.info(out)
            g = emit.zeros(ti.shape, ti.dtype)
        parts.append(g)
    return tail(node, [concat_values(emit, parts, axis)])


# ---------------------------------------------------------------------------- slice
def _slice_params(ctx: GradContext, node: onnx.NodeProto, rank: int):
    if ctx.opset < 10:
        starts = list(attr(node, "starts"))
        ends = list(attr(node, "ends"))
        axes = list(attr(node, "axes", list(range(len(starts)))))
        steps = [1] * len(starts)
    else:
        starts = required_ints(ctx, node, node.input[1], "starts")
        ends = required_ints(ctx, node, node.input[2], "ends")
        has = len(node.input)
        axes = (required_ints(ctx, node, node.input[3], "axes")
                if has > 3 and node.input[3] else list(range(len(starts))))
        steps = (required_ints(ctx, node, node.input[4], "steps")
                 if has > 4 and node.input[4] else [1] * len(starts))
    return starts, ends, [norm_axis(a, rank) for a in axes], steps


@register("Slice")
def _slice_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Put each selected element back where it came from, zeros elsewhere.

    Negative steps become positive by flipping the gradient; a step k > 1 spreads the
    gradient by padding a new unit axis to length k and merging it back (element i lands
    at i*k); a final zero Pad places the block at the first selected index.
    """
    emit = ctx.emit
    x_info = ctx.info(node.input[0])
    rank = len(x_info.shape)
    starts, ends, axes, steps = _slice_params(ctx, node, rank)
    g = gouts[0]
    lo = [0] * rank
    count = list(x_info.shape)
    stride = [1] * rank
    flip = []
    for s, e, a, k in zip(starts, ends, axes, steps, strict=True):
        if k == 0:
            raise GradientError(f"{node_label(node)}: slice step 0 is invalid")
        positions = slice_range(s, e, k, x_info.shape[a])
        count[a] = len(positions)
        if count[a] == 0:
            return tail(node, [emit.zeros(x_info.shape, x_info.dtype)])
        lo[a] = min(positions[0], positions[-1])
        stride[a] = abs(k) if count[a] > 1 else 1
        if k < 0 and count[a] > 1:
            flip.append(a)
    g = reverse_axes(emit, g, flip)
    g = _spread(emit, g, stride, count)
    begins = lo
    ends_pad = [d - b - (n - 1) * k - 1
                for d, b, n, k in zip(x_info.shape, lo, count, stride, strict=True)]
    return tail(node, [pad_values(emit, g, begins, ends_pad)])


def _spread(emit: Emitter, g: str, stride: list[int], count: list[int]) -> str:
    """Insert k-1 zeros after every element along each strided axis (none after the last)."""
    strided = [a for a, k in enumerate(stride) if k > 1]
    if not strided:
        return g
    shape = emit.info(g).shape
    expanded: list[int] = []
    for a, d in enumerate(shape):
        expanded += [d, 1] if a in strided else [d]
    g = emit.reshape(g, expanded)
    begins = [0] * len(expanded)
    ends = [0] * len(expanded)
    merged: list[int] = []
    pos = 0
    for a, d in enumerate(shape):
        if a in strided:
            ends[pos + 1] = stride[a] - 1
            merged.append(d * stride[a])
            pos += 2
        else:
            merged.append(d)
            pos += 1
    g = emit.reshape(pad_values(emit, g, begins, ends), merged)
    trimmed = [(n - 1) * stride[a] + 1 for a, n in enumerate(count) if a in strided]
    return slice_values(emit, g, [0] * len(strided), trimmed, strided)


# ---------------------------------------------------------------------------- pad
def _pad_params(ctx: GradContext, node: onnx.NodeProto, rank: int) -> tuple[list[int], list[int]]:
    if ctx.opset < 11:
        pads = list(attr(node, "pads"))
        axes = list(range(rank))
    else:
        pads = required_ints(ctx, node, node.input[1], "pads")
        has_axes = len(node.input) > 3 and node.input[3]
        axes = ([norm_axis(a, rank) for a in required_ints(ctx, node, node.input[3], "axes")]
                if has_axes else list(range(rank)))
    n = len(axes)
    begins = [0] * rank
    ends = [0] * rank
    for i, a in enumerate(axes):
        begins[a] = pads[i]
        ends[a] = pads[n + i]
    return begins, ends


@register("Pad")
def _pad_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    mode = text_attr(node, "mode", "constant")
    emit = ctx.emit
    x_info = ctx.info(node.input[0])
    rank = len(x_info.shape)
    begins, ends = _pad_params(ctx, node, rank)
    g = gouts[0]
    if mode == "constant":
        gx = _crop_back(emit, g, begins, ends, x_info.shape)
        grads: Grads = [gx if ctx.needs_grad(node.input[0]) else None, None]
        if len(node.input) > 2 and ctx.needs_grad(node.input[2]):
            grads.append(_pad_value_grad(ctx, g, gx, ctx.info(node.input[2]).shape))
        return tail(node, grads)
    if min(begins + ends) < 0:
        raise GradientError(f"{node_label(node)}: negative pads in mode '{mode}' unsupported")
    if mode not in ("edge", "reflect", "wrap"):
        raise GradientError(f"{node_label(node)}: no gradient for Pad mode '{mode}'")
    for a in range(rank):
        if begins[a] or ends[a]:
            g = _fold_axis(emit, g, AxisPad(a, begins[a], ends[a], x_info.shape[a]), mode)
    return tail(node, [g])


def _crop_back(emit: Emitter, g: str, begins: list[int], ends: list[int],
               shape: Sequence[int]) -> str:
    """Adjoint of a constant Pad: drop padded borders, zero-fill where pads cropped."""
    rank = len(shape)
    out_shape = emit.info(g).shape
    axes = [a for a in range(rank) if begins[a] > 0 or ends[a] > 0]
    starts = [max(begins[a], 0) for a in axes]
    stops = [out_shape[a] - max(ends[a], 0) for a in axes]
    g = slice_values(emit, g, starts, stops, axes)
    return pad_values(emit, g, [max(-b, 0) for b in begins], [max(-e, 0) for e in ends])


def _pad_value_grad(ctx: GradContext, g: str, gx_inner: str, shape: Sequence[int]) -> str:
    """The padding value appears in every padded cell: total minus the copied part."""
    emit = ctx.emit
    total = emit.reduce_sum(g, None, keepdims=False)
    inner = emit.reduce_sum(gx_inner, None, keepdims=False)
    return emit.reshape(emit.sub(total, inner), shape)


@dataclass(frozen=True)
class AxisPad:
    """The padding of one axis: ``before`` and ``after`` cells around the ``size`` it had."""

    axis: int
    before: int
    after: int
    size: int


def _fold_axis(emit: Emitter, g: str, pad: AxisPad, mode: str) -> str:
    """Adjoint of edge/reflect/wrap padding along one axis: add border cells to their source."""
    axis, before, after, n = pad.axis, pad.before, pad.after, pad.size
    out = slice_axis(emit, g, axis, before, before + n)
    if before:
        part = slice_axis(emit, g, axis, 0, before)
        if mode == "edge":
            part, lead, trail = emit.reduce_sum(part, [axis]), 0, n - 1
        elif mode == "reflect":
            part, lead, trail = reverse_axes(emit, part, [axis]), 1, n - 1 - before
        else:
            lead, trail = n - before, 0
        out = emit.add(out, pad_axis(emit, part, axis, lead, trail))
    if after:
        part = slice_axis(emit, g, axis, before + n, before + n + after)
        if mode == "edge":
            part, lead, trail = emit.reduce_sum(part, [axis]), n - 1, 0
        elif mode == "reflect":
            part, lead, trail = reverse_axes(emit, part, [axis]), n - 1 - after, 1
        else:
            lead, trail = 0, n - after
        out = emit.add(out, pad_axis(emit, part, axis, lead, trail))
    return out


# ---------------------------------------------------------------------------- gathers
@register("Gather")
def _gather_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Scatter-add the output gradient into the gathered rows (repeated rows accumulate)."""
    data, indices = node.input[0], node.input[1]
    if not ctx.needs_grad(data):
        return [None, None]
    emit = ctx.emit
    d_shape = ctx.info(data).shape
    axis = norm_axis(int(attr(node, "axis", 0)), len(d_shape))
    idx_rank = len(ctx.info(indices).shape)
    g = _without_padding_rows(ctx, node, gouts[0])
    # Bring the index dimensions to the front: g is then [*I, *D[:axis], *D[axis+1:]].
    g_rank = len(ctx.info(g).shape)
    perm = list(range(axis, axis + idx_rank)) + list(range(axis)) + list(
        range(axis + idx_rank, g_rank))
    g = emit.transpose(g, perm)
    rows_shape = [d_shape[axis]] + list(d_shape[:axis]) + list(d_shape[axis + 1:])
    if ctx.opset >= 16:
        rows = _scatter_rows(ctx, indices, g, rows_shape)
    else:
        rows = _onehot_rows(ctx, indices, g, rows_shape)
    back = list(range(1, axis + 1)) + [0] + list(range(axis + 1, len(d_shape)))
    return [emit.transpose(rows, back), None]


# ``nn.Embedding(padding_idx=P)`` as the dynamo exporter records it on the Gather it
# writes: ``aten.embedding.default(%weight, %ids, P, ...)``; P -1: no padding row.
_EMBEDDING_CALL = re.compile(r"aten\.embedding\.default\]?\(args = \(%\w+, %\w+, (-?\d+)")


def padding_row(node: onnx.NodeProto) -> int | None:
    """The padding row of the embedding a Gather was exported from, or None.

    The ONNX op has no such notion: ``nn.Embedding(padding_idx=P)`` reads row P like any
    other, but torch never passes that row a gradient. The TorchScript exporter drops P; the
    dynamo exporter keeps the FX call on the node (``pkg.torch.onnx.fx_node``), which says
    it."""
    if node.op_type != "Gather" or int(attr(node, "axis", 0)) != 0:
        return None
    fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_PROP), "")
    m = _EMBEDDING_CALL.search(fx)
    return int(m.group(1)) if m and int(m.group(1)) >= 0 else None


def _without_padding_rows(ctx: GradContext, node: onnx.NodeProto, g: str) -> str:
    """The output gradient with every position that looked up the padding row zeroed, so
    that row's gradient is 0 as torch's (its other rows get the same sums as before)."""
    pad = padding_row(node)
    if pad is None:
        return g
    emit = ctx.emit
    indices = node.input[1]
    dtype = ctx.info(indices).dtype
    hit = emit.op("Equal", [indices, emit.const(np.asarray(pad), dtype)],
                  info=TensorInfo(TensorProto.BOOL, ctx.info(indices).shape))
    trailing = len(ctx.info(g).shape) - len(ctx.info(indices).shape)
    if trailing:
        rank = len(ctx.info(indices).shape)
        hit = emit.unsqueeze(hit, list(range(rank, rank + trailing)))
    zero = emit.const(np.zeros((), dtype=ctx.info(g).np_dtype), ctx.info(g).dtype)
    return emit.op("Where", [hit, zero, g], info=ctx.info(g))


def _positive_indices(ctx: GradContext, indices: str, dim: int) -> str:
    """Indices in [0, dim): negative ones count from the end, as Gather reads them."""
    emit = ctx.emit
    value = ctx.constant_value(indices)
    if value is not None:
        return emit.const(np.mod(value.astype(np.int64), dim), TensorProto.INT64, name="indices")
    idx = emit.cast(indices, TensorProto.INT64)
    return emit.binary("Mod", idx, emit.const(np.asarray(dim, dtype=np.int64)))


def _scatter_rows(ctx: GradContext, indices: str, g: str, rows_shape: list[int]) -> str:
    """Sum the rows of ``g`` into a zero table: ScatterElements, chunked over the rows.

    ScatterND(reduction='add') would take each row of ``g`` as one update, but ORT's CPU
    kernel hands updates to intra-op threads with nothing guarding a row that repeats, so
    repeated tokens race and the embedding gradient changes from run to run
    (docs/DETERMINISM.md). ScatterElements adds each output element's updates in index order
    (the order torch's CPU embedding backward adds rows in; ORT splits its work only over
    independent columns, if at all), and ORT writes it in place into its input. Its price is
    an index per element instead of per row: int32 indices expanded to the gradient's shape,
    plus the int64 copy of them the kernel makes, bounded by cutting the rows into chunks
    whose indices, index copy and gradient slice together stay under
    ``SCATTER_CHUNK_BYTES``.
    """
    emit = ctx.emit
    dtype = ctx.info(g).dtype
    depth = rows_shape[0]
    width = int(np.prod(rows_shape[1:], dtype=np.int64))
    n = ctx.info(indices).numel
    rows = _row_indices(ctx, indices, depth, n)
    g2 = emit.reshape(g, [n, width])
    per_row = width * (ctx.info(rows).itemsize + _KERNEL_INDEX_BYTES + ctx.info(g).itemsize)
    chunk = max(1, min(n, SCATTER_CHUNK_BYTES // max(per_row, 1)))
    acc = emit.zeros([depth, width], dtype)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        part_g = g2 if end - start == n else slice_axis(emit, g2, 0, start, end)
        part_i = rows if end - start == n else slice_axis(emit, rows, 0, start, end)
        part_i = emit.expand(part_i, [end - start, width])
        acc = emit.op("ScatterElements", [acc, part_i, part_g], axis=0, reduction="add",
                      info=TensorInfo(dtype, (depth, width)))
    return emit.reshape(acc, rows_shape)


def _row_indices(ctx: GradContext, indices: str, depth: int, n: int) -> str:
    """``indices`` as an [n, 1] column of rows in [0, depth), int32 where rows fit in it."""
    emit = ctx.emit
    narrow = depth < 2**31
    value = ctx.constant_value(indices)
    if value is not None:
        rows = np.mod(value.astype(np.int64), depth).reshape(n, 1)
        return emit.const(rows.astype(np.int32 if narrow else np.int64),
                          TensorProto.INT32 if narrow else TensorProto.INT64, name="rows")
    idx = emit.reshape(_positive_indices(ctx, indices, depth), [n, 1])
    return emit.cast(idx, TensorProto.INT32) if narrow else idx


def _onehot_rows(ctx: GradContext, indices: str, g: str, rows_shape: list[int]) -> str:
    """Before opset 16 no scatter accumulates: sum rows with a one-hot matrix product."""
    emit = ctx.emit
    dtype = ctx.info(g).dtype
    n = ctx.info(indices).numel
    depth = rows_shape[0]
    rest = int(np.prod(rows_shape[1:], dtype=np.int64))
    idx = emit.reshape(indices, [n])
    onehot = emit.op("OneHot", [idx, emit.const(np.asarray([depth], np.int64)),
                                emit.const(np.asarray([0, 1]), dtype)],
                     axis=0, info=TensorInfo(dtype, (depth, n)))
    g2 = emit.reshape(g, [n, rest])
    rows = emit.op("MatMul", [onehot, g2], info=TensorInfo(dtype, (depth, rest)))
    return emit.reshape(rows, rows_shape)


@register("GatherElements")
def _gather_elements_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    data, indices = node.input[0], node.input[1]
    if not ctx.needs_grad(data):
        return [None, None]
    emit = ctx.emit
    d_info = ctx.info(data)
    axis = norm_axis(int(attr(node, "axis", 0)), len(d_info.shape))
    if ctx.opset < 16:
        raise GradientError(
            f"{node_label(node)}: the GatherElements gradient needs ScatterElements with "
            f"reduction='add' (opset 16+); this model uses opset {ctx.opset}. Re-export with "
            "opset 16 or newer."
        )
    idx = _positive_indices(ctx, indices, d_info.shape[axis])
    zeros = emit.zeros(d_info.shape, d_info.dtype)
    gx = emit.op("ScatterElements", [zeros, idx, gouts[0]], axis=axis, reduction="add",
                 info=d_info)
    return [gx, None]


@register("TopK")
def _topk_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """The values' gradient scattered back to where they were taken (a mixture of experts'
    router weights, torch.topk): TopK's indices are distinct along its axis, so a plain
    ScatterElements into zeros is exact and deterministic, no reduction needed."""
    x = node.input[0]
    if gouts[0] is None or not ctx.needs_grad(x):
        return [None] * len(node.input)
    x_info = ctx.info(x)
    axis = norm_axis(int(attr(node, "axis", -1)), len(x_info.shape))
    zeros = ctx.emit.zeros(x_info.shape, x_info.dtype)
    gx = ctx.emit.op("ScatterElements", [zeros, node.output[1], gouts[0]], axis=axis,
                     info=x_info)
    return [gx] + [None] * (len(node.input) - 1)


# ---------------------------------------------------------------------------- rearrangements
def _block_rearrangement(node: onnx.NodeProto, x_shape: Sequence[int]) -> tuple[list[int],
                                                                                 list[int]]:
    """DepthToSpace/SpaceToDepth as reshape -> transpose -> reshape: (first shape, perm)."""
    n, c, h, w = x_shape
    b = int(attr(node, "blocksize"))
    if node.op_type == "SpaceToDepth":
        return [n, c, h // b, b, w // b, b], [0, 3, 5, 1, 2, 4]
    mode = text_attr(node, "mode", "DCR")
    if mode == "CRD":
        return [n, c // (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3]
    return [n, b, b, c // (b * b), h, w], [0, 3, 4, 1, 5, 2]


@register("DepthToSpace", "SpaceToDepth")
def _depth_space_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """A fixed permutation of elements: undo its transpose on the gradient."""
    emit = ctx.emit
    x_shape = ctx.info(node.input[0]).shape
    split, perm = _block_rearrangement(node, x_shape)
    moved = [split[p] for p in perm]
    g = emit.reshape(gouts[0], moved)
    g = emit.transpose(g, [int(i) for i in np.argsort(perm)])
    return [emit.reshape(g, x_shape)]


@register("Trilu")
def _trilu_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Trilu keeps a fixed triangle: the gradient keeps the same triangle."""
    inputs = [gouts[0]] + list(node.input[1:2])
    g = ctx.emit.op("Trilu", inputs, upper=attr(node, "upper", 1), info=ctx.info(node.input[0]))
    return tail(node, [g])


# ---------------------------------------------------------------------------- scatters
def _scatter_reduction(node: onnx.NodeProto) -> str:
    return text_attr(node, "reduction", "none")


@register("ScatterElements", "ScatterND")
def _scatter_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """``y = data`` with ``updates`` written (reduction none) or added (add) at ``indices``.

    The updates' gradient gathers ``g`` at the same indices. The data's gradient is ``g``
    itself for add; for a plain write, the overwritten cells get none, so the same scatter
    writes zeros there (indices are unique for a plain write, as ONNX requires, so that
    scatter writes each cell once and no order matters). mul/max/min are refused.
    """
    emit = ctx.emit
    data, indices, updates = node.input[0], node.input[1], node.input[2]
    reduction = _scatter_reduction(node)
    if reduction not in ("none", "add"):
        raise GradientError(f"{node_label(node)}: no gradient for {node.op_type} with "
                            f"reduction='{reduction}' (only none and add)")
    g = gouts[0]
    elements = node.op_type == "ScatterElements"
    axis_attrs = {"axis": int(attr(node, "axis", 0))} if elements else {}
    d_data = d_updates = None
    if ctx.needs_grad(data):
        if reduction == "add":
            d_data = g
        else:
            u_info = ctx.info(updates)
            zeros = emit.zeros(u_info.shape, u_info.dtype)
            d_data = emit.op(node.op_type, [g, indices, zeros], info=ctx.info(data),
                             **axis_attrs)
    if ctx.needs_grad(updates):
        gather = "GatherElements" if elements else "GatherND"
        d_updates = emit.op(gather, [g, indices], info=ctx.info(updates), **axis_attrs)
    return [d_data, None, d_updates]


@register("CumSum")
def _cumsum_grad(ctx: GradContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Each input adds into every later (or, reversed, earlier) output: the gradient is the
    cumulative sum of ``g`` the other way round, with the same exclusivity."""
    g = ctx.emit.op("CumSum", [gouts[0], node.input[1]],
                    exclusive=int(attr(node, "exclusive", 0)),
                    reverse=1 - int(attr(node, "reverse", 0)), info=ctx.info(node.input[0]))
    return [g, None]
