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
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np

from memcc.errors import MemccError
from memcc.graph import Graph
from memcc.passes.cost_model import CostModel
from memcc.passes.liveness import LivenessReport
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.simulate import Simulation, simulate
from memcc.passes.solvers import ilp, sqrtn
from memcc.passes.solvers.problem import Problem

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
    """The array problem plus the mapping back to node names."""

    problem: Problem
    groups: tuple[tuple[str, ...], ...]   # variable -> forward nodes recomputed together
    crossing_bytes: np.ndarray
    crossing_vars: list[list[int]]
    # (input, reader) variable pairs; forbidding both makes the model chain-free, and exact.
    chain_pairs: np.ndarray

    @property
    def chain_free(self) -> Problem:
        return replace(self.problem, exclusive=self.chain_pairs)

    def plan(self, x: np.ndarray, strategy: str, **notes) -> Plan:
        names = frozenset(n for i in np.nonzero(x)[0] for n in self.groups[int(i)])
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
    """The linear model of ``graph``'s memory under recompute decisions.

    A recomputed node whose inputs are recomputed too starts a chain: the lowering re-runs
    the inputs where the node re-runs, which can be long before their own first backward
    reader. One level of that is modelled exactly (product terms); deeper chains are not,
    so the simulator judges every answer. ``PlanProblem.chain_free`` forbids chains instead
    (a recomputed node's recomputable inputs are kept): then the model is exact, at the
    price of the savings that only chains reach.
    """
    nodes = graph.nodes
    T = len(nodes)
    pos = {n.name: i for i, n in enumerate(nodes)}
    fwd_pos = np.array([n.name in st.forward for n in nodes], dtype=bool)
    values = live.values
    readers: dict[str, list[int]] = defaultdict(list)
    for i, n in enumerate(nodes):
        for inp in n.input:
            if inp:
                readers[inp].append(i)
    members: dict[str, list[str]] = defaultdict(list)
    for v, vl in values.items():
        members[vl.buffer].append(v)
    producer = {o: n for n in nodes for o in n.output if o}

    # Nodes whose outputs share one buffer (in place / aliases) are decided together.
    parent = {n.name: n.name for n in nodes if n.name in st.recomputable}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for n in nodes:
        if n.name not in parent:
            continue
        for o in n.output:
            vl = values.get(o)
            if vl is None or vl.buffer == o:
                continue
            owner = producer.get(vl.buffer)
            if owner is not None and owner.name in parent:
                parent[find(n.name)] = find(owner.name)

    # tau: where a node would be re-run if recomputed: before its first reader outside the
    # forward pass. A node that only feeds other forward nodes is re-run where its first
    # recomputed reader is. (If a longer recompute chain reaches it earlier, the model is
    # optimistic there; the simulator catches that and the budget is tightened.)
    inf = T + 1
    tau: dict[str, int] = {}
    for n in reversed(nodes):
        if n.name not in st.forward:
            continue
        direct = min((r for o in n.output for r in readers.get(o, ()) if not fwd_pos[r]),
                     default=inf)
        if direct < inf:
            tau[n.name] = direct
            continue
        tau[n.name] = min((tau.get(nodes[r].name, inf) for o in n.output
                           for r in readers.get(o, ()) if nodes[r].name in parent),
                          default=inf)

    roots = sorted({find(a) for a in parent if tau.get(a, inf) < inf}, key=lambda a: pos[a])
    var_of = {r: i for i, r in enumerate(roots)}
    groups: list[list[str]] = [[] for _ in roots]
    for a in parent:
        r = find(a)
        if r in var_of:
            groups[var_of[r]].append(a)
    for g in groups:
        g.sort(key=lambda a: pos[a])
    cost = np.zeros(len(roots))
    for i, g in enumerate(groups):
        cost[i] = sum(costs.seconds.get(a, 0.0) for a in g if tau.get(a, inf) < inf)

    tv: list[int] = []
    tb: list[float] = []
    ts: list[int] = []
    te: list[int] = []
    tu: list[int] = []
    tw: list[int] = []

    def term(var: int, nbytes: float, start: int, end: int, unless: int = -1,
             with_: int = -1) -> None:
        start, end = max(start, 0), min(end, T - 1)
        if nbytes and start <= end:
            tv.append(var)
            tb.append(nbytes)
            ts.append(start)
            te.append(end)
            tu.append(unless)
            tw.append(with_)

    for b, vals in members.items():
        owner = producer.get(b)
        if owner is None or owner.name not in parent:
            continue
        var = var_of.get(find(owner.name))
        if var is None:
            continue
        vl = values[b]
        if vl.death is None:
            continue
        all_r = [r for v in vals for r in readers.get(v, ())]
        bwd = [r for r in all_r if not fwd_pos[r]]
        t0 = min(tau.get(producer[v].name, inf) for v in vals if v in producer)
        if not bwd:
            # Only other clones read it: a transient of a recompute chain, live while the
            # chain runs (counted at the reader's position; conservative for long chains).
            if t0 < inf:
                term(var, float(vl.nbytes), t0, t0)
            continue
        fwd = [r for r in all_r if fwd_pos[r]]
        lf = max(fwd) if fwd else vl.birth
        term(var, -float(vl.nbytes), lf + 1, vl.death)
        term(var, float(vl.nbytes), min(t0, vl.death), vl.death)

    for n in nodes:
        if n.name not in parent or tau.get(n.name, inf) >= inf:
            continue
        var = var_of.get(find(n.name))
        if var is None:
            continue
        for inp in n.input:
            vl = values.get(inp)
            if vl is None or vl.birth < 0:
                continue
            bl = values[vl.buffer]
            if bl.death is None:
                continue
            src = producer.get(vl.buffer)
            other = var_of.get(find(src.name), -1) if src is not None and \
                src.name in parent else -1
            if other == var:
                continue
            if tau[n.name] > bl.death:
                term(var, float(bl.nbytes), bl.death + 1, tau[n.name], unless=other)
            if other >= 0:
                # Both recomputed: the input's clone is made when this reader re-runs, which
                # can be long before the input's own first backward reader.
                t_in = min(tau.get(producer[v].name, inf) for v in members[vl.buffer]
                           if v in producer)
                if tau[n.name] < t_in:
                    term(var, float(bl.nbytes), tau[n.name], min(t_in, T) - 1, with_=other)

    exclusive = sorted({
        (var_of[find(producer[i].name)], var_of[find(n.name)])
        for n in nodes if n.name in parent and find(n.name) in var_of
        for i in n.input
        if i in producer and producer[i].name in parent and find(producer[i].name) in var_of
        and var_of[find(producer[i].name)] != var_of[find(n.name)]
    })

    problem = Problem(
        base=np.asarray(live.live_during, dtype=np.float64),
        cost=cost,
        term_var=np.asarray(tv, dtype=np.int64),
        term_bytes=np.asarray(tb, dtype=np.float64),
        term_start=np.asarray(ts, dtype=np.int64),
        term_end=np.asarray(te, dtype=np.int64),
        names=tuple(roots),
        term_unless=np.asarray(tu, dtype=np.int64),
        term_with=np.asarray(tw, dtype=np.int64),
    )
    crossing_bytes, crossing_vars = _forward_cuts(nodes, st, values, readers, members,
                                                  producer, var_of, find, parent)
    return PlanProblem(problem, tuple(tuple(g) for g in groups), crossing_bytes,
                       crossing_vars, np.asarray(exclusive, dtype=np.int64).reshape(-1, 2))


def _forward_cuts(nodes, st, values, readers, members, producer, var_of, find, parent):
    """Bytes crossing each position of the forward order, and who produces them."""
    fwd = [i for i, n in enumerate(nodes) if n.name in st.forward]
    index = {p: k for k, p in enumerate(fwd)}
    F = len(fwd)
    diff = np.zeros(F + 1)
    spans: list[tuple[int, int, int]] = []
    for b, vl in values.items():
        if vl.buffer != b or vl.birth < 0 or b not in producer:
            continue
        if producer[b].name not in st.forward:
            continue
        last = max((index[r] for v in members[b] for r in readers.get(v, ()) if r in index),
                   default=None)
        start = index.get(vl.birth)
        if last is None or start is None or last <= start:
            continue
        diff[start] += vl.nbytes
        diff[last] -= vl.nbytes
        for v in members[b]:
            owner = producer[v].name if v in producer else None
            var = var_of.get(find(owner)) if owner in parent else None
            if var is not None:
                spans.append((start, last, var))
    crossing = np.cumsum(diff[:-1])
    crossing_vars: list[list[int]] = [[] for _ in range(F)]
    for start, last, var in spans:
        for k in range(start, last):
            crossing_vars[k].append(var)
    return crossing, crossing_vars


# ---------------------------------------------------------------------------- strategies
def choose_plan(graph: Graph, budget: int | None, costs: CostModel, *,
                strategy: str = "auto", time_limit: float = 60.0,
                structure: StepStructure | None = None,
                baseline: Simulation | None = None) -> PlanOutcome:
    """Pick the plan; ``budget=None`` means the smallest peak memcc can reach."""
    if strategy not in STRATEGIES:
        raise MemccError(f"--strategy '{strategy}': choose one of {', '.join(STRATEGIES)}")
    st = structure or StepStructure.of(graph)
    base = baseline or simulate(graph, Plan(), costs, st)
    deadline = time.perf_counter() + time_limit
    solver_info: dict = {"name": "none", "status": "not run", "gap": None}
    found: list[tuple[str, Simulation]] = [("none", base)]
    runs: list[dict] = [{"strategy": "none", "detail": "baseline (recompute nothing)",
                         "_sims": [base]}]
    if strategy == "none":
        return _finish(base, found, budget, "none", solver_info, runs,
                       smallest_first=budget is None)

    pp = build_problem(graph, st, base.liveness, costs)
    prob = pp.problem
    target = budget

    if strategy in ("sqrtn", "auto"):
        rec = np.ones(prob.n_vars, dtype=bool)
        n_before = len(found)
        for k, x in sqrtn.candidates(pp.crossing_bytes, pp.crossing_vars, prob.n_vars, rec):
            found.append(("sqrtn", simulate(graph, pp.plan(x, "sqrtn", segments=k), costs, st)))
        found.append(("sqrtn", simulate(graph, pp.plan(rec, "sqrtn", segments=0), costs, st)))
        sims = [sim for _, sim in found[n_before:]]
        runs.append({"strategy": "sqrtn", "detail": f"{len(sims)} segmentations",
                     "_sims": sims})
        if strategy == "sqrtn":
            return _finish(base, found, budget, "sqrtn", solver_info, runs,
                           smallest_first=budget is None)

    if target is None:
        # The smallest peak: minimise the modelled peak, then compare with the heuristics.
        remaining = max(deadline - time.perf_counter(), 1.0)
        sol = ilp.solve(prob, 0.0, time_limit=remaining / 2, objective="peak")
        solver_info = _solver_info(sol)
        sims = []
        if sol.status not in ("infeasible",):
            sims = [simulate(graph, pp.plan(sol.x, "ilp"), costs, st)]
            found.append(("ilp", sims[0]))
        runs.append(_ilp_run(sol, "smallest modelled peak", None, sims))
        target = min(s.peak_bytes for _, s in found)

    # 1. The chain-free model is exact: its optimum is a plan that fits whenever the model
    #    says so (mild budgets).
    sol = ilp.solve(pp.chain_free, float(target),
                    time_limit=max(deadline - time.perf_counter(), 0.5))
    solver_info = _solver_info(sol)
    sims = []
    if sol.status in ("optimal", "feasible"):
        sims = [simulate(graph, pp.plan(sol.x, "ilp", model="exact"), costs, st)]
        found.append(("ilp", sims[0]))
    runs.append(_ilp_run(sol, "exact model (no recompute chains)", target, sims))
    # 2. With chains (lower budgets): solve, simulate, and while the simulator disagrees,
    #    lower the budget the model aims for by the excess (at most 5% a round: an answer
    #    far off says little about how far to go).
    eff = float(target)
    for round_ in range(1, TIGHTEN_ROUNDS + 1):
        if any(s == "ilp" and sim.peak_bytes <= target for s, sim in found):
            break
        detail = f"model with recompute chains, round {round_}"
        remaining = deadline - time.perf_counter()
        if remaining <= 0.5:
            solver_info["status"] = solver_info.get("status", "time limit")
            runs.append({"strategy": "ilp", "detail": detail,
                         "status": "not run: time limit reached", "_sims": []})
            break
        sol = ilp.solve(prob, eff, time_limit=remaining)
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
        order = sorted(groups, key=lambda i: -pp.problem.cost[i])[:POLISH_CANDIDATES]
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
    return {"name": sol.solver, "status": sol.status, "gap": sol.gap,
            "solve_time_s": round(sol.solve_time_s, 3), "rounds": sol.iterations,
            "objective_s": sol.objective}


def _ilp_run(sol, detail: str, model_budget: float | None, sims: list[Simulation]) -> dict:
    """One ILP solve for ``PlanOutcome.runs``; an infeasible model has no objective (None,
    not inf: inf is not JSON)."""
    objective = sol.objective if math.isfinite(sol.objective) else None
    run = {"strategy": "ilp", "detail": detail, "status": sol.status, "solver": sol.solver,
           "objective_s": objective, "gap": sol.gap,
           "solve_time_s": round(sol.solve_time_s, 3), "_sims": sims}
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
    return PlanOutcome(best=best, baseline=base, strategy=name, solver=solver_info,
                       candidates=cands, smallest_peak=smallest, requested=strategy,
                       picked=picked, runs=described)


def _fmt(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e6:,.1f} MB ({int(n):,} bytes)"
