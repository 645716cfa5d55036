"""Optimizer state in host memory on a GPU (issue 31, deliverable 5): does it run, train the
same numbers, and hold what ``passes.analysis.device_memory`` predicts?

For SGD with momentum and AdamW on the zoo's GPT-2 (large vocabulary), the step as built and
the step with all its optimizer state host-resident (``passes.lowering.offload_state``) each run in
a
child process through ``DeviceStep`` on CUDA (state in host buffers bound to the copies);
per variant: the losses of ``--steps`` steps, the device bytes NVML saw (less the process's
CUDA context), the predicted steady bytes, the median step time, and what kept CUDA graph
capture off. Run on the GPU machine:

    python benchmarks/offload_state_cuda.py --out offload_state.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

DIMS = dict(batch=2, seq_len=128, vocab_size=50257, width=256, depth=2, heads=4)


def child(opt: str, offload: bool, steps: int) -> dict:
    """One variant in this process (a fresh CUDA context: NVML's reading is its own)."""
    from memcc.backend.device_step import DeviceSettings, DeviceStep, StepRoles
    from memcc.backend.memory import NvmlPeakMeter, device_baseline
    from memcc.backend.runner import synthetic_feeds
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.device_memory import predict_step
    from memcc.passes.lowering.offload_state import offload_state, optimizer_state
    from memcc.step import TrainingStep
    from models import build_model

    graph = build_training_step(load_graph(build_model("gpt2", **DIMS)),
                                BuildOptions(optimizer=opt))
    moved = None
    if offload:
        moved = offload_state(graph, [n for n, _ in optimizer_state(graph)])
        graph = moved.graph
    a, predicted = predict_step(graph)
    spec = TrainingStep.of(graph)
    base = device_baseline()
    meter = NvmlPeakMeter()
    meter.baseline = base
    meter.start()
    row: dict = {"optimizer": opt, "offload": offload,
                 "offloaded_bytes": moved.bytes if moved else 0,
                 "predicted_steady_bytes": predicted.steady_bytes}
    try:
        step = DeviceStep(a.graph, StepRoles(spec.loss, spec.state, a.in_place.aliased),
                          DeviceSettings(provider="cuda"))
        feeds = synthetic_feeds(graph, seed=0)
        losses, times = [], []
        for _ in range(steps):
            t0 = time.perf_counter()
            losses.append(step.run(feeds).loss)
            times.append(time.perf_counter() - t0)
        row |= {"losses": losses, "median_step_s": statistics.median(times[1:] or times),
                "captured": step.captured, "cuda_graph_note": step.cuda_graph_note,
                "host_resident": len(step.host_resident)}
    except Exception as exc:  # the row says what failed; the other variants still run
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    row["measured_device_bytes"] = meter.stop()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="offload_state_cuda.json")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--child", nargs=2, metavar=("OPT", "OFFLOAD"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "1", args.steps)))
        return 0
    rows = []
    for opt in ("sgd", "adamw"):
        for offload in (False, True):
            r = subprocess.run([sys.executable, __file__, "--child", opt, str(int(offload)),
                                "--steps", str(args.steps)], capture_output=True, text=True)
            try:
                rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
            except (IndexError, ValueError):
                rows.append({"optimizer": opt, "offload": offload,
                             "error": (r.stderr or r.stdout)[-2000:]})
            print(json.dumps(rows[-1]), flush=True)
    for opt in ("sgd", "adamw"):
        plain, off = (next(r for r in rows if r["optimizer"] == opt and r["offload"] == o)
                      for o in (False, True))
        if "losses" in plain and "losses" in off:
            off["max_loss_rel_diff"] = max(abs(x - y) / max(abs(x), 1e-12)
                                           for x, y in zip(plain["losses"], off["losses"],
                                                           strict=True))
    with open(args.out, "w") as f:
        json.dump({"dims": DIMS, "rows": rows}, f, indent=1)
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
