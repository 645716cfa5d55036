"""The plan pass: choose what to recompute so the step fits a budget at least added time.

Every strategy (``ilp``, ``sqrtn``, ``none``, ``auto``) returns a ``Plan`` and is judged by
the same simulator. The ILP works on a linear model of memory (``solvers/problem.py``);
when the simulated peak of its answer is above the budget (the model is an approximation
of ORT's buffer rules), the model's budget is lowered by the excess and it is solved again,
so a plan is only ever reported as fitting when the simulator says so.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from memcc.errors import MemccError
from memcc.graph import Graph
from memcc.passes.cost_model import CostModel
from memcc.passes.liveness import LivenessReport
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.simulate import Simulation, simulate
from memcc.passes.solvers import ilp, sqrtn
from memcc.passes.solvers.problem import Problem, ProblemBuilder
from memcc.passes.solvers.recompute_terms import RecomputeUnits, add_recompute_terms

STRATEGIES = ("auto", "ilp", "sqrtn", "none")
TIGHTEN_ROUNDS = 10


class BudgetError(MemccError):
    """No strategy found a plan within the budget; carries the smallest reachable peak."""

    def __init__(self, message: str, *, budget: int, smallest: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.smallest = smallest


@dataclass(frozen=True)
class PlanProblem:
    """The array problem plus the mapping from its variables back to forward nodes."""

    problem: Problem
    units: RecomputeUnits

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return self.units.groups

    def plan(self, x: np.ndarray, strategy: str, **notes) -> Plan:
        """The plan a solution of ``problem`` stands for."""
        return self.plan_units(self.units.units_of(x), strategy, **notes)

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
                  costs: CostModel) -> PlanProblem:
    """The linear model of ``graph``'s memory under every decision kind (recompute today;
    each kind adds its variables and terms through its own generator)."""
    builder = ProblemBuilder(np.asarray(live.live_during, dtype=np.float64))
    units = add_recompute_terms(builder, graph, st, live, costs)
    return PlanProblem(builder.build(), units)


# ---------------------------------------------------------------------------- strategies
def choose_plan(graph: Graph, budget: int | None, costs: CostModel, *,
                strategy: str = "auto", time_limit: float = 60.0,
                structure: StepStructure | None = None,
                baseline: Simulation | None = None) -> PlanOutcome:
    """Pick the plan; ``budget=None`` means the smallest peak memcc can reach.

    When nothing fits ``budget``, the smallest budget named in the error is found the way
    ``--budget min`` finds it (and if that search finds a plan within ``budget`` after all,
    it is returned), so the two can never disagree."""
    if strategy not in STRATEGIES:
        raise MemccError(f"--strategy '{strategy}': choose one of {', '.join(STRATEGIES)}")
    st = structure or StepStructure.of(graph)
    base = baseline or simulate(graph, Plan(), costs, st)
    prepared = None if strategy == "none" else _prepare(graph, st, base, costs)
    try:
        return _choose(graph, budget, costs, strategy, time_limit, st, base, prepared)
    except BudgetError:
        if budget is None:
            raise
        smallest = _choose(graph, None, costs, strategy, time_limit, st, base, prepared)
        if smallest.best.peak_bytes <= budget:
            return smallest
        raise BudgetError(
            f"the step does not fit the budget of {_fmt(budget)}: the smallest peak memcc "
            f"reached is {_fmt(smallest.best.peak_bytes)} (baseline {_fmt(base.peak_bytes)})."
            f" Use --budget {smallest.best.peak_bytes} or more, or --budget min.",
            budget=int(budget), smallest=smallest.best.peak_bytes) from None


def _prepare(graph: Graph, st: StepStructure, base: Simulation, costs: CostModel
             ) -> tuple[PlanProblem, list[Simulation]]:
    """The problem and the sqrt(n) segmentations (a strategy of their own, and the ILP's
    warm starts): the same for every budget, so a refusal's ``--budget min`` search reuses
    them."""
    pp = build_problem(graph, st, base.liveness, costs)
    n_units = len(pp.groups)
    every = np.ones(n_units, dtype=bool)
    segmentations = [
        simulate(graph, pp.plan_units(chosen, "sqrtn", segments=k), costs, st)
        for k, chosen in sqrtn.candidates(pp.units.crossing_bytes, pp.units.crossing_units,
                                          n_units, every)]
    segmentations.append(simulate(graph, pp.plan_units(every, "sqrtn", segments=0), costs, st))
    return pp, segmentations


def _choose(graph: Graph, budget: int | None, costs: CostModel, strategy: str,
            time_limit: float, st: StepStructure, base: Simulation,
            prepared: tuple[PlanProblem, list[Simulation]] | None = None) -> PlanOutcome:
    deadline = time.perf_counter() + time_limit
    solver_info: dict = {"name": "none", "status": "not run", "gap": None}
    found: list[tuple[str, Simulation]] = [("none", base)]
    runs: list[dict] = [{"strategy": "none", "detail": "baseline (recompute nothing)",
                         "_sims": [base]}]
    if strategy == "none":
        return _finish(base, found, budget, "none", solver_info, runs,
                       smallest_first=budget is None)

    pp, segmentations = prepared or _prepare(graph, st, base, costs)
    prob = pp.problem
    target = budget

    starts = pp.starts(segmentations, graph)
    if strategy == "ilp":
        # The MILP's first incumbents are candidates of the ILP strategy too (judged by the
        # simulator like its own answers), so the ILP never ends above a plan it started
        # from; the report names such a winner "ilp (sqrt(n) seed)".
        found.extend(("ilp", sim) for sim in segmentations)
        runs.append({"strategy": "ilp", "detail": "seeds: sqrt(n) segmentations",
                     "seed": True, "_sims": segmentations})
    if strategy in ("sqrtn", "auto"):
        found.extend(("sqrtn", sim) for sim in segmentations)
        runs.append({"strategy": "sqrtn", "detail": f"{len(segmentations)} segmentations",
                     "_sims": segmentations})
        if strategy == "sqrtn":
            return _finish(base, found, budget, "sqrtn", solver_info, runs,
                           smallest_first=budget is None)

    if target is None:
        # The smallest peak: minimise the modelled peak, then compare with the heuristics.
        remaining = max(deadline - time.perf_counter(), 1.0)
        sol = ilp.solve(prob, 0.0, time_limit=remaining / 2, objective="peak", starts=starts)
        solver_info = _solver_info(sol)
        sims = []
        if sol.status not in ("infeasible",):
            sims = [simulate(graph, pp.plan(sol.x, "ilp", modelled_peak=prob.peak(sol.x)),
                             costs, st)]
            found.append(("ilp", sims[0]))
        runs.append(_ilp_run(sol, "smallest modelled peak", None, sims))
        target = min(s.peak_bytes for _, s in found)

    # Solve at the target; while the simulator disagrees with the model (it states what
    # the model leaves out: clone scratch, in-place writes between clones), lower the
    # budget the model aims for by the excess (at most 5% a round: an answer far off says
    # little about how far to go).
    eff = float(target)
    for round_ in range(1, TIGHTEN_ROUNDS + 1):
        if any(s == "ilp" and sim.peak_bytes <= target and sim.plan.strategy == "ilp"
               for s, sim in found):
            break
        detail = "exact recompute model" if round_ == 1 else \
            f"exact recompute model, budget lowered by the simulator's excess (round {round_})"
        remaining = deadline - time.perf_counter()
        if remaining <= 0.5:
            solver_info["status"] = solver_info.get("status", "time limit")
            solver_info["limit_hit"] = "time"
            runs.append({"strategy": "ilp", "detail": detail,
                         "status": "not run: time limit reached", "_sims": []})
            break
        sol = ilp.solve(prob, eff, time_limit=remaining,
                        starts=starts + pp.starts([s for _, s in found], graph))
        if sol.status in ("infeasible", "time limit") or sol.status.startswith("not"):
            runs.append(_ilp_run(sol, detail, eff, []))
            break
        solver_info = _solver_info(sol)
        sim = simulate(graph, pp.plan(sol.x, "ilp", modelled_peak=prob.peak(sol.x)), costs, st)
        found.append(("ilp", sim))
        runs.append(_ilp_run(sol, detail, eff, [sim]))
        if sim.peak_bytes <= target:
            break
        eff -= min(sim.peak_bytes - target, 0.05 * target) * 1.05 + 1.0
    if strategy == "auto":
        # The polish is a refinement: it gets at most a quarter of the time limit.
        polish_deadline = min(deadline, time.perf_counter() + POLISH_SHARE * time_limit)
        polished = _polish(graph, pp, found, target, costs, st, polish_deadline)
        if polished is None:
            runs.append({"strategy": "polish", "detail": "the cheapest fitting plans",
                         "status": "no improvement", "_sims": []})
        else:
            sim, start = polished
            found.append(("auto", sim))
            runs.append({"strategy": "polish", "detail": f"from the {start} plan",
                         "from": start, "status": "improved", "_sims": [sim]})
    return _finish(base, found, target, strategy, solver_info, runs,
                   smallest_first=budget is None)


POLISH_CANDIDATES = 64
POLISH_STARTS = 4
POLISH_SHARE = 0.25


def _polish(graph: Graph, pp: PlanProblem, found: list[tuple[str, Simulation]],
            budget: float, costs: CostModel, st: StepStructure,
            deadline: float) -> tuple[Simulation, str] | None:
    """Start from the cheapest fitting plans and stop recomputing their most expensive nodes
    one by one while the simulator says the step still fits (exact, so it never breaks a
    plan). Several starts, because the cheapest plan is not always the one that polishes
    best (a sqrt(n) plan with more segments may shed more). Returns the best polished plan
    and the strategy of the plan it started from (the report names it: ``sqrtn+polish``)."""
    fitting = sorted(((name, sim) for name, sim in found
                      if sim.peak_bytes <= budget and sim.plan.recompute),
                     key=lambda p: p[1].added_time_s)
    index = {n: i for i, g in enumerate(pp.groups) for n in g}
    best: tuple[Simulation, str] | None = None
    seen: set[frozenset[str]] = set()
    for start_name, start in fitting[:POLISH_STARTS]:
        if start.plan.recompute in seen:
            continue
        seen.add(start.plan.recompute)
        chosen = set(start.plan.recompute)
        groups = {index[n] for n in chosen if n in index}
        order = sorted(groups, key=lambda i: -pp.units.unit_cost[i])[:POLISH_CANDIDATES]
        current = start
        for i in order:
            if time.perf_counter() > deadline:
                break
            trial = chosen - set(pp.groups[i])
            sim = simulate(graph, Plan(frozenset(trial), "auto"), costs, st)
            if sim.peak_bytes <= budget and sim.added_time_s < current.added_time_s:
                chosen, current = trial, sim
        if current is not start and (best is None
                                     or current.added_time_s < best[0].added_time_s):
            best = (current, start_name)
    return best


def _solver_info(sol) -> dict:
    objective = sol.objective if math.isfinite(sol.objective) else None
    return {"name": sol.solver, "status": sol.status, "gap": sol.gap,
            "solve_time_s": round(sol.solve_time_s, 3), "rounds": sol.iterations,
            "objective_s": objective, "limit_hit": sol.limit_hit}


def _ilp_run(sol, detail: str, model_budget: float | None, sims: list[Simulation]) -> dict:
    """One ILP solve for ``PlanOutcome.runs``; an infeasible model has no objective (None,
    not inf: inf is not JSON)."""
    objective = sol.objective if math.isfinite(sol.objective) else None
    run = {"strategy": "ilp", "detail": detail, "status": sol.status, "solver": sol.solver,
           "objective_s": objective, "gap": sol.gap,
           "solve_time_s": round(sol.solve_time_s, 3), "limit_hit": sol.limit_hit,
           "_sims": sims}
    if model_budget is not None:
        run["model_budget_bytes"] = int(model_budget)
    return run


def _describe_runs(runs: list[dict], best: Simulation, limit: float) -> list[dict]:
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
    fitting = [(s, sim) for s, sim in pool if sim.peak_bytes <= limit]
    cands = [{"strategy": s, "peak_bytes": sim.peak_bytes, "added_time_s": sim.added_time_s,
              **{k: v for k, v in sim.plan.notes.items() if k == "segments"}}
             for s, sim in found]
    if not fitting:
        raise BudgetError(
            f"the step does not fit the budget of {_fmt(budget)}: the smallest peak memcc "
            f"reached is {_fmt(smallest)} (baseline {_fmt(base.peak_bytes)}). Use "
            f"--budget {smallest} or more, or --budget min.",
            budget=int(budget or 0), smallest=smallest,
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


def _fmt(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e6:,.1f} MB ({int(n):,} bytes)"
