"""Term generator for the variant decision: which gradient rule each forward node uses.

For every forward node with applicable variants (``passes/lowering/variant_substitution.py``) there
is one
binary per variant and a choice group over them (none set = the default rule). A variant's
effect on memory is read off the variant's own nodes, emitted once here without touching
the step, against the default rule's nodes in the baseline schedule:

- saved values: per buffer either rule reads, its death moves to its last reader outside
  the default rule, or to the rule's end when the variant reads it (``-bytes`` or ``+bytes``
  over the difference); a value the variant reads late can no longer be overwritten in
  place by a later value (Tanh over its input), which then needs a buffer of its own; a
  value the variant adds to the forward pass (a mask) is live from the forward node to the
  end of the rule; what the default's nodes placed before its span hold (MaxPool's index
  Cast) is freed up to the span, since every variant removes them, and an optional output
  the forward node no longer produces (MaxPool's Indices) from its birth;
- working set: over the rule's span ``[a, b]`` in the schedule, memory becomes what the
  default rule's own values do not hold, plus the variant's peak working set (its values
  walked in its own order with the liveness analysis's aliases and in-place writes,
  results held to the end); rule inputs the default frees inside
  the span are held to its end. So the model is exact at the default's peak point inside the
  span and never understates elsewhere.

Cost: the variant's nodes priced by ``CostModel.price`` (calibrated analytic estimates for
nodes never measured) less the default nodes the substitution removes.

Interactions kept exact by rows: a variant excludes recomputing the node itself and the
producers and readers of values whose lifetime it changes (the recompute terms assume the
default's readers: a recomputed reader would hold such a value past the death the variant
term assumes), and offloading any value either rule reads.

Joint freeing: a saved buffer that the default rules of two nodes read (a block output
read by its Relu's backward and by the next convolution's weight gradient) dies early only
when both nodes use a variant that stops reading it. Each variant alone moves nothing before
the other rule's last read, so each such buffer gets one more binary, ``y <= (the variants
of the first node that drop it)`` and ``y <= (those of the second)``, that frees the buffer
from its last read outside the two rules to the earlier of their last reads (the later
part is the single variant's own term). Buffers read by three or more rules are left out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.gradients.variants import LOSSY, Variant
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import LivenessReport
from memcc.passes.lowering.variant_substitution import (
    NodeOrder,
    Replaced,
    applicable_variants,
    replaced_rule,
    rule_nodes,
)
from memcc.passes.plan import StepStructure
from memcc.passes.planning.model.offload_terms import OffloadVars
from memcc.passes.planning.model.problem import ProblemBuilder
from memcc.passes.planning.model.recompute_terms import RecomputeUnits
from memcc.passes.planning.model.variant_rule import (
    Emitted,
    Span,
    default_span,
    emit,
    external_reads,
    forward_reads,
    peak_working_set,
)
from memcc.step import rule_io

KIND = "variant"


@dataclass(frozen=True)
class VariantVars:
    """Decision variable -> (forward node, variant name), and what each variant is."""

    choice_of: dict[int, tuple[str, str]] = field(default_factory=dict)
    variant_of: dict[int, Variant] = field(default_factory=dict)


@dataclass(frozen=True)
class VariantScope:
    """What the variant terms are built against: the recompute units (a variant excludes
    recomputing what it changes), the offload variables (None: no swaps; a variant excludes
    offloading what either rule reads), and whether lossy-tier variants are offered."""

    units: RecomputeUnits
    swaps: OffloadVars | None = None
    allow_lossy: bool = False



@dataclass
class _Candidate:
    """One variant of one node before it becomes a variable: its cost, memory terms and the
    recompute units / offloads it excludes."""

    variant: Variant
    cost: float
    terms: list[tuple[float, int, int]] = field(default_factory=list)
    units: list[int] = field(default_factory=list)
    offloads: list[str] = field(default_factory=list)
    drops: set[str] = field(default_factory=set)   # saved buffers it stops reading
    members: tuple[str, ...] = ()                   # the nodes whose rules it replaces

    def term(self, nbytes: float, start: int, end: int) -> None:
        if nbytes and start <= end:
            self.terms.append((nbytes, start, end))

    def delta(self, lo: int, hi: int) -> np.ndarray:
        """Bytes this variant adds (negative: frees) at each point of ``[lo, hi]``."""
        diff = np.zeros(hi - lo + 2)
        for nbytes, t0, t1 in self.terms:
            diff[t0 - lo] += nbytes
            diff[t1 - lo + 1] -= nbytes
        return np.cumsum(diff[:-1])


def _useful(found: list[_Candidate]) -> list[_Candidate]:
    """The candidates worth a variable: each frees memory somewhere, and none is dominated
    (another frees at least as much at every point for no more time). Fewer binaries keep
    the MILP as fast as recompute alone where variants cannot help (late ResNet layers,
    where a chunked weight gradient only adds weight-sized buffers)."""
    if not found:
        return []
    lo = min((t0 for c in found for _, t0, _ in c.terms), default=0)
    hi = max((t1 for c in found for _, _, t1 in c.terms), default=0)
    deltas = [c.delta(lo, hi) for c in found]
    keep = []
    for i, c in enumerate(found):
        if c.drops:  # may free a buffer together with another node's variant
            keep.append(c)
            continue
        if not c.terms or deltas[i].min() >= 0:
            continue  # never lowers memory anywhere
        dominated = any(
            j != i and found[j].cost <= c.cost and np.all(deltas[j] <= deltas[i])
            and (found[j].cost < c.cost or np.any(deltas[j] < deltas[i]) or j < i)
            for j in range(len(found)) if found[j].terms and deltas[j].min() < 0)
        if not dominated:
            keep.append(c)
    return keep




class _StepView:
    """The step as the variant terms read it, indexed once per model: positions (by node
    identity), def-use, lifetimes, the default rules, the other kinds' variables (recompute
    units, offloads) and the values sharing each buffer."""

    def __init__(self, graph: Graph, st: StepStructure, live: LivenessReport,
                 costs: CostModel, scope: VariantScope) -> None:
        self.graph, self.st, self.live, self.costs = graph, st, live, costs
        self.nodes = graph.nodes
        self.du = graph.def_use()
        self.pos = {id(n): i for i, n in enumerate(self.nodes)}
        # Each region variant's match looks its nodes up by name: not a scan of the step
        # per candidate (3.7 s of a 30,905-node step's compile).
        self.order = NodeOrder({n.name: n for n in self.nodes}, self.pos)
        self.values = live.values
        self.outputs = set(graph.outputs)
        self.rules = rule_nodes(graph)
        self.unit_vars: dict[int, list[int]] = defaultdict(list)
        for var, u in scope.units.var_unit.items():
            self.unit_vars[u].append(var)
        self.unit_of_node = {name: u for u, g in enumerate(scope.units.groups) for name in g}
        swaps = scope.swaps
        self.offload_var = {v: var for var, v in (swaps.value_of.items() if swaps else ())}
        self.members: dict[str, list[str]] = defaultdict(list)
        for name, vl in self.values.items():
            self.members[vl.buffer].append(name)

    def forward_value(self, v: str) -> bool:
        """Whether ``v`` is made by the forward pass (not a Constant)."""
        p = self.du.producer.get(v)
        return p is not None and p.name in self.st.forward and p.op_type != "Constant"

    def buffer_of(self, v: str):
        """The buffer holding ``v`` (itself, or the one it aliases / was written into)
        when that buffer is freed during the step."""
        vl = self.values.get(v)
        if vl is None:
            return None
        bl = self.values.get(vl.buffer)
        if bl is None or bl.death is None or any(m in self.outputs
                                                 for m in self.members[vl.buffer]):
            return None
        return bl

    def later_readers(self, names, skip: set[int]) -> list[int]:
        """Positions of the readers of ``names`` that are not among the nodes ``skip``
        (identities)."""
        return [self.pos[id(r)] for m in names for r in self.du.readers.get(m, ())
                if id(r) not in skip]


def add_variant_terms(builder: ProblemBuilder, graph: Graph, st: StepStructure,
                      live: LivenessReport, costs: CostModel,
                      scope: VariantScope) -> VariantVars:
    """The variant decision's variables, rows and terms (module docstring): per forward
    node, its useful variants as one choice group; then the rows that keep a variant
    covering several nodes' rules apart from their own variants, and the joint freeing."""
    view = _StepView(graph, st, live, costs, scope)
    out = VariantVars()
    # buffer -> [(rule node, last read of the buffer inside the rule, variables dropping it)]
    rule_reads: dict[str, list[tuple[str, int, list[int]]]] = defaultdict(list)
    groups: dict[str, list[int]] = {}
    covering: list[tuple[int, tuple[str, ...]]] = []
    producers = graph.producers()
    for node in view.nodes:
        if node.name not in st.forward or node.name not in view.rules:
            continue
        candidates = [v for v in applicable_variants(graph, node, view.rules, producers)
                      if scope.allow_lossy or v.tier != LOSSY]
        if not candidates:
            continue
        found = _node_candidates(view, node, candidates)
        group, dropping = _add_choices(builder, view, node, _useful(found), out, covering)
        builder.choice(group)
        groups[node.name] = group
        _note_rule_reads(view, node, dropping, rule_reads)
    # A variant that replaces several nodes' rules excludes those nodes' own variants.
    for var, names in covering:
        for m in names:
            for other in groups.get(m, ()):
                if other != var:
                    builder.row({var: 1.0, other: 1.0}, 1.0)
    _add_joint_freeing(builder, view, rule_reads)
    return out


def _node_candidates(view: _StepView, node: onnx.NodeProto,
                     variants: list[Variant]) -> list[_Candidate]:
    """Each of ``variants`` that can be emitted for ``node``, with its terms."""
    spans: dict[tuple[str, ...], Span | None] = {}
    found: list[_Candidate] = []
    for variant in variants:
        got = replaced_rule(view.graph, node, variant, view.rules, view.order)
        if isinstance(got, str):
            continue
        if got.members not in spans:
            spans[got.members] = default_span(view.graph, got, view.pos, view.live,
                                              view.costs, view.forward_value)
        span = spans[got.members]
        em = emit(view.graph, node, variant, got) if span is not None else None
        if span is None or em is None:
            continue
        found.append(_candidate(view, node, variant, got, span, em))
    return found


def _candidate(view: _StepView, node: onnx.NodeProto, variant: Variant, got: Replaced,
               span: Span, em: Emitted) -> _Candidate:
    """One variant of ``node``: its added time, its memory terms against the default
    rules' ``span``, and what it excludes."""
    graph, nodes = view.graph, view.nodes
    b, grads = span.b, span.grads
    reads_default = span.reads_default
    made_fwd = {o for n in em.fwd for o in n.output if o}
    # What its backward reads (its forward nodes read right after the node, where
    # the values they read are live anyway).
    reads_variant = {v for v in external_reads(em.back)
                     if view.forward_value(v)} - grads - made_fwd
    view_graph = Graph(nodes=nodes, inputs=graph.inputs, outputs=graph.outputs,
                       initializers=graph.initializers, info=em.info,
                       opsets=graph.opsets, metadata=graph.metadata)
    added_s = sum(view.costs.price(n, view_graph) for n in em.back + em.fwd)
    c = _Candidate(variant, float(added_s - span.removed_s), members=got.members)
    # Working set over the span.
    peak = peak_working_set(em.back, em.info, graph.opset)
    for t in range(span.a, b + 1):
        c.term(float(peak - span.own[t - span.a]), t, t)
    for nbytes, t0, t1 in span.early:
        c.term(nbytes, t0, t1)
    for _, vl in span.inputs_dying:
        c.term(float(vl.nbytes), vl.death + 1, b)
    changed = _add_saved_buffer_terms(view, c, node, span, reads_variant)
    # Its constants are initializers to ORT: resident for the whole step.
    consts = sum(em.info[o].nbytes for n in em.back + em.fwd
                 if n.op_type == "Constant" for o in n.output if o in em.info)
    c.term(float(consts), 0, len(nodes) - 1)
    # Values it adds to the forward pass that its backward reads.
    back_reads = external_reads(em.back)
    for n in em.fwd:
        for o in n.output:
            if o in back_reads and o in em.info:
                c.term(float(em.info[o].nbytes), view.pos[id(node)] + 1, b)
    # Not with recompute of the node or of producers and readers of values whose
    # lifetime it changes, nor with offloading what either rule reads.
    du, unit_of_node = view.du, view.unit_of_node
    excluded = {unit_of_node.get(m) for m in got.members}
    excluded |= {unit_of_node.get(du.producer[v].name) for v in changed
                 if v in du.producer}
    excluded |= {unit_of_node.get(r.name) for v in changed
                 for r in du.readers.get(v, ())}
    c.units = sorted(x for x in excluded if x is not None and view.unit_vars[x])
    c.offloads = sorted((reads_default | reads_variant | set(node.output))
                        & set(view.offload_var))
    return c


def _add_saved_buffer_terms(view: _StepView, c: _Candidate, node: onnx.NodeProto,
                            span: Span, reads_variant: set[str]) -> set[str]:
    """Saved buffers: each buffer either rule reads now dies at its last reader outside the
    default rule, or at the rule's end if the variant reads it. Returns the values whose
    lifetime the variant changes (``c.drops``: the buffers it stops reading)."""
    values, members, buffer_of = view.values, view.members, view.buffer_of
    reads_default, old_ids, b = span.reads_default, span.old_ids, span.b
    optional_outs = {o for o in node.output[1:] if o}
    changed: set[str] = set()
    buffers = {bl.name: bl for v in reads_default | reads_variant
               if (bl := buffer_of(v)) is not None}
    c.drops = {bl.name for v in reads_default if (bl := buffer_of(v)) is not None
               and not any(m in reads_variant for m in members[bl.name])}
    for name, bl in sorted(buffers.items()):
        mem = members[name]
        others = view.later_readers(mem, old_ids)
        mine = [v for v in mem if v in reads_variant]
        end = max(others + [bl.birth] + ([b] if mine else []))
        if not others and not mine and set(mem) <= optional_outs:
            # the node no longer produces it (passes/lowering/variant_substitution.py)
            end = bl.birth - 1
        if end < bl.death:
            c.term(-float(bl.nbytes), end + 1, bl.death)
        elif end > bl.death:
            c.term(float(bl.nbytes), bl.death + 1, end)
        # A value the variant reads late can no longer be overwritten in place by a
        # later member of its buffer (Tanh over its input): that member gets its own.
        for v in mine:
            later = [m for m in mem if values[m].birth > values[v].birth]
            if later:
                first = min(values[m].birth for m in later)
                stop = max(view.later_readers(later, old_ids) + [first])
                c.term(float(bl.nbytes), first, stop)
        if end != bl.death or mine:
            changed.update(mem)
    return changed


def _add_choices(builder: ProblemBuilder, view: _StepView, node: onnx.NodeProto,
                 useful: list[_Candidate], out: VariantVars,
                 covering: list[tuple[int, tuple[str, ...]]]
                 ) -> tuple[list[int], dict[str, list[int]]]:
    """One variable per useful candidate of ``node``, with its terms and exclusion rows;
    returns the node's group and, per saved buffer, the variables that stop reading it."""
    group: list[int] = []
    dropping: dict[str, list[int]] = defaultdict(list)
    for c in useful:
        var = builder.variable(KIND, f"{c.variant.key} for {node.name}", c.cost)
        group.append(var)
        if len(c.members) > 1:
            covering.append((var, c.members))
        for name in c.drops:
            dropping[name].append(var)
        out.choice_of[var] = (node.name, c.variant.name)
        out.variant_of[var] = c.variant
        for nbytes, t0, t1 in c.terms:
            builder.term(var, nbytes, t0, t1)
        for u in c.units:
            builder.row({var: 1.0, **dict.fromkeys(view.unit_vars[u], 1.0)}, 1.0)
        for v in c.offloads:
            builder.row({var: 1.0, view.offload_var[v]: 1.0}, 1.0)
    return group, dropping


def _note_rule_reads(view: _StepView, node: onnx.NodeProto, dropping: dict[str, list[int]],
                     rule_reads: dict[str, list[tuple[str, int, list[int]]]]) -> None:
    """Record, per saved buffer the default rule of ``node`` reads, its last read inside
    the rule and the variables that stop reading it (for the joint freeing)."""
    old = view.rules[node.name]
    old_ids = {id(n) for n in old}
    gouts, _ = rule_io(node)  # type: ignore[misc]
    reads_own = forward_reads(old, gouts, view.forward_value)
    for name in {bl.name for v in reads_own if (bl := view.buffer_of(v)) is not None}:
        last = max(view.pos[id(r)] for m in view.members[name]
                   for r in view.du.readers.get(m, ()) if id(r) in old_ids)
        rule_reads[name].append((node.name, last, dropping.get(name, [])))


def _add_joint_freeing(builder: ProblemBuilder, view: _StepView,
                       rule_reads: dict[str, list[tuple[str, int, list[int]]]]) -> None:
    """One binary per saved buffer that exactly two nodes' default rules read, set only
    when both use a variant that stops reading it (module docstring)."""
    du, rules, unit_vars = view.du, view.rules, view.unit_vars
    for name, readers in sorted(rule_reads.items()):
        if len(readers) != 2 or not all(vars_ for _, _, vars_ in readers):
            continue
        bl = view.buffer_of(name)
        if bl is None:
            continue
        mem = view.members[name]
        both = {id(n) for r, _, _ in readers for n in rules[r]}
        outside = view.later_readers(mem, both)
        start = max(outside + [bl.birth]) + 1
        end = min(last for _, last, _ in readers)
        if start > end:
            continue
        y = builder.variable(KIND, f"joint free {name}", 0.0)
        builder.term(y, -float(bl.nbytes), start, end)
        for _, _, vars_ in readers:
            builder.row({y: 1.0, **dict.fromkeys(vars_, -1.0)}, 0.0)
        # Not with recompute of its producers or readers (a recomputed reader reads it in
        # the backward pass), nor with offloading it.
        touching = {du.producer[m].name for m in mem if m in du.producer}
        touching |= {r.name for m in mem for r in du.readers.get(m, ())}
        for u in {view.unit_of_node.get(p) for p in touching} - {None}:
            if unit_vars[u]:
                builder.row({y: 1.0, **dict.fromkeys(unit_vars[u], 1.0)}, 1.0)
        for m in mem:
            if m in view.offload_var:
                builder.row({y: 1.0, view.offload_var[m]: 1.0}, 1.0)
