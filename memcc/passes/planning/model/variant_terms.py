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

from collections import ChainMap, defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.gradients.variants import LOSSY, Variant
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import (
    ALIAS_OPS,
    INPLACE_OPS,
    LivenessReport,
    allocation_bytes,
    scratch_bytes,
)
from memcc.passes.lowering.variant_substitution import (
    Replaced,
    applicable_variants,
    dead_after_replacing,
    replaced_rule,
    rule_body,
    rule_nodes,
    variant_context,
)
from memcc.passes.plan import StepStructure
from memcc.passes.planning.model.offload_terms import OffloadVars
from memcc.passes.planning.model.problem import ProblemBuilder
from memcc.passes.planning.model.recompute_terms import RecomputeUnits
from memcc.step import rule_io

KIND = "variant"


@dataclass(frozen=True)
class VariantVars:
    """Decision variable -> (forward node, variant name), and what each variant is."""

    choice_of: dict[int, tuple[str, str]] = field(default_factory=dict)
    variant_of: dict[int, Variant] = field(default_factory=dict)


@dataclass(frozen=True)
class _Emitted:
    back: list[onnx.NodeProto]
    fwd: list[onnx.NodeProto]
    info: dict


def _emit(graph: Graph, node: onnx.NodeProto, variant: Variant,
          replaced: Replaced) -> _Emitted | None:
    """The variant's nodes for ``node``, emitted on a view of ``graph`` whose type table is
    a copy (the step is not touched)."""
    info = ChainMap({}, graph.info)  # the variant's new types land in the first map
    view = Graph(nodes=graph.nodes, inputs=graph.inputs, outputs=graph.outputs,
                 initializers=graph.initializers, info=info,  # type: ignore[arg-type]
                 opsets=graph.opsets, metadata=graph.metadata, name=graph.name)
    view.set_nodes(graph.nodes, graph.def_use())
    ctx = variant_context(view, node, f"{node.name}/{variant.name}/", taken=(),
                          wants=replaced.wants)
    try:
        variant.rule(ctx, node, [g or None for g in replaced.gouts])
    except Exception:  # a variant that cannot be emitted here is not offered
        return None
    fwd = list(ctx.forward.nodes) if ctx.forward is not None else []
    return _Emitted(list(ctx.emit.nodes), fwd, view.info)


def _external_reads(nodes: list[onnx.NodeProto]) -> set[str]:
    made = {o for n in nodes for o in n.output if o}
    return {i for n in nodes for i in n.input if i and i not in made}


def _forward_reads(rule: list[onnx.NodeProto], gouts: list[str], forward_value) -> set[str]:
    """The forward-pass values a rule's nodes read, its incoming gradients left out."""
    return {v for v in _external_reads(rule) if forward_value(v)} - {g for g in gouts if g}


def _peak_working_set(nodes: list[onnx.NodeProto], info, opset: int) -> int:
    """Largest bytes held by values ``nodes`` produce, walked in order, plus each kernel's
    own scratch while it runs (Where's selections); a buffer lives until the last reader
    among them of any value it holds (results, read by nobody here, to the end). Buffers
    are shared as the liveness analysis shares them: a Reshape returns its input's buffer
    and an in-place op (ScatterElements into its zeros) writes into it, so a rule that
    reshapes and scatters is not counted three times over."""
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            last[i] = k
    size, birth, end = _buffers(nodes, info, last)
    live, peak = 0, 0
    ends: dict[int, int] = defaultdict(int)
    for b, k in end.items():
        ends[k] += size[b]
    for k, n in enumerate(nodes):
        if n.op_type == "Constant":
            continue
        live += sum(size[o] for o in n.output if o and birth.get(o) == k)
        peak = max(peak, live + scratch_bytes(n, info, opset))
        live -= ends.pop(k, 0)
    return peak


def _buffers(nodes: list[onnx.NodeProto], info, last: dict[str, int]
             ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The buffers ``nodes`` allocate, by ``liveness``'s alias and in-place rules (a view
    of a value from outside holds no bytes here; an outside value is never written over):
    each buffer's bytes, birth and the index of its last reader among ``nodes``."""
    buffer_of: dict[str, str] = {}
    size: dict[str, int] = {}
    birth: dict[str, int] = {}
    end: dict[str, int] = {}
    for k, n in enumerate(nodes):
        if n.op_type == "Constant":
            continue
        for j, o in enumerate(n.output):
            if not o or o not in info:
                continue
            src = n.input[0] if j == 0 and n.input else ""
            b = buffer_of.get(src) if src else None
            if src and n.op_type in ALIAS_OPS:
                if b is None:
                    continue
            elif b is None or not _writes_over(n, b, src, o, k, end, info):
                b = o
                size[o], birth[o], end[o] = allocation_bytes(int(info[o].nbytes)), k, k
            buffer_of[o] = b
            end[b] = max(end[b], last.get(o, len(nodes)))
    return size, birth, end


def _writes_over(n: onnx.NodeProto, b: str, src: str, out: str, k: int,
                 end: dict[str, int], info) -> bool:
    """``n`` (at ``k``) writes ``out`` into the buffer ``b`` of its input ``src``: an
    in-place op, the buffer's last read, the same shape and element size."""
    return (n.op_type in INPLACE_OPS and end[b] == k
            and info[src].shape == info[out].shape
            and info[src].itemsize == info[out].itemsize)


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


def _before_span(old: list[onnx.NodeProto], a: int, pos: dict[int, int], values,
                 live: LivenessReport) -> list[tuple[float, int, int]]:
    """Terms freeing what the default rule's nodes placed before its backward span hold
    there (MaxPool's index Cast, right after the forward node): every variant removes them,
    and the span's own part is already in the working-set terms."""
    terms = []
    for n in old:
        k = pos[id(n)]
        if k >= a or n.op_type == "Constant":
            continue
        terms.append((-float(live.scratch[k]), k, k))
        for o in n.output:
            vl = values.get(o)
            if vl is not None and vl.owns_buffer:
                end = a - 1 if vl.death is None else min(vl.death, a - 1)
                terms.append((-float(vl.nbytes), vl.birth, end))
    return terms


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


def add_variant_terms(builder: ProblemBuilder, graph: Graph, st: StepStructure,
                      live: LivenessReport, costs: CostModel, units: RecomputeUnits,
                      swaps: OffloadVars | None = None, *,
                      allow_lossy: bool = False) -> VariantVars:
    nodes = graph.nodes
    du = graph.def_use()
    pos = {id(n): i for i, n in enumerate(nodes)}
    values = live.values
    outputs = set(graph.outputs)
    rules = rule_nodes(graph)
    unit_vars: dict[int, list[int]] = defaultdict(list)
    for var, u in units.var_unit.items():
        unit_vars[u].append(var)
    unit_of_node = {name: u for u, g in enumerate(units.groups) for name in g}
    offload_var = {v: var for var, v in (swaps.value_of.items() if swaps else ())}

    def forward_value(v: str) -> bool:
        p = du.producer.get(v)
        return p is not None and p.name in st.forward and p.op_type != "Constant"

    members: dict[str, list[str]] = defaultdict(list)
    for name, vl in values.items():
        members[vl.buffer].append(name)

    def buffer_of(v: str):
        """The buffer holding ``v`` (itself, or the one it aliases / was written into)
        when that buffer is freed during the step."""
        vl = values.get(v)
        if vl is None:
            return None
        bl = values.get(vl.buffer)
        if bl is None or bl.death is None or any(m in outputs for m in members[vl.buffer]):
            return None
        return bl

    out = VariantVars()
    # buffer -> [(rule node, last read of the buffer inside the rule, variables dropping it)]
    rule_reads: dict[str, list[tuple[str, int, list[int]]]] = defaultdict(list)
    groups: dict[str, list[int]] = {}
    covering: list[tuple[int, tuple[str, ...]]] = []
    for node in nodes:
        if node.name not in st.forward or node.name not in rules:
            continue
        candidates = [v for v in applicable_variants(graph, node, rules)
                      if allow_lossy or v.tier != LOSSY]
        if not candidates:
            continue
        optional_outs = {o for o in node.output[1:] if o}
        spans: dict[tuple[str, ...], _Span | None] = {}
        found: list[_Candidate] = []
        for variant in candidates:
            got = replaced_rule(graph, node, variant, rules)
            if isinstance(got, str):
                continue
            if got.members not in spans:
                spans[got.members] = _default_span(graph, got, pos, live, costs,
                                                   forward_value)
            span = spans[got.members]
            em = _emit(graph, node, variant, got) if span is not None else None
            if span is None or em is None:
                continue
            a, b, old_ids, grads = span.a, span.b, span.old_ids, span.grads
            reads_default, own = span.reads_default, span.own
            made_fwd = {o for n in em.fwd for o in n.output if o}
            # What its backward reads (its forward nodes read right after the node, where
            # the values they read are live anyway).
            reads_variant = {v for v in _external_reads(em.back)
                             if forward_value(v)} - grads - made_fwd
            view_graph = Graph(nodes=nodes, inputs=graph.inputs, outputs=graph.outputs,
                               initializers=graph.initializers, info=em.info,
                               opsets=graph.opsets, metadata=graph.metadata)
            added_s = sum(costs.price(n, view_graph) for n in em.back + em.fwd)
            c = _Candidate(variant, float(added_s - span.removed_s), members=got.members)
            # Working set over the span.
            peak = _peak_working_set(em.back, em.info, graph.opset)
            for t in range(a, b + 1):
                c.term(float(peak - own[t - a]), t, t)
            for nbytes, t0, t1 in span.early:
                c.term(nbytes, t0, t1)
            for _, vl in span.inputs_dying:
                c.term(float(vl.nbytes), vl.death + 1, b)
            # Saved buffers: each buffer either rule reads now dies at its last reader
            # outside the default rule, or at the rule's end if the variant reads it.
            changed: set[str] = set()
            buffers = {bl.name: bl for v in reads_default | reads_variant
                       if (bl := buffer_of(v)) is not None}
            c.drops = {bl.name for v in reads_default if (bl := buffer_of(v)) is not None
                       and not any(m in reads_variant for m in members[bl.name])}
            for name, bl in sorted(buffers.items()):
                mem = members[name]
                others = [pos[id(r)] for m in mem for r in du.readers.get(m, ())
                          if id(r) not in old_ids]
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
                        stop = max([pos[id(r)] for m in later for r in du.readers.get(m, ())
                                    if id(r) not in old_ids] + [first])
                        c.term(float(bl.nbytes), first, stop)
                if end != bl.death or mine:
                    changed.update(mem)
            # Its constants are initializers to ORT: resident for the whole step.
            consts = sum(em.info[o].nbytes for n in em.back + em.fwd
                         if n.op_type == "Constant" for o in n.output if o in em.info)
            c.term(float(consts), 0, len(nodes) - 1)
            # Values it adds to the forward pass that its backward reads.
            back_reads = _external_reads(em.back)
            for n in em.fwd:
                for o in n.output:
                    if o in back_reads and o in em.info:
                        c.term(float(em.info[o].nbytes), pos[id(node)] + 1, b)
            # Not with recompute of the node or of producers and readers of values whose
            # lifetime it changes, nor with offloading what either rule reads.
            excluded = {unit_of_node.get(m) for m in got.members}
            excluded |= {unit_of_node.get(du.producer[v].name) for v in changed
                         if v in du.producer}
            excluded |= {unit_of_node.get(r.name) for v in changed
                         for r in du.readers.get(v, ())}
            c.units = sorted(x for x in excluded if x is not None and unit_vars[x])
            c.offloads = sorted((reads_default | reads_variant | set(node.output))
                                & set(offload_var))
            found.append(c)
        group: list[int] = []
        dropping: dict[str, list[int]] = defaultdict(list)
        for c in _useful(found):
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
                builder.row({var: 1.0, **dict.fromkeys(unit_vars[u], 1.0)}, 1.0)
            for v in c.offloads:
                builder.row({var: 1.0, offload_var[v]: 1.0}, 1.0)
        builder.choice(group)
        groups[node.name] = group
        old = rules[node.name]
        old_ids = {id(n) for n in old}
        gouts, _ = rule_io(node)  # type: ignore[misc]
        reads_own = _forward_reads(old, gouts, forward_value)
        for name in {bl.name for v in reads_own if (bl := buffer_of(v)) is not None}:
            last = max(pos[id(r)] for m in members[name] for r in du.readers.get(m, ())
                       if id(r) in old_ids)
            rule_reads[name].append((node.name, last, dropping.get(name, [])))
    # A variant that replaces several nodes' rules excludes those nodes' own variants.
    for var, names in covering:
        for m in names:
            for other in groups.get(m, ()):
                if other != var:
                    builder.row({var: 1.0, other: 1.0}, 1.0)
    _add_joint_freeing(builder, rule_reads, members, du, pos, rules, unit_of_node,
                       unit_vars, offload_var, buffer_of)
    return out


@dataclass
class _Span:
    """The default rules a variant replaces, as the baseline schedule runs them: their
    backward span ``[a, b]``, what they read and hold there, and what removing them saves."""

    a: int
    b: int
    old_ids: set[int]
    grads: set[str]
    reads_default: set[str]
    own: np.ndarray
    removed_s: float
    early: list[tuple[float, int, int]]
    inputs_dying: list


def _default_span(graph: Graph, got: Replaced, pos: dict[int, int], live: LivenessReport,
                  costs: CostModel, forward_value) -> _Span | None:
    values = live.values
    old = got.old
    body = rule_body(old, got.gouts)
    if not body:
        return None
    a, b = pos[id(body[0])], max(pos[id(n)] for n in body)
    grads = {g for g in got.gouts if g}
    # The default's own values live at each point of its span.
    own = np.zeros(b - a + 1)
    for n in old:
        for o in n.output:
            vl = values.get(o)
            if vl is None or not vl.owns_buffer or n.op_type == "Constant":
                continue
            lo, hi = max(vl.birth, a), min(b if vl.death is None else vl.death, b)
            if lo <= hi:
                own[lo - a:hi - a + 1] += vl.nbytes
        if a <= pos[id(n)] <= b:
            own[pos[id(n)] - a] += live.scratch[pos[id(n)]]
    # Only what the substitution removes: a gradient sum the rule emitted stays.
    removed = dead_after_replacing(graph, old, {g for g in got.results if g})
    return _Span(
        a, b, {id(n) for n in old}, grads,
        _forward_reads(old, got.gouts, forward_value), own,
        float(sum(costs.of(n) for n in removed)),
        _before_span(old, a, pos, values, live),
        # Rule inputs the default frees inside its span: the variant may read them later.
        [(v, vl) for v in _external_reads(old)
         if (vl := values.get(v)) is not None and vl.owns_buffer
         and vl.death is not None and a <= vl.death < b])


def _add_joint_freeing(builder: ProblemBuilder, rule_reads, members, du, pos, rules,
                       unit_of_node, unit_vars, offload_var, buffer_of) -> None:
    """One binary per saved buffer that exactly two nodes' default rules read, set only
    when both use a variant that stops reading it (module docstring)."""
    for name, readers in sorted(rule_reads.items()):
        if len(readers) != 2 or not all(vars_ for _, _, vars_ in readers):
            continue
        bl = buffer_of(name)
        if bl is None:
            continue
        mem = members[name]
        both = {id(n) for r, _, _ in readers for n in rules[r]}
        outside = [pos[id(r)] for m in mem for r in du.readers.get(m, ())
                   if id(r) not in both]
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
        for u in {unit_of_node.get(p) for p in touching} - {None}:
            if unit_vars[u]:
                builder.row({y: 1.0, **dict.fromkeys(unit_vars[u], 1.0)}, 1.0)
        for m in mem:
            if m in offload_var:
                builder.row({y: 1.0, offload_var[m]: 1.0}, 1.0)
