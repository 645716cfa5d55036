"""Accumulating scatters written so that ONNX Runtime's CUDA provider gives the same bits on
every run.

ORT's CUDA kernel for ``ScatterElements(reduction="add")`` adds each update with an atomic
add, so where several updates land on one element the order of the additions, and with it
the float result, changes from run to run; ``use_deterministic_compute`` does not change
that. On an H200 (onnxruntime-gpu 1.31.1) the zoo GPT-2 and BERT steps gave different
losses in two runs for this reason alone: only the embedding table's gradient differed
(docs/DETERMINISM.md, "CUDA"). memcc emits such scatters for three gradients: Gather (the
embedding; ``shape_ops._scatter_rows``: axis 0, int32 row indices expanded along the row,
chunked), MaxPool (``nn.scatter_to_argmax``: flat argmax indices) and GatherElements.

``for_cuda_determinism`` rewrites each of them into standard ONNX ops whose CUDA kernels
have one writer per output element (or one atomic add per element per kernel), so the
order of every sum is fixed by the graph:

- **rows** (the Gather gradient, and every axis-0 scatter whose indices are constant along
  the row; a chain of chunks is merged back into one): the row ids are sorted (``TopK``
  with k = all of them on the unique key ``row * m + position``, so ties cannot exist and
  the order does not depend on the sort's stability), the update rows gathered in that
  order, then summed per run of equal ids by a segmented inclusive scan by doubling
  (``ceil(log2(m))`` steps of ``x += Gather(x, src_k)``, where ``src_k`` points 2^k rows
  back inside the same run, or at a zero row), and the table is one ``Gather`` of each
  run's last row (a small int ``ScatterElements`` without reduction, to unique cells,
  finds it; rows that no update names read the zero row). Cost: one sort of m keys and
  about 2 log2(m) + 3 passes over the [m, width] updates, instead of the atomics; no
  [tokens, vocabulary] temporary. With constant row ids the whole plan is computed here.
- **MaxPool phases** (the MaxPool gradient): the pooled outputs are split by phase,
  ``(oh mod t_h, ow mod t_w)`` with ``t = ceil(effective kernel / stride)``; within one
  phase the windows do not overlap, so the argmax targets are unique, and each phase is one
  ``ScatterElements(reduction="add")`` in a fixed order: one atomic add per element per
  kernel, which is deterministic. 3x3 stride-2 pooling: 4 scatters of a quarter each.
- **flat** (anything else, e.g. a GatherElements gradient with repeated indices along the
  axis): flat target offsets are computed and summed as rows of width 1.

Left alone, as deterministic already: scatters with at most one update per element (the
indices have extent 1 along the axis, as the loss's GatherElements gradient does; constant
unique indices; MaxPool windows that do not overlap), and ``max``/``min`` reductions, whose
result does not depend on the order. Left alone and reported as still nondeterministic:
``mul`` reductions and ``ScatterND`` forms other than one index per row.

Sums change order: the rewritten step equals the original within a tolerance, not bit for
bit (``tests/test_deterministic_scatter.py`` states it: 1e-5 of the largest element).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

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
from memcc.graph import Graph, TensorInfo, ancestors, attr, node_label
from memcc.step import GRAD_OF_PROP, ROLE_PROP, RULE_PROP

I32, I64, BOOL = TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL
# Index vectors up to this length are constants; longer ones are computed (Range/Sub/Max)
# so the step file does not carry megabytes of integers.
_CONST_INDEX_MAX = 1 << 16
# The scan's index table for all steps at once is computed in one go up to this size.
_BATCHED_SCAN_BYTES = 64 << 20
# Ops that keep every value of their input (the MaxPool indices reach the scatter through
# a Cast to int32 and a Reshape to flat).
_VALUE_PRESERVING = ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")
_COPIED_PROPS = (ROLE_PROP, GRAD_OF_PROP, RULE_PROP)


@dataclass
class Report:
    """What ``for_cuda_determinism`` did. ``rewritten``: one line per rewritten scatter
    (chained chunks merged into one are listed together); ``left``: nodes that stay
    nondeterministic on CUDA, each with why; ``already``: accumulating scatters left alone
    because their result cannot depend on the order of the updates."""

    rewritten: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"rewritten": list(self.rewritten), "left": list(self.left),
                "already_deterministic": list(self.already)}


def _reduction(node: onnx.NodeProto) -> str:
    value = attr(node, "reduction", b"none")
    return value.decode() if isinstance(value, bytes) else str(value)


def is_accumulating_scatter(node: onnx.NodeProto) -> bool:
    """A ScatterElements or ScatterND that combines updates (reduction other than none)."""
    return (node.domain in ("", "ai.onnx") and node.op_type in ("ScatterElements", "ScatterND")
            and _reduction(node) != "none")


# ---------------------------------------------------------------------------- plans
@dataclass
class _Rows:
    """Sum rows of ``values`` [m, width] into a [depth, width] table at ``keys``."""

    node: onnx.NodeProto
    keys: str | np.ndarray | _FlatKeys  # [m] row ids (a value, known here, or flat offsets)
    values: str                  # [m, width]
    depth: int
    width: int
    parts: list[tuple[str | np.ndarray | _FlatKeys, str]] = field(default_factory=list)


@dataclass
class _Phases:
    """MaxPool gradient: one unique-target scatter per window phase."""

    node: onnx.NodeProto
    indices: str                 # [N, C, *O] argmax
    updates: str                 # [N, C, *O]
    phases: list[int]            # t per spatial axis


def for_cuda_determinism(graph: Graph) -> tuple[Graph, Report]:
    """A copy of ``graph`` with every order-dependent accumulating scatter rewritten as
    described above (``graph`` itself when there is nothing to rewrite), and the report."""
    report = Report()
    producers = graph.producers()
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    plans: dict[int, _Rows | _Phases] = {}
    for i, node in enumerate(graph.nodes):
        if not is_accumulating_scatter(node):
            continue
        verdict = _classify(graph, node, producers)
        if isinstance(verdict, str):
            kind, why = verdict.split(":", 1)
            (report.already if kind == "already" else report.left).append(
                f"{node_label(node)}:{why}")
            continue
        plans[i] = verdict
    if not plans:
        return graph, report

    # Chunks of one row scatter (memcc cuts the Gather gradient into chunks, each adding
    # into the previous one's table) are merged: one sort and one scan for all of them.
    merged_into: dict[int, int] = {}
    index_of = {id(n): i for i, n in enumerate(graph.nodes)}
    for i in sorted(plans):
        plan = plans[i]
        if not isinstance(plan, _Rows):
            continue
        data = plan.node.input[0]
        prev = producers.get(data)
        j = index_of.get(id(prev)) if prev is not None else None
        if (j is None or j not in plans or not isinstance(plans[j], _Rows)
                or data in outputs or len(consumers.get(data, [])) != 1):
            continue
        head = merged_into.get(j, j)
        first = plans[head]
        if (first.depth, first.width) != (plan.depth, plan.width) or \
                graph.info[first.values].dtype != graph.info[plan.values].dtype:
            continue
        first.parts.append((plan.keys, plan.values))
        merged_into[i] = head
    last_of: dict[int, int] = {}
    for i, head in merged_into.items():
        last_of[head] = max(last_of.get(head, head), i)

    out = graph.copy()
    emit = Emitter(out, detached=True, prefix="det/")
    nodes: list[onnx.NodeProto] = []
    dropped: list[onnx.NodeProto] = []
    emit_at = {last_of.get(h, h): h for h in plans if h not in merged_into}
    for i, node in enumerate(out.nodes):
        if i not in plans:
            nodes.append(node)
            continue
        dropped.append(graph.nodes[i])
        head = emit_at.get(i)
        if head is None:
            continue  # a chunk merged into a later node's rewrite
        plan = plans[head]
        start = len(emit.nodes)
        target = graph.nodes[i]
        if isinstance(plan, _Rows):
            members = [plan.node] + [graph.nodes[k] for k, h in sorted(merged_into.items())
                                     if h == head]
            line = _emit_rows_plan(emit, out, plan, target, producers)
            names = ", ".join(f"{m.op_type} '{m.name or m.output[0]}'" for m in members)
            report.rewritten.append(f"{names}: {line}")
        else:
            line = _emit_phases(emit, plan)
            report.rewritten.append(f"{node_label(plan.node)}: {line}")
        made = emit.nodes[start:]
        props = {p.key: p.value for p in target.metadata_props if p.key in _COPIED_PROPS}
        for n in made:
            for key, value in props.items():
                n.metadata_props.add(key=key, value=value)
        nodes.extend(made)
    position = {id(n): k for k, n in enumerate(graph.nodes)}
    nodes = _drop_dead(nodes, dropped, producers, set(out.outputs),
                       lambda n: out.nodes[position[id(n)]])
    out.set_nodes(nodes)
    produced = {o for n in nodes for o in n.output if o}
    for n in graph.nodes:  # shapes of values that no longer exist (merged chunks' tables)
        for o in n.output:
            if o and o not in produced:
                out.info.pop(o, None)
    return out, report


# ---------------------------------------------------------------------------- analysis
def _classify(graph: Graph, node: onnx.NodeProto, producers) -> _Rows | _Phases | str:
    """A plan for ``node``, or "already: why" / "left: why"."""
    reduction = _reduction(node)
    if reduction in ("max", "min"):
        return f"already: reduction='{reduction}' does not depend on the order of the updates"
    if reduction != "add":
        return (f"left: reduction='{reduction}': a product depends on the order of the updates "
                "and no deterministic form is written for it")
    data, indices, updates = node.input[0], node.input[1], node.input[2]
    infos = [graph.info.get(v) for v in (data, indices, updates)]
    if any(i is None for i in infos):
        return "left: no static shape for its inputs"
    d_info, i_info, u_info = infos
    if not d_info.is_float:
        return "already: integer sums do not depend on the order"
    if node.op_type == "ScatterND":
        return _classify_nd(graph, node, d_info, i_info, u_info, producers)
    rank = len(d_info.shape)
    axis = int(attr(node, "axis", 0)) % max(rank, 1)
    if i_info.shape[axis] == 1 or i_info.numel <= 1:
        return "already: one update per element (the indices have extent 1 along the axis)"
    const = constant_value(graph, indices, producers)
    if const is not None:
        flat = _flat_targets(np.asarray(const, np.int64), d_info.shape, axis)
        if len(np.unique(flat)) == flat.size:
            return "already: constant indices with no repeated target"
    pool = _maxpool_form(graph, node, producers)
    if isinstance(pool, str):
        return pool
    if pool is not None:
        return pool
    rows = _rows_form(graph, node, axis, d_info, i_info, u_info, producers)
    if rows is None:
        keys = (_flat_targets(np.asarray(const, np.int64), d_info.shape, axis)
                if const is not None else _FlatKeys(indices, axis, d_info.shape, i_info.shape))
        rows = _Rows(node=node, keys=keys, values=updates, depth=d_info.numel, width=1)
    if isinstance(rows.keys, np.ndarray):
        known = np.mod(rows.keys, rows.depth)
        if len(np.unique(known)) == known.size:
            return "already: constant indices with no repeated target"
    return rows


def _classify_nd(graph, node, d_info, i_info, u_info, producers) -> _Rows | str:
    q = i_info.shape[-1]
    m = i_info.numel // max(q, 1)
    if m <= 1:
        return "already: one update"
    if q != 1:
        return (f"left: ScatterND with {q} coordinates per index: only one coordinate per "
                "index (a row scatter) is rewritten")
    width = int(np.prod(d_info.shape[1:], dtype=np.int64))
    if u_info.numel != m * width:
        return "left: ScatterND updates are not whole rows"
    const = constant_value(graph, node.input[1], producers)
    keys: str | np.ndarray = node.input[1]
    if const is not None:
        keys = np.mod(np.asarray(const, np.int64).reshape(m), d_info.shape[0])
        if len(np.unique(keys)) == m:
            return "already: constant indices with no repeated target"
    return _Rows(node=node, keys=keys, values=node.input[2], depth=d_info.shape[0],
                 width=width)


@dataclass
class _FlatKeys:
    """Flat offsets of a ScatterElements' targets in its data, computed when emitted."""

    indices: str
    axis: int
    data_shape: tuple[int, ...]
    index_shape: tuple[int, ...]


def _flat_targets(idx: np.ndarray, data_shape: Sequence[int], axis: int) -> np.ndarray:
    idx = np.mod(idx, data_shape[axis])
    strides = np.cumprod([1, *list(data_shape)[::-1]])[:-1][::-1]
    grids = np.indices(idx.shape, dtype=np.int64)
    flat = idx * strides[axis]
    for d in range(idx.ndim):
        if d != axis:
            flat = flat + grids[d] * strides[d]
    return flat.reshape(-1)


def _rows_form(graph, node, axis, d_info, i_info, u_info, producers) -> _Rows | None:
    """Axis 0, whole rows, indices constant along each row (memcc's Gather gradient)."""
    if axis != 0 or len(d_info.shape) < 2:
        if axis == 0 and len(d_info.shape) == 1:  # a flat scatter is rows of width one
            const = constant_value(graph, node.input[1], producers)
            keys = np.asarray(const, np.int64) if const is not None else node.input[1]
            return _Rows(node=node, keys=keys, values=node.input[2], depth=d_info.shape[0],
                         width=1)
        return None
    m = i_info.shape[0]
    if tuple(i_info.shape[1:]) != tuple(d_info.shape[1:]) or u_info.shape != i_info.shape:
        return None
    width = int(np.prod(d_info.shape[1:], dtype=np.int64))
    const = constant_value(graph, node.input[1], producers)
    if const is not None:
        arr = np.asarray(const, np.int64).reshape(m, -1)
        if not (arr == arr[:, :1]).all():
            return None
        return _Rows(node=node, keys=arr[:, 0], values=node.input[2], depth=d_info.shape[0],
                     width=width)
    prod = producers.get(node.input[1])
    if prod is None or prod.op_type != "Expand":
        return None
    src = prod.input[0]
    s_info = graph.info.get(src)
    if s_info is None or len(s_info.shape) != len(i_info.shape) or s_info.shape[0] != m or \
            any(d != 1 for d in s_info.shape[1:]):
        return None
    s_const = constant_value(graph, src, producers)
    keys = np.asarray(s_const, np.int64).reshape(m) if s_const is not None else src
    return _Rows(node=node, keys=keys, values=node.input[2], depth=d_info.shape[0],
                 width=width)


def _trace(value: str, producers) -> tuple[str, onnx.NodeProto | None]:
    """Follow value-preserving ops upwards: the first value that is not such an output."""
    seen = 0
    while seen < 16:
        p = producers.get(value)
        if p is None or p.op_type not in _VALUE_PRESERVING:
            return value, p
        value = p.input[0]
        seen += 1
    return value, producers.get(value)


def _nonnegative(graph: Graph, value: str, producers) -> bool:
    """Whether ``value`` provably holds no negative index (memcc wraps them with Mod)."""
    src, p = _trace(value, producers)
    if p is None:
        const = constant_value(graph, src, producers)
        return const is not None and bool((np.asarray(const) >= 0).all())
    if p.op_type == "Expand":
        return _nonnegative(graph, p.input[0], producers)
    if p.op_type == "Mod":
        divisor = constant_value(graph, p.input[1], producers)
        return divisor is not None and bool((np.asarray(divisor) > 0).all())
    if p.op_type == "MaxPool":
        return list(p.output).index(src) == 1 if src in p.output else False
    if p.op_type == "Constant":
        const = constant_value(graph, src, producers)
        return const is not None and bool((np.asarray(const) >= 0).all())
    return False


def _maxpool_form(graph, node, producers) -> _Phases | str | None:
    """The MaxPool gradient: flat data, indices = (Cast/Reshape of) MaxPool's Indices."""
    data, indices, updates = node.input[:3]
    d_info = graph.info[data]
    if len(d_info.shape) != 1:
        return None
    idx_p = producers.get(indices)
    upd_p = producers.get(updates)
    if idx_p is None or upd_p is None or idx_p.op_type != "Reshape" or upd_p.op_type != "Reshape":
        return None
    shaped_idx, shaped_upd = idx_p.input[0], upd_p.input[0]
    src, pool = _trace(shaped_idx, producers)
    if pool is None or pool.op_type != "MaxPool" or len(pool.output) < 2 or \
            pool.output[1] != src or int(attr(pool, "storage_order", 0)) != 0:
        return None
    y_info = graph.info.get(pool.output[0])
    x_info = graph.info.get(pool.input[0])
    if y_info is None or x_info is None or x_info.numel != d_info.numel:
        return None
    if graph.info[shaped_idx].shape != y_info.shape or \
            graph.info.get(shaped_upd, TensorInfo(0, ())).shape != y_info.shape:
        return None
    kernel = list(attr(pool, "kernel_shape"))
    n = len(kernel)
    strides = list(attr(pool, "strides", [1] * n))
    dilations = list(attr(pool, "dilations", [1] * n))
    phases = [-(-((k - 1) * d + 1) // s) for k, s, d in zip(kernel, strides, dilations,
                                                          strict=True)]
    if all(t == 1 for t in phases):
        return f"already: the {pool.name or 'MaxPool'} windows do not overlap (unique targets)"
    return _Phases(node=node, indices=shaped_idx, updates=shaped_upd, phases=phases)


# ---------------------------------------------------------------------------- emission
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
