"""The plan pass: choose what to recompute so the step fits a budget at least added time.

Every strategy (registered by name in ``strategies.py``: ``ilp``, ``sqrtn``, ``none``,
``auto``) returns simulated plans, and this pass picks the cheapest that fits, so every
strategy is judged by the same simulator and a plan is only ever reported as fitting when
the simulator says so. The ILP works on a linear model of memory (``solvers/problem.py``)
built here once per call by the term generators of each decision kind.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from memcc.errors import MemccError
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import LivenessReport, small_buffers
from memcc.passes.lowering.variant_substitution import apply_variants, region_variants
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.model.offload_terms import OffloadVars, add_offload_terms
from memcc.passes.planning.model.problem import ProblemBuilder
from memcc.passes.planning.model.recompute_terms import add_recompute_terms
from memcc.passes.planning.model.variant_terms import VariantVars, add_variant_terms
from memcc.passes.planning.simulate import Simulation, simulate
from memcc.passes.planning.solvers import sqrtn
from memcc.passes.planning.strategies import REGISTRY, Found, Planning, PlanProblem

STRATEGIES = ("auto", *sorted(n for n in REGISTRY if n != "auto"))


class BudgetError(MemccError):
    """No strategy found a plan within the budget; carries the smallest reachable peak and,
    where the search for it ran, its plan (``outcome``: compile weighs that plan's own heap
    room before refusing, so the budget a refusal names is one it accepts)."""

    def __init__(self, message: str, *, budget: int, smallest: int,
                 outcome: PlanOutcome | None = None,
                 runs: list[dict] | None = None) -> None:
        super().__init__(message)
        self.budget = budget
        self.smallest = smallest
        self.outcome = outcome
        # The strategy runs that found nothing within the budget, as the report shows them
        # (``_describe_runs``): a later search that does fit keeps them in its report, so
        # that a run is never dropped from it for having failed.
        self.runs = list(runs or [])


@dataclass
class PlanOutcome:
    """What the pass decided and how it got there (for the report)."""

    best: Simulation
    baseline: Simulation
    strategy: str  # the candidate that won: none, sqrtn, ilp, or auto (a polished plan)
    solver: dict   # the last ILP solve only; ``runs`` says what every strategy returned
    candidates: list[dict] = field(default_factory=list)
    smallest_peak: int | None = None
    requested: str = "auto"  # --strategy as given
    # What the winner is, named so that ``auto`` never hides it: none, sqrtn, ilp, or
    # "<start>+polish" for a plan the polish derived from a sqrtn or ILP plan.
    picked: str = ""
    # One entry per strategy run, in order, each with what it returned (``_finish``); the
    # report prints them so that a failed first ILP model is not mistaken for the answer.
    runs: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``auto -> ilp``: what was asked for and what was picked."""
        return f"{self.requested} -> {self.picked or self.strategy}"


# ---------------------------------------------------------------------------- the model
def build_problem(graph: Graph, st: StepStructure, live: LivenessReport,
                  costs: CostModel, *, offload: bool = False,
                  variants: bool = True, allow_lossy: bool = False) -> PlanProblem:
    """The linear model of ``graph``'s memory under every decision kind: recompute, the
    gradient-rule variant of each node (``variants``), and on a device provider
    (``offload``) swap to host memory; each kind adds its variables and terms through its
    own generator. ``allow_lossy`` also offers the lossy-tier variants (16-bit storage)."""
    builder = ProblemBuilder(np.asarray(live.live_during, dtype=np.float64))
    units = add_recompute_terms(builder, graph, st, live, costs)
    swaps = add_offload_terms(builder, graph, st, live, costs, units) if offload else None
    chosen = add_variant_terms(builder, graph, st, live, costs, units, swaps,
                               allow_lossy=allow_lossy) if variants else VariantVars()
    return PlanProblem(builder.build(), units, swaps or OffloadVars({}), chosen)


# ---------------------------------------------------------------------------- the pass
def choose_plan(graph: Graph, budget: int | None, costs: CostModel, *,
                strategy: str = "auto", time_limit: float = 60.0,
                structure: StepStructure | None = None,
                baseline: Simulation | None = None, offload: bool = False,
                variants: bool = True, device: str = "cpu",
                allow_lossy: bool = False, regions: bool = True,
                heap_room: bool = False, smallest_on_refusal: bool = True) -> PlanOutcome:
    """Pick the plan; ``budget=None`` means the smallest peak memcc can reach.

    ``heap_room``: a plan fits where its peak and the heap room of the small buffers it
    adds do (``Simulation.fit_bytes``; CPU with malloc, where compile's slack holds the
    room of the step's own), so that its own recomputed values do not leave it over.

    ``offload``: the step runs on a device provider, so saved values may also be swapped to
    host memory (``costs.link`` prices the copies); never on the CPU provider, where host
    and device are one memory.

    When nothing fits ``budget``, the smallest budget named in the error is found the way
    ``--budget min`` finds it (and if that search finds a plan within ``budget`` after all,
    it is returned), so the two can never disagree.

    ``regions``: where that search runs (``--budget min``, or nothing fits), plan once more
    over the step with its region variants in place (``_over_region_variants``).

    ``smallest_on_refusal=False``: where nothing fits, refuse without that search (the
    error's ``smallest`` is then only the smallest peak of the plans tried): for the search
    over the region variants at a budget, whose caller searches the smallest peak itself,
    as ``--budget min`` does."""
    if strategy not in REGISTRY:
        raise MemccError(f"--strategy '{strategy}': choose one of {', '.join(STRATEGIES)}")
    st = structure or StepStructure.of(graph)
    base = baseline or simulate(graph, Plan(), costs, st, device=device)
    # The step as built fits: no plan can add less than nothing, so no strategy runs.
    fits_as_built = budget is not None and base.peak_bytes <= budget
    planning = None if strategy == "none" or fits_as_built else _prepare(
        graph, st, base, costs, time_limit, offload, variants, device, allow_lossy, heap_room)

    region_step: list = []   # built once, on first use: (variants, step, structure, baseline)
    tried: list[dict] = []   # runs that found nothing within the budget, kept for the report

    def over_regions(target: int | None, limit: float) -> PlanOutcome | None:
        if planning is None or not (variants and regions):
            return None
        if not region_step:
            region_step.append(_region_step(graph, st, base, costs, device, allow_lossy))
        if region_step[0] is None:
            return None
        return _over_region_variants(graph, target, costs, st, base, region_step[0],
                                     strategy=strategy, time_limit=limit,
                                     offload=planning.host_copies, device=device,
                                     allow_lossy=allow_lossy, heap_room=heap_room,
                                     failed=tried)

    def left() -> float:
        """What is left of this call's time limit (``--budget min``'s region search gets
        that; at least a second, so its sqrt(n) plans and the report's entries exist)."""
        end = planning.deadline if planning is not None else time.perf_counter()
        return max(end - time.perf_counter(), 1.0)

    try:
        found = _choose(planning, base, budget, strategy)
        if budget is not None:
            return found
        alt = over_regions(None, left())
        if alt is None:
            return found
        if found.best.peak_bytes <= alt.best.peak_bytes:
            return replace(found, candidates=found.candidates + alt.candidates,
                           runs=found.runs + _not_picked(alt.runs))
        return replace(alt, candidates=found.candidates + alt.candidates,
                       runs=_not_picked(found.runs) + alt.runs)
    except BudgetError as exc:
        if budget is None or not smallest_on_refusal:
            raise
        tried.extend(_not_picked(exc.runs))
    # Nothing found fits ``budget``. Over the step with its region variants in place, the
    # same strategy with the whole time limit, as for the step as built (``auto`` there runs
    # the ILP too: with sqrt(n) alone it returned plans dearer than ``--strategy ilp``'s).
    alt = over_regions(budget, time_limit)
    if alt is not None:
        return replace(alt, runs=tried + alt.runs)
    # Then the smallest peak, searched as --budget min searches it (the same time limit,
    # shared the same way), so that the budget a refusal names is --budget min's.
    if planning is not None:
        planning = replace(planning, deadline=time.perf_counter() + time_limit)
    smallest = _choose(planning, base, None, strategy)
    if smallest.best.fit_bytes <= budget:
        return replace(smallest, runs=tried + smallest.runs)
    runs = tried + _not_picked(smallest.runs)
    alt = over_regions(None, left())
    if alt is not None:
        if alt.best.fit_bytes <= budget:
            return replace(alt, runs=runs + alt.runs)
        runs += _not_picked(alt.runs)
        if alt.best.peak_bytes < smallest.best.peak_bytes:
            smallest = alt
    raise BudgetError(
        f"the step does not fit the budget of {_fmt(budget)}: the smallest peak memcc "
        f"reached is {_fmt(smallest.best.peak_bytes)} (baseline {_fmt(base.peak_bytes)})."
        f" Use --budget {smallest.best.peak_bytes} or more, or --budget min.",
        budget=int(budget), smallest=smallest.best.peak_bytes, outcome=smallest, runs=runs)


def _not_picked(runs: list[dict]) -> list[dict]:
    return [{**r, "picked": False} for r in runs]


def _region_step(graph: Graph, st: StepStructure, base: Simulation, costs: CostModel,
                 device: str, allow_lossy: bool
                 ) -> tuple[dict[str, str], Graph, StepStructure, Simulation] | None:
    """The step with every region variant substituted (a decomposed GELU differentiated
    from its input: ``activation_from_input``), its structure and its baseline; None when
    there is no region variant or substituting them does not lower the step's peak."""
    pre = region_variants(graph, st, allow_lossy=allow_lossy)
    if not pre:
        return None
    over = apply_variants(graph, Plan(variants=pre)).graph
    st1 = StepStructure.of(over)
    base1 = simulate(over, Plan(), costs, st1, device=device)
    if base1.peak_bytes >= base.peak_bytes:
        return None
    return pre, over, st1, base1


def _over_region_variants(graph: Graph, budget: int | None, costs: CostModel,
                          st: StepStructure, base: Simulation,
                          region_step: tuple[dict[str, str], Graph, StepStructure,
                                             Simulation], *,
                          strategy: str, time_limit: float, offload: bool, device: str,
                          allow_lossy: bool, heap_room: bool = False,
                          failed: list[dict] | None = None) -> PlanOutcome | None:
    """The plan found over ``region_step`` (``_region_step``), or None when none fits (then
    the runs that found nothing go into ``failed``, where given).

    The ILP offers these variants too, but excludes recomputing the nodes they cover: its
    recompute terms assume the default rules' readers. Near the floor the best plans do
    both (recompute the MLP, and keep only the GELU's input for its backward), so where the
    floor is searched the plan is also sought over the step with the variants already
    substituted, where the recompute terms are exact. The plan returned carries those
    variants too and is simulated again over ``graph``; the peaks agree."""
    pre, over, st1, base1 = region_step
    # The strategy asked for: ``auto`` runs sqrt(n), the ILP and the polish here too. With
    # sqrt(n) alone, a budget only this search could meet got sqrt(n)'s plan where
    # ``--strategy ilp`` found one a third cheaper (the zoo's GPT-2 at batch 8 x 64, width
    # 32: +30.6% against +20.2%; tests/test_auto_strategy.py). ``time_limit``: a budget's
    # search gets the whole limit, as the step as built did; ``--budget min``'s gets what
    # that left (the ILP's runs then say "not run: time limit reached" where it is none).
    try:
        # At a budget, without the smallest-peak search where nothing fits: the caller
        # runs that itself, as --budget min does.
        # For --budget min, under auto, sqrt(n) only: the smallest peak is the aim there,
        # and the ILP over the region variants added 17-60 s to --budget min on the zoo's
        # GPT-2 for a peak 1.3% lower (and CI's compile tests with it).
        sought = "sqrtn" if budget is None and strategy == "auto" else strategy
        alt = choose_plan(over, budget, costs, strategy=sought, time_limit=time_limit,
                          structure=st1, baseline=base1, offload=offload, device=device,
                          allow_lossy=allow_lossy, regions=False, heap_room=heap_room,
                          smallest_on_refusal=False)
    except BudgetError as exc:
        if failed is not None:
            failed.extend({**r, "region_variants": len(pre), "picked": False}
                          for r in exc.runs)
        return None
    plan = replace(alt.best.plan, variants={**pre, **alt.best.plan.variants})
    best = simulate(graph, plan, costs, st, host_copies=offload, device=device,
                    heap_base=small_buffers(graph) if heap_room else None)
    runs = [{**r, "region_variants": len(pre)} for r in alt.runs]
    cands = [{**c, "region_variants": True} for c in alt.candidates]
    return replace(alt, best=best, baseline=base, runs=runs, candidates=cands,
                   requested=strategy, picked=f"{alt.picked or alt.strategy} over region variants")


def _prepare(graph: Graph, st: StepStructure, base: Simulation, costs: CostModel,
             time_limit: float, offload: bool = False, variants: bool = True,
             device: str = "cpu", allow_lossy: bool = False,
             heap_room: bool = False) -> Planning:
    """The problem and the sqrt(n) segmentations (a strategy of their own, and the ILP's
    warm starts): the same for every budget."""
    offload = offload and costs.link is not None
    heap_base = small_buffers(graph) if heap_room else None
    pp = build_problem(graph, st, base.liveness, costs, offload=offload, variants=variants,
                       allow_lossy=allow_lossy)
    n_units = len(pp.groups)
    every = np.ones(n_units, dtype=bool)
    segmentations = [
        simulate(graph, pp.plan_units(chosen, "sqrtn", segments=k), costs, st, device=device,
                 heap_base=heap_base)
        for k, chosen in sqrtn.candidates(pp.units.crossing_bytes, pp.units.crossing_units,
                                          n_units, every)]
    segmentations.append(simulate(graph, pp.plan_units(every, "sqrtn", segments=0), costs, st,
                                  device=device, heap_base=heap_base))
    return Planning(graph, costs, st, base, pp, tuple(segmentations),
                    time.perf_counter() + time_limit, time_limit, host_copies=offload,
                    device=device, heap_base=heap_base)


def _choose(planning: Planning | None, base: Simulation, budget: int | None,
            strategy: str) -> PlanOutcome:
    found = Found()
    found.add("none", [base], {"strategy": "none", "detail": "baseline (recompute nothing)"})
    if planning is not None:
        found.extend(REGISTRY[strategy](planning, budget))
    elif strategy != "none":
        found.runs.append({"strategy": strategy, "detail": "the step as built fits the budget",
                           "status": "not run", "_sims": []})
    solver = found.solver or {"name": "none", "status": "not run", "gap": None}
    target = budget
    if budget is None and strategy in ("ilp", "auto"):
        target = min(s.peak_bytes for _, s in found.plans)
    return _finish(base, found.plans, target, strategy, solver, found.runs,
                   smallest_first=budget is None)


def _describe_runs(runs: list[dict], best: Simulation | None, limit: float) -> list[dict]:
    """Replace each run's simulations by what the report needs: how many plans, whether
    any fits, the cheapest fitting one (or else the smallest peak), and whether the winner
    came from this run."""
    out = []
    for run in runs:
        sims = run["_sims"]
        entry = {k: v for k, v in run.items() if k != "_sims"}
        fitting = [s for s in sims if s.peak_bytes <= limit]
        if sims:
            shown = min(fitting, key=lambda s: (s.added_time_s, s.peak_bytes)) if fitting \
                else min(sims, key=lambda s: s.peak_bytes)
            entry.update(plans=len(sims), fitting=len(fitting),
                         peak_bytes=shown.peak_bytes, added_time_s=shown.added_time_s)
        entry["picked"] = any(s is best for s in sims)
        out.append(entry)
    return out


def _finish(base: Simulation, found: list[tuple[str, Simulation]], budget: int | None,
            strategy: str, solver_info: dict, runs: list[dict], *,
            smallest_first: bool = False) -> PlanOutcome:
    """The cheapest plan within the budget (``smallest_first``: the smallest peak, then the
    cheapest among equals, for ``--budget min``)."""
    if strategy != "auto":
        pool = [(s, sim) for s, sim in found if s == strategy or s == "none"]
    else:
        pool = found
    smallest = min(sim.peak_bytes for _, sim in found)
    limit = math.inf if budget is None else budget
    # a budget holds a plan's added small buffers too (fit_bytes); the smallest peak is a peak
    fitting = [(s, sim) for s, sim in pool
               if (sim.peak_bytes if smallest_first else sim.fit_bytes) <= limit]
    cands = [{"strategy": s, "peak_bytes": sim.peak_bytes, "added_time_s": sim.added_time_s,
              **{k: v for k, v in sim.plan.notes.items() if k in ("segments", "rebuilt_again")}}
             for s, sim in found]
    if not fitting:
        raise BudgetError(
            f"the step does not fit the budget of {_fmt(budget)}: the smallest peak memcc "
            f"reached is {_fmt(smallest)} (baseline {_fmt(base.peak_bytes)}). Use "
            f"--budget {smallest} or more, or --budget min.",
            budget=int(budget or 0), smallest=smallest,
            runs=_describe_runs(runs, None, limit),
        )
    if smallest_first:
        name, best = min(fitting, key=lambda p: (p[1].peak_bytes, p[1].added_time_s))
    else:
        name, best = min(fitting, key=lambda p: (p[1].added_time_s, p[1].peak_bytes))
    described = _describe_runs(runs, best, limit)
    picked = name
    if name == "auto":
        start = next((r.get("from") for r in described if r["picked"] and r.get("from")), None)
        picked = f"{start}+polish" if start else "polish"
    elif any(r["picked"] and r.get("seed") for r in described):
        picked = f"{name} (sqrt(n) seed)"
    return PlanOutcome(best=best, baseline=base, strategy=name, solver=solver_info,
                       candidates=cands, smallest_peak=smallest, requested=strategy,
                       picked=picked, runs=described)


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
                           host_copies=host_copies, device=device)
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


def _fmt(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e6:,.1f} MB ({int(n):,} bytes)"
