"""Run each parameter's optimizer update as soon as it may: a node order, nothing else changes.

``memcc build`` emits every update after the whole backward pass, so all gradients are alive
at once when the updates start, and (copying the state) all new values are alive at the end:
with SGD momentum four copies of the parameters, with AdamW six. Once the updates are
written in place (``passes.analysis.inplace``), the old value of a parameter may be overwritten as
soon as its last reader has run, and its gradient may go as soon as its update has run. This
pass moves each update there: the backward pass keeps its order, and the update nodes that
produce one carried output (its *cone*: the update nodes among its ancestors) are inserted
right after the point where

- every value the cone reads from outside it has been computed (the gradient is complete),
- every reader outside the cone of an input the cone overwrites in place (the parameter,
  its optimizer state, and their views) has run.

The cone's own nodes keep their relative order, so each one computes exactly what it did:
results are bit-identical. Cones are emitted by the first position of their output in the
file; update nodes in no cone (none in built steps) stay at the end.

``ensures``: the result is a topological order of the same nodes, and every update that was
safe to write in place in the file's order is still safe in the new one (checked with
``passes.analysis.inplace``). When either fails the file's order is returned unchanged, with the
reason.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass

import onnx

from memcc.graph import Graph
from memcc.passes.analysis.inplace import alias_children, analyze_in_place, sharing_buffer
from memcc.step import Role, TrainingStep


@dataclass(frozen=True)
class UpdateSchedule:
    """The node order to run; ``moved`` says whether it differs from the file's, and
    ``reason`` why it does not when the pass gave up."""

    nodes: list[onnx.NodeProto]
    moved: bool
    reason: str = ""


def schedule_updates_early(graph: Graph, step: TrainingStep | None = None,
                           in_place: Mapping[str, str] | None = None) -> UpdateSchedule:
    """The step's nodes with each update cone placed as early as it may run (see above)."""
    step = step or TrainingStep.of(graph)
    nodes = list(graph.nodes)
    roles = step.roles
    updates = [n for n in nodes if roles.get(n.name) is Role.UPDATE]
    if not updates:
        return UpdateSchedule(nodes, False, "no update nodes")
    aliased = dict(in_place if in_place is not None
                   else analyze_in_place(graph, step.state).aliased)
    is_update = {id(n) for n in updates}
    producer = {o: n for n in nodes for o in n.output if o}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in nodes:
        for i in n.input:
            if i:
                readers.setdefault(i, []).append(n)

    cones: list[list[onnx.NodeProto]] = []
    for out in step.state:
        p = producer.get(out)
        if p is None or id(p) not in is_update:
            continue
        cone: dict[int, onnx.NodeProto] = {}
        stack = [p]
        while stack:
            n = stack.pop()
            if id(n) in cone:
                continue
            cone[id(n)] = n
            stack.extend(producer[i] for i in n.input
                         if i in producer and id(producer[i]) in is_update)
        cones.append(_late_leaves([n for n in updates if id(n) in cone]))

    views = alias_children(nodes)

    def waits_for(cone: list[onnx.NodeProto]) -> set[int]:
        """Nodes outside the cone that must run before it."""
        inside = {id(n) for n in cone}
        need: set[int] = set()
        for n in cone:
            for i in n.input:
                src = producer.get(i)
                if src is not None and id(src) not in inside:
                    need.add(id(src))
            for o in n.output:
                if o in aliased:
                    for v in sharing_buffer(views, aliased[o]):
                        need.update(id(r) for r in readers.get(v, ()) if id(r) not in inside)
        return need

    order = _ConeOrder(cones, [waits_for(c) for c in cones]).run(nodes, is_update)
    return _ensure(graph, step, nodes, order, aliased)


class _ConeOrder:
    """The file's order with each cone placed as soon as every node it waits for is: a
    count of what each cone still waits for, and who waits for each node, so that placing
    a node touches only its waiters (a scan of every cone after every node took 35 s on
    timm's Sequencer2d-S, a 31,777-node step with 1,500 parameters' cones). Ready cones run
    in index order, in passes as a scan in index order makes them: a cone made ready by a
    later one runs in the next pass."""

    def __init__(self, cones: list[list[onnx.NodeProto]], needs: list[set[int]]) -> None:
        self.cones = cones
        self.left = [len(need) for need in needs]
        self.waiters: dict[int, list[int]] = {}
        for k, need in enumerate(needs):
            for x in need:
                self.waiters.setdefault(x, []).append(k)
        self.ready = [k for k, n in enumerate(self.left) if n == 0]
        self.done = [False] * len(cones)
        self.order: list[onnx.NodeProto] = []
        self.placed: set[int] = set()

    def run(self, nodes: list[onnx.NodeProto], is_update: set[int]) -> list[onnx.NodeProto]:
        self._emit_ready()
        for n in nodes:
            if id(n) in is_update:
                continue
            self._place(n, self.ready)
            self._emit_ready()
        # cones that never became ready
        return self.order + [n for n in nodes if id(n) not in self.placed]

    def _place(self, n: onnx.NodeProto, newly: list[int]) -> None:
        self.order.append(n)
        self.placed.add(id(n))
        for k in self.waiters.get(id(n), ()):
            self.left[k] -= 1
            if self.left[k] == 0:
                newly.append(k)

    def _emit_ready(self) -> None:
        while self.ready:
            heap = sorted(set(self.ready))
            self.ready = []
            while heap:
                k = heapq.heappop(heap)
                if self.done[k]:
                    continue
                self.done[k] = True
                newly: list[int] = []
                for n in self.cones[k]:
                    if id(n) not in self.placed:
                        self._place(n, newly)
                for j in newly:
                    if j > k:
                        heapq.heappush(heap, j)
                    else:
                        self.ready.append(j)


def _late_leaves(cone: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The cone in file order, except that a node reading nothing the cone computes (AdamW's
    ``(1 - lr * wd) * P``, momentum's ``0.9 * buf``) runs just before its first reader in
    the cone: its output, as large as the parameter, is not held while the rest is computed.
    Constants count as read from outside (ORT makes them initializers). Every node still
    reads the same values, so the results are the same bits."""
    made = {o for n in cone if n.op_type != "Constant" for o in n.output if o}
    leaves = {id(n) for n in cone if not any(i in made for i in n.input if i)}
    producer = {o: n for n in cone for o in n.output if o}
    order: list[onnx.NodeProto] = []
    done: set[int] = set()

    def place(n: onnx.NodeProto) -> None:  # n after the deferred leaves it reads
        for i in n.input:
            src = producer.get(i)
            if src is not None and id(src) in leaves and id(src) not in done:
                done.add(id(src))
                place(src)
        order.append(n)
        done.add(id(n))

    for n in cone:
        if id(n) not in leaves:
            place(n)
    for n in cone:
        if id(n) not in done:
            place(n)
    return order


def _ensure(graph: Graph, step: TrainingStep, nodes: list[onnx.NodeProto],
            order: list[onnx.NodeProto], aliased: Mapping[str, str]) -> UpdateSchedule:
    if [id(n) for n in order] == [id(n) for n in nodes]:
        return UpdateSchedule(nodes, False, "every update already runs as early as it may")
    if len(order) != len(nodes) or {id(n) for n in order} != {id(n) for n in nodes}:
        return UpdateSchedule(nodes, False, "internal: the new order lost or doubled nodes")
    available = set(graph.inputs) | set(graph.initializers)
    for n in order:
        missing = [i for i in n.input if i and i not in available]
        if missing:
            return UpdateSchedule(nodes, False, f"'{n.name}' would read '{missing[0]}' before "
                                                "it is computed")
        available.update(o for o in n.output if o)
    still = analyze_in_place(graph, step.state, order).aliased
    lost = sorted(set(aliased) - set(still))
    if lost:
        return UpdateSchedule(nodes, False, f"'{lost[0]}' could no longer be written in place")
    return UpdateSchedule(order, True)
