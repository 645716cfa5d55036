"""The nodes of a step in the order an analysis walks them, read out of the protobuf once.

Liveness walks every node's op, inputs and outputs several times (how often each value is
read, whether the order is valid, the buffers), for every plan a search judges; each walk
of a ``NodeProto``'s repeated fields makes new strings. A ``NodeTable`` holds them as plain
lists and tuples. Enters: a graph and an order (node names or nodes; default the graph's).
Leaves: the table, or a ``ValueError`` for an order that is not one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from memcc.graph import Graph

# A node with its op, inputs and outputs, as read once.
Row = tuple[onnx.NodeProto, str, tuple[str, ...], tuple[str, ...]]


def rows_of(graph: Graph) -> dict[int, Row]:
    """The rows of ``graph``'s nodes by id, read once and kept on it while its node list is
    the one read (the list object and its length, as ``DefUse.tracks``). For the step a
    search plans, whose nodes every lowered plan shares (``Graph.copy(share_nodes=True)``)
    and no pass edits in place: each simulation read all of them again."""
    kept = graph._rows
    if isinstance(kept, tuple) and kept[0] is graph.nodes and kept[1] == len(graph.nodes):
        return kept[2]
    rows = {id(n): (n, n.op_type, tuple(n.input), tuple(n.output)) for n in graph.nodes}
    graph._rows = (graph.nodes, len(graph.nodes), rows)
    return rows


@dataclass(frozen=True)
class NodeTable:
    """``nodes`` in order with each one's op, inputs and outputs."""

    nodes: list[onnx.NodeProto]
    ops: list[str]
    ins: list[tuple[str, ...]]
    outs: list[tuple[str, ...]]

    @classmethod
    def of(cls, nodes: list[onnx.NodeProto], known: Mapping[int, Row] | None = None
           ) -> NodeTable:
        """``known``: rows read before, by node id (``rows_of``): a node whose row is there
        is not read again (the row holds the node, so an id is never another node's)."""
        if not known:
            return cls(nodes, [n.op_type for n in nodes], [tuple(n.input) for n in nodes],
                       [tuple(n.output) for n in nodes])
        ops: list[str] = []
        ins: list[tuple[str, ...]] = []
        outs: list[tuple[str, ...]] = []
        for n in nodes:
            r = known.get(id(n))
            if r is None or r[0] is not n:
                r = (n, n.op_type, tuple(n.input), tuple(n.output))
            ops.append(r[1])
            ins.append(r[2])
            outs.append(r[3])
        return cls(nodes, ops, ins, outs)

    def check(self, graph: Graph) -> None:
        """Refuse an order that runs a node before one of its inputs exists."""
        available = set(graph.inputs) | set(graph.initializers) | {""}
        for j, ins in enumerate(self.ins):
            for i in ins:
                if i not in available:
                    raise ValueError(
                        f"order runs node '{self.nodes[j].name}' before its input '{i}' exists")
            available.update(self.outs[j])


def resolve_order(graph: Graph, order: Sequence[str | onnx.NodeProto] | None
                  ) -> list[onnx.NodeProto]:
    """The nodes in ``order`` (default: graph order); ``NodeTable.check`` checks them."""
    if order is None:
        return list(graph.nodes)
    by_name = {n.name: n for n in graph.nodes}
    nodes = []
    for item in order:
        if isinstance(item, onnx.NodeProto):
            nodes.append(item)
        elif item in by_name:
            nodes.append(by_name[item])
        else:
            raise ValueError(f"order names node '{item}', which the graph does not have")
    if len(nodes) != len(graph.nodes):
        raise ValueError(f"order has {len(nodes)} nodes, the graph {len(graph.nodes)}")
    return nodes
