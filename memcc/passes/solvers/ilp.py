"""Exact recompute choice under a budget: a 0-1 ILP solved by HiGHS (CBC as fallback).

Formulation (O(n) variables, unlike Checkmate's T x T stage grid): one binary per
recomputable forward node, minimise the added time, subject to the modelled bytes live at
each time point staying under the budget. Writing a row for every time point would give
millions of nonzeros on real steps, so rows are generated lazily: start with the time points
where the baseline is highest, solve, evaluate the model at every time point (one cumsum),
add the most violated points, and repeat until none is violated. The rows that end up in
the model are the handful of places where memory actually binds.
"""

from __future__ import annotations

import time

import numpy as np

from memcc.errors import MemccError
from memcc.passes.solvers.problem import Problem, Solution

INITIAL_ROWS = 16
ROWS_PER_ROUND = 8
MAX_ROUNDS = 40


class SolverUnavailable(MemccError):
    """No MILP solver could be loaded (pulp with highspy, or pulp's bundled CBC)."""


def _make_solver(time_limit: float, name: str):
    try:
        import pulp
    except ImportError as exc:  # pragma: no cover - pulp is a dependency
        raise SolverUnavailable("the ILP strategy needs pulp: pip install pulp highspy") from exc
    if name == "highs":
        try:
            import highspy  # noqa: F401

            return pulp.HiGHS(msg=False, timeLimit=max(time_limit, 0.1), threads=1), "HiGHS"
        except (ImportError, pulp.PulpSolverError):
            name = "cbc"
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=max(int(time_limit), 1)), "CBC"


def _initial_rows(problem: Problem, k: int) -> list[int]:
    order = np.argsort(-problem.base, kind="stable")
    return sorted({int(t) for t in order[:k]})


def solve(problem: Problem, budget: float, *, time_limit: float = 60.0,
          solver: str = "highs", objective: str = "time") -> Solution:
    """Minimise added time s.t. modelled memory <= budget (objective="time"), or minimise the
    modelled peak with the added time as a tie-breaker (objective="peak")."""
    import pulp

    start = time.perf_counter()
    n = problem.n_vars
    if n == 0:
        x = np.zeros(0, dtype=bool)
        ok = problem.peak(x) <= budget or objective == "peak"
        return Solution(x, "optimal" if ok else "infeasible", 0.0, 0.0, 0.0, "none")
    rows = _initial_rows(problem, INITIAL_ROWS)
    status, gap, name = "not solved", None, solver
    x = np.zeros(n, dtype=bool)
    rounds = 0
    scale = max(float(problem.base.max(initial=1.0)), 1.0)
    cost_scale = max(float(problem.cost.sum()), 1e-12)
    for rounds in range(1, MAX_ROUNDS + 1):
        remaining = time_limit - (time.perf_counter() - start)
        if remaining <= 0:
            status = "time limit" if status == "not solved" else status
            break
        prob, xv = _model(problem, rows, budget, objective, scale, cost_scale)
        backend, name = _make_solver(remaining, solver)
        prob.solve(backend)
        st = pulp.LpStatus[prob.status]
        values = np.array([(v.value() or 0.0) > 0.5 for v in xv], dtype=bool)
        if st == "Infeasible":
            return Solution(x, "infeasible", None, float("inf"),
                            time.perf_counter() - start, name, rounds)
        if st not in ("Optimal",) and not values.any() and prob.status != 1:
            status = "time limit" if st == "Not Solved" else st.lower()
            break
        x = values
        gap = _gap(prob)
        status = "optimal" if st == "Optimal" and (gap is None or gap <= 1e-4) else "feasible"
        mem = problem.memory(x)
        limit = mem.max() if objective == "peak" else budget
        violated = np.nonzero(mem > limit * (1 + 1e-9) + 1.0)[0] if objective != "peak" else \
            np.array([int(np.argmax(mem))])
        new = [int(t) for t in violated[np.argsort(-mem[violated])][:ROWS_PER_ROUND]
               if int(t) not in rows]
        if not new:
            break
        rows = sorted(set(rows) | set(new))
    objective_s = float(problem.cost[x].sum())
    return Solution(x, status, gap, objective_s, time.perf_counter() - start, name, rounds)


def _model(problem: Problem, rows: list[int], budget: float, objective: str, scale: float,
           cost_scale: float):
    """The MILP over the given memory rows; returns (pulp problem, x variables)."""
    import pulp

    n = problem.n_vars
    prob = pulp.LpProblem("memcc_recompute", pulp.LpMinimize)
    def new_var(name: str, low=None, up=None, cat: str = "Continuous"):
        if hasattr(prob, "add_variable"):  # PuLP >= 3.3
            return prob.add_variable(name, low, up, cat=cat)
        return pulp.LpVariable(name, low, up, cat=cat)

    xv = [new_var(f"x{i}", cat="Binary") for i in range(n)]
    zv: dict[tuple[str, int, int], pulp.LpVariable] = {}

    def var(key):
        if isinstance(key, int):
            return xv[key]
        if key not in zv:
            # Memory rows only ever push z down, so with z >= 0:
            # unless: z >= x_v - x_u gives max(0, x_v - x_u); and: z >= x_v + x_w - 1 gives
            # the product of two binaries.
            kind, v, u = key
            z = new_var(f"z{kind[0]}{v}_{u}", 0, 1)
            if kind == "unless":
                prob.addConstraint(z >= xv[v] - xv[u])
            else:
                prob.addConstraint(z >= xv[v] + xv[u] - 1)
            zv[key] = z
        return zv[key]

    added = pulp.lpSum(float(problem.cost[i]) / cost_scale * xv[i] for i in range(n)
                       if problem.cost[i] > 0)
    peak = None
    if objective == "peak":
        peak = new_var("peak", 0)
        prob += peak + 1e-6 * added
    else:
        prob += added + 1e-9 * pulp.lpSum(xv)
    if problem.exclusive is not None:
        for u, m in problem.exclusive:
            prob += xv[int(u)] + xv[int(m)] <= 1
    for t in rows:
        coeffs = problem.row(t)
        lhs = pulp.lpSum(c / scale * var(k) for k, c in coeffs.items() if c != 0.0)
        if peak is not None:
            prob += lhs + problem.base[t] / scale <= peak
        else:
            prob += lhs <= (budget - problem.base[t]) / scale
    return prob, xv


def _gap(prob) -> float | None:
    model = getattr(prob, "solverModel", None)
    if model is None or not hasattr(model, "getInfo"):
        return None
    try:
        g = float(model.getInfo().mip_gap)
    except Exception:
        return None
    return g if np.isfinite(g) else None
