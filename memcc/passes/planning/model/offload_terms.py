"""Term generator for the offload decision: which saved values to swap to host memory.

One binary per candidate value ``v``: "copy v to the host right after its last forward
reader and back right before its first backward reader" (``passes/lowering/swap.py`` places the
copies exactly there). On the device, v's buffer is then free over the gap between the two,
so the term is ``-bytes`` over ``[last forward reader + 1, first backward reader - 1]`` of the
baseline schedule (the copy back is live from just before the first backward reader, as v
was). It costs two copies over the host link (``CostModel.link``): ORT runs them on the
compute stream, so nothing overlaps.

Offload and recompute of the same value exclude each other, and so do offloading v and
recomputing a node that reads v (its clone would need v on the device inside the gap): one
row per such pair keeps the model exact. Only values that own their buffer alone (no alias
or in-place write shares it) are candidates, and only on a device provider: on the CPU
provider host and device are one memory and there is nothing to save.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import LivenessReport
from memcc.passes.plan import StepStructure
from memcc.passes.planning.model.problem import ProblemBuilder
from memcc.passes.planning.model.recompute_terms import RecomputeUnits

KIND = "offload"
# A gap shorter than this many nodes saves too little time-integrated memory to be worth a
# variable (the copies' latency alone exceeds what a few nodes take).
MIN_GAP = 2


@dataclass(frozen=True)
class OffloadVars:
    """Decision variable -> the value it swaps out."""

    value_of: dict[int, str]


def add_offload_terms(builder: ProblemBuilder, graph: Graph, st: StepStructure,
                      live: LivenessReport, costs: CostModel,
                      units: RecomputeUnits) -> OffloadVars:
    if costs.link is None:
        return OffloadVars({})
    nodes = graph.nodes
    du = graph.def_use()
    pos = {id(n): i for i, n in enumerate(nodes)}
    sharing: dict[str, int] = defaultdict(int)
    for vl in live.values.values():
        sharing[vl.buffer] += 1
    unit_vars: dict[int, list[int]] = defaultdict(list)
    for var, u in units.var_unit.items():
        unit_vars[u].append(var)
    unit_of_node = {name: u for u, g in enumerate(units.groups) for name in g}
    outputs = set(graph.outputs)
    value_of: dict[int, str] = {}
    for v in sorted(st.saved):
        vl = live.values.get(v)
        producer = du.producer.get(v)
        if (vl is None or producer is None or producer.name not in st.forward
                or v in outputs or vl.buffer != v or sharing[v] != 1 or vl.death is None):
            continue
        readers = du.readers.get(v, ())
        forward = [pos[id(r)] for r in readers if r.name in st.forward]
        backward = [pos[id(r)] for r in readers if r.name not in st.forward]
        if not backward:
            continue
        last_forward = max(forward + [pos[id(producer)]])
        first_backward = min(backward)
        if first_backward - last_forward - 1 < MIN_GAP:
            continue
        var = builder.variable(KIND, f"offload {v}", costs.link.round_trip(vl.nbytes))
        builder.term(var, -float(vl.nbytes), last_forward + 1, first_backward - 1)
        value_of[var] = v
        # Not with recompute of v itself, nor of a node whose clone reads v.
        excluded = {unit_of_node.get(producer.name)}
        excluded |= {unit_of_node.get(r.name) for r in readers}
        for u in sorted(x for x in excluded if x is not None):
            if unit_vars[u]:
                builder.row({var: 1.0, **dict.fromkeys(unit_vars[u], 1.0)}, 1.0)
    return OffloadVars(value_of)
