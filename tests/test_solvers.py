"""The array solvers: the ILP is optimal for its model (checked by brute force), the
memory model evaluates terms as documented, and sqrtn returns one candidate per k."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from memcc.passes.solvers import ilp, sqrtn
from memcc.passes.solvers.problem import Problem


def random_problem(n: int, horizon: int, seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    base = np.zeros(horizon)
    tv, tb, ts, te, tu = [], [], [], [], []
    for i in range(n):
        s = int(rng.integers(1, horizon // 2))
        e = int(rng.integers(horizon // 2, horizon - 1))
        size = float(rng.uniform(1, 10))
        base[s : e + 1] += size
        rec = int(rng.integers(s + 1, e + 1))
        tv += [i, i]
        tb += [-size, size]
        ts += [s + 1, rec]
        te += [e, e]
        tu += [-1, -1]
        if i > 0 and rng.random() < 0.5:  # keeps an earlier value alive unless recomputed
            tv.append(i)
            tb.append(float(rng.uniform(1, 5)))
            ts.append(rec - 1)
            te.append(rec)
            tu.append(i - 1)
    return Problem(base, rng.uniform(0.1, 1.0, n), np.array(tv), np.array(tb), np.array(ts),
                   np.array(te), tuple(map(str, range(n))), np.array(tu))


def brute_force(problem: Problem, budget: float) -> float:
    best = np.inf
    for bits in itertools.product([0, 1], repeat=problem.n_vars):
        x = np.array(bits, dtype=bool)
        if problem.peak(x) <= budget + 1e-9:
            best = min(best, float(problem.cost[x].sum()))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_ilp_matches_brute_force_optimum(seed):
    p = random_problem(9, 40, seed)
    peak0 = p.peak(np.zeros(p.n_vars, dtype=bool))
    lowest = min(p.peak(np.array(b, dtype=bool))
                 for b in itertools.product([0, 1], repeat=p.n_vars))
    budget = lowest + 0.4 * (peak0 - lowest)
    sol = ilp.solve(p, budget, time_limit=20)
    assert sol.status == "optimal"
    assert p.peak(sol.x) <= budget + 1e-6
    assert sol.objective == pytest.approx(brute_force(p, budget), rel=1e-6, abs=1e-9)


def test_ilp_reports_infeasible_below_the_lowest_model_peak():
    p = random_problem(6, 30, 3)
    lowest = min(p.peak(np.array(b, dtype=bool))
                 for b in itertools.product([0, 1], repeat=p.n_vars))
    assert ilp.solve(p, lowest * 0.5, time_limit=10).status == "infeasible"


def test_ilp_minimum_peak_objective_reaches_the_brute_force_minimum():
    p = random_problem(8, 30, 5)
    lowest = min(p.peak(np.array(b, dtype=bool))
                 for b in itertools.product([0, 1], repeat=p.n_vars))
    sol = ilp.solve(p, 0.0, time_limit=20, objective="peak")
    assert p.peak(sol.x) == pytest.approx(lowest)


def test_unless_terms_count_only_when_the_other_variable_is_off():
    p = Problem(np.zeros(4), np.ones(2), np.array([0]), np.array([5.0]), np.array([1]),
                np.array([2]), ("a", "b"), np.array([1]))
    assert p.peak(np.array([1, 0], dtype=bool)) == 5.0
    assert p.peak(np.array([1, 1], dtype=bool)) == 0.0
    assert p.peak(np.array([0, 0], dtype=bool)) == 0.0


def test_empty_problem_is_solved_trivially():
    p = Problem(np.array([3.0]), np.zeros(0), np.zeros(0, int), np.zeros(0), np.zeros(0, int),
                np.zeros(0, int), ())
    assert ilp.solve(p, 5.0).status == "optimal"
    assert ilp.solve(p, 1.0).status == "infeasible"


def test_sqrtn_keeps_the_producers_crossing_each_cut():
    crossing = np.array([5.0, 1.0, 5.0, 5.0, 1.0, 5.0])
    crossing_vars = [[0], [1], [2], [3], [4], [5]]
    cands = dict(sqrtn.candidates(crossing, crossing_vars, 6, np.ones(6, dtype=bool)))
    assert cands[1].all()  # one segment: recompute everything
    x3 = cands[3]
    assert not x3[1] and not x3[4]  # the cheap cuts were chosen as checkpoints
