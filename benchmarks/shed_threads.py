"""Plans shed to a budget (``compiler/shed_starts.py``), run at 1 and 2 intra-op threads,
twice each, every run from the written file (the step updates its state in place, so a
second run on the same arrays would start from the first one's state), against the first
run bit for bit; and ``--verify``.

    python benchmarks/shed_threads.py [MODEL.onnx BUDGET ...]

Given pairs of a file and a budget, those; else the cases below.

The zoo's ResNet-18 (batch 8, 96 px, width 16) at 70% and MobileNetV2 (batch 8, 64 px) at
50%, ``--cost analytic --time-limit 10``: the two rows of BENCHMARKS.md, "auto against ilp
and sqrtn", where the shedding decided the plan.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import onnx  # noqa: E402
from threads import mismatches, run_once  # noqa: E402

from memcc.backend.runner import synthetic_feeds  # noqa: E402
from memcc.compiler import CompileOptions, compile_model  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from models import build_model  # noqa: E402

CASES = (("resnet18", dict(batch=8, resolution=96, width=16), "70%"),
         ("mobilenetv2", dict(batch=8, resolution=64), "50%"))


def main(argv: list[str]) -> int:
    bad = 0
    given = [(Path(m), None, b) for m, b in zip(argv[::2], argv[1::2], strict=True)]
    with tempfile.TemporaryDirectory(prefix="memcc-shed-") as tmp:
        for name, sizes, budget in given or CASES:
            if sizes is None:
                src, name = name, name.stem
            else:
                src = Path(tmp) / f"{name}.onnx"
                onnx.save(build_model(name, **sizes), str(src))
            out = Path(tmp) / f"{name}.memcc.onnx"
            report = compile_model(src, CompileOptions(
                budget=int(budget) if budget.isdigit() else budget, cost="analytic",
                time_limit=10, verify=True),
                output=out).report
            v = report["verification"]
            feeds = synthetic_feeds(load_graph(out), seed=0)
            runs = {(t, k): run_once(load_graph(out), {n: a.copy() for n, a in feeds.items()}, t)
                    for t in (1, 2) for k in (1, 2)}
            differ = {f"{t} threads, run {k}": len(d) for (t, k), got in runs.items()
                      if (d := mismatches(runs[(1, 1)], got))}
            bad += bool(differ) or not v["ok"]
            print(f"{name} at {budget}: {report['plan']['strategy_label']}; --verify "
                  f"{'OK' if v['ok'] else 'FAILED'} ({v['comparison'][:40]}); 1 and 2 threads, "
                  f"twice each: {differ or 'the same bits'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
