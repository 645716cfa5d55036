"""Term generator for the variant decision: which gradient rule each forward node uses.

For every forward node with applicable variants (``passes/variants.py``) there is one
binary per variant and a choice group over them (none set = the default rule). A variant's
effect on memory is read off the variant's own nodes, emitted once here without touching
the step, against the default rule's nodes in the baseline schedule:

- saved values: a forward value the default rule reads and the variant does not dies at its
  last other reader instead (``-bytes`` over the gap); one the variant reads and the default
  does not lives on to the end of the rule (``+bytes``); a value the variant adds to the
  forward pass (a mask) is live from the forward node to the end of the rule;
- working set: over the rule's span ``[a, b]`` in the schedule, memory becomes what the
  default rule's own values do not hold, plus the variant's peak working set (its values
  walked in its own order, results held to the end); rule inputs the default frees inside
  the span are held to its end. So the model is exact at the default's peak point inside the
  span and never understates elsewhere.

Cost: the variant's nodes priced by ``CostModel.price`` (calibrated analytic estimates for
nodes never measured) less the default nodes the substitution removes.

Interactions kept exact by rows: a variant excludes recomputing the node itself and the
producers of values whose lifetime it changes (the recompute terms assume the default's
readers), and offloading any value either rule reads.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.gradients.variants import LOSSY, Variant
from memcc.graph import Graph
from memcc.passes.cost_model import CostModel
from memcc.passes.liveness import LivenessReport
from memcc.passes.plan import StepStructure
from memcc.passes.solvers.offload_terms import OffloadVars
from memcc.passes.solvers.problem import ProblemBuilder
from memcc.passes.solvers.recompute_terms import RecomputeUnits
from memcc.passes.variants import applicable_variants, rule_nodes, variant_context
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


def _emit(graph: Graph, node: onnx.NodeProto, variant: Variant) -> _Emitted | None:
    """The variant's nodes for ``node``, emitted on a view of ``graph`` whose type table is
    a copy (the step is not touched)."""
    view = Graph(nodes=graph.nodes, inputs=graph.inputs, outputs=graph.outputs,
                 initializers=graph.initializers, info=dict(graph.info),
                 opsets=graph.opsets, metadata=graph.metadata, name=graph.name)
    gouts, _ = rule_io(node) or ([], [])
    ctx = variant_context(view, node, f"{node.name}/{variant.name}/")
    try:
        variant.rule(ctx, node, [g or None for g in gouts])
    except Exception:  # a variant that cannot be emitted here is not offered
        return None
    fwd = list(ctx.forward.nodes) if ctx.forward is not None else []
    return _Emitted(list(ctx.emit.nodes), fwd, view.info)


def _external_reads(nodes: list[onnx.NodeProto]) -> set[str]:
    made = {o for n in nodes for o in n.output if o}
    return {i for n in nodes for i in n.input if i and i not in made}


def _peak_working_set(nodes: list[onnx.NodeProto], info: dict) -> int:
    """Largest bytes held by values ``nodes`` produce, walked in order; a value lives until
    its last reader among them (results, read by nobody here, to the end)."""
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            last[i] = k
    live, peak = 0, 0
    ends: dict[int, int] = defaultdict(int)
    for k, n in enumerate(nodes):
        if n.op_type == "Constant":
            continue
        born = 0
        for o in n.output:
            if o and o in info:
                nb = int(info[o].nbytes)
                born += nb
                ends[last.get(o, len(nodes))] += nb
        live += born
        peak = max(peak, live)
        live -= ends.pop(k, 0)
    return peak


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
    for node in nodes:
        if node.name not in st.forward or node.name not in rules:
            continue
        candidates = [v for v in applicable_variants(graph, node, rules)
                      if allow_lossy or v.tier != LOSSY]
        if not candidates:
            continue
        old = rules[node.name]
        body = [n for n in old if n.op_type != "Constant"]
        if not body:
            continue
        a, b = pos[id(body[0])], pos[id(body[-1])]
        old_ids = {id(n) for n in old}
        gouts, _ = rule_io(node)  # type: ignore[misc]
        grads = {g for g in gouts if g}
        reads_default = {v for v in _external_reads(old) if forward_value(v)} - grads
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
        removed_s = sum(costs.of(n) for n in old)
        # Rule inputs the default frees inside its span: the variant may read them later.
        inputs_dying = [(v, vl) for v in _external_reads(old)
                        if (vl := values.get(v)) is not None and vl.owns_buffer
                        and vl.death is not None and a <= vl.death < b]
        group: list[int] = []
        for variant in candidates:
            em = _emit(graph, node, variant)
            if em is None:
                continue
            made_fwd = {o for n in em.fwd for o in n.output if o}
            # What its backward reads (its forward nodes read right after the node, where
            # the values they read are live anyway).
            reads_variant = {v for v in _external_reads(em.back)
                             if forward_value(v)} - grads - made_fwd
            view_graph = Graph(nodes=nodes, inputs=graph.inputs, outputs=graph.outputs,
                               initializers=graph.initializers, info=em.info,
                               opsets=graph.opsets, metadata=graph.metadata)
            added_s = sum(costs.price(n, view_graph) for n in em.back + em.fwd)
            var = builder.variable(KIND, f"{variant.key} for {node.name}",
                                   float(added_s - removed_s))
            group.append(var)
            out.choice_of[var] = (node.name, variant.name)
            out.variant_of[var] = variant
            # Working set over the span.
            peak = _peak_working_set(em.back, em.info)
            for t in range(a, b + 1):
                builder.term(var, float(peak - own[t - a]), t, t)
            for _, vl in inputs_dying:
                builder.term(var, float(vl.nbytes), vl.death + 1, b)
            # Saved values the variant no longer reads.
            changed: set[str] = set()
            for v in reads_default - reads_variant:
                bl = buffer_of(v)
                if bl is None:
                    continue
                others = [pos[id(r)] for m in members[bl.name] for r in du.readers.get(m, ())
                          if id(r) not in old_ids]
                end = max(others + [bl.birth])
                if end < bl.death:
                    builder.term(var, -float(bl.nbytes), end + 1, bl.death)
                    changed.update(members[bl.name])
            # Saved values it reads that the default does not, held to the rule's end.
            for v in reads_variant - reads_default:
                changed.add(v)
                bl = buffer_of(v)
                if bl is not None and bl.death < b:
                    builder.term(var, float(bl.nbytes), bl.death + 1, b)
            # Values it adds to the forward pass that its backward reads.
            back_reads = _external_reads(em.back)
            for n in em.fwd:
                for o in n.output:
                    if o in back_reads and o in em.info:
                        builder.term(var, float(em.info[o].nbytes), pos[id(node)] + 1, b)
            # Rows: not with recompute of the node or of producers whose values it changes,
            # nor with offloading what either rule reads.
            excluded = {unit_of_node.get(node.name)}
            excluded |= {unit_of_node.get(du.producer[v].name) for v in changed
                         if v in du.producer}
            for u in sorted(x for x in excluded if x is not None):
                if unit_vars[u]:
                    builder.row({var: 1.0, **dict.fromkeys(unit_vars[u], 1.0)}, 1.0)
            for v in sorted((reads_default | reads_variant | set(node.output))
                            & set(offload_var)):
                builder.row({var: 1.0, offload_var[v]: 1.0}, 1.0)
        builder.choice(group)
    return out
