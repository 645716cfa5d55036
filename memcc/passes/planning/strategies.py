"""Planning strategies, registered by name: each is a function of (what is planned, budget).

A strategy reads a ``Planning`` (the step, its linear model, the sqrt(n) segmentations and
the deadline; nothing in it changes) and a budget (``None``: the smallest peak it can
reach), and returns what it found: simulated plans, one entry per run for the report, and
the last solver's statistics. The plan pass (``planner.choose_plan``) picks the winner from
what the strategy returned, judging every plan by the same simulator. A new strategy is one
decorated function; ``--strategy`` lists whatever is registered.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.lowering.variant_substitution import overlapping
from memcc.passes.plan import Offload, Plan, StepStructure
from memcc.passes.planning.model.offload_terms import OffloadVars
from memcc.passes.planning.model.problem import Problem, Solution, SparseRows
from memcc.passes.planning.model.recompute_terms import RecomputeUnits
from memcc.passes.planning.model.variant_terms import KIND as VARIANT_KIND
from memcc.passes.planning.model.variant_terms import VariantVars
from memcc.passes.planning.simulate import Simulation, simulate
from memcc.passes.planning.solvers import ilp

TIGHTEN_ROUNDS = 10
POLISH_CANDIDATES = 64
POLISH_STARTS = 4
POLISH_SHARE = 0.25
# The polish's trades, on its cheapest plan (``_exchange``): stop recomputing one of the
# EXCHANGE_UNITS dearest units and recompute instead one of the EXCHANGE_PARTNERS cheapest
# units live at the peak that makes. Bounded by that count, so that the same step and budget
# give the same plan on a loaded machine, and by their own share of the time limit.
EXCHANGE_UNITS = 16
EXCHANGE_SHARE = 0.15
EXCHANGE_PARTNERS = 2
# How much more than the ILP's first answer (a share of the step's time) the rounds may cost
# before recompute alone is tried too (``_worth_recompute_alone``).
ROUNDS_SLACK = 0.02
# How far above the target the ILP's first answer may simulate before recompute alone is tried
# too, whatever the rounds cost (``_worth_recompute_alone``).
FAR_OFF = 0.05
# An answer stopped at a limit with a larger optimality gap than this is searched again from
# the smallest peak (``_weak_rounds``).
WEAK_GAP = 0.10


@dataclass(frozen=True)
class PlanProblem:
    """The array problem plus the mapping from its variables back to forward nodes, to the
    gradient-rule variants it may choose and, on a device provider, to the values it may
    swap out."""

    problem: Problem
    units: RecomputeUnits
    offload: OffloadVars = field(default_factory=lambda: OffloadVars({}))
    variants: VariantVars = field(default_factory=VariantVars)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return self.units.groups

    def plan(self, x: np.ndarray, strategy: str, **notes) -> Plan:
        """The plan a solution of ``problem`` stands for."""
        plan = self.plan_units(self.units.units_of(x), strategy, **notes)
        swapped = {v: Offload("host") for var, v in self.offload.value_of.items()
                   if x[var] > 0.5}
        chosen = dict(c for var, c in self.variants.choice_of.items() if x[var] > 0.5)
        if swapped:
            plan = replace(plan, offload=swapped)
        return replace(plan, variants=chosen) if chosen else plan

    def starts(self, sims: list[Simulation], graph: Graph) -> list[np.ndarray]:
        """Warm starts for the ILP from plans already simulated."""
        position = {n.name: i for i, n in enumerate(graph.nodes)}
        out = []
        for sim in sims:
            if sim.plan.recompute:
                x = self.units.start_from(self.problem.n_vars, sim.rerun_before, position)
                if x is not None:
                    out.append(x)
        return out

    def plan_units(self, chosen: np.ndarray, strategy: str, **notes) -> Plan:
        """The plan that recomputes the units marked in ``chosen`` (bool per unit)."""
        names = frozenset(n for u in np.nonzero(chosen)[0] for n in self.groups[int(u)])
        return Plan(names, strategy, notes)


@dataclass(frozen=True)
class Planning:
    """Everything a strategy may read. Built once per ``choose_plan`` call, so a refusal's
    ``--budget min`` search reuses the model and the segmentations."""

    graph: Graph
    costs: CostModel
    structure: StepStructure
    baseline: Simulation
    model: PlanProblem
    segmentations: tuple[Simulation, ...]
    deadline: float          # time.perf_counter() value after which strategies stop
    time_limit: float
    host_copies: bool = False  # a device provider: swapped-out copies are host memory
    device: str = "cpu"        # whose allocation rules the peak follows (simulate)
    # The step's small buffers, where plans must fit with the heap room of those they add
    # (``simulate(heap_base=...)``); None where they need not.
    heap_base: int | None = None

    def simulate(self, plan: Plan) -> Simulation:
        return simulate(self.graph, plan, self.costs, self.structure,
                        host_copies=self.host_copies, device=self.device,
                        heap_base=self.heap_base)

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass
class Found:
    """What a strategy returns: (candidate name, simulated plan) pairs, one report entry per
    run (each with its plans under ``_sims``), and the last ILP solve's statistics."""

    plans: list[tuple[str, Simulation]] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    solver: dict | None = None

    def add(self, name: str, sims: list[Simulation], run: dict) -> None:
        self.plans.extend((name, s) for s in sims)
        self.runs.append({**run, "_sims": sims})

    def extend(self, other: Found) -> None:
        self.plans.extend(other.plans)
        self.runs.extend(other.runs)
        self.solver = other.solver or self.solver


Strategy = Callable[[Planning, "int | None"], Found]
REGISTRY: dict[str, Strategy] = {}


def strategy(name: str) -> Callable[[Strategy], Strategy]:
    """Register a strategy under ``name`` (what ``--strategy`` accepts)."""
    def register(fn: Strategy) -> Strategy:
        REGISTRY[name] = fn
        return fn
    return register


@strategy("none")
def keep_everything(p: Planning, budget: int | None) -> Found:
    """The step as built: every value kept (the baseline)."""
    return Found()


@strategy("sqrtn")
def sqrt_n(p: Planning, budget: int | None) -> Found:
    """Chen et al.'s segmentations, one per segment count (``solvers/sqrtn.py``); where none
    fits, the same segmentations rebuilt again (``_rebuilt_again``)."""
    out = _segmented(p)
    _add_rebuilt_again(p, budget, out)
    return out


def _segmented(p: Planning) -> Found:
    out = Found()
    out.add("sqrtn", list(p.segmentations),
            {"strategy": "sqrtn", "detail": f"{len(p.segmentations)} segmentations"})
    return out


def _add_rebuilt_again(p: Planning, budget: int | None, out: Found) -> None:
    """When nothing found so far fits (or for ``--budget min``), each segmentation again
    with every recomputed node rebuilt for each later use instead of kept
    (``Plan.recompute_again``).

    A segmentation recomputes a segment once, when its backward begins, and keeps every
    clone until its own backward reader: all of the segment's activations are live at once,
    plus every boundary. Rebuilt again, a clone made only to reach another value is dropped
    as soon as that value exists; the next reader rebuilds it from the nearest kept value.
    What stays is the boundaries, one chain and one layer's activations, at the price of
    recomputing early layers of a segment once per later layer (Chen et al.'s recursive
    form, Griewank's revolve). Measured on the zoo's ResNet-50 (batch 32, 128 px,
    ``--budget min --no-variants``, BENCHMARKS.md): the smallest peak goes from 35.2% to
    30.1% of the step as built, at +26.9% predicted time once polished.
    Only where it is needed, since each plan costs a simulation; bounded by work (one
    simulation per segmentation of at least two segments, one per variant kind), not by the
    clock, so a busy machine gets the same plans. One segment rebuilds every layer from the
    inputs for every later one: quadratic time, and never the lowest peak where measured."""
    if budget is not None and any(sim.peak_bytes <= budget for _, sim in out.plans):
        return
    sims = []
    for seg in p.segmentations:
        if not seg.plan.recompute or int(seg.plan.notes.get("segments", 0)) < 2:
            continue
        plan = replace(seg.plan, recompute_again=seg.plan.recompute,
                       notes={**seg.plan.notes, "rebuilt_again": True})
        sims.append(p.simulate(plan))
    out.add("sqrtn", sims, {"strategy": "sqrtn", "rebuilt_again": True,
                            "detail": f"{len(sims)} segmentations, recomputed nodes rebuilt "
                                      "again for each later use"})
    if sims:
        lowest = min(sims, key=lambda sim: (sim.peak_bytes, sim.added_time_s))
        if budget is None or lowest.peak_bytes > budget:
            with_variants = _variant_kinds(p, lowest)
            if with_variants is not lowest:
                out.add("sqrtn", [with_variants],
                        {"strategy": "sqrtn", "rebuilt_again": True,
                         "detail": "the lowest of those, with the variant kinds that lower "
                                   "its peak"})


def _variant_kinds(p: Planning, start: Simulation) -> Simulation:
    """``start`` with whole variant kinds added (``Conv:chunks8`` on every Conv that offers
    it, ...) one kind at a time, each kept where the simulator finds a lower peak.

    The ILP chooses variants for plans it can model; a rebuilt-again plan it cannot, so the
    simulator judges kinds instead of single nodes: a handful of simulations instead of one
    per node, and a kind works the same way at every layer."""
    kinds: dict[str, dict[str, str]] = {}
    for node, name in p.model.variants.choice_of.values():
        kinds.setdefault(name, {}).setdefault(node, name)
    current = start
    for name in sorted(kinds):
        chosen = {**kinds[name], **current.plan.variants}   # a node keeps its first kind
        # A variant covering several nodes' rules (a decomposed GELU) excludes those nodes'
        # own variants: the kind chosen first keeps them.
        clash = overlapping(p.graph, chosen, keep=current.plan.variants)
        chosen = {n: v for n, v in chosen.items() if n not in clash}
        if chosen == dict(current.plan.variants):
            continue
        sim = p.simulate(replace(current.plan, variants=chosen))
        if sim.peak_bytes < current.peak_bytes:
            current = sim
    return current


@strategy("ilp")
def exact_model(p: Planning, budget: int | None) -> Found:
    """The MILP over the linear memory model (``solvers/ilp.py``), seeded with the sqrt(n)
    segmentations. ``budget=None``: minimise the modelled peak, then the time at the smallest
    peak found. While the simulator disagrees with the model (it states what the model
    leaves out: clone scratch, in-place writes between clones), the budget the model aims
    for is lowered by the excess (at most 5% a round: an answer far off says little about
    how far to go). What runs when, and why: docs/PLANNING_CORE.md, "What the ``ilp``
    strategy runs"."""
    out = Found()
    pp, prob, graph = p.model, p.model.problem, p.graph
    starts = pp.starts(list(p.segmentations), graph)
    # The MILP's first incumbents are candidates of the ILP strategy too (judged by the
    # simulator like its own answers), so the ILP never ends above a plan it started from;
    # the report names such a winner "ilp (sqrt(n) seed)".
    out.add("ilp", list(p.segmentations),
            {"strategy": "ilp", "detail": "seeds: sqrt(n) segmentations", "seed": True})
    target = budget
    known_rows: list[int] = []   # time points where memory binds, carried between solves
    if target is None:
        sol = _smallest_peak(p, starts, out, "smallest modelled peak", with_variants=True)
        known_rows = list(sol.rows)
        target = min(s.peak_bytes for _, s in out.plans + [("none", p.baseline)])

    first = _tighten(p, prob, float(target), starts, known_rows, out, "exact recompute model")
    if budget is not None and VARIANT_KIND in prob.kind \
            and _worth_recompute_alone(out, float(target), first, p.baseline.compute_cost_s):
        # The variants' terms are exact one at a time, but a combination with recompute can
        # be modelled below what the simulator finds, and the rounds that lower the budget
        # then end far above the plan recompute alone reaches. MONeT's ResNet-50 step
        # (BENCHMARKS.md) at 6.00 GB: the report's runs show five rounds with variants, the
        # only fitting one at +17.2%, and one round over recompute alone at +7.7%. So the
        # same rounds run again over recompute alone, from the memory rows already found;
        # the cheapest fitting plan wins.
        alone = Found()
        _tighten(p, _fixed_to_zero(prob, VARIANT_KIND), float(target), starts,
                 list(first.rows), alone, "exact recompute model without variants")
        out.extend(alone)
    if budget is not None and p.remaining() > 1.0 and _weak_rounds(out, float(target), first):
        # The rounds stopped at their work or time limit without a plan that fits (every
        # sqrt(n) seed above the budget, so the time objective had no incumbent to improve),
        # or with a fitting one far from optimal. The smallest-peak search finds another
        # fitting start, and the time objective runs again from it; the polish then starts
        # from the cheapest of them. MONeT's ResNet-50 step at 4.99 GB (BENCHMARKS.md): the
        # rounds ended with nothing (+21.7% polished, +11.7% with this), or, on the step
        # built a commit later, with a plan at +18.2% and a 50% gap (+15.7% polished,
        # +12.25% with this).
        low = _smallest_peak(p, starts, out, "smallest modelled peak, as another start",
                             with_variants=False)
        if low.status != "infeasible" and p.remaining() > 1.0:
            # One solve, on half of what is left, so the polish keeps its share of the
            # clock. Rounds here found nothing more on that step (a second round stopped
            # at its work limit without an answer) and took the compile to the time limit.
            sol = ilp.solve(prob, float(target), time_limit=p.remaining() / 2,
                            starts=[low.x, *starts], rows=list(low.rows))
            _add_answer(p, prob, sol, out, "exact recompute model, from the smallest peak",
                        float(target))
    return out


def _add_answer(p: Planning, prob: Problem, sol: Solution, out: Found, detail: str,
                model_budget: float) -> Simulation | None:
    """Record one time-objective solve in ``out``: its plan, simulated, when the solver
    answered (None when it proved the budget infeasible or stopped without an answer)."""
    if sol.status in ("infeasible", "time limit") or sol.status.startswith("not"):
        if sol.status == "time limit":
            # It ran and was stopped with nothing: the report's ``solver`` says so
            # (``limit_hit: "time"``), not "not run".
            out.solver = solver_info(sol)
        out.add("ilp", [], _ilp_run(sol, detail, model_budget))
        return None
    out.solver = solver_info(sol)
    sim = p.simulate(p.model.plan(sol.x, "ilp", modelled_peak=prob.peak(sol.x)))
    out.add("ilp", [sim], _ilp_run(sol, detail, model_budget))
    return sim


def _fitting_ilp_costs(out: Found, target: float) -> list[float]:
    """The added time of every plan the ILP strategy found that fits ``target``."""
    return [sim.added_time_s for _, sim in out.plans
            if sim.plan.strategy == "ilp" and sim.peak_bytes <= target]


def _ilp_fits(out: Found, target: float) -> bool:
    return bool(_fitting_ilp_costs(out, target))


def _weak_rounds(out: Found, target: float, rounds: _Rounds) -> bool:
    """Whether the rounds ended at a work or time limit with no fitting plan, or with one
    whose optimality gap is above ``WEAK_GAP``. A proven answer (optimal, or infeasible) is
    left alone."""
    if rounds.status in ("infeasible", "optimal", ""):
        return False
    if not _ilp_fits(out, target):
        return True
    return rounds.gap is None or rounds.gap > WEAK_GAP


def _smallest_peak(p: Planning, starts: list[np.ndarray], out: Found, detail: str, *,
                   with_variants: bool) -> Solution:
    """Minimise the modelled peak (time as the tie-breaker), simulate the answer and add it
    to ``out``. Searched over recompute (and swap) only: with the variant binaries too,
    this peak-objective MILP took twice as long and stopped at a higher peak on the planner
    tests' GPT-2 (measured: 60 s and 1,565,908 B against 26 s and 1,559,764 B).
    ``with_variants``: then once more with the variants, from that answer (never higher,
    often lower)."""
    pp, prob = p.model, p.model.problem
    recompute_only = _fixed_to_zero(prob, VARIANT_KIND)
    sol = ilp.solve(recompute_only, 0.0, time_limit=max(p.remaining(), 1.0) / 4,
                    objective="peak", starts=starts)
    if with_variants and recompute_only is not prob and sol.status != "infeasible":
        sol = ilp.solve(prob, 0.0, time_limit=max(p.remaining(), 1.0) / 3,
                        objective="peak", starts=[sol.x, *starts], rows=list(sol.rows))
    out.solver = solver_info(sol)
    sims = []
    if sol.status != "infeasible":
        sims = [p.simulate(pp.plan(sol.x, "ilp", modelled_peak=prob.peak(sol.x)))]
    out.add("ilp", sims, _ilp_run(sol, detail, None))
    return sol


class _Rounds(NamedTuple):
    """What ``_tighten`` learnt: the first answer's modelled cost and simulated peak (None
    when nothing was solved), the memory rows the last solve ended with, and its status
    and gap (``_weak_rounds``)."""

    first_cost: float | None
    first_peak: int | None
    rows: tuple[int, ...]
    status: str          # the last solve's ("" when none ran)
    gap: float | None    # the last solve's optimality gap


def _worth_recompute_alone(out: Found, target: float, first: _Rounds, step_s: float) -> bool:
    """Whether the rounds over variants and recompute may have ended far above what
    recompute alone reaches: no round fit, the first answer was more than ``FAR_OFF`` above
    the target (the model was misled, and lowering its budget says little), or the fitting
    plan costs more than ``ROUNDS_SLACK`` of the step above the first answer's promise.

    Otherwise the second set of solves is not worth its time: on the 5,097-node GPT-2 at
    33% the first answer was 1.7% above the target, the second round cost 0.35% of the step
    more, and recompute alone then found a plan 0.03% cheaper in 18 s of solving. On
    MONeT's ResNet-50 step the first answers were 7-10% above at 8.01 and 6.00 GB, and
    recompute alone was cheaper by about 0.5% of the step (BENCHMARKS.md)."""
    if first.first_cost is None or first.first_peak is None:
        return False
    fitting = _fitting_ilp_costs(out, target)
    if not fitting or first.first_peak > (1 + FAR_OFF) * target:
        return True
    return min(fitting) - first.first_cost > ROUNDS_SLACK * step_s


def _tighten(p: Planning, prob: Problem, target: float, starts: list[np.ndarray],
             known_rows: list[int], out: Found, label: str) -> _Rounds:
    """Solve ``prob`` at ``target``; while the simulator finds the answer above it, lower
    the budget the model aims for by the excess (at most 5% a round) and solve again."""
    pp, graph = p.model, p.graph
    eff = target
    first_cost: float | None = None
    first_peak: int | None = None
    status, gap = "", None
    for round_ in range(1, TIGHTEN_ROUNDS + 1):
        if _ilp_fits(out, target):
            break
        detail = label if round_ == 1 else \
            f"{label}, budget lowered by the simulator's excess (round {round_})"
        if p.remaining() <= 0.5:
            out.solver = {**(out.solver or {"name": "none", "gap": None}),
                          "status": (out.solver or {}).get("status", "time limit"),
                          "limit_hit": "time"}
            out.add("ilp", [], {"strategy": "ilp", "detail": detail,
                                "status": "not run: time limit reached"})
            break
        sol = ilp.solve(prob, eff, time_limit=p.remaining(),
                        starts=starts + pp.starts([s for _, s in out.plans], graph),
                        rows=known_rows)
        known_rows = list(sol.rows)
        status, gap = sol.status, sol.gap
        sim = _add_answer(p, prob, sol, out, detail, eff)
        if sim is None:
            break
        if first_cost is None:
            first_cost, first_peak = float(sol.objective), sim.peak_bytes
        if sim.peak_bytes <= target:
            break
        eff -= min(sim.peak_bytes - target, 0.05 * target) * 1.05 + 1.0
    return _Rounds(first_cost, first_peak, tuple(known_rows), status, gap)


@strategy("auto")
def best_of_all(p: Planning, budget: int | None) -> Found:
    """sqrt(n) and the ILP, then the polish (stop recomputing the most expensive nodes of
    the cheapest fitting plans while the simulator says the step still fits)."""
    out = _segmented(p)
    solved = exact_model(p, budget)
    # The ILP's seeds are the segmentations sqrt(n) already returned.
    seeds = {id(s) for s in p.segmentations}
    solved.plans = [(n, s) for n, s in solved.plans if id(s) not in seeds]
    solved.runs = [r for r in solved.runs if not r.get("seed")]
    out.extend(solved)
    _add_rebuilt_again(p, budget, out)
    target = budget if budget is not None else min(
        [s.peak_bytes for _, s in out.plans] + [p.baseline.peak_bytes])
    # The polish is a refinement: it gets at most a quarter of the time limit.
    deadline = min(p.deadline, time.perf_counter() + POLISH_SHARE * p.time_limit)
    # Plans the ILP proved optimal (within its gap) in its model: the trades look for what
    # a solve stopped at a limit left, and on such a plan they cost time for nothing (the
    # 5,097-node GPT-2 at 33%: 8 s, no trade).
    proven = {id(s) for r in out.runs if r.get("status") == "optimal" for s in r["_sims"]}
    polished = _polish(p, out.plans, target, deadline, room=budget is not None,
                       proven=proven)
    if polished is None:
        out.add("auto", [], {"strategy": "polish", "detail": "the cheapest fitting plans",
                             "status": "no improvement"})
    else:
        sim, start, trades = polished
        out.add("auto", [sim], {"strategy": "polish", "detail": f"from the {start} plan",
                                "from": start, "status": "improved", "trades": trades})
    return out


def _polish(p: Planning, found: list[tuple[str, Simulation]], budget: float,
            deadline: float, *, room: bool = False,
            proven: set[int] | frozenset[int] = frozenset()
            ) -> tuple[Simulation, str, int] | None:
    """Start from the cheapest fitting plans and stop recomputing their most expensive nodes
    one by one, then drop their time-costing variants, while the simulator says the step
    still fits (exact, so it never breaks a plan). Several starts, because the cheapest
    plan is not always the one that polishes best (a sqrt(n) plan with more segments may
    shed more). Returns the best polished plan, the strategy of the plan it started
    from (the report names it: ``sqrtn+polish``) and how many trades (``_exchange``) it
    kept. ``room``: judge fitting by
    ``Simulation.fit_bytes`` (a budget, not the smallest peak, holds the heap room of the
    small buffers a plan adds). ``proven``: ids of plans an ILP solve proved optimal; the
    trades are left out where the best plan is one of them."""
    pp = p.model

    def size(sim: Simulation) -> int:
        return sim.fit_bytes if room else sim.peak_bytes

    fitting = sorted(((name, sim) for name, sim in found
                      if size(sim) <= budget and (sim.plan.recompute
                                                       or sim.plan.variants)),
                     key=lambda q: q[1].added_time_s)
    variant_cost = {c: float(pp.problem.cost[var]) for var, c in pp.variants.choice_of.items()}
    index = {n: i for i, g in enumerate(pp.groups) for n in g}
    best: tuple[Simulation, str] | None = None
    seen: set[frozenset[str]] = set()

    def by_cost(names: frozenset[str]) -> list[int]:
        """The units holding ``names``, dearest first."""
        units = {index[n] for n in names if n in index}
        return sorted(units, key=lambda u: -pp.units.unit_cost[u])[:POLISH_CANDIDATES]

    for start_name, start in fitting[:POLISH_STARTS]:
        key = (start.plan.recompute, frozenset(start.plan.variants.items()))
        if key in seen:
            continue
        seen.add(key)
        # Stop recomputing the dearest units (their rebuilt-again marks go with them).
        current = _shed(p, start, budget, deadline, size, [
            lambda plan, g=frozenset(pp.groups[i]): without(plan, g)
            for i in by_cost(start.plan.recompute)])
        # Then share the clones of rebuilt-again units, dearest first: each one shared is a
        # chain that no longer runs twice.
        current = _shed(p, current, budget, deadline, size, [
            lambda plan, g=frozenset(pp.groups[i]): replace(
                plan, recompute_again=plan.recompute_again - g)
            for i in by_cost(current.plan.recompute_again)])
        # Then the variants that cost time, dearest first: the model may have credited one
        # with a saving the simulator does not see.
        dear = sorted((n for n, v in current.plan.variants.items()
                       if variant_cost.get((n, v), 0.0) > 0),
                      key=lambda n: -variant_cost[(n, current.plan.variants[n])])
        current = _shed(p, current, budget, deadline, size, [
            lambda plan, node=node: replace(
                plan, variants={n: v for n, v in plan.variants.items() if n != node})
            for node in dear[:POLISH_CANDIDATES]])
        if current is not start and (best is None
                                     or current.added_time_s < best[0].added_time_s):
            best = (current, start_name)
    # Then trade, on the best plan only: a dear unit that does not fit when shed alone may
    # fit when cheaper units live at the new peak are recomputed instead. Its own share of
    # the limit, so that slow starts above do not leave it none.
    if not fitting:
        return None
    # The cheapest plan so far: a polished one, or the cheapest start where the polish
    # left every start dearer than it.
    current, start_name = min([(fitting[0][1], fitting[0][0])] + ([best] if best else []),
                              key=lambda q: q[0].added_time_s)
    if id(current) in proven:
        return None if best is None else (*best, 0)
    traded, trades = _exchange(
        p, current, budget,
        min(p.deadline, time.perf_counter() + EXCHANGE_SHARE * p.time_limit),
        size, index, by_cost(current.plan.recompute)[:EXCHANGE_UNITS])
    if traded is not current:
        return traded, start_name, trades
    return None if best is None else (*best, 0)


def without(plan: Plan, group: frozenset[str]) -> Plan:
    """``plan`` no longer recomputing the nodes of ``group`` (their rebuilt-again marks go
    with them): the move the polish and its trades are made of."""
    return replace(plan, recompute=plan.recompute - group,
                   recompute_again=plan.recompute_again - group)


def _exchange(p: Planning, current: Simulation, budget: float, deadline: float,
              size: Callable[[Simulation], int], index: dict[str, int],
              dear: list[int]) -> tuple[Simulation, int]:
    """For each of the ``dear`` units (dearest first): stop recomputing it, and where the
    step then no longer fits, recompute instead one of the cheaper units whose values
    recomputing moves out of the new peak (``_partners``; cheapest per byte first, at most
    ``EXCHANGE_PARTNERS`` tries). Keeps a trade where the simulator says the step fits and
    costs less. Returns the plan and the number of trades kept.

    Shedding alone cannot make these moves, and the ILP, stopped at its limit with a gap,
    leaves them: on MONeT's ResNet-50 step at 4.99 GB the trades took the polished plan
    from +12.2% to +11.0% (BENCHMARKS.md, "Eleventh session")."""
    pp = p.model
    cost = pp.units.unit_cost
    producer = p.graph.producers()
    trades = 0
    for a in dear:
        if time.perf_counter() > deadline:
            break
        g_a = frozenset(pp.groups[a])
        if not g_a <= current.plan.recompute:
            continue
        shed = without(current.plan, g_a)
        sim = p.simulate(replace(shed, strategy="auto"))
        if size(sim) <= budget:
            if sim.added_time_s < current.added_time_s:
                current = sim
            continue
        # A partner lowers the new peak by at most the bytes of its values live there.
        freed = _partners(sim, shed, p.structure.forward, producer, index, cost,
                          float(cost[a]))
        excess = size(sim) - budget
        for b in [u for u in freed if freed[u] >= excess][:EXCHANGE_PARTNERS]:
            if time.perf_counter() > deadline:
                break
            traded = p.simulate(replace(
                shed, recompute=shed.recompute | frozenset(pp.groups[b]), strategy="auto"))
            if size(traded) <= budget and traded.added_time_s < current.added_time_s:
                current = traded
                trades += 1
                break
    return current, trades


def _partners(sim: Simulation, plan: Plan, forward: frozenset[str] | set[str],
              producer: dict, index: dict[str, int], cost: np.ndarray,
              below: float) -> dict[int, int]:
    """Units not recomputed by ``plan``, cheaper than ``below``, that produce a value live
    at ``sim``'s peak which recomputing would move out of it: every forward reader of the
    value runs before the peak and every other reader (backward nodes, clones) after it.
    Unit -> the bytes of its values live there, cheapest per byte first."""
    live = sim.liveness
    t = live.peak_step
    if t < 0:
        return {}
    wanted = {v for v in live.live_at_peak if v in producer}
    readers: dict[str, list[tuple[int, bool]]] = {v: [] for v in wanted}
    for i, n in enumerate(sim.graph.nodes):
        for v in n.input:
            if v in readers:
                readers[v].append((i, n.name in forward))
    freed: dict[int, int] = {}
    for v in wanted:
        life = live.values.get(v)
        if life is None or not life.owns_buffer or any(
                (i >= t) if fwd else (i <= t) for i, fwd in readers[v]):
            continue
        name = producer[v].name
        u = index.get(name)
        if u is None or name in plan.recompute or cost[u] >= below:
            continue
        freed[u] = freed.get(u, 0) + life.nbytes
    return {u: freed[u] for u in sorted(freed, key=lambda u: (float(cost[u]) / freed[u], u))}


def _shed(p: Planning, current: Simulation, budget: float, deadline: float,
          size: Callable[[Simulation], int], steps: list[Callable[[Plan], Plan]]
          ) -> Simulation:
    """Apply each of ``steps`` (a plan -> a cheaper plan) to the plan kept so far, in order,
    keeping the result where the simulator says the step still fits and costs less."""
    for step in steps:
        if time.perf_counter() > deadline:
            break
        sim = p.simulate(replace(step(current.plan), strategy="auto"))
        if size(sim) <= budget and sim.added_time_s < current.added_time_s:
            current = sim
    return current


def _fixed_to_zero(prob: Problem, kind: str) -> Problem:
    """``prob`` with every variable of decision kind ``kind`` held at 0 (one row each)."""
    fixed = [i for i, k in enumerate(prob.kind) if k == kind]
    if not fixed:
        return prob
    rows = prob.rows
    extra_ptr = rows.ptr[-1] + np.arange(1, len(fixed) + 1, dtype=np.int64)
    return replace(prob, rows=SparseRows(
        np.concatenate([rows.ptr, extra_ptr]),
        np.concatenate([rows.var, np.asarray(fixed, dtype=np.int64)]),
        np.concatenate([rows.coef, np.ones(len(fixed))]),
        np.concatenate([rows.rhs, np.zeros(len(fixed))])))


def solver_info(sol: Solution) -> dict:
    objective = sol.objective if math.isfinite(sol.objective) else None
    return {"name": sol.solver, "status": sol.status, "gap": sol.gap,
            "solve_time_s": round(sol.solve_time_s, 3), "rounds": sol.iterations,
            "objective_s": objective, "limit_hit": sol.limit_hit}


def _ilp_run(sol: Solution, detail: str, model_budget: float | None) -> dict:
    """One ILP solve for the report; an infeasible model has no objective (None, not inf:
    inf is not JSON)."""
    objective = sol.objective if math.isfinite(sol.objective) else None
    run = {"strategy": "ilp", "detail": detail, "status": sol.status, "solver": sol.solver,
           "objective_s": objective, "gap": sol.gap,
           "solve_time_s": round(sol.solve_time_s, 3), "limit_hit": sol.limit_hit}
    if model_budget is not None:
        run["model_budget_bytes"] = int(model_budget)
    return run
