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
