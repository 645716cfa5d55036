"""Reading values that are known at compile time (initializers and Constant nodes)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.graph import Graph


def constant_value(graph: Graph, name: str,
                   producers: Mapping[str, onnx.NodeProto] | None = None) -> np.ndarray | None:
    """The value of ``name`` if it is a (non-overridable) initializer or a Constant output.

    Pass ``producers`` (value -> node) when calling this many times: without it every call
    walks the whole graph.
    """
    if not name:
        return None
    if name in graph.initializers and name not in graph.inputs:
        return np.asarray(graph.initializers[name])
    if name in graph.initializers:
        # A graph input with a default value can be overridden at run time.
        return None
    if producers is not None:
        node = producers.get(name)
        return constant_node_value(node) if node is not None and node.op_type == "Constant" \
            else None
    for node in graph.nodes:
        if node.op_type == "Constant" and node.output and node.output[0] == name:
            return constant_node_value(node)
    return None


def constant_node_value(node) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            return numpy_helper.to_array(a.t)
        if a.name == "value_float":
            return np.asarray(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.asarray(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.asarray(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.asarray(list(a.ints), dtype=np.int64)
        if a.name == "sparse_value":
            return None
    _ = helper
    return None


def constant_filled(a: np.ndarray) -> bool:
    """Whether ``a`` has elements and every one equals the first: no pattern its values
    could prove (a zero bias, a ones-initialised scale). A sample decides most arrays
    (trained or random weights) without a pass over all of them."""
    flat = a.reshape(-1)
    if flat.size == 0 or np.any(flat[:64] != flat[0]):
        return False
    return bool(np.all(flat == flat[0]))


def broadcasts_to(source: np.ndarray, target: np.ndarray) -> bool:
    """Whether ``target`` is ``source`` broadcast (numpy's rules, ``Expand``'s), bit for
    bit: how a folded copy is told to be one parameter repeated."""
    if source.dtype != target.dtype or source.ndim > target.ndim or source.size == 0:
        return False
    try:
        if np.broadcast_shapes(source.shape, target.shape) != target.shape:
            return False
    except ValueError:
        return False
    return np.ascontiguousarray(np.broadcast_to(source, target.shape)).tobytes() \
        == np.ascontiguousarray(target).tobytes()

