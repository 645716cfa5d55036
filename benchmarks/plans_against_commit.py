"""The plans this checkout compiles against those of another checkout, at the same budgets
in bytes: which fits, its predicted added step time, its peak, and the compile's wall time.

    git worktree add /tmp/base REV
    python benchmarks/plans_against_commit.py --base /tmp/base MODEL.onnx [MODEL.onnx ...]
        [--shares 0.5,0.7,0.85,min] [--time-limit 10] [--repeats 1] [--out FILE.jsonl]

Each budget is a share of the budget the step as built needs as ``--base`` resolves
``--budget 100%`` (the same bytes on both sides, though the two may define 100%
differently). Every compile is ``compile_model(MODEL, CompileOptions(budget=B,
cost="analytic", time_limit=T))`` in a fresh process with the side's source first on
``sys.path``, the two sides interleaved, so a difference in the machine's load falls on
both. Figures are predictions (analytic costs): nothing is run. A search cut by its time
limit can give another plan on another run; ``--repeats`` shows how much.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One compile, run in a child with PYTHONPATH set to the side's source: prints one line.
ONE = r"""
import json, sys, time
model, budget, limit = sys.argv[1:4]
from memcc.compiler import CompileOptions, compile_model
from memcc.errors import MemccError
t0 = time.perf_counter()
row = {}
try:
    r = compile_model(model, CompileOptions(budget=int(budget) if budget.isdigit() else budget,
                                            cost="analytic", time_limit=float(limit)))
    p = r.report["plan"]
    row = dict(fits=True, peak_bytes=p["peak_bytes"], added=p["overhead"],
               budget_bytes=r.report["budget_bytes"],
               label=r.outcome.label,
               as_built=(r.report.get("budget_share") or {}).get("as_built_budget_bytes"))
except MemccError as e:
    row = dict(fits=False, smallest=getattr(e, "smallest", None))
row["wall_s"] = time.perf_counter() - t0
print(json.dumps(row))
"""


def compile_once(src: Path, model: str, budget: str, limit: float) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{src / 'tests'}"}
    # Run from the side's checkout: ``python -c`` puts the working directory first on
    # sys.path, ahead of PYTHONPATH.
    out = subprocess.run([sys.executable, "-c", ONE, str(Path(model).resolve()), budget,
                          str(limit)], env=env, cwd=src, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--base", type=Path, required=True, help="the other checkout")
    ap.add_argument("--shares", default="0.5,0.7,0.85,min")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sides = {"base": args.base.resolve(), "this": ROOT}
    print(f"{'model':28} {'budget':>12} {'side':>5} {'result':>22} {'peak MB':>9} "
          f"{'budget MB':>9} {'wall s':>7}  plan")
    for model in args.models:
        whole = compile_once(sides["base"], model, "100%", args.time_limit)["as_built"]
        for share in args.shares.split(","):
            budget = "min" if share == "min" else str(int(whole * float(share)))
            for _ in range(args.repeats):
                for side, src in sides.items():
                    r = compile_once(src, model, budget, args.time_limit)
                    r |= dict(model=model, budget=budget, share=share, side=side)
                    result = (f"{r['added']:+.2%}" if r["fits"]
                              else f"refused ({r['smallest'] or 0:,})")
                    peak = f"{r['peak_bytes'] / 1e6:.2f}" if r["fits"] else ""
                    needs = f"{r['budget_bytes'] / 1e6:.2f}" if r["fits"] else ""
                    print(f"{Path(model).name[:28]:28} {budget:>12} {side:>5} {result:>22} "
                          f"{peak:>9} {needs:>9} {r['wall_s']:7.1f}  {r.get('label', '')}",
                          flush=True)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
