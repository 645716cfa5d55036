"""Lower a ``Plan`` to ONNX: clone the recomputed forward nodes into the backward pass.

Semantics (the simulator and every strategy rely on exactly this):
- Walk the step in its order. Forward nodes stay as they are.
- Before a non-forward node runs, every forward value it reads whose producer the plan marks
  RECOMPUTE is made available by cloning its producer right there; the clone's own forward
  inputs are resolved the same way (recursively), so a recomputed chain reaches back to
  values that are kept (or to inputs and parameters).
- A value is recomputed at most once: later readers use the first clone, which liveness
  then keeps until its last reader. The original forward value is freed after its last
  forward reader, which is where the saving comes from.
- Except for the nodes in ``plan.recompute_again``: a clone of theirs made only to rebuild
  another value (inside a chain) is read by that chain alone, so it dies there; a later
  reader rebuilds it, from the nearest kept value. Such values are recomputed once per
  chain that passes through them.
Clones repeat the same kernels on the same inputs, so the rewritten step computes the same
numbers bit for bit. Optional outputs that nobody reads are dropped from clones (ORT never
frees an unconsumed output, ORT_NOTES.md §3); a Split clone that needs only some pieces
becomes one Slice per piece (a Split must write them all).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.def_use import DefUse
from memcc.graph import Graph, TensorInfo, attr, unique_namer
from memcc.passes.plan import Plan, StepStructure

RECOMPUTE_SUFFIX = ".rc"


@dataclass(frozen=True)
class RecomputeResult:
    graph: Graph
    cloned_nodes: tuple[str, ...]      # names of forward nodes that were re-executed
    recomputed_values: tuple[str, ...]  # forward values whose backward readers use a clone
    # forward node -> the non-forward node whose input made it re-run (it runs just before)
    rerun_before: dict[str, str] = field(default_factory=dict)


def apply_recompute(graph: Graph, plan: Plan, structure: StepStructure | None = None
                    ) -> RecomputeResult:
    """Return a new graph realising ``plan``; ``graph`` is left untouched.

    The new graph holds ``graph``'s nodes where it keeps them as they are
    (``Graph.copy(share_nodes=True)``): a node it edits (a backward reader given a clone,
    a forward node losing an unread output) is a copy of its own (``DefUse.own``). The
    copy's def-use index (carried over from ``graph`` when it has one) is kept correct
    through every edit and handed on with the result, so the passes after this one and
    liveness do not rebuild it.
    """
    st = structure or StepStructure.of(graph)
    recompute = plan.recompute & st.recomputable
    out = graph.copy(with_index=bool(recompute), share_nodes=bool(recompute))
    if not recompute:
        return RecomputeResult(out, (), ())
    cloner = _Cloner(out, recompute, plan.recompute_again & recompute)
    du = cloner.du
    # Values a recomputed node produces, or clones made: the only inputs ``resolve`` can
    # give another name (the rest are read as they are, without asking: this loop sees
    # every input of the backward pass, for every plan judged).
    rebuilt = {v for v, n in du.producer.items() if n.name in recompute}
    clone_of = cloner.clone_of
    new_nodes: list[onnx.NodeProto] = []
    forward = st.forward
    for at, node in enumerate(out.nodes):
        if node.name in forward:
            new_nodes.append(node)
            continue
        emitted: list[onnx.NodeProto] = []
        ours = False
        for k, i in enumerate(node.input):
            if i in rebuilt or i in clone_of:
                r = cloner.resolve(i, emitted, node.name)
                if r != i:
                    if not ours:   # shared with ``graph``: edited in a copy of its own
                        node, ours = du.own(out.nodes, at), True
                    du.rewire(node, k, r)
        new_nodes.extend(emitted)
        new_nodes.append(node)
    new_nodes = _drop_dead_forward_outputs(new_nodes, st, set(out.outputs), du)
    out.set_nodes(new_nodes, du.attach(new_nodes))
    recomputed = tuple(sorted(v for v in cloner.ever_cloned if v in st.saved))
    return RecomputeResult(out, tuple(dict.fromkeys(cloner.cloned)), recomputed,
                           cloner.rerun_before)


class _Cloner:
    """The clones made so far while ``apply_recompute`` walks the copy ``out``: each
    forward value's current clone (``clone_of``), every node cloned, which non-forward node
    each clone runs before, and the def-use index kept up to date with every clone."""

    def __init__(self, out: Graph, recompute: frozenset[str] | set[str],
                 again: frozenset[str] | set[str]) -> None:
        self.out = out
        self.recompute = recompute
        self.again = again
        self.du: DefUse = out.def_use()
        self.producers = self.du.producer
        # Every value name (``Graph.values``: the index's produced values are the nodes'
        # outputs) and node name is taken.
        self.fresh = unique_namer([*out.inputs, *out.initializers, *self.producers,
                                   *(n.name for n in out.nodes)])
        self.clone_of: dict[str, str] = {}   # forward value -> its recomputed name
        self.cloned: list[str] = []
        # Outputs read by any node of the input step; unread optional outputs are dropped
        # from clones. (Taken before any edit: the clones must not depend on the order of
        # edits.)
        self.read_before = {v for v, r in self.du.readers.items() if r}
        self.rerun_before: dict[str, str] = {}
        self.ever_cloned: set[str] = set()

    def needs_clone(self, value: str) -> onnx.NodeProto | None:
        if not value or value in self.clone_of:
            return None
        node = self.producers.get(value)
        return node if node is not None and node.name in self.recompute else None

    def resolve(self, value: str, emitted: list[onnx.NodeProto], reader: str) -> str:
        """The name ``reader`` reads for ``value``: its clone, made now (inputs first, in
        input order) if it has none yet. Iterative, because a chain can run through a whole
        forward pass (ResNet-152's is deeper than Python's recursion limit)."""
        if value in self.clone_of:
            return self.clone_of[value]
        first = self.needs_clone(value)
        if first is None:
            return value
        stack: list[tuple[onnx.NodeProto, int]] = [(first, 0)]
        private: list[str] = []   # clones only this chain may read (plan.recompute_again)
        while stack:
            node, k = stack[-1]
            child = None
            while k < len(node.input) and child is None:
                child = self.needs_clone(node.input[k])
                k += 1
            if child is not None:
                stack[-1] = (node, k)
                stack.append((child, 0))
                continue
            stack.pop()
            self.emit(node, emitted, reader)
            if stack and node.name in self.again:
                private.extend(o for o in node.output if o in self.clone_of)
        result = self.clone_of[value]
        for o in private:
            del self.clone_of[o]
        return result

    def emit(self, node: onnx.NodeProto, emitted: list[onnx.NodeProto], reader: str) -> None:
        """Clone ``node`` (reading the current clones of its inputs) into ``emitted``."""
        inputs = [self.clone_of.get(i, i) if i else "" for i in node.input]
        self.rerun_before[node.name] = reader
        needed = [bool(o) and o in self.read_before for o in node.output]
        if node.op_type == "Split" and not all(needed):
            self._emit_split_as_slices(node, inputs[0], needed, emitted)
            return
        if node.op_type == "BatchNormalization" and attr(node, "training_mode", 0) \
                and len(inputs) >= 5:
            inputs[3:5] = [self._own_copy(v, emitted) for v in inputs[3:5]]
        clone = onnx.NodeProto()
        clone.CopyFrom(node)
        clone.name = self.fresh(node.name + RECOMPUTE_SUFFIX)
        del clone.input[:]
        clone.input.extend(inputs)
        outs = []
        keep_all = _outputs_required(node)
        for k, o in enumerate(node.output):
            if o and (needed[k] or keep_all or not optional_output(node, k)):
                name = self.fresh(o + RECOMPUTE_SUFFIX)
                self.clone_of[o] = name
                self.ever_cloned.add(o)
                self.out.info[name] = self.out.info[o]
                outs.append(name)
            else:
                outs.append("")
        while outs and not outs[-1]:
            outs.pop()
        del clone.output[:]
        clone.output.extend(outs)
        self.du.add(clone)
        emitted.append(clone)
        self.cloned.append(node.name)

    def _own_copy(self, value: str, emitted: list[onnx.NodeProto]) -> str:
        """``value`` times one, in a buffer of its own, for a training-mode BatchNorm's
        clone to read as running statistics: ORT's CPU kernel writes into that input's
        buffer where a second training BatchNorm reads it (an Identity is aliased, so it
        does not help), which changed the state fed to the step (tests/test_ort_facts.py;
        a SegFormer plan gave other running statistics on its second run). Its running
        outputs are dead; x * 1 is x, bit for bit."""
        info = self.out.info[value]
        one = self.fresh(f"{value}{RECOMPUTE_SUFFIX}.one")
        self.out.initializers[one] = np.ones((), info.np_dtype)
        self.out.info[one] = TensorInfo(info.dtype, ())
        name = self.fresh(f"{value}{RECOMPUTE_SUFFIX}.copy")
        self.out.info[name] = info
        copy = onnx.helper.make_node("Mul", [value, one], [name],
                                     name=self.fresh(f"{value}{RECOMPUTE_SUFFIX}.copy"))
        self.du.add(copy)
        emitted.append(copy)
        return name

    def _emit_split_as_slices(self, node: onnx.NodeProto, x: str, needed: list[bool],
                              emitted: list[onnx.NodeProto]) -> None:
        """A Split whose clone needs only some pieces, as one Slice per piece (the same
        bits: a copy either way). A Split must write all its pieces (their count is the
        split's), and ORT never frees a piece nobody reads, so the clone of a Split with
        unread pieces (mixnet's mixed depthwise kernels, as the dynamo exporter writes
        them) was invalid ONNX with them dropped and a leak with them kept."""
        info = self.out.info
        rank = len(info[x].shape)
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % rank
        start = 0
        for k, o in enumerate(node.output):
            size = info[o].shape[axis]
            if needed[k]:
                bounds = []
                for what, v in (("starts", start), ("ends", start + size), ("axes", axis)):
                    c = self.fresh(f"{o}{RECOMPUTE_SUFFIX}.{what}")
                    self.out.initializers[c] = np.asarray([v], np.int64)
                    info[c] = TensorInfo(onnx.TensorProto.INT64, (1,))
                    bounds.append(c)
                name = self.fresh(o + RECOMPUTE_SUFFIX)
                self.clone_of[o] = name
                self.ever_cloned.add(o)
                info[name] = info[o]
                clone = onnx.helper.make_node(
                    "Slice", [x, *bounds], [name],
                    name=self.fresh(node.name + RECOMPUTE_SUFFIX))
                clone.metadata_props.extend(node.metadata_props)
                self.du.add(clone)
                emitted.append(clone)
            start += size
        self.cloned.append(node.name)


def _drop_dead_forward_outputs(nodes: list[onnx.NodeProto], st: StepStructure,
                               graph_outputs: set[str], du: DefUse) -> list[onnx.NodeProto]:
    """Forward outputs that only the backward read, and now nobody reads, must go.

    ORT never frees an output that no node consumes, so leaving one behind would pin it for
    the whole step: drop unread optional outputs, and whole forward nodes nobody reads.
    Removing a node can leave its inputs unread, so this repeats to a fixed point (which is
    the same whatever the order of removals).
    """

    def read(v: str) -> bool:
        return v in graph_outputs or du.reader_count(v) > 0

    forward = st.forward
    work = [n for n in reversed(nodes) if n.name in forward]   # popped in graph order
    waiting = {id(n) for n in work}
    removed: set[int] = set()
    at: dict[int, int] = {}   # a node's place in ``nodes``, once one is edited
    mine: set[int] = set()    # the nodes edited: copies of their own

    def own(n: onnx.NodeProto) -> onnx.NodeProto:
        """``n`` to edit: a copy of its own (``nodes`` share those of the step planned)."""
        if id(n) in mine:
            return n
        if not at:
            at.update((id(m), k) for k, m in enumerate(nodes))
        k = at[id(n)]
        n = du.own(nodes, k)
        at[id(n)] = k
        mine.add(id(n))
        return n

    while work:        # a worklist, not passes over the step until nothing changes
        n = work.pop()
        waiting.discard(id(n))
        names = tuple(n.output)  # read once; output k is blanked at step k only
        outs = [o for o in names if o]
        if outs and not any(read(o) for o in outs) and n.op_type not in _SIDE_EFFECTS:
            du.remove(n)
            removed.add(id(n))
            for i in n.input:     # their producers may have lost their last reader
                p = du.producer.get(i) if i else None
                if p is not None and p.name in forward and id(p) not in waiting:
                    work.append(p)
                    waiting.add(id(p))
            continue
        for k in range(len(names) - 1, 0, -1):
            o = names[k]
            if o and not read(o) and optional_output(n, k) and not _outputs_required(n):
                n = own(n)
                du.drop_output(n, k)
        if len(n.output) > 1 and not n.output[-1]:
            n = own(n)
            while len(n.output) > 1 and not n.output[-1]:
                n.output.pop()
    return [n for n in nodes if id(n) not in removed]


_SIDE_EFFECTS = frozenset()


def _outputs_required(node: onnx.NodeProto) -> bool:
    """ORT refuses BatchNormalization in training mode without its three outputs (the
    running statistics are tiny; the clone's copies are simply never read)."""
    if node.op_type != "BatchNormalization":
        return False
    return any(a.name == "training_mode" and a.i for a in node.attribute)


def optional_output(node: onnx.NodeProto, k: int) -> bool:
    """Whether output ``k`` of ``node`` is optional in its op's schema (ORT accepts the node
    without it)."""
    return _optional_output(node.op_type, node.domain or "", k)


@functools.cache
def _optional_output(op_type: str, domain: str, k: int) -> bool:
    """``optional_output`` by op, looked up once (the lowering asks for every plan)."""
    try:
        schema = onnx.defs.get_schema(op_type, domain=domain)
    except Exception:
        return False
    outs = schema.outputs
    if k >= len(outs):
        return False
    return outs[k].option == onnx.defs.OpSchema.FormalParameterOption.Optional
