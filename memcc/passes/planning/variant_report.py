"""What a plan's gradient-rule variants do, per kind, measured by the simulator: the
report's ``plan.variants`` (``compiler/planning.plan_summary``)."""

from __future__ import annotations

from dataclasses import replace

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.plan import StepStructure
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate


def describe_variants(graph: Graph, sim: Simulation, costs: CostModel,
                      structure: StepStructure | None = None, *,
                      host_copies: bool = False, device: str = "cpu") -> dict:
    """What the plan's variants do, per variant kind (``Relu:mask``, ``Conv:chunks4``): how
    many nodes use it, and the peak bytes saved and predicted seconds added, each measured
    by simulating the same plan without that kind (so the figures come from the simulator,
    not from the model). ``exactness`` is the plan's tier: ``exact`` when every variant is
    bit-identical, else ``equivalent`` with the largest stated ``tolerance``."""
    from memcc.frontend.gradients.variants import EXACT, TIERS, Variant, lookup

    op_of = {n.name: n.op_type for n in graph.nodes}
    chosen = {n: v for n, v in sim.plan.variants.items() if v != "default"}
    by_kind: dict[str, tuple[Variant, list[str]]] = {}
    for node, name in sorted(chosen.items()):
        variant = lookup(op_of.get(node, ""), name)
        if variant is not None:
            by_kind.setdefault(variant.key, (variant, []))[1].append(node)
    kinds = {}
    for key, (variant, nodes) in sorted(by_kind.items()):
        rest = {n: v for n, v in chosen.items() if n not in nodes}
        without = simulate(graph, replace(sim.plan, variants=rest), costs, structure,
                           SimulationRules(device, host_copies=host_copies))
        kinds[key] = {"nodes": len(nodes),
                      "bytes_saved": without.peak_bytes - sim.peak_bytes,
                      "added_time_s": sim.added_time_s - without.added_time_s,
                      "tier": variant.tier}
    inexact = [(v.tier, v.tolerance) for v, _ in by_kind.values() if v.tier != EXACT]
    return {
        "chosen": dict(sorted(chosen.items())),
        "by_kind": kinds,
        "exactness": max((t for t, _ in inexact), key=TIERS.index, default=EXACT),
        "tolerance": max((tol for _, tol in inexact), default=0.0),
    }
