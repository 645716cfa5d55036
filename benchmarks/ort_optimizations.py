"""Should memcc plan on the graph ORT optimizes for the provider? The evidence.

For zoo training steps, runs the step under the execution contract (optimizations off) and
with ORT's optimization levels BASIC / EXTENDED / ALL turned on (everything else as in the
contract), and reports: nodes after optimization (ORT saves its optimized graph), the
median step time, the measured peak, and whether ORT still ran the file's order.

    python benchmarks/ort_optimizations.py --out docs/ORT_OPTIMIZATIONS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402

from memcc.backend.memory import measure_in_subprocess  # noqa: E402
from memcc.backend.profile_order import check_session_order, planned_order  # noqa: E402
from memcc.backend.runner import session_graph, synthetic_feeds  # noqa: E402
from memcc.backend.session import session_options  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from models import build_model  # noqa: E402

CASES = {
    "gpt2": dict(batch=8, seq_len=128, width=256, depth=4, heads=4),
    "resnet18": dict(batch=16, resolution=96, width=32),
    "bert": dict(batch=8, seq_len=128, width=256, depth=4, heads=4),
}
LEVELS = {
    "contract (off)": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def run(name: str, opts: dict, reps: int, tmp: Path) -> list[dict]:
    step = build_training_step(load_graph(build_model(name, **opts)), BuildOptions())
    g, values = session_graph(step)
    model = g.to_model()
    feeds = {**values, **synthetic_feeds(step, 0)}
    planned = planned_order(g.nodes)
    rows = []
    for label, level in LEVELS.items():
        so = session_options(profile=True, profile_prefix=str(tmp / "p"))
        so.graph_optimization_level = level
        if level != ort.GraphOptimizationLevel.ORT_DISABLE_ALL:
            # Only the level changes: the contract's disabled-optimizer list is removed too.
            so.add_session_config_entry("optimization.disable_specified_optimizers", "")
        opt_path = tmp / f"{name}-{label.split()[0]}.onnx"
        so.optimized_model_filepath = str(opt_path)
        sess = ort.InferenceSession(model.SerializeToString(), so,
                                    providers=["CPUExecutionProvider"])
        sess.run(None, feeds)
        order = check_session_order(sess, planned)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            times.append(time.perf_counter() - t0)
        n_opt = len(onnx.load(str(opt_path), load_external_data=False).graph.node)
        overrides = {} if level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL else {
            "graph_optimization_level": level.name}
        peak = max(measure_in_subprocess(model, feeds, runs=1, overrides=overrides))
        rows.append({"model": name, "level": label, "nodes": len(g.nodes),
                     "nodes_after": n_opt, "step_time_s": statistics.median(times),
                     "peak_bytes": peak, "order_kept": order.matches})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name, opts in CASES.items():
            rows += run(name, opts, args.reps, Path(d))
    lines = ["| model | ORT optimization | nodes run | median step (s) | vs contract | "
             "measured peak (MB) | file order kept |", "|---|---|---|---|---|---|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["model"], r["step_time_s"])
        lines.append(f"| {r['model']} | {r['level']} | {r['nodes_after']} | "
                     f"{r['step_time_s']:.3f} | {r['step_time_s'] / base[r['model']]:.2f} | "
                     f"{r['peak_bytes'] / 1e6:,.1f} | {r['order_kept']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
