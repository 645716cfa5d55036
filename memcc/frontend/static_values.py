"""What the load-time rewrites know about a model before it is a ``Graph``.

In: an ONNX model whose shapes were inferred (dimensions bound). Out: each value's element
type and static shape (``value_types``), values known at compile time (``StaticValues``:
initializers, Constants, ``Shape``/``Size`` of static values, small integer ops over them,
evaluated with ``onnx.reference``), fresh names apart from every name in the model
(``Namer``) and Constant nodes made from arrays (``const_node``). Shared by
``canonicalize``, ``sequences`` and ``function_ops``; it changes no model.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.frontend.constants import constant_node_value

# value -> (element type, static shape or None)
ValueTypes = dict[str, tuple[int, tuple[int, ...] | None]]
# Small integer/bool values the static evaluator computes to decide an If condition.
MAX_STATIC_ELEMENTS = 4096


def value_types(model: onnx.ModelProto) -> ValueTypes:
    """value -> (elem_type, static shape or None) from the inferred model."""
    out: ValueTypes = {}
    g = model.graph
    for vi in (*g.input, *g.value_info, *g.output):
        t = vi.type
        if not t.HasField("tensor_type") or not t.tensor_type.elem_type:
            continue
        tt = t.tensor_type
        shape: tuple[int, ...] | None = None
        if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
            shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        out[vi.name] = (int(tt.elem_type), shape)
    for init in g.initializer:
        out[init.name] = (int(init.data_type), tuple(int(d) for d in init.dims))
    return out


class Namer:
    """Fresh value and node names, apart from every name in the model and each other."""

    def __init__(self, model: onnx.ModelProto) -> None:
        taken = {v for n in model.graph.node for v in (*n.input, *n.output, n.name)}
        taken |= {v.name for v in (*model.graph.input, *model.graph.output,
                                   *model.graph.initializer)}
        self.taken = taken

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


class StaticValues:
    """Values known at compile time: initializers, Constant nodes, ``Shape``/``Size`` of
    statically shaped values, and small integer/bool ops over those (evaluated with
    ``onnx.reference``). Used to decide ``If`` conditions and sequence positions."""

    def __init__(self, model: onnx.ModelProto, types: ValueTypes) -> None:
        self.types = types
        self.opset = next((o.version for o in model.opset_import
                           if o.domain in ("", "ai.onnx")), 13)
        graph_inputs = {i.name for i in model.graph.input}
        self.known: dict[str, np.ndarray] = {
            t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.name not in graph_inputs and int(np.prod(t.dims)) <= MAX_STATIC_ELEMENTS}
        self.producer = {o: n for n in model.graph.node for o in n.output if o}
        self.failed: set[str] = set()

    def value(self, name: str) -> np.ndarray | None:
        if not name:
            return None
        if name in self.known:
            return self.known[name]
        if name in self.failed:
            return None
        # Iterative depth-first evaluation: shape-arithmetic chains can be long.
        stack = [name]
        while stack:
            v = stack[-1]
            if v in self.known or v in self.failed:
                stack.pop()
                continue
            node = self.producer.get(v)
            if node is None:
                self.failed.add(v)
                stack.pop()
                continue
            pending = [i for i in self._inputs_needed(node)
                       if i not in self.known and i not in self.failed]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._evaluate(node)
            for o in node.output:
                if o and o not in self.known:
                    self.failed.add(o)
        return self.known.get(name)

    def _inputs_needed(self, node: onnx.NodeProto) -> list[str]:
        if node.op_type in ("Shape", "Size", "Constant"):
            return []
        return [i for i in node.input if i]

    def _evaluate(self, node: onnx.NodeProto) -> None:
        out = node.output[0] if node.output else ""
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            return
        if node.op_type == "Constant":
            v = constant_node_value(node)
            if v is not None:
                self.known[out] = v
            return
        if node.op_type in ("Shape", "Size"):
            t = self.types.get(node.input[0])
            if t is None or t[1] is None:
                return
            shape = t[1]
            if node.op_type == "Size":
                self.known[out] = np.asarray(int(np.prod(shape)), dtype=np.int64)
                return
            start = node_attr(node, "start", 0)
            end = node_attr(node, "end", len(shape))
            self.known[out] = np.asarray(shape[slice(start, end)], dtype=np.int64)
            return
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute):
            return
        if any(i and i not in self.known for i in node.input):
            return
        if any(self.known[i].dtype.kind == "f" for i in node.input if i):
            return
        from onnx.reference import ReferenceEvaluator

        inits = [numpy_helper.from_array(self.known[i], i) for i in dict.fromkeys(node.input)
                 if i]
        g = helper.make_graph([node], "static", [], [helper.make_empty_tensor_value_info(out)],
                              inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", self.opset)])
        try:
            (value,) = ReferenceEvaluator(m).run(None, {})
        except Exception:
            return
        value = np.asarray(value)
        if value.size <= MAX_STATIC_ELEMENTS and value.dtype.kind in "biu":
            self.known[out] = value


def node_attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def const_node(fresh: Namer, value: np.ndarray) -> onnx.NodeProto:
    out = fresh("canonical_const")
    return helper.make_node("Constant", [], [out], name=fresh("Constant"),
                            value=numpy_helper.from_array(value, out))
