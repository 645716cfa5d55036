"""Measured over predicted peak of a small transformers GPT-2's `--budget min` plan.

A first-use walk-through (BENCHMARKS.md, "Session 37") saw the arena meter 6.8% over the
prediction on this model: GPT-2 with 2 layers of width 128, 4 heads, a vocabulary of 1,000
and 64 positions, exported in train mode by the TorchScript exporter at 4 x 64 tokens.
This exports it, compiles `--budget min` with malloc and with the arena, and runs each plan
with `memcc run --steps 4 --json` (its `measured_over_predicted`), and the step as built
for comparison.

    python benchmarks/small_gpt2_truth.py [--time-limit 60] [--keep DIR]

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


if __name__ == "__main__":
    main()
