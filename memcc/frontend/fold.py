"""Fold shape arithmetic into constants once every dimension is bound.

Exporters compute shapes at run time (Shape -> Gather -> Concat -> Reshape). With all
dimensions bound those values are known at compile time, and leaving them in the graph
costs more than time: ORT runs ready Shape/Size nodes ahead of everything else whatever the
file order says (PRIORITY_BASED), so a planned order could never be kept exactly. Folding
turns them into Constant nodes, which ORT loads as initializers and never schedules.

Only small integer values (shape arithmetic) computed from Shape/Size and from non-float
constants are folded: nothing that reads a parameter, so no weight is baked into a constant,
and no float tensor, because a folded value lives for the whole step (a ConstantOfShape
zeros tensor computed when needed is cheaper than one held from the start). An integer
buffer the forward writes (a step counter, ``steps += 1``: a ``BUFFER_MUTATION`` of the
dynamo exporter's signature) is no constant: the step carries it, and its ``steps + 1``
folded from the exported value was written back as 1 at every step.

Each Constant keeps the node it replaced (``FOLDED_FROM``, on the Constant's metadata), so
that ``memcc export`` can write the forward model with the exporter's shape computations
again (``with_shape_computations``): folded, a reshape to ``[8, 16, 12, 64]`` holds the
built batch, and the model the user exported took any.
"""

from __future__ import annotations

import base64

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.frontend.constants import constant_node_value
from memcc.frontend.export_signature import signature_of
from memcc.graph import Graph, TensorInfo, in_dependency_order
from memcc.step import KIND_KEY, TRAINING_STEP

MAX_FOLDED_ELEMENTS = 4096
FOLDED_FROM = "memcc.folded_from"
# Graph metadata: set where a forward model was folded with records (kept by its step).
FOLD_RECORDS_KEY = "memcc.fold_records"
_NEVER = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                    "Bernoulli", "Multinomial", "Dropout"})


def fold_shape_computations(graph: Graph) -> tuple[Graph, dict]:
    """Replace statically known small nodes by Constant nodes in place; return the graph
    and how many (the pass contract, ``memcc/pass_contract.py``)."""
    known: dict[str, np.ndarray] = {}
    sig = signature_of(graph)
    written = sig.mutated_buffers if sig is not None else frozenset()
    for name, arr in graph.initializers.items():
        if name not in graph.inputs and name not in written and \
                not np.issubdtype(np.asarray(arr).dtype, np.floating):
            known[name] = np.asarray(arr)
    folded: set[str] = set()
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
        const = helper.make_node("Constant", [], [out], name=node.name,
                                 value=numpy_helper.from_array(value, out))
        # With the values of the exporter's constants it read, which may go unused now.
        const.metadata_props.add(key=FOLDED_FROM, value=_record(node, {
            i: known[i] for i in node.input if i in known and i not in folded}))
        new_nodes.append(const)
        folded.add(out)
    graph.nodes = new_nodes
    if graph.metadata.get(KIND_KEY) != TRAINING_STEP:  # a step's records are its model's
        graph.metadata[FOLD_RECORDS_KEY] = "1"
    return graph, {"folded": len(folded)}


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


def _record(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> str:
    """``node`` and the ``constants`` it reads, as text for a metadata property: a graph
    of the node, without its exporter metadata (dynamo's stack traces) or doc string, and
    the constants as initializers."""
    bare = onnx.NodeProto()
    bare.CopyFrom(node)
    del bare.metadata_props[:]
    bare.ClearField("doc_string")
    record = helper.make_graph([bare], "folded", [], [], [
        numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return base64.b64encode(record.SerializeToString()).decode("ascii")


def _recorded(node: onnx.NodeProto) -> onnx.GraphProto | None:
    """What ``_record`` wrote on a folded Constant (None: not one)."""
    text = next((p.value for p in node.metadata_props if p.key == FOLDED_FROM), None)
    if node.op_type != "Constant" or text is None:
        return None
    record = onnx.GraphProto()
    record.ParseFromString(base64.b64decode(text))
    if len(record.node) != 1 or list(record.node[0].output) != list(node.output):
        return None
    return record


def has_fold_records(graph: Graph) -> bool:
    """Whether ``graph`` (a step, or a model) was folded by a memcc that records what it
    folded: a step built before then had its forward model's shapes folded for good."""
    return FOLD_RECORDS_KEY in graph.metadata


def with_shape_computations(graph: Graph) -> tuple[Graph, int]:
    """A copy of ``graph`` in which every folded Constant whose recorded node can run again
    (its inputs are in the graph, recorded with it, or restored too) is that node again,
    in an order where each node follows its inputs' producers; and how many were restored.
    The values are the same at the built sizes; at other sizes they follow the inputs, as
    in the model the exporter wrote. Nodes of other memcc passes that fixed a size stay as
    they are: the caller checks the result at other sizes."""
    records = {i: r for i, n in enumerate(graph.nodes) if (r := _recorded(n)) is not None
               and _reads_what_it_read(graph, r, n)}
    available = set(graph.inputs) | set(graph.initializers)
    available |= {o for i, n in enumerate(graph.nodes) if i not in records
                  for o in n.output if o}
    restored: dict[int, onnx.GraphProto] = {}
    while True:  # a record may read another: restored once that one is
        more = {i: r for i, r in records.items() if i not in restored and all(
            not x or x in available or any(t.name == x for t in r.initializer)
            for x in r.node[0].input)}
        if not more:
            break
        restored.update(more)
        available |= {r.node[0].output[0] for r in more.values()}
    if not restored:
        return graph, 0
    out = graph.copy(with_index=False)
    for r in restored.values():
        for t in r.initializer:
            if t.name not in available:
                out.initializers[t.name] = numpy_helper.to_array(t)
                out.info[t.name] = TensorInfo(t.data_type, tuple(t.dims))
                available.add(t.name)
    nodes = [restored[i].node[0] if i in restored else n for i, n in enumerate(out.nodes)]
    out.set_nodes(in_dependency_order(nodes))
    return out, len(restored)


def _reads_what_it_read(graph: Graph, record: onnx.GraphProto, folded: onnx.NodeProto
                        ) -> bool:
    """Whether a recorded ``Shape`` reads a value of the shape it read when it was folded
    (another rewrite may have removed that value and given its name to another one): its
    folded value against the value's shape now. Other nodes are checked through them."""
    node = record.node[0]
    if node.op_type != "Shape":
        return True
    info = graph.info.get(node.input[0])
    value = constant_node_value(folded)
    if info is None or value is None:
        return False
    start = next((a.i for a in node.attribute if a.name == "start"), 0)
    end = next((a.i for a in node.attribute if a.name == "end"), None)
    return [int(d) for d in value.reshape(-1)] == list(info.shape)[slice(start, end)]
