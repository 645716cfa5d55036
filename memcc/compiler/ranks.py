"""``memcc compile --nproc N [--zero Z]``: the step planned as each data-parallel rank runs it.

``memcc train --nproc N`` (``memcc.dist``) splits the step at its updates: every rank holds
the gradient bucket all step (no gradient freed by its update), with ZeRO-1 only its own
parameters' optimizer state, and runs only their updates; with ZeRO-2 its bucket holds only
its own parameters' gradients (the others' are reduced to their owners and freed).
``passes.analysis.rank_step`` writes each rank's step down as a graph; here the planner
plans that graph, under the user's budget, which thereby means a per-rank peak:

1. every rank's graph is judged without a plan, and the heaviest is planned (ZeRO-0: the
   ranks are alike; ZeRO-1 and 2: the shards differ by whole parameters);
2. the plan is judged on every other rank's graph; where one peaks above the planned
   rank, it is planned instead (once more: the plan that fits the heaviest fits all);
3. the plan is lowered onto the step itself (plans name the same nodes and values), which
   is the file written: ``memcc train --nproc`` splits it again.

With ``--bucket-mb B`` each rank's graph is the one ``dist.bucket_memory`` writes for a rank
that reduces its gradients by buckets (no gradient held, each bucket's updates between the
segments): the per-rank budget then means the peak of ``memcc train --nproc N --bucket-mb
B``. The plan is lowered onto the step, which train cuts at its buckets again, so the
compiled step's own bucketed peak is simulated after lowering and reported next to the
planned one (``peak_bytes_per_rank_as_cut``).

The report's ``data_parallel`` section says what was planned: ranks, the rank planned,
each rank's predicted peak, the bucket's bytes, each rank's optimizer state, and gloo's
scratch (``rank_step.COMM_SCRATCH_BYTES``, counted as held all step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memcc.compiler.options import CompileOptions
from memcc.compiler.planning import Planned
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.rank_step import RankStep, rank_steps
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import BudgetError
from memcc.passes.planning.simulate import SimulationRules, simulate

PlanOne = Callable[[Graph], tuple[Planned, dict | None]]


def rank_views(graph: Graph, options: CompileOptions) -> list[RankStep]:
    """Every rank's graph as ``memcc train --nproc`` runs it (``rank_step.rank_steps``;
    by buckets, ``dist.bucket_memory``'s), heaviest by state first."""
    if options.ranks.zero == 2:
        from memcc.dist.split import check_zero2
        from memcc.step import TrainingStep

        check_zero2(graph, TrainingStep.of(graph), "the step")
    views = rank_steps(graph, options.ranks)
    bucket = options.bucket_bytes
    if not bucket:
        return views
    from memcc.dist.bucket_memory import bucketed_rank_graph

    return [dataclasses.replace(v, graph=bucketed_rank_graph(graph, options.ranks, v.rank,
                                                             bucket)) for v in views]


def floor_view(graph: Graph, options: CompileOptions) -> Graph:
    """The rank graph a budget's floor is checked on: the rank keeping the most state."""
    return rank_views(graph, options)[0].graph


def _peak(view: RankStep, plan: Plan, costs: CostModel, options: CompileOptions) -> int:
    """The rank's predicted peak with ``plan``, as trained (by buckets: in the order the
    graph places the updates)."""
    return simulate(view.graph, plan, costs, StepStructure.of(view.graph),
                    SimulationRules(options.device, early_updates=True)).peak_bytes


def plan_for_ranks(graph: Graph, costs: CostModel, options: CompileOptions,
                   plan_one: PlanOne) -> tuple[Planned, dict | None, dict]:
    """The plan for the heaviest rank (module docstring): ``plan_one``'s ``Planned`` with the
    step written (``Planned.step``) the step itself rewritten by that plan, the offloaded
    state section ``plan_one`` gave, and the report's ``data_parallel`` section."""
    views = rank_views(graph, options)
    base = {v.rank: _peak(v, Plan(), costs, options) for v in views}
    target = max(views, key=lambda v: (base[v.rank], -v.rank))
    for _ in range(2):
        planned, offloaded = plan_one(target.graph)
        plan = planned.outcome.best.plan
        peaks = {v.rank: _peak(v, plan, costs, options) for v in views}
        worst = max(views, key=lambda v: (peaks[v.rank], -v.rank))
        if worst is target or peaks[worst.rank] <= peaks[target.rank]:
            break
        target = worst
    if planned.planning_budget is not None and \
            peaks[worst.rank] > planned.planning_budget:
        raise BudgetError(
            f"the plan for rank {target.rank} peaks at {peaks[worst.rank]:,} bytes on "
            f"rank {worst.rank}, over the per-rank budget; give a larger --budget or "
            "--budget min", budget=planned.planning_budget, smallest=peaks[worst.rank])
    full = simulate(graph, plan, costs, StepStructure.of(graph),
                    SimulationRules(options.device, early_updates=True))
    section = _section(options, views, target, peaks, base)
    if options.bucket_bytes:
        cut = section["peak_bytes_per_rank_as_cut"] = _as_cut(full.graph, options)
        if planned.planning_budget is not None and max(cut) > planned.planning_budget:
            raise BudgetError(
                f"the plan fits rank {target.rank} by buckets as planned, but the step it "
                f"writes, cut again at its buckets, peaks at {max(cut):,} bytes, over the "
                "per-rank budget; give a larger --budget, or compile without --bucket-mb",
                budget=planned.planning_budget, smallest=max(cut))
    return (Planned(planned.outcome, full.graph, planned.slack, planned.planning_budget),
            offloaded, section)


def _section(options: CompileOptions, views: list[RankStep], planned: RankStep,
             peaks: dict[int, int], base: dict[int, int]) -> dict:
    """The report's ``data_parallel`` section (README, "Report fields")."""
    ranks = options.ranks
    by_rank = {v.rank: v for v in views}

    def each(f) -> list[int]:  # ZeRO-0: one graph stands for every rank
        return [int(f(by_rank.get(r) or views[0], r if r in by_rank else views[0].rank))
                for r in range(ranks.world)]

    peak = each(lambda v, r: peaks[r])
    return {
        "world_size": ranks.world, "zero": ranks.zero,
        "bucket_bytes": options.bucket_bytes,
        "budget_is_per_rank": True,
        "planned_rank": planned.rank,
        "heaviest_rank": max(range(ranks.world), key=lambda r: (peak[r], -r)),
        "peak_bytes_per_rank": peak,
        "baseline_peak_bytes_per_rank": each(lambda v, r: base[r]),
        "gradient_bucket_bytes": max(each(lambda v, r: v.bucket_bytes)),
        "gradient_bucket_bytes_per_rank": each(lambda v, r: v.bucket_bytes),
        "optimizer_state_bytes_per_rank": each(lambda v, r: v.state_bytes),
        "comm_scratch_bytes": views[0].comm_bytes,
        "method": ("passes.analysis.rank_step: the step split at its updates, the gradient "
                   "bucket (ZeRO-2: the rank's own gradients; the others' from the backward "
                   "to the step's end) and gloo's scratch held all step, the rank's own "
                   "updates and optimizer state"),
    }


def _as_cut(step: Graph, options: CompileOptions) -> list[int]:
    """Each rank's predicted peak by buckets of the step as written (the plan lowered):
    ``memcc train --nproc --bucket-mb`` cuts that step, whose recomputed nodes may move a
    cut, and reports this prediction."""
    from memcc.dist.memory import predicted_rank_peak

    ranks = options.ranks
    count = ranks.world if ranks.zero else 1
    peaks = [predicted_rank_peak(step, ranks.world, ranks.zero, r, options.bucket_bytes)
             for r in range(count)]
    return peaks if ranks.zero else peaks * ranks.world
