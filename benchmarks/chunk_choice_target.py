"""Issue 31's row-chunk target: ``memcc compile --budget X``, X = 1/3 of PyTorch eager's
peak, on a transformers GPT-2 exported with torch.onnx.export, with no chunk flag.

PyTorch eager's peak is measured as ``as_built_vs_eager.py`` measures it (the same seeded
``GPT2LMHeadModel``, SGD with momentum, ``memory.CpuPeakMeter`` in a fresh process). The
forward model is exported (dynamo), compiled by the CLI for a third of that peak, and the
compiled step is run in place (as ``memcc train`` runs it) to measure its peak.

    python benchmarks/chunk_choice_target.py [--batch 8 --seq-len 256 --vocab 50257
        --width 256 --depth 4 --heads 4] [--fraction 0.3333] [--cost auto] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.as_built_vs_eager import export, measure_torch  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402

MB = 1e6


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("batch", 8), ("seq-len", 256), ("vocab", 50257), ("width", 256),
                          ("depth", 4), ("heads", 4)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--fraction", type=float, default=1 / 3)
    ap.add_argument("--cost", default="auto")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--form", default="dynamo")
    ap.add_argument("--keep", type=Path, help="keep the files in this folder")
    args = ap.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("batch", "seq_len", "vocab", "width", "depth",
                                         "heads")}
    eager = measure_torch(cfg, args.steps)
    budget = int(eager["peak_bytes"] * args.fraction)
    print(f"PyTorch eager peak {eager['peak_bytes'] / MB:.1f} MB ({eager['method']}); "
          f"budget {budget / MB:.1f} MB", flush=True)
    with tempfile.TemporaryDirectory(prefix="memcc-chunks-") as tmp:
        d = args.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        src, out = d / "gpt2.onnx", d / "gpt2.memcc.onnx"
        export(cfg, args.form, src)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "memcc.cli", "compile", str(src),
                            "--budget", str(budget), "-o", str(out), "--cost", args.cost],
                           capture_output=True, text=True, cwd=ROOT)
        took = time.perf_counter() - t0
        print(r.stdout + r.stderr[-3000:], flush=True)
        print(f"compile took {took:.0f} s, exit {r.returncode}")
        if r.returncode != 0:
            return 1
        rep = json.loads(out.with_name(out.stem + ".report.json").read_text())
        run = run_steps(out, RunRequest(steps=args.steps, in_place=True, separate_timing=False))
        print(json.dumps({"config": cfg, "eager_peak_bytes": eager["peak_bytes"],
                          "budget_bytes": budget, "compile_s": round(took, 1),
                          "row_chunks": rep["row_chunks"],
                          "plan_peak_bytes": rep["plan"]["peak_bytes"],
                          "baseline_peak_bytes": rep["baseline"]["peak_bytes"],
                          "overhead": rep["plan"]["overhead"],
                          "in_place_measured_peak_bytes": run.measured_peak_bytes,
                          "in_place_predicted_peak_bytes": run.predicted_peak_bytes},
                         indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
