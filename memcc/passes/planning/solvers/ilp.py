"""Exact choice under a budget: a 0-1 ILP over a ``Problem``, solved by HiGHS (CBC fallback).

Minimise the added time subject to the modelled bytes live at each time point staying under
the budget. Writing a row for every time point would give millions of nonzeros on real
steps, so memory rows are generated lazily: start with the points where the baseline is
highest, solve, evaluate the model at every point (one cumsum over settled values), add the
most violated points, and repeat until none is violated. The rows that end up in the model
are the handful of places where memory actually binds.

The search is bounded by work, so that the same input gives the same plan on an idle or a
busy machine: at most ``MAX_ROUNDS`` row rounds and ``MIP_MAX_NODES`` branch-and-bound nodes
per solve, one thread, a fixed seed. The time limit still binds where a caller passes a
short one (``exact._smallest_peak`` gets a share of what is left, and on large steps
uses it up); hitting it is reported (``Solution.limit_hit``), and only then may the answer
depend on the machine's load.

The time limit holds whatever the solver does. HiGHS gets it as its own ``time_limit``, an
interrupt callback stops it at the deadline (it then returns its best incumbent), and the
solve runs in a thread the caller stops waiting for shortly after the deadline: a solver
that neither checks its clock nor calls back in time (highspy 1.16.0's RENS heuristic) is
left to finish on its own, and the round keeps the best answer the solver reported before
(``limit_hit: "time"``). Nothing a solver prints reaches stdout
(``quiet.stdout_kept_clean``). docs/PLANNING_CORE.md, "Each solve's deadline".
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from memcc.passes.planning.model.problem import Problem, Solution
from memcc.passes.planning.solvers.quiet import stdout_kept_clean

INITIAL_ROWS = 48
ROWS_PER_ROUND = 40
MAX_ROUNDS = 8
LP_ROUNDS = 30
MIP_MAX_NODES = 10
MIP_REL_GAP = 0.025
# How long past its deadline a solve is waited for before it is left behind: a share of
# its time limit (so that --time-limit plus 10% holds), at least enough to collect an
# answer the interrupt callback stopped, at most a second.
LATE_SHARE = 0.05
LATE_MIN_S = 0.1
LATE_MAX_S = 1.0
# Solves left behind at their deadline, kept referenced until they end (their interrupt
# flag is set, so they stop at the solver's next check).
_left_behind: list[tuple[object, threading.Thread]] = []
# How long the process waits at its exit for solves left behind to end (``wait_for_left_behind``).
EXIT_WAIT_S = 2.0


def wait_for_left_behind(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the solves left behind to end; True when none is
    still running. Why: a HiGHS solve still running when the interpreter shuts down calls
    its Python callbacks into a finalizing interpreter, and the process aborts
    ("terminate called without an active exception", exit status 134) after its work was
    done and its files written. Interrupted, most end at their next callback, in
    milliseconds; one inside a heuristic that never calls back may run for minutes, and
    the command line (``memcc.cli.main``) then ends the process without finalizing it."""
    end = time.perf_counter() + timeout
    for _, thread in list(_left_behind):
        thread.join(max(end - time.perf_counter(), 0.0))
    return not any(thread.is_alive() for _, thread in _left_behind)


def _wait_at_exit() -> None:
    wait_for_left_behind(EXIT_WAIT_S)


def _initial_rows(problem: Problem, budget: float, objective: str, k: int) -> list[int]:
    """The highest baseline point of each of ``k`` stretches of the schedule where the
    baseline is over the budget (everywhere, for the peak objective): memory binds at
    several separate places (the end of the forward pass, each backward block), and
    starting with all of them saves rounds."""
    over = np.arange(problem.horizon) if objective == "peak" else \
        np.nonzero(problem.base > budget)[0]
    if len(over) == 0:
        over = np.array([int(np.argmax(problem.base))])
    return _spread_rows(over, problem.base, set(), k)


class WarmStart(NamedTuple):
    """Where a solve starts. ``starts`` are candidate solutions (e.g. heuristic plans
    written as variables); the cheapest one that satisfies the model is handed to the
    solver as its first incumbent, and each round starts from the previous round's answer
    when it still fits. ``rows`` are time points known to bind (a previous solve's
    ``Solution.rows``), added from the start."""

    starts: list[np.ndarray]
    rows: list[int] | tuple[int, ...] = ()


class _Ask(NamedTuple):
    """What one solver call is asked: the memory rows (time points) it holds to
    ``budget``, and the objective ("time" or "peak")."""

    rows: list[int]
    budget: float
    objective: str


def solve(problem: Problem, budget: float, *, time_limit: float = 60.0,
          solver: str = "highs", objective: str = "time",
          warm: WarmStart | None = None) -> Solution:
    """Minimise added time s.t. modelled memory <= budget (objective="time"), or minimise the
    modelled peak with the added time as a tie-breaker (objective="peak"), from ``warm``
    (``WarmStart``: incumbents and rows known to bind)."""
    starts, rows = warm if warm is not None else (None, None)
    start = time.perf_counter()
    n = problem.n_vars
    zero = problem.settle(np.zeros(n))
    if n == 0 or not np.any(problem.binary):
        ok = problem.peak(zero) <= budget or objective == "peak"
        return Solution(zero, "optimal" if ok else "infeasible", 0.0, 0.0,
                        time.perf_counter() - start, "none")
    run = _highs if solver == "highs" and _has_highs() else _cbc
    name = "HiGHS" if run is _highs else "CBC"
    fitting = [problem.settle(x) for x in (starts or [])]
    fitting = [x for x in fitting if problem.feasible(x)
               and (objective == "peak" or problem.memory(x).max() <= budget * (1 + 1e-9))]
    incumbent = min(fitting, key=problem.added_time) if fitting else None
    rows = sorted(set(_initial_rows(problem, budget, objective, INITIAL_ROWS)) | set(rows or ()))
    status, gap, limit_hit = "not solved", None, None
    x = zero
    # Phase 1: find where memory binds on the LP relaxation, whose solves are cheap; the
    # MIP rounds then start with those rows and seldom need more than one or two.
    for _ in range(LP_ROUNDS):
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            break
        result = run(problem, _Ask(rows, budget, objective), remaining, None, relax=True)
        if result.status == "infeasible":
            # No fractional answer fits, so no 0-1 answer does either.
            return Solution(x, "infeasible", None, float("inf"),
                            time.perf_counter() - start, name, 0)
        if result.values is None:
            break
        new = _new_rows(problem, problem.settle(result.values, relaxed=True), rows, budget,
                        objective)
        if not new:
            break
        rows = sorted(set(rows) | set(new))
    rounds = 0
    for rounds in range(1, MAX_ROUNDS + 1):
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            limit_hit = "time"
            status = "time limit" if status == "not solved" else status
            break
        result = run(problem, _Ask(rows, budget, objective), remaining, incumbent)
        if result.status == "infeasible":
            return Solution(x, "infeasible", None, float("inf"),
                            time.perf_counter() - start, name, rounds)
        if result.values is None:
            # No answer within this round's work limit: keep the last round's (the
            # simulator judges it), or report the limit when there is none.
            limit_hit = result.limit or "time"
            status = "time limit" if status == "not solved" else "feasible"
            break
        x = problem.settle(result.values)
        gap, limit_hit = result.gap, result.limit or limit_hit
        status = "optimal" if result.status == "optimal" else "feasible"
        mem = problem.memory(x)
        new = _new_rows(problem, x, rows, budget, objective)
        if not new:
            break
        rows = sorted(set(rows) | set(new))
        if incumbent is None or problem.added_time(x) < problem.added_time(incumbent):
            if objective == "peak" or mem.max() <= budget * (1 + 1e-9):
                incumbent = x
    else:
        limit_hit = limit_hit or "work"
    return Solution(x, status, gap, problem.added_time(x), time.perf_counter() - start, name,
                    rounds, limit_hit, tuple(rows))


def _new_rows(problem: Problem, x: np.ndarray, rows: list[int], budget: float,
              objective: str) -> list[int]:
    """Points where settled ``x`` breaks a memory row that is not in the model yet."""
    mem = problem.memory(x)
    if objective == "peak":
        # Points above the peak the model saw on its rows: the peak is elsewhere.
        seen = float(mem[rows].max())
        violated = np.nonzero(mem > seen * (1 + 1e-9) + 1.0)[0]
    else:
        violated = np.nonzero(mem > budget * (1 + 1e-9) + 1.0)[0]
    return _spread_rows(violated, mem, set(rows), ROWS_PER_ROUND)


def _spread_rows(violated: np.ndarray, mem: np.ndarray, taken: set[int], k: int) -> list[int]:
    """The most violated point of each of ``k`` stretches of the schedule: one round then
    covers every separate peak instead of ``k`` neighbours of the highest one."""
    fresh = np.array([t for t in violated.tolist() if t not in taken], dtype=np.int64)
    if len(fresh) == 0:
        return []
    out = []
    for part in np.array_split(fresh, min(k, len(fresh))):
        out.append(int(part[np.argmax(mem[part])]))
    return sorted(set(out))


@dataclass(frozen=True)
class _Result:
    status: str                  # "optimal", "feasible", "infeasible", "none"
    values: np.ndarray | None
    gap: float | None
    limit: str | None            # "work" or "time" when a limit stopped the search


def _matrix(problem: Problem, rows: list[int], budget: float, objective: str):
    """The MILP as arrays: (cost, lower, upper, integral, A rows (CSR), row lower, row upper).

    Memory rows are scaled to the baseline peak and costs to their sum, so that HiGHS's
    tolerances mean the same on a 100 MB and a 100 GB step."""
    n = problem.n_vars
    scale = max(float(problem.base.max(initial=1.0)), 1.0)
    cost_scale = max(float(np.abs(problem.cost).sum()), 1e-12)  # variants may save time
    binary = problem.binary
    cost = problem.cost / cost_scale + 1e-9 * binary
    if problem.preference is not None and n:
        # Far below the gap tolerance: it only orders answers the cost cannot tell apart.
        cost = cost + 1e-4 / n * problem.preference
    ncol = n + (1 if objective == "peak" else 0)
    lower = np.zeros(ncol)
    upper = np.ones(ncol)
    integral = np.concatenate([binary, np.zeros(ncol - n, dtype=bool)])
    if objective == "peak":
        cost = np.concatenate([1e-6 * cost, [1.0]])
        upper[-1] = np.inf
    ptr, idx, val, lo, hi = [0], [], [], [], []

    def add(cols, coefs, low, high) -> None:
        idx.extend(int(c) for c in cols)
        val.extend(float(c) for c in coefs)
        ptr.append(len(idx))
        lo.append(low)
        hi.append(high)

    for group in problem.choice_groups:
        add(group, np.ones(len(group)), -np.inf, 1.0)
    for k in range(problem.rows.count):
        var, coef = problem.rows.row(k)
        add(var, coef, -np.inf, float(problem.rows.rhs[k]))
    for k in range(problem.floors.count):
        var, coef = problem.floors.row(k)
        aux = int(problem.floor_aux[k])
        add([aux, *var.tolist()], [1.0, *(-coef).tolist()], float(problem.floors.rhs[k]),
            np.inf)
    for t in rows:
        coeffs = problem.memory_row(t)
        cols = list(coeffs)
        coefs = [coeffs[c] / scale for c in cols]
        if objective == "peak":
            add([*cols, n], [*coefs, -1.0], -np.inf, -float(problem.base[t]) / scale)
        else:
            add(cols, coefs, -np.inf, (budget - float(problem.base[t])) / scale)
    return cost, lower, upper, integral, (ptr, idx, val), np.array(lo), np.array(hi)


def _has_highs() -> bool:
    try:
        import highspy  # noqa: F401
    except ImportError:
        return False
    return True


def _highs(problem: Problem, ask: _Ask, time_limit: float, incumbent: np.ndarray | None,
           relax: bool = False) -> _Result:
    import highspy

    objective = ask.objective
    deadline = time.perf_counter() + max(float(time_limit), 0.1)
    cost, lower, upper, integral, (ptr, idx, val), lo, hi = _matrix(problem, *ask)
    inf = highspy.kHighsInf
    # Everything that touches HiGHS runs under the guard: 1.16 prints its banner on stdout
    # when the first Highs object is made, before output_flag can be set.
    with stdout_kept_clean():
        h = highspy.Highs()
        # Output off before the model goes in (passModel and setSolution may log).
        for key, value in (("output_flag", False), ("log_to_console", False),
                           ("threads", 1), ("random_seed", 0),
                           ("mip_rel_gap", MIP_REL_GAP), ("mip_max_nodes", MIP_MAX_NODES),
                           ("mip_allow_restart", False),
                           ("time_limit", max(float(time_limit), 0.1)),
                           *_release_options()):
            h.setOptionValue(key, value)
        lp = highspy.HighsLp()
        lp.num_col_ = len(cost)
        lp.num_row_ = len(lo)
        lp.col_cost_ = cost
        lp.col_lower_ = lower
        lp.col_upper_ = np.where(np.isinf(upper), inf, upper)
        lp.row_lower_ = np.where(np.isinf(lo), -inf, lo)
        lp.row_upper_ = np.where(np.isinf(hi), inf, hi)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.asarray(ptr, dtype=np.int32)
        lp.a_matrix_.index_ = np.asarray(idx, dtype=np.int32)
        lp.a_matrix_.value_ = np.asarray(val, dtype=np.float64)
        if not relax:
            lp.integrality_ = [highspy.HighsVarType.kInteger if b else
                               highspy.HighsVarType.kContinuous for b in integral]
        h.passModel(lp)
        if incumbent is not None:
            start = highspy.HighsSolution()
            col = list(map(float, incumbent))
            if objective == "peak":
                col.append(float(problem.memory(incumbent).max()) /
                           max(float(problem.base.max(initial=1.0)), 1.0))
            start.col_value = col
            h.setSolution(start)
        returned, best = _run_until(h, deadline, float(time_limit))
        if not returned:
            # Left behind: its best answer so far, as the improving-solution callback saw it.
            if best is None:
                return _Result("none", None, None, "time")
            return _Result("feasible", best[: problem.n_vars], None, "time")
        status = h.getModelStatus()
        text = h.modelStatusToString(status).lower()
        has_solution = h.getInfo().primal_solution_status == 2
        values = np.asarray(h.getSolution().col_value[: problem.n_vars], dtype=np.float64) \
            if has_solution else None
        gap = float(h.getInfo().mip_gap) if has_solution else None
    gap = gap if gap is not None and np.isfinite(gap) else None
    if "infeasible" in text and not has_solution:
        return _Result("infeasible", None, None, None)
    limit = _limit_of(text)
    if status == highspy.HighsModelStatus.kOptimal:
        return _Result("optimal", values, gap, None)
    return _Result("feasible" if values is not None else "none", values, gap, limit)


def _limit_of(status_text: str) -> str | None:
    """Which limit a HiGHS model status names: our interrupt at the deadline ("Interrupted
    by user") and HiGHS's own time limit are "time"; node and iteration limits "work"."""
    if "time" in status_text or "interrupt" in status_text:
        return "time"
    return "work" if "limit" in status_text else None


def _release_options() -> tuple[tuple[str, object], ...]:
    """Options for the installed HiGHS release only.

    HiGHS 1.16.0's RENS heuristic can run on past both the time limit and the interrupt
    callback: the smallest-peak MIP of MONeT's ResNet-50 step at 4.99 GB (1,431 rows and
    1,181 columns after presolve) stayed in it for minutes under an 11 s limit, where
    1.15.1 stops at the limit. With RENS off, 1.16.0 ends that solve within its limit
    (BENCHMARKS.md, "The time limit under the newest highspy").

    Every release: no strong branching to make pseudo-costs reliable before they are used
    (``mip_pscost_minreliable`` 0, HiGHS's default 8). With at most ``MIP_MAX_NODES``
    nodes per solve, strong branching was two thirds of the LP iterations of the
    smallest-peak MILPs that dominate ``--budget min``; without it the zoo's GPT-2, BERT
    and ResNet-18 steps planned the same peaks 25-35% sooner (GPT-2 31.8 -> 21.6 s CPU,
    BERT 23.3 -> 18.2 s), and the planner's and heap-room tests ran 9% sooner, all
    passing (BENCHMARKS.md, "Branching in the smallest-peak search")."""
    common = (("mip_pscost_minreliable", 0),)
    if _highs_version() >= (1, 16):
        return (("mip_heuristic_run_rens", False), *common)
    return common


def _highs_version() -> tuple[int, ...]:
    import importlib.metadata

    try:
        text = importlib.metadata.version("highspy")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def _run_until(h, deadline: float, time_limit: float) -> tuple[bool, np.ndarray | None]:
    """Run ``h`` in a thread. Returns (whether it returned by the deadline plus a grace of
    ``LATE_SHARE`` of ``time_limit``, clamped to [``LATE_MIN_S``, ``LATE_MAX_S``]; the best
    MIP solution its improving-solution callback reported, or None).

    An interrupt callback stops the MIP, simplex and IPM at the deadline itself (HiGHS then
    returns its best incumbent); the grace only covers collecting that answer. A solve still
    running after it is left behind with its interrupt flag set (``_left_behind``), and
    the caller must not touch ``h`` again: the best solution reported so far is all it
    gets. HiGHS releases the GIL while it runs, so the wait here and the callbacks are not
    held up by it."""
    stop = threading.Event()
    lock = threading.Lock()
    best: list[tuple[float, np.ndarray]] = []

    def interrupt(event) -> None:
        if stop.is_set() or time.perf_counter() >= deadline:
            event.interrupt()

    def improved(event) -> None:
        out = event.data_out
        value = float(out.objective_function_value)
        with lock:
            if not best or value < best[0][0]:
                best[:] = [(value, np.array(out.mip_solution, dtype=np.float64))]

    hooks = (("cbMipInterrupt", interrupt), ("cbSimplexInterrupt", interrupt),
             ("cbIpmInterrupt", interrupt), ("cbMipImprovingSolution", improved))
    for name, fn in hooks:
        hook = getattr(h, name, None)   # highspy releases before 1.8 have no callbacks
        if hook is not None:
            hook.subscribe(fn)
    done = threading.Event()
    failure: list[BaseException] = []

    def work() -> None:
        try:
            h.run()
        except BaseException as exc:  # re-raised in the caller's thread
            failure.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=work, name="memcc-highs", daemon=True)
    thread.start()
    late = min(max(LATE_SHARE * time_limit, LATE_MIN_S), LATE_MAX_S)
    try:
        returned = done.wait(max(deadline - time.perf_counter(), 0.0) + late)
    except BaseException:  # Ctrl-C: the solve is stopped and waited for at exit, as below
        stop.set()
        _leave_behind(h, thread)
        raise
    if failure:
        raise failure[0]
    if returned:
        return True, None
    stop.set()
    _leave_behind(h, thread)
    with lock:
        return False, (best[0][1].copy() if best else None)


def _leave_behind(h, thread: threading.Thread) -> None:
    """Keep a solve whose interrupt flag is set referenced until it ends, and wait for it at
    exit (``wait_for_left_behind``): a Ctrl-C during a solve left it running into the
    interpreter's shutdown, which aborted ("terminate called without an active
    exception")."""
    _left_behind[:] = [(s, t) for s, t in _left_behind if t.is_alive()]
    if not _left_behind:
        atexit.unregister(_wait_at_exit)
        atexit.register(_wait_at_exit)
    _left_behind.append((h, thread))


def _cbc(problem: Problem, ask: _Ask, time_limit: float, incumbent: np.ndarray | None,
         relax: bool = False) -> _Result:
    """pulp's bundled CBC, for installs without highspy (no warm start)."""
    import pulp

    cost, lower, upper, integral, (ptr, idx, val), lo, hi = _matrix(problem, *ask)
    prob = pulp.LpProblem("memcc_plan", pulp.LpMinimize)
    xs = [pulp.LpVariable(f"v{i}", lower[i], None if np.isinf(upper[i]) else upper[i],
                          cat="Integer" if integral[i] and not relax else "Continuous")
          for i in range(len(cost))]
    prob += pulp.lpSum(float(c) * x for c, x in zip(cost, xs, strict=True) if c)
    for k in range(len(lo)):
        expr = pulp.lpSum(float(val[j]) * xs[idx[j]] for j in range(ptr[k], ptr[k + 1]))
        if np.isfinite(hi[k]):
            prob += expr <= float(hi[k])
        if np.isfinite(lo[k]):
            prob += expr >= float(lo[k])
    with stdout_kept_clean():   # CBC runs as a child process that inherits fd 1
        prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=max(int(time_limit), 1), threads=1,
                                     gapRel=MIP_REL_GAP))
    st = pulp.LpStatus[prob.status]
    if st == "Infeasible":
        return _Result("infeasible", None, None, None)
    values = np.array([x.value() or 0.0 for x in xs[: problem.n_vars]])
    if st != "Optimal" and not values.any():
        return _Result("none", None, None, "time")
    return _Result("optimal" if st == "Optimal" else "feasible", values, None,
                   None if st == "Optimal" else "time")
