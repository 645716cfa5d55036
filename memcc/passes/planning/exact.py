"""The ``ilp`` strategy: the MILP over the linear memory model (``model/``, solved by
``solvers/ilp.py``), seeded with the sqrt(n) segmentations, its answers judged by the
simulator and the budget the model aims for lowered while they disagree. A
``PlanningContext`` and a ``Budget`` in, a ``StrategyResult`` out (``context.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from memcc.passes.analysis.bfc_arena import CUDA_PAGE_BYTES
from memcc.passes.planning.context import PlanningContext, StrategyResult, strategy
from memcc.passes.planning.model.problem import Problem, Solution, SparseRows
from memcc.passes.planning.model.variant_terms import KIND as VARIANT_KIND
from memcc.passes.planning.request import Budget
from memcc.passes.planning.simulate import Simulation
from memcc.passes.planning.solvers import ilp
from memcc.passes.planning.solvers.ilp import WarmStart

TIGHTEN_ROUNDS = 10
# How much more than the ILP's first answer (a share of the step's time) the rounds may cost
# before recompute alone is tried too (``_worth_recompute_alone``).
ROUNDS_SLACK = 0.02
# How far above the target the ILP's first answer may simulate before recompute alone is tried
# too, whatever the rounds cost (``_worth_recompute_alone``).
FAR_OFF = 0.05
# An answer stopped at a limit with a larger optimality gap than this is searched again from
# the smallest peak (``_weak_rounds``).
WEAK_GAP = 0.10



@strategy("ilp")
def exact_model(p: PlanningContext, budget: Budget) -> StrategyResult:
    """The MILP over the linear memory model (``solvers/ilp.py``), seeded with the sqrt(n)
    segmentations. ``Budget.MIN``: minimise the modelled peak, then the time at the smallest
    peak found. While the simulator disagrees with the model (it states what the model
    leaves out: clone scratch, in-place writes between clones), the budget the model aims
    for is lowered by the excess (at most 5% a round: an answer far off says little about
    how far to go). What runs when, and why: docs/PLANNING_CORE.md, "What the ``ilp``
    strategy runs"."""
    out = StrategyResult()
    pp, prob, graph = p.model, p.model.problem, p.graph
    starts = pp.starts(list(p.segmentations), graph)
    # The MILP's first incumbents are candidates of the ILP strategy too (judged by the
    # simulator like its own answers), so the ILP never ends above a plan it started from;
    # the report names such a winner "ilp (sqrt(n) seed)".
    out.add("ilp", list(p.segmentations),
            {"strategy": "ilp", "detail": "seeds: sqrt(n) segmentations", "seed": True})
    known_rows: list[int] = []   # time points where memory binds, carried between solves
    if budget.is_min:
        sol = _smallest_peak(p, starts, out, "smallest modelled peak", with_variants=True)
        known_rows = list(sol.rows)
        aim = _Aim(min(s.peak_bytes for _, s in out.plans + [("none", p.baseline)]), True)
    else:
        aim = _Aim(budget.bytes, False)

    first = _tighten(p, prob, aim, WarmStart(starts, known_rows), out,
                     "exact recompute model")
    if not budget.is_min and VARIANT_KIND in prob.kind \
            and _worth_recompute_alone(out, aim, first, p.baseline.compute_cost_s):
        # The variants' terms are exact one at a time, but a combination with recompute can
        # be modelled below what the simulator finds, and the rounds that lower the budget
        # then end far above the plan recompute alone reaches. MONeT's ResNet-50 step
        # (BENCHMARKS.md) at 6.00 GB: the report's runs show five rounds with variants, the
        # only fitting one at +17.2%, and one round over recompute alone at +7.7%. So the
        # same rounds run again over recompute alone, from the memory rows already found;
        # the cheapest fitting plan wins.
        alone = StrategyResult()
        _tighten(p, _fixed_to_zero(prob, VARIANT_KIND), aim,
                 WarmStart(starts, list(first.rows)), alone,
                 "exact recompute model without variants")
        out.extend(alone)
    if not budget.is_min and p.remaining() > 1.0 and _weak_rounds(out, aim, first):
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
            sol = ilp.solve(prob, aim.bytes, time_limit=p.remaining() / 2,
                            warm=WarmStart([low.x, *starts], list(low.rows)))
            _add_answer(p, prob, sol, out, "exact recompute model, from the smallest peak",
                        aim.bytes)
    return out


def _add_answer(p: PlanningContext, prob: Problem, sol: Solution, out: StrategyResult, detail: str,
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


class _Aim(NamedTuple):
    """What the time-objective rounds aim for: ``bytes``, held by a plan's peak alone
    (``by_peak``: the smallest-peak search) or by its peak and its added small buffers'
    heap room (a budget, as ``planner._finish`` judges the answer: rounds that stopped at
    a plan under the budget by its peak alone ended with nothing that fit; the zoo's
    MobileNetV2 at 20.4 MB, round 2 under by peak, over with its heap room, and the
    polish of a sqrt(n) plan won at +3.3% where the next round fits at +0.0%)."""

    bytes: float
    by_peak: bool

    def need(self, sim: Simulation) -> int:
        return sim.peak_bytes if self.by_peak else sim.fit_bytes

    def holds(self, sim: Simulation) -> bool:
        return self.need(sim) <= self.bytes


def _fitting_ilp_costs(out: StrategyResult, aim: _Aim) -> list[float]:
    """The added time of every plan the ILP strategy found that fits ``aim``."""
    return [sim.added_time_s for _, sim in out.plans
            if sim.plan.strategy == "ilp" and aim.holds(sim)]


def _ilp_fits(out: StrategyResult, aim: _Aim) -> bool:
    return bool(_fitting_ilp_costs(out, aim))


def _weak_rounds(out: StrategyResult, aim: _Aim, rounds: _Rounds) -> bool:
    """Whether the rounds ended at a work or time limit with no fitting plan, or with one
    whose optimality gap is above ``WEAK_GAP``. A proven answer (optimal, or infeasible) is
    left alone."""
    if rounds.status in ("infeasible", "optimal", ""):
        return False
    if not _ilp_fits(out, aim):
        return True
    return rounds.gap is None or rounds.gap > WEAK_GAP


def _smallest_peak(p: PlanningContext, starts: list[np.ndarray], out: StrategyResult,
                   detail: str, *, with_variants: bool) -> Solution:
    """Minimise the modelled peak (time as the tie-breaker), simulate the answer and add it
    to ``out``. Searched over recompute (and swap) only: with the variant binaries too,
    this peak-objective MILP took twice as long and stopped at a higher peak on the planner
    tests' GPT-2 (measured: 60 s and 1,565,908 B against 26 s and 1,559,764 B).
    ``with_variants``: then once more with the variants, from that answer (never higher,
    often lower)."""
    pp, prob = p.model, p.model.problem
    recompute_only = _fixed_to_zero(prob, VARIANT_KIND)
    sol = ilp.solve(recompute_only, 0.0, time_limit=max(p.remaining(), 1.0) / 4,
                    objective="peak", warm=WarmStart(starts))
    if with_variants and recompute_only is not prob and sol.status != "infeasible":
        sol = ilp.solve(prob, 0.0, time_limit=max(p.remaining(), 1.0) / 3,
                        objective="peak", warm=WarmStart([sol.x, *starts], list(sol.rows)))
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


def _worth_recompute_alone(out: StrategyResult, aim: _Aim, first: _Rounds,
                           step_s: float) -> bool:
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
    fitting = _fitting_ilp_costs(out, aim)
    if not fitting or first.first_peak > (1 + FAR_OFF) * aim.bytes:
        return True
    return min(fitting) - first.first_cost > ROUNDS_SLACK * step_s


def _tighten(p: PlanningContext, prob: Problem, aim: _Aim, warm: WarmStart,
             out: StrategyResult, label: str) -> _Rounds:
    """Solve ``prob`` at ``aim``; while the simulator finds the answer above it, lower
    the budget the model aims for by the excess (at most 5% a round; on CUDA at least one
    2 MiB device page, the unit its peaks move by: a Llama step 10 KB over ended eight
    rounds on the same page) and solve again."""
    target = aim.bytes
    starts, known_rows = warm
    pp, graph = p.model, p.graph
    eff = target - _device_excess(p, prob)
    first_cost: float | None = None
    first_peak: int | None = None
    status, gap = "", None
    for round_ in range(1, TIGHTEN_ROUNDS + 1):
        if _ilp_fits(out, aim):
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
                        warm=WarmStart(starts + pp.starts([s for _, s in out.plans], graph),
                                       known_rows))
        known_rows = list(sol.rows)
        status, gap = sol.status, sol.gap
        sim = _add_answer(p, prob, sol, out, detail, eff)
        if sim is None:
            break
        if first_cost is None:
            first_cost, first_peak = float(sol.objective), sim.peak_bytes
        if aim.holds(sim):
            break
        eff -= max(min(aim.need(sim) - target, 0.05 * target) * 1.05 + 1.0,
                   CUDA_PAGE_BYTES if p.rules.device == "cuda" else 0.0)
    return _Rounds(first_cost, first_peak, tuple(known_rows), status, gap)



def _device_excess(p: PlanningContext, prob: Problem) -> float:
    """What the simulator counts on CUDA that the model never does, whatever the plan: the
    bytes the CUDA session holds for itself (``device_memory.CUDA_SESSION_BYTES``, 192 MiB).
    The model counts live bytes; the simulator the device pages of the arena replay plus
    those. The rounds start from the budget less them: from the budget itself, lowered by
    at most 5% a round, ten rounds never reached a plan where the session is a large share
    of the step (a small transformer at 345 MB, 201 MB of it the session's: every round
    answered "recompute nothing"). The rest of the difference (pages, fragmentation) is
    plan-dependent and left to the rounds. 0 on the CPU."""
    device = p.baseline.device
    if p.rules.device != "cuda" or device is None or not len(prob.base):
        return 0.0
    return float(min(device.session_bytes,
                     max(p.baseline.peak_bytes - float(prob.base.max()), 0.0)))


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
