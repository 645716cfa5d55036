"""How close the cost model's ``compute_cost_s`` is to the measured step time.

For zoo training steps: the sum of per-node times measured by ORT's profiler (the
``measured`` cost model), the roofline estimate (``analytic``, calibrated on this CPU), and
the median wall time of ``session.run`` for the whole step (``memcc run``).

    python benchmarks/cost_model_accuracy.py --out docs/COST_MODEL.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.profiling import calibrate_cpu_rates, measured_costs  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.analysis.cost_model import analytic_costs  # noqa: E402
from models import build_model  # noqa: E402

CASES = {
    "mlp": dict(batch=1024, width=512, depth=6),
    "resnet18": dict(batch=16, resolution=96, width=32),
    "resnet50": dict(batch=8, resolution=128),
    "mobilenetv2": dict(batch=16, resolution=96, width_mult=0.5),
    "gpt2": dict(batch=8, seq_len=128, width=256, depth=4, heads=4),
    "bert": dict(batch=8, seq_len=128, width=256, depth=4, heads=4),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rates = calibrate_cpu_rates(use_cache=False)
    lines = ["| model | nodes | measured step (s) | profiled kernel time (s) | ratio | "
             "measured cost model total (s) | ratio | analytic estimate (s) | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        for name, opts in CASES.items():
            step = build_training_step(load_graph(build_model(name, **opts)), BuildOptions())
            path = Path(d) / "step.onnx"
            save_graph(step, path)
            run = run_steps(path, RunRequest(steps=5))
            measured = measured_costs(step, "cpu", use_cache=False)
            meas = measured.total(step)
            kern = measured.kernel_s or 0.0
            ana = analytic_costs(step, rates).total(step)
            t = run.step_time_s
            lines.append(f"| {name} | {len(step.nodes)} | {t:.3f} | {kern:.3f} | "
                         f"{kern / t:.2f} | {meas:.3f} | {meas / t:.2f} | {ana:.3f} | "
                         f"{ana / t:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + (f"\n\nRates used by the analytic model: {rates.to_json()}\n")
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
