"""Which carried-state updates may be written into the buffer of the value they replace.

An analysis (nothing is changed). A training step takes parameters and optimizer state as
inputs and returns their new values as outputs; by default ORT gives every output a buffer of
its own, so at the end of a step both the old and the new copy of all state are allocated.
When the output ``P.new`` is bound to the buffer of the input ``P`` (ORT's IOBinding,
``memcc.trainer``), one copy suffices. That is only correct when the old value is no longer
needed at the moment the new one is written:

- the producer of ``P.new`` is an element-wise kernel (``Add``, ``Sub``, ``Mul``, ``Div``)
  whose output has ``P``'s exact type, so each element is read before it is overwritten,
  and any operand that shares ``P``'s buffer has the output's shape (no broadcast reads);
  or a ``Split`` that does not read ``P`` (a grouped update's, ``frontend/update_groups.py``:
  it copies from the joined new value, made after the join read ``P``);
- no node after the producer (in execution order) reads ``P`` or a value that shares its
  buffer (Reshape, Identity, ... ``liveness.ALIAS_OPS``): the producer is the last reader of
  the old value, or comes after it;
- ``P`` is not itself a graph output, and no other update is written over it.

Steps built by ``memcc build`` emit every update after the whole backward pass, so each SGD,
momentum and Adam moment update qualifies. Updates that do not (a BatchNormalization running
statistic, written by the BatchNormalization kernel itself, whose reads and writes memcc has
not checked for overlap; an ``Identity`` output) are reported with the reason and keep a
buffer of their own, as before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from memcc.def_use import DefUse
from memcc.graph import Graph
from memcc.passes.analysis.liveness import ALIAS_OPS

ELEMENTWISE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})


@dataclass(frozen=True)
class InPlaceUpdates:
    """``aliased``: output -> the input whose buffer it is written into; ``refused``:
    output -> why it keeps a buffer of its own."""

    aliased: Mapping[str, str]
    refused: Mapping[str, str]


@dataclass(frozen=True)
class _StepUses:
    """Who writes and who reads each value in the order the step runs, read once per step
    for every update ``_refusal`` judges: the graph's def-use index (kept by the lowering,
    so a simulation builds none) and each node's place in ``nodes``."""

    nodes: list[onnx.NodeProto]
    position: dict[int, int]                 # id(node) -> its place in ``nodes``
    producer: Mapping[str, onnx.NodeProto]
    readers_of: Mapping[str, list[onnx.NodeProto]]
    outputs: set[str]                        # the graph's outputs
    views: Mapping[str, list[str]]           # ``alias_children(nodes)``

    @classmethod
    def of(cls, graph: Graph, nodes: list[onnx.NodeProto] | None) -> _StepUses:
        """``nodes``: the order (None: the graph's, whose index it then reuses)."""
        du = graph.def_use() if nodes is None else DefUse.build(nodes)
        nodes = graph.nodes if nodes is None else nodes
        return cls(nodes, {id(n): j for j, n in enumerate(nodes)}, du.producer, du.readers,
                   set(graph.outputs), alias_children(nodes))

    def readers(self, value: str) -> list[int]:
        """The places of the nodes that read ``value``, in order (once per input read)."""
        return sorted(self.position[id(r)] for r in self.readers_of.get(value, ()))


def analyze_in_place(graph: Graph, updates: Mapping[str, str],
                     order: Sequence[onnx.NodeProto] | None = None) -> InPlaceUpdates:
    """Decide, for each ``output -> input`` update of the step, whether it can alias."""
    uses = _StepUses.of(graph, list(order) if order is not None else None)
    aliased: dict[str, str] = {}
    refused: dict[str, str] = {}
    taken: set[str] = set()
    for out, inp in updates.items():
        why = _refusal(graph, uses, out, inp, taken)
        if why is None:
            aliased[out] = inp
            taken.add(inp)
        else:
            refused[out] = why
    return InPlaceUpdates(aliased, refused)


def _refusal(graph: Graph, uses: _StepUses, out: str, inp: str, taken: set[str]
             ) -> str | None:
    """Why ``out`` cannot be written over ``inp`` (None: it can); ``taken``: the inputs
    other updates are already written over."""
    node = uses.producer.get(out)
    if node is None:
        return "no node produces it"
    if inp in uses.outputs:
        return f"'{inp}' is itself a graph output"
    if inp in taken:
        return f"another update is already written over '{inp}'"
    split = node.op_type == "Split"
    if node.op_type not in ELEMENTWISE_OPS and not split:
        return f"its producer is {node.op_type}, not an element-wise Add/Sub/Mul/Div or a Split"
    ti_out, ti_in = graph.info.get(out), graph.info.get(inp)
    if ti_out is None or ti_out != ti_in:
        return f"its type differs from '{inp}'"
    shared = sharing_buffer(uses.views, inp)
    if split and shared & set(node.input):
        return f"its producer, a Split, reads the old value ('{inp}')"
    for operand in node.input:
        if operand in shared and graph.info.get(operand) is not None and \
                graph.info[operand].shape != ti_out.shape:
            return f"its producer reads '{operand}' (the old value) with broadcasting"
    at = uses.position[id(node)]
    for v in shared:
        later = [j for j in uses.readers(v) if j > at]
        if later:
            reader = uses.nodes[later[-1]]
            return (f"'{reader.name or reader.op_type}' reads the old value ('{v}') after "
                    f"'{node.name or node.op_type}' writes the new one")
    return None


def alias_children(nodes: Sequence[onnx.NodeProto]) -> dict[str, list[str]]:
    """Value -> the values ORT may hand out as views of its buffer, one step down (read
    once per graph: ``sharing_buffer`` walks it for every update)."""
    children: dict[str, list[str]] = {}
    for n in nodes:
        if n.op_type in ALIAS_OPS and n.input and n.input[0] and n.output:
            children.setdefault(n.input[0], []).append(n.output[0])
    return children


def sharing_buffer(nodes: Sequence[onnx.NodeProto] | Mapping[str, list[str]], inp: str
                   ) -> set[str]:
    """``inp`` and every value ORT may hand out as a view of its buffer. ``nodes``: the
    step's nodes, or their ``alias_children`` when asked for many values."""
    children = nodes if isinstance(nodes, Mapping) else alias_children(nodes)
    shared = {inp}
    stack = [inp]
    while stack:
        for c in children.get(stack.pop(), ()):
            if c not in shared:
                shared.add(c)
                stack.append(c)
    return shared
