"""The def-use index every pass that edits a graph keeps: each value's producer and readers.

Apart from ``graph`` (which builds it, ``Graph.def_use``, and hands it on through
``Graph.copy`` and ``Graph.set_nodes``) because it is a structure of its own, with edit
methods a pass calls instead of editing nodes behind it.
"""

from __future__ import annotations

import onnx


class DefUse:
    """Def-use index of a node list: each value's producer and its readers, in node order.

    Built once per graph (``Graph.def_use``) instead of one ad-hoc map per pass. A pass that
    edits the graph keeps it correct with ``add`` / ``remove`` / ``rewire`` and hands it on
    with ``Graph.set_nodes``; ``check`` rebuilds it from scratch and compares, which is what
    the lowering's ``ensures`` checks and the tests use. Nodes are keyed by ``id()``:
    ``NodeProto`` is not hashable, and the index never outlives the nodes it holds.
    """

    __slots__ = ("producer", "readers", "_nodes", "_size")

    def __init__(self) -> None:
        self.producer: dict[str, onnx.NodeProto] = {}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        self._nodes: list[onnx.NodeProto] | None = None
        self._size = 0

    @classmethod
    def build(cls, nodes: list[onnx.NodeProto]) -> DefUse:
        du = cls()
        producer, readers = du.producer, du.readers
        for n in nodes:
            for o in n.output:
                if o:
                    producer[o] = n
            for i in n.input:
                if i:
                    r = readers.get(i)
                    if r is None:
                        readers[i] = [n]
                    else:
                        r.append(n)
        du._nodes, du._size = nodes, len(nodes)
        return du

    def tracks(self, nodes: list[onnx.NodeProto]) -> bool:
        """Cheap guard: same list object, same length (in-place edits go through us)."""
        return self._nodes is nodes and self._size == len(nodes)

    def attach(self, nodes: list[onnx.NodeProto]) -> DefUse:
        """Declare ``nodes`` (a reordering of what was indexed, after our edits) as ours."""
        self._nodes, self._size = nodes, len(nodes)
        return self

    def reader_count(self, value: str) -> int:
        return len(self.readers.get(value, ()))

    def add(self, node: onnx.NodeProto) -> None:
        """Index a node the caller is about to insert (it places it in the list itself)."""
        for o in node.output:
            if o:
                self.producer[o] = node
        for i in node.input:
            if i:
                self.readers.setdefault(i, []).append(node)
        self._size += 1

    def remove(self, node: onnx.NodeProto) -> None:
        """Forget a node the caller removes from the list."""
        for o in node.output:
            if o and self.producer.get(o) is node:
                del self.producer[o]
        for i in node.input:
            if i:
                self._drop_reader(i, node)
        self._size -= 1

    def rewire(self, node: onnx.NodeProto, k: int, value: str) -> None:
        """Make input ``k`` of ``node`` read ``value`` instead, index included."""
        old = node.input[k]
        if old == value:
            return
        if old:
            self._drop_reader(old, node)
        node.input[k] = value
        if value:
            self.readers.setdefault(value, []).append(node)

    def drop_output(self, node: onnx.NodeProto, k: int) -> None:
        """Blank output ``k`` of ``node`` (an optional output nobody reads)."""
        o = node.output[k]
        if o and self.producer.get(o) is node:
            del self.producer[o]
        node.output[k] = ""

    def _drop_reader(self, value: str, node: onnx.NodeProto) -> None:
        r = self.readers.get(value)
        if not r:
            return
        for j, x in enumerate(r):
            if x is node:
                del r[j]
                break
        if not r:
            del self.readers[value]

    def remapped(self, old: list[onnx.NodeProto], new: list[onnx.NodeProto]) -> DefUse:
        """The same index over ``new``, a node-for-node copy of ``old`` (``Graph.copy``), or
        the same nodes (then a copy of the index, to edit apart)."""
        to_new = {id(a): b for a, b in zip(old, new, strict=True)}
        du = DefUse()
        du.producer = {v: to_new[id(n)] for v, n in self.producer.items()}
        du.readers = {v: [to_new[id(n)] for n in r] for v, r in self.readers.items()}
        du._nodes, du._size = new, len(new)
        return du

    def own(self, nodes: list[onnx.NodeProto], k: int) -> onnx.NodeProto:
        """``nodes[k]`` replaced, in the list and here, by a copy of its own to edit (a
        graph that shares its nodes, ``Graph.copy(share_nodes=True)``)."""
        old = nodes[k]
        nodes[k] = new = onnx.NodeProto()
        new.CopyFrom(old)
        for o in old.output:
            if o and self.producer.get(o) is old:
                self.producer[o] = new
        for i in dict.fromkeys(old.input):
            r = self.readers.get(i) if i else None
            for j, x in enumerate(r or ()):
                if x is old:
                    r[j] = new
        return new

    def check(self, nodes: list[onnx.NodeProto]) -> list[str]:
        """Differences between this index and one rebuilt from ``nodes`` (empty: correct)."""
        fresh = DefUse.build(nodes)
        problems: list[str] = []
        for v in set(fresh.producer) | set(self.producer):
            if fresh.producer.get(v) is not self.producer.get(v):
                problems.append(f"producer of '{v}' is stale")
        for v in set(fresh.readers) | set(self.readers):
            a = sorted(id(n) for n in fresh.readers.get(v, ()))
            b = sorted(id(n) for n in self.readers.get(v, ()))
            if a != b:
                problems.append(f"readers of '{v}' are stale")
        if not self.tracks(nodes):
            problems.append("the index was built for another node list")
        return sorted(problems)
