"""The deterministic forms of accumulating scatters written out as standard ONNX ops
(``deterministic_scatter``'s module docstring tells the forms and their cost).

Enters: an ``Emitter`` over the copy being rewritten and a plan from ``scatter_forms``
(``_Rows`` or ``_Phases``). Leaves: the emitted nodes, the last of which writes the
scatter's output, and one line saying what was written; ``_drop_dead`` then removes the
nodes that only fed the replaced scatters.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from memcc.frontend.constants import constant_value
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.shape_ops import (
    concat_values,
    pad_axis,
    slice_axis,
    slice_values,
    split_values,
)
from memcc.graph import Graph, TensorInfo, ancestors, attr
from memcc.passes.providers.scatter_forms import _FlatKeys, _nonnegative, _Phases, _Rows

I32, I64, BOOL = TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL
# Index vectors up to this length are constants; longer ones are computed (Range/Sub/Max)
# so the step file does not carry megabytes of integers.
_CONST_INDEX_MAX = 1 << 16
# The scan's index table for all steps at once is computed in one go up to this size.
_BATCHED_SCAN_BYTES = 64 << 20


def _unslice(graph: Graph, parts: Sequence[str], producers) -> str | None:
    """The value the ``parts`` are consecutive axis-0 slices of, covering all of it."""
    srcs, bounds = set(), []
    for p in parts:
        node = producers.get(p)
        if node is None or node.op_type != "Slice" or len(node.input) < 3:
            return None
        vals = [constant_value(graph, v, producers) if v else None for v in node.input[1:5]]
        starts, ends = vals[0], vals[1]
        axes = vals[2] if len(vals) > 2 and vals[2] is not None else np.zeros(1, np.int64)
        steps = vals[3] if len(vals) > 3 and vals[3] is not None else np.ones(1, np.int64)
        if starts is None or ends is None or np.size(axes) != 1 or int(np.ravel(axes)[0]) != 0 \
                or int(np.ravel(steps)[0]) != 1:
            return None
        srcs.add(node.input[0])
        bounds.append((int(np.ravel(starts)[0]), int(np.ravel(ends)[0])))
    if len(srcs) != 1:
        return None
    src = srcs.pop()
    total = graph.info[src].shape[0]
    pos = 0
    for s, e in bounds:
        if s != pos:
            return None
        pos = min(e, total)
    return src if pos == total else None


def _emit_rows_plan(emit: Emitter, out: Graph, plan: _Rows, target: onnx.NodeProto,
                    producers) -> str:
    """Emit the merged chunks of one row scatter; the last node writes ``target``'s output."""
    parts = [(plan.keys, plan.values), *plan.parts]
    dtype = out.info[plan.values].dtype
    keys_list = [k for k, _ in parts]
    values_list = [v for _, v in parts]
    if all(isinstance(k, np.ndarray) for k in keys_list):
        keys: str | np.ndarray = np.concatenate([np.ravel(k) for k in keys_list])
    else:
        names = [k for k in keys_list if isinstance(k, str)]
        whole = _unslice(out, names, producers) if len(names) == len(keys_list) > 1 else None
        if whole is not None:
            keys_list = [whole]
        flat = []
        for k in keys_list:
            if isinstance(k, _FlatKeys):
                flat.append(_emit_flat_keys(emit, k, _nonnegative(out, k.indices, producers)))
                continue
            if isinstance(k, np.ndarray):
                flat.append(emit.const(np.mod(k.reshape(-1).astype(np.int64), plan.depth), I64,
                                       name="rows"))
                continue
            name = emit.reshape(k, [out.info[k].numel])
            if not _nonnegative(out, k, producers):
                name = _wrap_negative(emit, name, plan.depth)
            flat.append(name)
        if len({out.info[n].dtype for n in flat}) > 1:
            flat = [emit.cast(n, I64) for n in flat]
        keys = concat_values(emit, flat, 0)
    whole_v = _unslice(out, values_list, producers) if len(values_list) > 1 else None
    vals = [whole_v] if whole_v is not None else values_list
    vals = [emit.reshape(v, [out.info[v].numel // plan.width, plan.width]) for v in vals]
    values = concat_values(emit, vals, 0)
    m = out.info[values].shape[0]
    table, line = _segment_sum(emit, keys, values, plan.depth, plan.width, dtype)
    data = plan.node.input[0]
    d_shape = out.info[target.output[0]].shape
    result = emit.reshape(table, list(d_shape))
    if not _is_zero(out, data, producers):
        result = emit.op("Add", [data, result], info=TensorInfo(dtype, tuple(d_shape)))
    _rename_output(emit, out, result, target.output[0])
    kind = "rows" if plan.width > 1 else "flat"
    chunks = f" ({len(parts)} chunks merged)" if len(parts) > 1 else ""
    return f"{kind}: {m} updates of width {plan.width} into {plan.depth}{chunks}; {line}"


def _is_zero(graph: Graph, value: str, producers) -> bool:
    p = producers.get(value)
    if p is not None and p.op_type == "ConstantOfShape":
        v = attr(p, "value")
        return v is None or not np.any(onnx.numpy_helper.to_array(v))
    const = constant_value(graph, value, producers)
    return const is not None and not np.any(const)


def _rename_output(emit: Emitter, graph: Graph, value: str, name: str) -> None:
    """Make the node that produced ``value`` (emitted here) write ``name`` instead."""
    for n in reversed(emit.nodes):
        for k, o in enumerate(n.output):
            if o == value:
                n.output[k] = name
                graph.info[name] = graph.info[value]
                graph.info.pop(value, None)
                return
    emit.op("Identity", [value], outputs=[name], info=graph.info[value])


def _arange(emit: Emitter, n: int, dtype: int, start: int = 0) -> str:
    np_dtype = np.int32 if dtype == I32 else np.int64
    if n <= _CONST_INDEX_MAX:
        return emit.const(np.arange(start, start + n, dtype=np_dtype), dtype, name="arange")
    return emit.op("Range", [emit.const(np.asarray(start, np_dtype), dtype),
                             emit.const(np.asarray(start + n, np_dtype), dtype),
                             emit.const(np.asarray(1, np_dtype), dtype)],
                   info=TensorInfo(dtype, (n,)))


def _emit_flat_keys(emit: Emitter, k: _FlatKeys, nonnegative: bool) -> str:
    """Flat offsets [M] of the targets: index * stride(axis) + the other coordinates'."""
    strides = np.cumprod([1, *list(k.data_shape)[::-1]])[:-1][::-1]
    idx = emit.cast(k.indices, I64)
    if not nonnegative:
        idx = _wrap_negative(emit, idx, k.data_shape[k.axis])
    rank = len(k.index_shape)
    flat = emit.mul(idx, emit.const(np.asarray(strides[k.axis], np.int64)))
    for d in range(rank):
        if d == k.axis or k.index_shape[d] == 1:
            continue
        shape = [1] * rank
        shape[d] = k.index_shape[d]
        coord = (np.arange(k.index_shape[d], dtype=np.int64) * strides[d]).reshape(shape)
        flat = emit.add(flat, emit.const(coord, I64, name="offsets"))
    flat = emit.expand(flat, list(k.index_shape))
    return emit.reshape(flat, [int(np.prod(k.index_shape))])


def _wrap_negative(emit: Emitter, idx: str, extent: int) -> str:
    """Negative indices count from the end (as ScatterElements reads them)."""
    info = emit.info(idx)
    np_dtype = np.int32 if info.dtype == I32 else np.int64
    neg = emit.op("Less", [idx, emit.const(np.asarray(0, np_dtype), info.dtype)],
                  info=TensorInfo(BOOL, info.shape))
    wrapped = emit.add(idx, emit.const(np.asarray(extent, np_dtype), info.dtype))
    return emit.op("Where", [neg, wrapped, idx], info=info)


def _segment_sum(emit: Emitter, keys: str | np.ndarray, values: str, depth: int, width: int,
                 dtype: int) -> tuple[str, str]:
    """[depth, width] table: row r = sum of the rows of ``values`` whose key is r (keys in
    [0, depth)), in an order the graph fixes. Returns the table and a line for the report."""
    m = emit.info(values).shape[0]
    if isinstance(keys, np.ndarray):
        return _segment_sum_known(emit, np.mod(keys.astype(np.int64), depth), values, depth,
                                  width, dtype)
    steps = max(1, math.ceil(math.log2(m)))
    kt = I32 if depth * m < 2**31 else I64
    np_kt = np.int32 if kt == I32 else np.int64
    k = emit.cast(keys, kt)
    # Unique sort keys: row * m + position. The sorted order is then the only one, whatever
    # the sort's treatment of ties (ORT's CUDA TopK picks bitonic, radix-select or CUB's
    # radix sort by size).
    positions = _arange(emit, m, kt)
    comp = emit.add(emit.mul(k, emit.const(np.asarray(m, np_kt), kt)), positions)
    sorted_keys, perm = emit.op("TopK", [comp, emit.const(np.asarray([m], np.int64), I64)],
                                outputs=2, axis=0, largest=0, sorted=1,
                                info=[TensorInfo(kt, (m,)), TensorInfo(I64, (m,))])
    rows = emit.op("Div", [sorted_keys, emit.const(np.asarray(m, np_kt), kt)],
                   info=TensorInfo(kt, (m,)))
    x = emit.op("Gather", [values, perm], axis=0, info=TensorInfo(dtype, (m, width)))
    x = pad_axis(emit, x, 0, 1, 0)                               # row 0: zeros
    rows_p = concat_values(emit, [emit.const(np.asarray([-1], np_kt), kt), rows], 0)
    for src in _scan_sources(emit, rows_p, m, steps, kt):
        back = emit.op("Gather", [x, src], axis=0, info=TensorInfo(dtype, (m + 1, width)))
        x = emit.add(x, back)
    # Each run's last row holds its sum: find it for every table row with a scatter of
    # positions to unique cells (a run's other rows go to spare cells depth + i).
    nxt = concat_values(emit, [slice_axis(emit, rows, 0, 1, m),
                               emit.const(np.asarray([-1], np_kt), kt)], 0)
    ends_run = emit.op("Equal", [rows, nxt], info=TensorInfo(BOOL, (m,)))
    spare = emit.add(_arange(emit, m, I64), emit.const(np.asarray(depth, np.int64), I64))
    target = emit.op("Where", [ends_run, spare, emit.cast(rows, I64)],
                     info=TensorInfo(I64, (m,)))
    cells = emit.zeros([depth + m], I64)
    where = emit.op("ScatterElements", [cells, target, _arange(emit, m, I64, start=1)], axis=0,
                    info=TensorInfo(I64, (depth + m,)))
    where = slice_axis(emit, where, 0, 0, depth)
    table = emit.op("Gather", [x, where], axis=0, info=TensorInfo(dtype, (depth, width)))
    return table, f"sort by TopK, {steps}-step segmented scan, Gather of each run's sum"


def _scan_sources(emit: Emitter, rows_p: str, m: int, steps: int, kt: int) -> list[str]:
    """Per scan step k, the row each of the m + 1 rows adds: 2^k rows back when that row is
    in the same run, else row 0 (zeros). All steps at once where the [steps, m + 1] index
    table is small (5 nodes instead of 3 per step: each node costs a launch on CUDA), one
    step at a time where it would be large (flat scatters of millions of elements)."""
    back = np.maximum(np.arange(m + 1, dtype=np.int64)[None, :]
                      - (1 << np.arange(steps, dtype=np.int64))[:, None], 0) \
        if steps * (m + 1) <= _CONST_INDEX_MAX * 4 else None
    zero = emit.const(np.asarray(0, np.int64), I64)
    if back is not None or steps * (m + 1) * 8 <= _BATCHED_SCAN_BYTES:
        shape = (steps, m + 1)
        if back is not None:
            cand = emit.const(back, I64, name="back")
        else:
            j = emit.reshape(_arange(emit, m + 1, I64), [1, m + 1])
            d = emit.const((1 << np.arange(steps, dtype=np.int64))[:, None], I64)
            cand = emit.op("Max", [emit.sub(j, d), zero], info=TensorInfo(I64, shape))
        there = emit.op("Gather", [rows_p, cand], axis=0, info=TensorInfo(kt, shape))
        same = emit.op("Equal", [there, rows_p], info=TensorInfo(BOOL, shape))
        src = emit.op("Where", [same, cand, zero], info=TensorInfo(I64, shape))
        if steps == 1:
            return [emit.reshape(src, [m + 1])]
        return split_values(emit, emit.reshape(src, [steps * (m + 1)]), 0, [m + 1] * steps)
    j = _arange(emit, m + 1, I64)
    out = []
    for k in range(steps):
        cand = emit.op("Max", [emit.sub(j, emit.const(np.asarray(1 << k, np.int64), I64)),
                               zero], info=TensorInfo(I64, (m + 1,)))
        there = emit.op("Gather", [rows_p, cand], axis=0, info=TensorInfo(kt, (m + 1,)))
        same = emit.op("Equal", [there, rows_p], info=TensorInfo(BOOL, (m + 1,)))
        out.append(emit.op("Where", [same, cand, zero], info=TensorInfo(I64, (m + 1,))))
    return out


def _segment_sum_known(emit: Emitter, keys: np.ndarray, values: str, depth: int, width: int,
                       dtype: int) -> tuple[str, str]:
    """The same with the keys known here: the sort and every index vector are constants."""
    m = keys.size
    perm = np.argsort(keys, kind="stable")
    rows = keys[perm]
    run = max(np.unique(rows, return_counts=True)[1])
    steps = max(1, math.ceil(math.log2(run))) if run > 1 else 0
    x = emit.op("Gather", [values, emit.const(perm.astype(np.int64), I64, name="order")], axis=0,
                info=TensorInfo(dtype, (m, width)))
    x = pad_axis(emit, x, 0, 1, 0)
    rows_p = np.concatenate([[-1], rows])
    j = np.arange(m + 1, dtype=np.int64)
    for s in range(steps):
        cand = np.maximum(j - (1 << s), 0)
        src = np.where(rows_p[cand] == rows_p, cand, 0)
        back = emit.op("Gather", [x, emit.const(src, I64, name="back")], axis=0,
                       info=TensorInfo(dtype, (m + 1, width)))
        x = emit.add(x, back)
    where = np.zeros(depth, np.int64)
    last = np.append(rows[1:] != rows[:-1], True)
    where[rows[last]] = np.nonzero(last)[0] + 1
    table = emit.op("Gather", [x, emit.const(where, I64, name="runs")], axis=0,
                    info=TensorInfo(dtype, (depth, width)))
    return table, f"constant rows (longest run {run}): {steps}-step segmented scan, Gather"


def _emit_phases(emit: Emitter, plan: _Phases) -> str:
    node = plan.node
    shape = emit.info(plan.indices).shape
    spatial = list(range(2, len(shape)))
    acc = node.input[0]
    d_info = emit.info(acc)
    count = 0
    combos = list(itertools.product(*[range(t) for t in plan.phases]))
    for k, phase in enumerate(combos):
        ends = [shape[a] for a in spatial]
        if any(p >= e for p, e in zip(phase, ends, strict=True)):
            continue
        idx = slice_values(emit, plan.indices, list(phase), ends, spatial, plan.phases)
        upd = slice_values(emit, plan.updates, list(phase), ends, spatial, plan.phases)
        n = emit.info(idx).numel
        idx = emit.reshape(idx, [n])
        upd = emit.reshape(upd, [n])
        outs = [node.output[0]] if k == len(combos) - 1 else 1
        acc = emit.op("ScatterElements", [acc, idx, upd], outputs=outs, axis=0,
                      reduction="add", info=d_info)
        count += 1
    if acc != node.output[0]:
        _rename_output(emit, emit.graph, acc, node.output[0])
    return (f"MaxPool phases {'x'.join(map(str, plan.phases))}: {count} scatters, each with "
            "unique targets")


def _drop_dead(nodes: list[onnx.NodeProto], dropped: list[onnx.NodeProto], producers,
               keep: set[str], copy_of) -> list[onnx.NodeProto]:
    """Remove the nodes that only fed the replaced scatters (the chunks' Slices and
    Expands), and nothing else. ``dropped`` and ``producers`` are the original graph's;
    ``copy_of`` maps its nodes to their copies in ``nodes``."""
    upstream, _ = ancestors([i for n in dropped for i in n.input], producers)
    candidates = {id(copy_of(p)) for p in upstream}
    alive = list(nodes)
    while True:
        used = {i for n in alive for i in n.input if i} | keep
        dead = [n for n in alive if id(n) in candidates and not any(o in used for o in n.output)]
        if not dead:
            return alive
        gone = {id(n) for n in dead}
        alive = [n for n in alive if id(n) not in gone]
