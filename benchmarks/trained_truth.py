"""Memory truth of the step as it trains: compile's predicted peak against ``memcc train``.

``memcc compile`` plans the step ``memcc train`` runs (updates written in place, each moved
to just after its gradient where that lowers the peak: ``passes.analysis.arrange``), so the peak in
its report is a prediction of what training holds. This measures it, for each model (zoo
models, and with ``--exports`` torch.onnx exports of a transformers GPT-2 and a train-mode
convnet) and each budget (the step as built, and compiled at ``--fractions`` of it):

- **arena**: compiled with ``--arena`` and trained through ORT's CPU arena by
  ``memcc.Trainer``, measured by ``memcc train``'s own meter (``trainer.StepMemory``: the
  growth of the process's high-water mark over a step, heap trimmed before it, plus the
  arrays the trainer holds and feeds), the largest of the steps after the first, in a fresh
  process per row;
- **malloc**: compiled for malloc and run in place by ``memcc run`` (the same arrangement,
  measured in its own measuring child, ``backend.memory``).

Each row prints compile's predicted peak, the measured peak and measured/predicted.

    python benchmarks/trained_truth.py --out /tmp/truth.md
    python benchmarks/trained_truth.py --models gpt2 resnet18 --fractions 0.5 --exports
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {
    "mlp": dict(batch=4096, width=1024, depth=6),
    "resnet18": dict(batch=16, resolution=128, width=32),
    "resnet50": dict(batch=8, resolution=128),
    "mobilenetv2": dict(batch=16, resolution=128, width_mult=1.0),
    "unet": dict(batch=4, resolution=128, width=32),
    "gpt2": dict(batch=8, seq_len=256, width=256, depth=4, heads=4),
    "bert": dict(batch=8, seq_len=256, width=256, depth=4, heads=4),
}


def export_cases(tmp: Path) -> list[tuple[str, Path]]:
    """A transformers GPT-2 (dynamo) and a train-mode convnet (TorchScript), as users export."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=8000,
                                  n_positions=256, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0)
    gpt = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids):
            return self.m(input_ids=input_ids).logits

    ids = torch.randint(0, 8000, (4, 256))
    gp = tmp / "gpt2_export.onnx"
    torch.onnx.export(Logits(gpt), (ids,), str(gp), dynamo=True, input_names=["input_ids"],
                      output_names=["logits"])
    layers, c = [], 3
    for cout in (32, 64, 64, 128):
        layers += [torch.nn.Conv2d(c, cout, 3, padding=1), torch.nn.BatchNorm2d(cout),
                   torch.nn.ReLU()]
        c = cout
    conv = torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                               torch.nn.Linear(c, 10)).train()
    cp = tmp / "convnet_export.onnx"
    torch.onnx.export(conv, (torch.randn(16, 3, 96, 96),), str(cp), dynamo=False,
                      input_names=["x"], output_names=["logits"],
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return [("gpt2 (transformers, dynamo)", gp), ("convnet (TorchScript, train mode)", cp)]


def measure_training(path: str, steps: int) -> dict:
    """In this (fresh) process: ``memcc train``'s meter over ``steps`` steps of the step."""
    from memcc.backend.runner import synthetic_feeds
    from memcc.trainer import StepMemory, Trainer

    trainer = Trainer(path, arena=True)
    feeds = synthetic_feeds(trainer.graph, 0)
    batch = {d.name: feeds[d.name] for d in trainer.inputs}
    meter = StepMemory(trainer)
    for _ in range(steps):
        meter.start(batch)
        trainer.step(batch)
        meter.stop()
    return {"measured": meter.peak, "trainer_predicted": meter.predicted,
            "method": meter.method}


def _train_in_child(path: Path, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--measure-training", str(path),
                          "--steps", str(steps)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Rows:
    """Which rows each model gets: budgets (fractions of the step as built), measured steps,
    allocators."""

    fractions: tuple[float, ...] = (0.5,)
    steps: int = 4
    allocators: tuple[str, ...] = ("arena", "malloc")


def rows_for(label: str, model: Path, want: Rows, tmp: Path, log) -> list[dict]:
    from memcc.backend.runner import RunRequest, run_steps
    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.planning.planner import BudgetError

    rows = []
    fractions, steps = list(want.fractions), want.steps
    for allocator in want.allocators:
        arena = allocator == "arena"
        base = None
        for fraction in [1.0, *fractions]:
            t0 = time.perf_counter()
            out = tmp / f"{allocator}_{fraction}.onnx"
            budget = "min" if fraction == 0 else (
                int(base * fraction) if base is not None and fraction < 1.0 else "100GB")
            try:
                r = compile_model(model, CompileOptions(budget=budget, arena=arena,
                                                        cost="analytic", time_limit=20),
                                  output=out).report
            except BudgetError as exc:
                log(f"{label} {allocator} {fraction:.0%}: refused ({exc.smallest:,} bytes "
                    "is the smallest budget)")
                continue
            if base is None:
                base = r["baseline"]["peak_bytes"]
            predicted = r["plan"]["peak_bytes"] if fraction < 1.0 else base
            if arena:
                m = _train_in_child(out, steps)
                measured, how = m["measured"], "memcc train (arena)"
                log(f"trainer's own prediction {m['trainer_predicted']:,}")
            else:
                run = run_steps(out, RunRequest(steps=steps, separate_timing=False))
                measured, how = run.measured_peak_bytes, "memcc run (in place, malloc)"
            row = {"model": label, "allocator": allocator,
                   "budget": "as built" if fraction == 1.0 else
                   "min" if fraction == 0 else f"{fraction:.0%}",
                   "predicted": predicted, "measured": measured,
                   "ratio": measured / predicted if measured else None, "measured_by": how,
                   "seconds": round(time.perf_counter() - t0, 1)}
            log(json.dumps(row))
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| model | allocator | budget | compile's predicted peak (MB) | measured (MB) "
             "| measured/predicted | measured by |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.4f}" if r["ratio"] is not None else "-"
        measured = f"{r['measured'] / 1e6:,.1f}" if r["measured"] else "-"
        lines.append(f"| {r['model']} | {r['allocator']} | {r['budget']} | "
                     f"{r['predicted'] / 1e6:,.1f} | {measured} | {ratio} | {r['measured_by']} |")
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    if ratios:
        lines.append(f"\n{len(ratios)} rows: measured/predicted from {min(ratios):.4f} to "
                     f"{max(ratios):.4f}; within 3%: "
                     f"{sum(abs(x - 1) <= 0.03 for x in ratios)}/{len(ratios)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--fractions", nargs="*", type=float, default=[0.5],
                    help="budgets as fractions of the step as built (0: --budget min)")
    ap.add_argument("--exports", action="store_true", help="also the torch.onnx exports")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--allocators", nargs="*", default=["arena", "malloc"],
                    choices=["arena", "malloc"], help="which rows (default: both)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--measure-training", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure_training:
        print(json.dumps(measure_training(args.measure_training, args.steps)))
        return 0
    from models import build_model

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    rows: list[dict] = []
    want = Rows(tuple(args.fractions), args.steps, tuple(args.allocators))
    with tempfile.TemporaryDirectory(prefix="memcc-trained-") as d:
        tmp = Path(d)
        cases = [(f"{m} {SIZES[m]}", _saved(build_model(m, **SIZES[m]), tmp / f"{m}.onnx"))
                 for m in args.models]
        if args.exports:
            cases += export_cases(tmp)
        for label, path in cases:
            rows += rows_for(label, path, want, tmp, log)
    text = table(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


def _saved(model, path: Path) -> Path:
    import onnx

    onnx.save(model, str(path))
    return path


if __name__ == "__main__":
    sys.exit(main())
