"""Does a HiGHS work option end memcc's smallest-peak MIP before its time limit? (issue 31)

A solve stopped by its time limit can answer differently on a loaded machine; a limit
counted in work would not. This builds the step compile plans for a zoo model (its row
chunks given), prepares it as the planner does, and solves its smallest-peak MIP over
recompute alone (``exact._smallest_peak``'s first solve) at each ``--limits`` with memcc's
HiGHS options plus ``--options`` (JSON), printing each HiGHS call: LP relaxation or MIP,
rows, seconds, status and which limit stopped it (BENCHMARKS.md, "A work bound for the ILP
solves instead of the clock?").

    python benchmarks/highs_work_limits.py [--model gpt2:batch=4,seq_len=128]
        [--chunks 8,8,8] [--limits 60] [--options '{"mip_max_leaves": 1}']
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.steps import parse_model
    from memcc.compiler.costing import node_costs
    from memcc.compiler.loading import load_step
    from memcc.compiler.options import CompileOptions
    from memcc.frontend.build import BuildOptions
    from memcc.passes.plan import Plan, StepStructure
    from memcc.passes.planning.exact import _fixed_to_zero
    from memcc.passes.planning.model.variant_terms import KIND
    from memcc.passes.planning.planner import _prepare
    from memcc.passes.planning.request import PlanRequest
    from memcc.passes.planning.simulate import SimulationRules, simulate
    from memcc.passes.planning.solvers import ilp
    from models import build_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt2:batch=4,seq_len=128")
    ap.add_argument("--chunks", default="8,8,8", help="loss,attention,mlp chunks")
    ap.add_argument("--limits", default="60", help="time limits, comma-separated")
    ap.add_argument("--options", default="{}", help="HiGHS options besides memcc's (JSON)")
    a = ap.parse_args(argv)
    loss, attention, mlp = (int(x) for x in a.chunks.split(","))
    name, opts = parse_model(a.model)
    options = CompileOptions(budget="min", cost="analytic", build=BuildOptions(
        loss_chunks=loss, attention_chunks=attention, mlp_chunks=mlp))
    g, _ = load_step(build_model(name, **opts), name, options)
    costs, _ = node_costs(g, options, print, None)
    st = StepStructure.of(g)
    base = simulate(g, Plan(), costs, st, SimulationRules("cpu"))
    p = _prepare(g, costs, PlanRequest(time_limit=600), st, base)
    problem = _fixed_to_zero(p.model.problem, KIND)
    starts = p.model.starts(list(p.segmentations), g)
    extra = tuple(json.loads(a.options).items())
    release, highs = ilp._release_options, ilp._highs
    ilp._release_options = lambda: tuple(release()) + extra

    def logged(prob, ask, limit, incumbent, relax=False):
        t = time.perf_counter()
        r = highs(prob, ask, limit, incumbent, relax=relax)
        print(json.dumps({"call": "LP" if relax else "MIP", "rows": len(ask.rows),
                          "seconds": round(time.perf_counter() - t, 2), "status": r.status,
                          "limit": r.limit, "gap": r.gap}), flush=True)
        return r

    ilp._highs = logged
    print(f"{a.model} chunks {a.chunks}: {len(g.nodes)} nodes, {problem.n_vars} variables, "
          f"options {a.options}")
    for limit in (float(x) for x in a.limits.split(",")):
        t = time.perf_counter()
        sol = ilp.solve(problem, 0.0, time_limit=limit, objective="peak",
                        warm=ilp.WarmStart(starts))
        print(json.dumps({"time_limit": limit, "wall_s": round(time.perf_counter() - t, 1),
                          "status": sol.status, "limit_hit": sol.limit_hit, "gap": sol.gap,
                          "modelled_peak": float(problem.memory(sol.x).max())}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
