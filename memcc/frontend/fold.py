"""Fold shape arithmetic into constants once every dimension is bound.

Exporters compute shapes at run time (Shape -> Gather -> Concat -> Reshape). With all
dimensions bound those values are known at compile time, and leaving them in the graph
costs more than time: ORT runs ready Shape/Size nodes ahead of everything else whatever the
file order says (PRIORITY_BASED), so a planned order could never be kept exactly. Folding
turns them into Constant nodes, which ORT loads as initializers and never schedules.

Only small integer values (shape arithmetic) computed from Shape/Size and from non-float
constants are folded: nothing that reads a parameter, so no weight is baked into a constant,
and no float tensor, because a folded value lives for the whole step (a ConstantOfShape
zeros tensor computed when needed is cheaper than one held from the start).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.frontend.constants import constant_node_value
from memcc.graph import Graph, TensorInfo

MAX_FOLDED_ELEMENTS = 4096
_NEVER = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                    "Bernoulli", "Multinomial", "Dropout"})


def fold_shape_computations(graph: Graph) -> tuple[Graph, dict]:
    """Replace statically known small nodes by Constant nodes in place; return the graph
    and how many (the pass contract, ``memcc/pass_contract.py``)."""
    known: dict[str, np.ndarray] = {}
    for name, arr in graph.initializers.items():
        if name not in graph.inputs and not np.issubdtype(np.asarray(arr).dtype, np.floating):
            known[name] = np.asarray(arr)
    folded = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.nodes:
        value = _fold(node, graph, known)
        if value is None:
            if node.op_type == "Constant" and len(node.output) == 1:
                v = constant_node_value(node)
                if v is not None and v.size <= MAX_FOLDED_ELEMENTS:
                    known[node.output[0]] = v
            new_nodes.append(node)
            continue
        out = node.output[0]
        known[out] = value
        graph.info[out] = TensorInfo(helper.np_dtype_to_tensor_dtype(value.dtype),
                                     tuple(int(d) for d in value.shape))
        new_nodes.append(helper.make_node("Constant", [], [out], name=node.name,
                                          value=numpy_helper.from_array(value, out)))
        folded += 1
    graph.nodes = new_nodes
    return graph, {"folded": folded}


def _fold(node: onnx.NodeProto, graph: Graph, known: dict[str, np.ndarray]
          ) -> np.ndarray | None:
    if len(node.output) != 1 or node.op_type in _NEVER or node.domain not in ("", "ai.onnx"):
        return None
    out_info = graph.info.get(node.output[0])
    if out_info is None or out_info.numel > MAX_FOLDED_ELEMENTS or out_info.is_float:
        return None
    if node.op_type in ("Shape", "Size"):
        src = graph.info.get(node.input[0])
        if src is None:
            return None
        if node.op_type == "Size":
            return np.asarray(src.numel, dtype=np.int64)
        start, end = 0, len(src.shape)
        for a in node.attribute:
            if a.name == "start":
                start = a.i
            elif a.name == "end":
                end = a.i
        return np.asarray(src.shape[slice(start, end)], dtype=np.int64)
    if node.op_type == "Constant" or not node.input:
        return None
    if not all((not i) or i in known for i in node.input):
        return None
    return _evaluate(node, graph, known)


def _evaluate(node: onnx.NodeProto, graph: Graph, known: dict[str, np.ndarray]
              ) -> np.ndarray | None:
    from onnx.reference import ReferenceEvaluator

    inits = [numpy_helper.from_array(known[i], i) for i in dict.fromkeys(node.input) if i]
    g = helper.make_graph([node], "fold", [], [helper.make_empty_tensor_value_info(
        node.output[0])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", graph.opset)])
    try:
        (value,) = ReferenceEvaluator(m).run(None, {})
    except Exception:
        return None
    value = np.asarray(value)
    info = graph.info.get(node.output[0])
    if info is not None and tuple(value.shape) != tuple(info.shape):
        return None
    return value
