"""Which deterministic form each accumulating scatter takes (``deterministic_scatter``).

Enters: a graph and one accumulating ``ScatterElements`` / ``ScatterND`` node. Leaves: a plan
(``_Rows``: a sort-and-scan of rows; ``_Phases``: MaxPool windows split by phase) or a
verdict string, "already: why" (deterministic as it is) or "left: why" (no form written).
Reads the graph only; ``scatter_emission`` writes the plans out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx

from memcc.frontend.constants import constant_value
from memcc.graph import Graph, TensorInfo, attr

# Ops that keep every value of their input (the MaxPool indices reach the scatter through
# a Cast to int32 and a Reshape to flat).
_VALUE_PRESERVING = ("Cast", "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze")


def _reduction(node: onnx.NodeProto) -> str:
    value = attr(node, "reduction", b"none")
    return value.decode() if isinstance(value, bytes) else str(value)


class _ScatterShapes(NamedTuple):
    """The static shapes of a scatter's data, indices and updates."""

    data: TensorInfo
    indices: TensorInfo
    updates: TensorInfo


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



def classify(graph: Graph, node: onnx.NodeProto, producers) -> _Rows | _Phases | str:
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
    shapes = _ScatterShapes(*infos)
    d_info, i_info = shapes.data, shapes.indices
    if not d_info.is_float:
        return "already: integer sums do not depend on the order"
    if node.op_type == "ScatterND":
        return _classify_nd(graph, node, shapes, producers)
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
    rows = _rows_form(graph, node, axis, shapes, producers)
    if rows is None:
        keys = (_flat_targets(np.asarray(const, np.int64), d_info.shape, axis)
                if const is not None else _FlatKeys(indices, axis, d_info.shape, i_info.shape))
        rows = _Rows(node=node, keys=keys, values=updates, depth=d_info.numel, width=1)
    if isinstance(rows.keys, np.ndarray):
        known = np.mod(rows.keys, rows.depth)
        if len(np.unique(known)) == known.size:
            return "already: constant indices with no repeated target"
    return rows


def _classify_nd(graph, node, shapes: _ScatterShapes, producers) -> _Rows | str:
    d_info, i_info, u_info = shapes
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


def _rows_form(graph, node, axis, shapes: _ScatterShapes, producers) -> _Rows | None:
    """Axis 0, whole rows, indices constant along each row (memcc's Gather gradient)."""
    d_info, i_info, u_info = shapes
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

