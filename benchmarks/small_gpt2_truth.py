"""Measured over predicted peak of a small transformers GPT-2's `--budget min` plan.

A first-use walk-through (BENCHMARKS.md, "Session 37") saw the arena meter 6.8% over the
prediction on this model: GPT-2 with 2 layers of width 128, 4 heads, a vocabulary of 1,000
and 64 positions, exported in train mode by the TorchScript exporter at 4 x 64 tokens.
This exports it, compiles `--budget min` with malloc and with the arena, and runs each plan
with `memcc run --steps 4 --json` (its `measured_over_predicted`), and the step as built
for comparison. Then the step as it trains: each step trained by `memcc train --arena
--steps 6 --json` on synthetic tokens, its meter (`trainer.StepMemory`: the growth of the
high-water mark over a step plus the arrays the trainer holds, the largest of the steps
after the first) against the prediction it prints, ``--repeats`` times in fresh processes.
`memcc run`'s meter counts the whole process over a baseline, so it also sees the Python
and ORT objects its measuring child makes for every input it binds each step (BENCHMARKS.md,
"Session 41"); the trainer binds its inputs once.

    python benchmarks/small_gpt2_truth.py [--time-limit 60] [--repeats 2] [--keep DIR]

``--keep DIR`` leaves the export and the three steps there (``benchmarks/alloc_trace.py``
reads them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def export(out: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000,
                                  n_positions=64, use_cache=False)
    model = transformers.GPT2LMHeadModel(cfg).train()

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            return self.model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False, return_dict=False)[0]

    ids = torch.randint(0, 1000, (4, 64))
    axes = {0: "batch", 1: "seq"}
    torch.onnx.export(Logits().train(), (ids, torch.ones(4, 64, dtype=torch.int64)), str(out),
                      dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False, opset_version=17,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"],
                      dynamic_axes={"input_ids": axes, "attention_mask": axes, "logits": axes})


def memcc(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "memcc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    return r.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", default="60")
    ap.add_argument("--keep", type=Path, help="write the export and the steps here")
    ap.add_argument("--repeats", type=int, default=2,
                    help="`memcc train --arena` runs per step (fresh processes)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d = a.keep or Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        export(d / "g.onnx")
        dims = ["--dim", "batch=4", "--dim", "seq=64"]
        memcc("build", str(d / "g.onnx"), *dims, "-o", str(d / "built.onnx"))
        steps = {"as built": d / "built.onnx"}
        for name, flags in (("min, malloc", []), ("min, arena", ["--arena"])):
            out = d / f"{name.replace(', ', '_')}.onnx"
            memcc("compile", str(d / "g.onnx"), *dims, "--budget", "min", "--time-limit",
                  a.time_limit, *flags, "-o", str(out))
            steps[name] = out
        for name, step in steps.items():
            r = json.loads(memcc("run", str(step), "--steps", "4", "--json"))
            print(f"{name}: measured {r['measured_peak_bytes'] / 2**20:.2f} MiB, predicted "
                  f"{r['predicted_peak_bytes'] / 2**20:.2f} MiB, measured/predicted "
                  f"{r['measured_over_predicted']:.3f}")
        trained(d, steps, a.repeats)


def trained(d: Path, steps: dict[str, Path], repeats: int) -> None:
    """Each step as ``memcc train --arena`` runs it: measured over predicted per run."""
    import numpy as np

    rng = np.random.default_rng(0)
    data = d / "tokens.npz"
    np.savez(data, input_ids=rng.integers(0, 1000, (32, 64)),
             attention_mask=np.ones((32, 64), np.int64),
             labels=rng.integers(0, 1000, (32, 64)))
    for name, step in steps.items():
        ratios = []
        for _ in range(repeats):
            m = json.loads(memcc("train", str(step), "--data", str(data), "--steps", "6",
                                 "--arena", "--json"))["memory"]
            ratios.append(m["measured_peak_bytes"] / m["predicted_peak_bytes"])
        print(f"{name}, trained (--arena): predicted {m['predicted_peak_bytes'] / 2**20:.2f} "
              f"MiB, measured/predicted " + ", ".join(f"{r:.3f}" for r in ratios))


if __name__ == "__main__":
    main()
