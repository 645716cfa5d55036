"""Time every HiGHS solve of one `memcc compile`: the LP-relaxation row rounds and the 0-1
rounds, with the rows each had and what it returned.

The compile report gives the total solve time and the number of rounds; this shows where
the time goes (docs/PLANNING_CORE.md, BENCHMARKS.md quote it). Usage, with any compile
arguments after the step:

    python benchmarks/ilp_solves.py STEP.onnx --budget 367MB --strategy ilp --cost analytic
"""

from __future__ import annotations

import sys
import time

from memcc.cli import app
from memcc.passes.planning.solvers import ilp

_solve = ilp._highs


def _timed(problem, ask, time_limit, incumbent, relax=False):
    start = time.perf_counter()
    rows, objective = ask.rows, ask.objective
    result = _solve(problem, ask, time_limit, incumbent, relax)
    kind = "LP " if relax else "0-1"
    gap = "-" if result.gap is None else f"{result.gap:.3%}"
    print(f"{kind} {objective:4s} vars={problem.n_vars} memory rows={len(rows):4d} "
          f"{time.perf_counter() - start:7.2f} s  {result.status:9s} gap {gap}",
          file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    ilp._highs = _timed
    app(["compile", *sys.argv[1:]])
