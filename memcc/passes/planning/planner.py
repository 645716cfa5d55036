"""The plan pass: choose what to recompute so the step fits a budget at least added time.

In: the step, its costs and a ``PlanRequest`` (``request.py``: the budget, ``Budget.MIN``
for the smallest peak, the strategy, the time limit, the decision kinds allowed, the
device). Out: a ``PlanOutcome`` (the chosen plan simulated, the baseline, every run
tried), or a ``BudgetError`` carrying the smallest peak reached, in neutral words (the
flags a user gives are the caller's to name: ``compiler.planning``).

Every strategy (registered by name in ``strategies.py``: ``ilp``, ``sqrtn``, ``none``,
``auto``) returns simulated plans, and this pass picks the cheapest that fits, so every
strategy is judged by the same simulator and a plan is only ever reported as fitting when
the simulator says so. The ILP works on a linear model of memory (``model/problem.py``)
built here once per call by the term generators of each decision kind.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from memcc.errors import MemccError
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import LivenessReport, small_buffers
from memcc.passes.lowering.variant_substitution import apply_variants, region_variants
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.alternatives import nearest, runs_smallest
from memcc.passes.planning.model.offload_terms import OffloadVars, add_offload_terms
from memcc.passes.planning.model.problem import ProblemBuilder
from memcc.passes.planning.model.recompute_terms import add_recompute_terms
from memcc.passes.planning.model.variant_terms import (
    VariantScope,
    VariantVars,
    add_variant_terms,
)
from memcc.passes.planning.refusal import BudgetError
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate
from memcc.passes.planning.solvers import sqrtn
from memcc.passes.planning.strategies import (
    REGISTRY,
    PlanModel,
    PlanningContext,
    StrategyResult,
    StrategyRun,
)
from memcc.passes.planning.work import SIMULATED_NODES_PER_S

STRATEGIES = ("auto", *sorted(n for n in REGISTRY if n != "auto"))
# ``Budget.MIN``'s search over the region variants: the share of the time limit its work
# is counted from (``_Search.region_share``), and the room the solves before it leave for
# it, the rebuilt-again segmentations and compile's judging of the plan as trained, in
# units of this call's preparation (the model and the sqrt(n) segmentations simulated):
# that work took 2.7-4.75 of them on the zoo's GPT-2 with row chunks (loaded 2-core
# machine; the step with its region variants, now built before the solves, included),
# the rebuilt-again plans and the plan as trained alone about 1.5. The estimate only moves
# the solves' deadline: their work limits stay.
REGION_SHARE = 0.05
# How many of a search's other answers (``PlanOutcome.alternatives``) compile sheds.
ALTERNATIVES = 3
AFTER_MIN_PREPARES = 3.0
AFTER_MIN_PREPARES_NO_REGION = 1.5
# The sqrt(n) segmentations are simulated outside any solver, as cut and (where nothing
# fits, and always for ``Budget.MIN``) rebuilt again, over the step and at ``Budget.MIN``
# over its region variants too: four simulations per segment count. They may take this
# share of the work ``time_limit`` buys (``SIMULATED_NODES_PER_S``); past it the counts
# are thinned (``sqrtn.spread``), at least ``MIN_SEGMENT_COUNTS`` kept. On the dynamo
# GPT-2 export at batch 8 x 32 with row chunks (about 1,650 nodes) under --time-limit 10
# the 13 counts simulated four times took longer than the setting's share of the limit.
SEGMENTATION_SHARE = 0.35
MIN_SEGMENT_COUNTS = 4


@dataclass
class PlanOutcome:
    """What the plan pass decided (``best``, simulated, and the ``baseline`` it is weighed
    against) and how it got there: ``candidates`` and ``runs`` are the report's rows (every
    plan simulated, every strategy run), ``solver`` the last ILP solve's figures."""

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
    # The search's other answers over the same step as ``best``: each run's smallest plan,
    # cheapest first, every one: compile sheds the first ``ALTERNATIVES`` to a budget
    # (``compiler/shed_starts.py``), ``--budget min`` judges all as trained (three only:
    # a longer --time-limit's cheaper runs pushed out LCNet-050's, 11.19 -> 11.63 MB).
    alternatives: tuple[Simulation, ...] = ()
    # Every other plan over that step, smallest budget first (``alternatives.nearest``).
    near: tuple[Simulation, ...] = ()

    @property
    def label(self) -> str:
        """``auto -> ilp``: what was asked for and what was picked."""
        return f"{self.requested} -> {self.picked or self.strategy}"


# ---------------------------------------------------------------------------- the model
def build_problem(graph: Graph, st: StepStructure, live: LivenessReport,
                  costs: CostModel, kinds: DecisionKinds | None = None) -> PlanModel:
    """The linear model of ``graph``'s memory under every decision kind ``kinds`` allows:
    recompute (always), the gradient-rule variant of each node (``kinds.variants``; the
    lossy-tier ones, 16-bit storage, with ``kinds.lossy``), and on a device provider
    (``kinds.offload``) swap to host memory; each kind adds its variables and terms
    through its own generator."""
    kinds = kinds or DecisionKinds()
    builder = ProblemBuilder(np.asarray(live.live_during, dtype=np.float64))
    units = add_recompute_terms(builder, graph, st, live, costs)
    swaps = add_offload_terms(builder, graph, st, live, costs, units) if kinds.offload \
        else None
    chosen = add_variant_terms(builder, graph, st, live, costs,
                               VariantScope(units, swaps, kinds.lossy)) \
        if kinds.variants else VariantVars()
    return PlanModel(builder.build(), units, swaps or OffloadVars({}), chosen)


# ---------------------------------------------------------------------------- the pass
def choose_plan(graph: Graph, costs: CostModel, request: PlanRequest, *,
                structure: StepStructure | None = None,
                baseline: Simulation | None = None) -> PlanOutcome:
    """Pick the plan ``request`` asks for (``PlanRequest``: the budget, ``Budget.MIN`` for
    the smallest peak memcc can reach; the strategy; the decision kinds; ...).
    ``structure`` and ``baseline``: the step's, where the caller has them already.

    When nothing fits the budget, the smallest budget named in the error is found the way
    ``Budget.MIN`` finds it (and if that search finds a plan within the budget after all,
    it is returned), so the two can never disagree; ``request.smallest_on_refusal=False``
    refuses without that search. Where that search runs, ``request.regions`` plans once
    more over the step with its region variants in place (``_Search.over_regions``)."""
    if request.strategy not in REGISTRY:
        raise MemccError(f"--strategy '{request.strategy}': choose one of "
                         f"{', '.join(STRATEGIES)}")
    st = structure or StepStructure.of(graph)
    base = baseline or simulate(graph, Plan(), costs, st, SimulationRules(request.device))
    return _Search(graph, costs, request, st, base).run()


class _Search:
    """One ``choose_plan`` call: the step as given, and (built once, on first use) the step
    with its region variants in place; the runs that found nothing, kept for the report."""

    def __init__(self, graph: Graph, costs: CostModel, request: PlanRequest,
                 st: StepStructure, base: Simulation) -> None:
        self.graph, self.costs, self.request, self.st, self.base = \
            graph, costs, request, st, base
        # The step as built fits: no plan can add less than nothing, so no strategy runs.
        fits_as_built = request.budget.holds(base.peak_bytes)
        self.context: PlanningContext | None = \
            None if request.strategy == "none" or fits_as_built else _prepare(
                graph, costs, request, st, base)
        self.region_step: list = []  # built once, on first use: RegionStep or None
        self.tried: list[dict] = []  # runs that found nothing within the budget

    def run(self) -> PlanOutcome:
        budget = self.request.budget
        if budget.is_min:
            self._keep_room_for_the_region_search()
        try:
            found = _choose(self.context, self.base, budget, self.request.strategy)
            return self._smallest_of(found) if budget.is_min else found
        except BudgetError as exc:
            if budget.is_min:
                raise
            self.tried.extend(_not_picked(exc.runs))
            if not self.request.smallest_on_refusal:
                # The plan over the region variants at the budget still (a step that fits
                # only so fits), not the smallest-peak search.
                alt = self.over_regions(budget, self.request.time_limit, self.request.deadline)
                if alt is None:
                    raise
                return replace(alt, runs=self.tried + alt.runs)
        return self._after_refusal()

    def _smallest_of(self, found: PlanOutcome) -> PlanOutcome:
        """``Budget.MIN``: the smaller peak of ``found`` and the plan over the region
        variants, with both searches' candidates and runs."""
        alt = self.over_regions(Budget.MIN, *self.region_share())
        if alt is None:
            return found
        if found.best.fit_bytes <= alt.best.fit_bytes:
            return replace(found, candidates=found.candidates + alt.candidates,
                           runs=found.runs + _not_picked(alt.runs))
        return replace(_over_the_step(alt, found), candidates=found.candidates + alt.candidates,
                       runs=_not_picked(found.runs) + alt.runs)

    def _after_refusal(self) -> PlanOutcome:
        """Nothing found fits the budget. Over the step with its region variants in place,
        the same strategy with the whole time limit, as for the step as built (``auto``
        there runs the ILP too: with sqrt(n) alone it returned plans dearer than
        ``--strategy ilp``'s). Then the smallest peak, searched as ``Budget.MIN`` searches
        it (the same time limit, shared the same way), so that the budget a refusal names
        is ``--budget min``'s; a plan it finds within the budget after all is returned."""
        budget, time_limit = self.request.budget, self.request.time_limit
        alt = self.over_regions(budget, time_limit, self.request.deadline)
        if alt is not None:
            return replace(alt, runs=self.tried + alt.runs)
        if self.context is not None:
            # A fresh limit for the smallest peak, within the caller's deadline if it set one.
            end = time.perf_counter() + time_limit
            if self.request.deadline is not None:
                end = min(end, self.request.deadline)
            self.context = replace(self.context, deadline=end)
            self._keep_room_for_the_region_search()
        smallest = _choose(self.context, self.base, Budget.MIN, self.request.strategy)
        if smallest.best.fit_bytes <= budget.bytes:
            return replace(smallest, runs=self.tried + smallest.runs)
        runs = self.tried + _not_picked(smallest.runs)
        alt = self.over_regions(Budget.MIN, *self.region_share())
        if alt is not None:
            if alt.best.fit_bytes <= budget.bytes:
                return replace(alt, runs=runs + alt.runs)
            runs += _not_picked(alt.runs)
            if alt.best.fit_bytes < smallest.best.fit_bytes:
                smallest = _over_the_step(alt, smallest)
        raise _refusal(budget.bytes, smallest.best.peak_bytes, self.base.peak_bytes,
                       outcome=smallest, runs=runs)

    def region_share(self) -> tuple[float, float]:
        """``Budget.MIN``'s region search: its work (``REGION_SHARE`` of the time limit, a
        count that does not depend on the clock: it was what the first search left, so its
        polish ran more moves on a quiet machine) and its deadline (this call's, at least a
        second from now, so that its sqrt(n) plans and the report's entries exist)."""
        end = self.context.deadline if self.context is not None else time.perf_counter()
        return (REGION_SHARE * self.request.time_limit,
                max(end, time.perf_counter() + 1.0))

    def _keep_room_for_the_region_search(self) -> None:
        """``Budget.MIN`` simulates the segmentations rebuilt again after the solves, then
        plans over the region variants (and compile judges the plan as trained): the
        solves leave that work room before the deadline (``PlanningContext.after_s``),
        measured in this call's own preparation, so that it is not what overruns the limit
        (the zoo's GPT-2 with row chunks at --budget min: 10 s past a 30 s limit on a
        loaded machine). The step with its region variants is built here, before the
        solves, to know whether there is one to plan over."""
        if self.context is None:
            return
        region = self.request.regions and self.request.kinds.variants \
            and self._region() is not None
        prepares = AFTER_MIN_PREPARES if region else AFTER_MIN_PREPARES_NO_REGION
        self.context = replace(self.context, after_s=prepares * self.context.prepare_s)

    def _region(self) -> RegionStep | None:
        """The step with its region variants in place, built once (None: there is none)."""
        if not self.region_step:
            self.region_step.append(_region_step(self.graph, self.st, self.base, self.costs,
                                                 self.request))
        return self.region_step[0]

    def over_regions(self, budget: Budget, time_limit: float,
                     deadline: float | None) -> PlanOutcome | None:
        """The plan found over the step with its region variants in place
        (``_region_step``), or None where there is none or none fits (then the runs that
        found nothing go into ``tried``).

        The ILP offers these variants too, but excludes recomputing the nodes they cover:
        its recompute terms assume the default rules' readers. Near the floor the best plans
        do both (recompute the MLP, and keep only the GELU's input for its backward), so
        where the floor is searched the plan is also sought over the step with the variants
        already substituted, where the recompute terms are exact. The plan returned carries
        those variants too and is simulated again over the step as given; the peaks
        agree."""
        request = self.request
        if self.context is None or not (request.kinds.variants and request.regions):
            return None
        if not budget.is_min and time.perf_counter() > self.context.deadline:
            # At a budget, past the deadline (a screen of a row-chunk setting, or the
            # search before a refusal's smallest-peak one): not another whole search.
            self.tried.append({"strategy": request.strategy, "detail": "over region variants",
                               "status": "not run: time limit reached", "picked": False})
            return None
        region = self._region()
        if region is None:
            return None
        # The strategy asked for: ``auto`` runs sqrt(n), the ILP and the polish here too.
        # With sqrt(n) alone, a budget only this search could meet got sqrt(n)'s plan where
        # ``--strategy ilp`` found one a third cheaper (the zoo's GPT-2 at batch 8 x 64,
        # width 32: +30.6% against +20.2%; tests/test_auto_strategy.py). ``time_limit``: a
        # budget's search gets the whole limit, as the step as built did; ``Budget.MIN``'s
        # gets what that left (the ILP's runs then say "not run: time limit reached" where
        # it is none). At a budget, without the smallest-peak search where nothing fits:
        # the caller runs that itself, as --budget min does. For ``Budget.MIN``, under
        # auto, sqrt(n) only: the smallest peak is the aim there, and the ILP over the
        # region variants added 17-60 s to --budget min on the zoo's GPT-2 for a peak 1.3%
        # lower (and CI's compile tests with it).
        sought = "sqrtn" if budget.is_min and request.strategy == "auto" else request.strategy
        asked = replace(request, budget=budget, strategy=sought, time_limit=time_limit,
                        deadline=deadline, segment_counts=self.context.segment_counts,
                        kinds=replace(request.kinds, offload=self.context.host_copies),
                        regions=False, smallest_on_refusal=False)
        try:
            alt = choose_plan(region.graph, self.costs, asked, structure=region.structure,
                              baseline=region.baseline)
        except BudgetError as exc:
            self.tried.extend({**r, "region_variants": len(region.variants), "picked": False}
                              for r in exc.runs)
            return None
        plan = replace(alt.best.plan, variants={**region.variants, **alt.best.plan.variants})
        best = self.context.simulate(plan)
        runs = [{**r, "region_variants": len(region.variants)} for r in alt.runs]
        cands = [{**c, "region_variants": True} for c in alt.candidates]
        return replace(alt, best=best, baseline=self.base, runs=runs, candidates=cands,
                       requested=request.strategy, alternatives=(),
                       picked=f"{alt.picked or alt.strategy} over region variants")


def _refusal(budget: int, smallest: int, baseline: int, **given: Any) -> BudgetError:
    """The planner's refusal: the numbers, in neutral words (the flags a user gives are
    the caller's to name: ``compiler.planning``); ``given``: BudgetError's other fields."""
    return BudgetError(
        f"no plan fits the budget of {_fmt(budget)}: the smallest peak reached is "
        f"{_fmt(smallest)} (baseline {_fmt(baseline)})",
        budget=int(budget), smallest=smallest, **given)


def _not_picked(runs: list[dict]) -> list[dict]:
    return [{**r, "picked": False} for r in runs]


@dataclass(frozen=True)
class RegionStep:
    """The step with every region variant substituted (``variants``: node -> variant),
    its structure and its baseline."""

    variants: dict[str, str]
    graph: Graph
    structure: StepStructure
    baseline: Simulation


def _region_step(graph: Graph, st: StepStructure, base: Simulation, costs: CostModel,
                 request: PlanRequest) -> RegionStep | None:
    """The step with every region variant substituted (a decomposed GELU differentiated
    from its input: ``activation_from_input``); None when there is no region variant or
    substituting them does not lower the step's peak."""
    pre = region_variants(graph, st, allow_lossy=request.kinds.lossy)
    if not pre:
        return None
    over = apply_variants(graph, Plan(variants=pre)).graph
    st1 = StepStructure.of(over)
    base1 = simulate(over, Plan(), costs, st1, SimulationRules(request.device))
    if base1.peak_bytes >= base.peak_bytes:
        return None
    return RegionStep(pre, over, st1, base1)


def _prepare(graph: Graph, costs: CostModel, request: PlanRequest, st: StepStructure,
             base: Simulation) -> PlanningContext:
    """The model and the sqrt(n) segmentations (a strategy of their own, and the ILP's
    warm starts): the same for every budget."""
    began = time.perf_counter()
    offload = request.kinds.offload and costs.link is not None
    rules = SimulationRules(request.device, host_copies=offload,
                            heap_base=small_buffers(graph) if request.heap_room else None)
    pp = build_problem(graph, st, base.liveness, costs,
                       replace(request.kinds, offload=offload))
    n_units = len(pp.groups)
    every = np.ones(n_units, dtype=bool)
    # Judged without host copies, as they always were (a segmentation swaps nothing).
    seg_rules = replace(rules, host_copies=False)
    counts = segment_counts(request, len(graph.nodes))
    segmentations = [
        simulate(graph, pp.plan_units(chosen, "sqrtn", segments=k), costs, st, seg_rules)
        for k, chosen in sqrtn.candidates(pp.units.crossing_bytes, pp.units.crossing_units,
                                          n_units, every, max_candidates=counts)]
    segmentations.append(simulate(graph, pp.plan_units(every, "sqrtn", segments=0), costs, st,
                                  seg_rules))
    now = time.perf_counter()
    deadline = now + request.time_limit if request.deadline is None else request.deadline
    return PlanningContext(graph, costs, st, base, pp, tuple(segmentations), deadline,
                           request.time_limit, rules, prepare_s=now - began,
                           segment_counts=counts)


def segment_counts(request: PlanRequest, nodes: int) -> int:
    """How many sqrt(n) segment counts this call simulates: the request's, else as many as
    ``SEGMENTATION_SHARE`` of its work buys (a count from the limit and the step's size,
    not the clock, so that a busy machine plans the same)."""
    if request.segment_counts is not None:
        return request.segment_counts
    passes = 4 if request.budget.is_min else 2
    work = SEGMENTATION_SHARE * request.time_limit * SIMULATED_NODES_PER_S / max(nodes, 1)
    return max(MIN_SEGMENT_COUNTS, int(work / passes))


def _choose(context: PlanningContext | None, base: Simulation, budget: Budget,
            strategy: str) -> PlanOutcome:
    found = StrategyResult()
    found.add("none", [base], {"strategy": "none", "detail": "baseline (recompute nothing)"})
    if context is not None:
        found.extend(REGISTRY[strategy](context, budget))
    elif strategy != "none":
        found.runs.append(StrategyRun({"strategy": strategy,
                                       "detail": "the step as built fits the budget",
                                       "status": "not run"}))
    target = budget
    if budget.is_min and strategy in ("ilp", "auto"):
        target = Budget.of(min(s.peak_bytes for _, s in found.plans))
    return _finish(base, found, target, strategy, smallest_first=budget.is_min)


def _describe_runs(runs: list[StrategyRun], best: Simulation | None,
                   limit: float, *, by_peak: bool = False) -> list[dict]:
    """Each run's report row: its fields and what the report needs of its simulations:
    how many plans, whether any fits, the cheapest fitting one (or else the smallest
    peak), and whether the winner came from this run. A plan fits as ``_finish`` judges
    it: its peak and its added small buffers' heap room (``fit_bytes``) within ``limit``,
    or its peak alone (``by_peak``, the smallest-peak search); judged by the peak alone,
    a cheaper plan that the heap room put over the budget read "fits" next to a dearer
    one picked as "the cheapest plan that fits"."""
    out = []
    for run in runs:
        sims = run.sims
        entry = dict(run.fields)
        fitting = [s for s in sims if (s.peak_bytes if by_peak else s.fit_bytes) <= limit]
        if sims:
            shown = min(fitting, key=lambda s: (s.added_time_s, s.peak_bytes)) if fitting \
                else min(sims, key=lambda s: s.peak_bytes)
            entry.update(plans=len(sims), fitting=len(fitting),
                         peak_bytes=shown.peak_bytes, added_time_s=shown.added_time_s)
        entry["picked"] = any(s is best for s in sims)
        out.append(entry)
    return out


def _finish(base: Simulation, found: StrategyResult, target: Budget, strategy: str, *,
            smallest_first: bool = False) -> PlanOutcome:
    """The cheapest plan within ``target`` (``smallest_first``: the smallest peak, then the
    cheapest among equals, for ``Budget.MIN``)."""
    solver_info = found.solver or {"name": "none", "status": "not run", "gap": None}
    if strategy != "auto":
        pool = [(s, sim) for s, sim in found.plans if s == strategy or s == "none"]
    else:
        pool = found.plans
    smallest = min(sim.peak_bytes for _, sim in found.plans)
    limit = math.inf if target.is_min else target.bytes
    # a budget holds a plan's added small buffers too (fit_bytes); the smallest peak is a peak
    fitting = [(s, sim) for s, sim in pool
               if (sim.peak_bytes if smallest_first else sim.fit_bytes) <= limit]
    cands = [{"strategy": s, "peak_bytes": sim.peak_bytes, "added_time_s": sim.added_time_s,
              **{k: v for k, v in sim.plan.notes.items() if k in ("segments", "rebuilt_again")}}
             for s, sim in found.plans]
    if not fitting:
        raise _refusal(0 if target.is_min else target.bytes, smallest, base.peak_bytes,
                       runs=_describe_runs(found.runs, None, limit, by_peak=smallest_first),
                       smallest_fit=min(sim.fit_bytes for _, sim in found.plans))
    if smallest_first:
        # The smallest budget (peak and added heap room), not peak: SegFormer 7.48 -> 6.80 MB
        name, best = min(pool, key=lambda p: (p[1].fit_bytes, p[1].peak_bytes, p[1].added_time_s))
    else:
        name, best = min(fitting, key=lambda p: (p[1].added_time_s, p[1].peak_bytes))
    described = _describe_runs(found.runs, best, limit, by_peak=smallest_first)
    others = runs_smallest(found, best, pool)
    picked = name
    if name == "auto":
        start = next((r.get("from") for r in described if r["picked"] and r.get("from")), None)
        picked = f"{start}+polish" if start else "polish"
    elif any(r["picked"] and r.get("seed") for r in described):
        picked = f"{name} (sqrt(n) seed)"
    return PlanOutcome(best=best, baseline=base, strategy=name, solver=solver_info,
                       candidates=cands, smallest_peak=smallest, requested=strategy,
                       picked=picked, runs=described, alternatives=others,
                       near=nearest(best, pool, others))


def _over_the_step(winner: PlanOutcome, given: PlanOutcome) -> PlanOutcome:
    """``winner`` (the search over region variants) with alternatives over the step as
    given: ``given``'s answer and its alternatives (those of the region search are plans of
    the step with its variants substituted)."""
    return replace(winner, alternatives=(given.best, *given.alternatives), near=given.near)


def _fmt(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e6:,.1f} MB ({int(n):,} bytes)"
