"""In-place updates: the peak of a training step with its state updated in place vs copied.

For GPT-2 at its real parameter count (124M, tied embeddings; batch and sequence small, so
that the state, not the activations, is what the comparison is about) with SGD momentum and
with AdamW, this prints for the copying runner (``memcc run``) and for the in-place
arrangement (``memcc.Trainer``, ``memcc run`` with ``in_place=True``):

- the predicted and the measured peak, each measured in one ``run_steps`` call (fresh
  measuring process, see ``backend/memory.py``), and what was saved in units of the
  parameter bytes;
- the step time of the two, timed interleaved in one process with glibc's default allocator
  (``benchmarks/stats.py``: median of per-round ratios, 95% bootstrap interval);
- whether the losses of both are bit-identical.

    python benchmarks/inplace_updates.py                     # gpt2, sgd and adamw
    python benchmarks/inplace_updates.py --batch 1 --seq-len 128 --rounds 8 --optimizer sgd
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.stats import paired_times, ratio_interval  # noqa: E402
from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps, session_graph, synthetic_feeds  # noqa: E402
from memcc.backend.session import make_session  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.step import TrainingStep  # noqa: E402
from memcc.trainer import Trainer  # noqa: E402
from models import build_model  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def mb(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


class CopyingLoop:
    """``memcc run``'s loop in this process: session.run, outputs replace the inputs."""

    def __init__(self, path: Path, feeds: dict) -> None:
        graph = load_graph(path)
        self.spec = TrainingStep.of(graph)
        self.outputs = list(graph.outputs)
        sgraph, self.values = session_graph(graph)
        self.values.update(feeds)
        self.session = make_session(sgraph.to_model(), "cpu")

    def step(self) -> float:
        result = dict(zip(self.outputs, self.session.run(self.outputs, self.values),
                          strict=True))
        for out, inp in self.spec.state.items():
            self.values[inp] = result[out]
        return float(result[self.spec.loss])


def bench(optimizer: str, forward, tmp: Path, args) -> dict:
    log(f"{optimizer}: building the step")
    graph = build_training_step(load_graph(forward), BuildOptions(optimizer=optimizer))
    spec = TrainingStep.of(graph)
    param_bytes = sum(graph.info[p].nbytes for p in spec.parameters)
    n_params = sum(graph.info[p].numel for p in spec.parameters)
    path = save_graph(graph, tmp / f"gpt2_{optimizer}.onnx")
    del graph
    runs = {}
    for label, in_place in (("copying", False), ("in place", True)):
        log(f"{optimizer}: measuring {label} ({args.steps} steps)")
        runs[label] = run_steps(path, RunRequest(steps=args.steps, in_place=in_place,
                                separate_timing=False))
    copying, inplace = runs["copying"], runs["in place"]
    same_losses = list(copying.losses) == list(inplace.losses)

    log(f"{optimizer}: timing, {args.rounds} interleaved rounds")
    feeds = synthetic_feeds(load_graph(path), seed=0)
    loop = CopyingLoop(path, feeds)
    trainer = Trainer(path)
    a_times, b_times = paired_times(loop.step, lambda: trainer.step(feeds),
                                    rounds=args.rounds, warmup=1)
    ratio = ratio_interval(a_times, b_times)
    return {
        "optimizer": optimizer, "params": n_params, "param_bytes": param_bytes,
        "copying": copying, "in_place": inplace, "same_losses": same_losses,
        "schedule": trainer.arrangement.schedule,
        "aliased": f"{len(trainer.in_place.aliased)}/{len(trainer.updates)}",
        "ratio": ratio,
    }


def report(rows: list[dict]) -> None:
    print("| optimizer | parameters | runner | predicted peak | measured peak | "
          "measured/predicted |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        for label, key in (("copying (memcc run)", "copying"), ("in place", "in_place")):
            run = r[key]
            m, p = run.measured_peak_bytes, run.predicted_peak_bytes
            print(f"| {r['optimizer']} | {r['params'] / 1e6:.1f}M ({mb(r['param_bytes'])}) | "
                  f"{label} | {mb(p)} | {mb(m)} | {m / p:.4f} |")
    print()
    print("| optimizer | saved, predicted | saved, measured | updates in place | order | "
          "step time in place / copying (95% CI) | losses bit-identical |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        pb = r["param_bytes"]
        c, i = r["copying"], r["in_place"]
        sp = (c.predicted_peak_bytes - i.predicted_peak_bytes) / pb
        sm = (c.measured_peak_bytes - i.measured_peak_bytes) / pb \
            if c.measured_peak_bytes and i.measured_peak_bytes else float("nan")
        rt = r["ratio"]
        print(f"| {r['optimizer']} | {sp:.2f}x parameter bytes | {sm:.2f}x | {r['aliased']} | "
              f"{r['schedule']} | {rt.cell()}: {rt.verdict('in place', 'copying')} | "
              f"{r['same_losses']} |")
    for r in rows:
        for key in ("copying", "in_place"):
            run = r[key]
            print(f"\n{r['optimizer']} {key}: peak at {run.prediction.get('peak_node')}, "
                  f"breakdown {run.prediction.get('breakdown_at_peak')}; order matches plan: "
                  f"{run.order_matches_plan}; losses {[round(x, 6) for x in run.losses]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer", nargs="+", default=["sgd", "adamw"])
    ap.add_argument("--preset", default="gpt2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="measured steps per run_steps call")
    ap.add_argument("--rounds", type=int, default=8, help="interleaved timing rounds")
    args = ap.parse_args()
    forward = build_model("gpt2", preset=args.preset, batch=args.batch, seq_len=args.seq_len)
    rows = []
    with tempfile.TemporaryDirectory(prefix="memcc-inplace-") as tmp:
        for opt in args.optimizer:
            rows.append(bench(opt, forward, Path(tmp), args))
    print(f"GPT-2 preset {args.preset}, batch {args.batch}, seq_len {args.seq_len}; "
          f"numpy {np.__version__}\n")
    report(rows)


if __name__ == "__main__":
    main()
