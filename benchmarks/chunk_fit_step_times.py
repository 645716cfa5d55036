"""Is the plan the row-chunk screen chose faster than the step as built's plan? (issue 31)

The transformers GPT-2 of ``chunk_choice_target.py`` (4 layers x 256, vocabulary 50,257,
batch 8 x 256, dynamo export), compiled at 85% of its peak twice: with every kind whole
(the step as built's plan, which recomputes) and as compile chooses (the screen picks the
loss over 8 chunks); each run in place by ``run_steps`` (as ``memcc run`` runs it), 4 steps,
median of steps 2-4, ``--rounds`` rounds in alternating order, then the per-round ratio.

    python benchmarks/chunk_fit_step_times.py [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.as_built_vs_eager import export  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.compiler import CompileOptions, compile_model  # noqa: E402
from memcc.frontend.build import BuildOptions  # noqa: E402

MODEL = dict(batch=8, seq_len=256, vocab=50257, width=256, depth=4, heads=4)
WHOLE = BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--fraction", type=float, default=0.85)
    a = ap.parse_args(argv)
    d = Path(tempfile.mkdtemp())
    src = d / "hf.onnx"
    export(MODEL, "dynamo", src)
    base = compile_model(src, CompileOptions(budget="1TB", cost="analytic")).report
    budget = str(int(base["baseline"]["peak_bytes"] * a.fraction))
    paths = {}
    for name, build in (("as-built", WHOLE), ("chosen", BuildOptions())):
        out = d / f"{name}.onnx"
        r = compile_model(src, CompileOptions(budget=budget, cost="analytic", build=build),
                          output=out).report
        print(name, r["row_chunks"]["chosen"], f"added {r['plan']['overhead']:+.1%}",
              f"peak {r['plan']['peak_bytes']:,} B", flush=True)
        paths[name] = out
    times: dict[str, list[float]] = {k: [] for k in paths}
    for i in range(a.rounds):
        for k in (list(paths) if i % 2 == 0 else list(paths)[::-1]):
            res = run_steps(paths[k], RunRequest(steps=4))
            times[k].append(statistics.median(res.step_times_s[1:]))
    for k, v in times.items():
        print(k, f"median {statistics.median(v):.3f} s;", [round(x, 3) for x in v])
    ratios = [c / b for c, b in zip(times["chosen"], times["as-built"], strict=True)]
    print("chosen / as-built per round:", [round(x, 3) for x in ratios])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
