"""Does the same compile give the same plan every time? (issue 31: plans that hold)

Runs ``compile_model`` on the same zoo step, budget and ``--time-limit`` several times, each
in a fresh process (``--jobs`` at once, so that the later runs meet a busier machine), and
prints each run's plan: its peak, its added time, what the polish ran (``simulations``, and
``cut_by_time_limit`` where the clock, not the count, stopped it), the output file's hash
and the wall time. A budget that ``--budget min`` named is only worth naming if a later
compile reaches it again; with the polish bounded by the clock, a ResNet-18 at
``--time-limit 20`` gave three different peaks in three runs.

    python benchmarks/plan_repeat.py [--model resnet18:batch=8,resolution=64]
        [--budget min] [--time-limit 20] [--runs 3] [--jobs 2] [--row-chunks]

``--row-chunks``: compile chooses the row chunks (the step as built and the settings it
plans share the one ``--time-limit``, ``memcc/compiler/chunk_clock.py``); without it every
kind is kept whole, one plan per compile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
sys.path[:0] = [{root!r}, {tests!r}]
from benchmarks.steps import parse_model
from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions
from models import build_model
name, opts = parse_model({model!r})
t = time.perf_counter()
r = compile_model(build_model(name, **opts), CompileOptions(
    budget={budget!r}, cost="analytic", time_limit={limit!r},
    build=BuildOptions() if {chunks!r} else BuildOptions(loss_chunks=1, attention_chunks=1,
                                                         mlp_chunks=1)),
    output={out!r}).report
polish = [s for s in r["strategies"] if s.get("strategy") == "polish"]
print(json.dumps({{"peak_bytes": r["plan"]["peak_bytes"],
    "overhead": r["plan"]["overhead"],
    "simulations": [p.get("simulations") for p in polish],
    "cut": sorted({{c for p in polish for c in p.get("cut_by_time_limit", [])}}),
    "chunks": r["row_chunks"]["chosen"],
    "wall_s": time.perf_counter() - t}}))
"""


def one_run(model: str, budget: str, limit: float, out: Path, chunks: bool = False) -> dict:
    """Compile in a fresh process; its report's figures and the written file's hash."""
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"), model=model,
                        budget=budget, limit=limit, out=str(out), chunks=chunks)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:]}
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["sha256"] = hashlib.sha256(out.read_bytes()).hexdigest()[:16]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet18:batch=8,resolution=64",
                    help="zoo model as name:key=value,... (benchmarks/steps.py)")
    ap.add_argument("--budget", default="min", help="'min' or bytes")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="runs at once")
    ap.add_argument("--out", type=Path, help="write the rows as JSON here")
    ap.add_argument("--row-chunks", action="store_true",
                    help="let compile choose the row chunks (else every kind whole)")
    a = ap.parse_args(argv)
    budget = a.budget if a.budget == "min" else int(float(a.budget))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(lambda i: one_run(a.model, budget, a.time_limit,
                                               Path(tmp) / f"run{i}.onnx", a.row_chunks),
                             range(a.runs)))
    print(f"{a.model}, --budget {a.budget}, --time-limit {a.time_limit:g}, {a.runs} runs, "
          f"{a.jobs} at once ({time.perf_counter() - t0:.0f} s)")
    print("| run | row chunks | peak (B) | added time | polish simulations | cut by clock | "
          "file | wall (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        if "error" in r:
            print(f"| {i} | failed: {r['error']} |")
            continue
        chunks = "/".join(str(n) for n in r["chunks"].values())
        print(f"| {i} | {chunks} | {r['peak_bytes']:,} | {r['overhead']:+.4%} | "
              f"{r['simulations']} | "
              f"{','.join(r['cut']) or '-'} | {r['sha256']} | {r['wall_s']:.1f} |")
    files = {r.get("sha256") for r in rows}
    same = len(files) == 1 and None not in files
    print(f"same output file in every run: {same}")
    if a.out:
        a.out.write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows,
                                     "same": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
