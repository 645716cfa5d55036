"""Memory truth: predicted vs measured peak of training steps, and the executed order.

Builds each zoo model at a size where the step's activations pass 200 MB (and, with
``--exports``, large torch.onnx exports of a convnet and a transformer), runs it with
``memcc run`` semantics, and prints measured/predicted and ``order_matches_plan``.

    python benchmarks/memory_truth.py --out docs/MEMORY_TRUTH.md

``--arena`` runs the steps through ORT's arena with the CUDA provider's settings on the CPU
(``memcc run --arena``) and compares with the arena model (``memcc/passes/analysis/arena.py``), next
to the live-bytes prediction the arena-off measurement is checked against.

    python benchmarks/memory_truth.py --arena --models mlp gpt2 bert resnet18
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.analysis.liveness import analyze_liveness  # noqa: E402
from models import build_model  # noqa: E402

SIZES = {
    "mlp": dict(batch=8192, width=1024, depth=8),
    "resnet18": dict(batch=32, resolution=224, width=32),
    "resnet50": dict(batch=16, resolution=224),
    "vgg16": dict(batch=16, resolution=224, width=32),
    "mobilenetv2": dict(batch=32, resolution=128, width_mult=1.0),
    "unet": dict(batch=8, resolution=128, width=32),
    "gpt2": dict(batch=8, seq_len=256, width=256, depth=6, heads=4),
    "bert": dict(batch=8, seq_len=256, width=256, depth=6, heads=4),
}


def export_cases(tmp: Path):
    """Large torch.onnx exports (TorchScript, training mode) of a convnet and a transformer."""
    import torch
    import transformers

    torch.manual_seed(0)
    cases = []

    class Conv(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers, c = [], 3
            for cout in (64, 64, 128, 128, 256, 256):
                layers += [torch.nn.Conv2d(c, cout, 3, padding=1), torch.nn.BatchNorm2d(cout),
                           torch.nn.ReLU()]
                c = cout
            self.body = torch.nn.Sequential(*layers)
            self.head = torch.nn.Linear(c, 10)

        def forward(self, x):
            return self.head(self.body(x).mean(dim=(2, 3)))

    conv = Conv().train()
    x = torch.randn(16, 3, 96, 96)
    p = tmp / "convnet_export.onnx"
    torch.onnx.export(conv, (x,), str(p), dynamo=False, input_names=["x"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    cases.append(("convnet (torch.onnx TorchScript)", p, {}))

    cfg = transformers.GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=2000,
                                  n_positions=512, attn_pdrop=0, resid_pdrop=0, embd_pdrop=0)
    gpt = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.randint(0, 2000, (8, 256))
    p = tmp / "gpt2_export.onnx"
    torch.onnx.export(Logits(gpt), (ids, torch.ones_like(ids)), str(p), dynamo=True,
                      input_names=["input_ids", "attention_mask"], output_names=["logits"])
    cases.append(("gpt2 (transformers, torch.onnx dynamo)", p, {}))
    return cases


def measure(label: str, model, dims, tmp: Path, steps: int, log, arena: bool = False) -> dict:
    t0 = time.perf_counter()
    step = build_training_step(load_graph(model, dims), BuildOptions())
    path = tmp / "step.onnx"
    save_graph(step, path)
    live = analyze_liveness(step)
    run = run_steps(path, RunRequest(steps=steps, arena=arena))
    act = live.breakdown["activations"]
    row = {"model": label, "nodes": len(step.nodes), "activations_at_peak": act,
           "predicted": run.predicted_peak_bytes, "measured": run.measured_peak_bytes,
           "ratio": run.measured_peak_bytes / run.predicted_peak_bytes,
           "order": run.order_matches_plan, "seconds": time.perf_counter() - t0,
           "live": live.peak_bytes}
    log(f"{label}: predicted {row['predicted'] / 1e6:.1f} MB, measured "
        f"{row['measured'] / 1e6:.1f} MB, ratio {row['ratio']:.4f}, order {row['order']}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(SIZES))
    ap.add_argument("--exports", action="store_true", help="also the torch.onnx exports")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--arena", action="store_true",
                    help="measure through ORT's arena (CUDA's settings) against the arena model")
    args = ap.parse_args(argv)

    def log(m):
        print(m, file=sys.stderr, flush=True)

    rows = []
    with tempfile.TemporaryDirectory(prefix="memcc-truth-") as d:
        tmp = Path(d)
        for name in args.models:
            rows.append(measure(f"{name} {SIZES[name]}", build_model(name, **SIZES[name]), {},
                                tmp, args.steps, log, args.arena))
        if args.exports:
            for label, path, dims in export_cases(tmp):
                rows.append(measure(label, path, dims, tmp, args.steps, log, args.arena))
    if args.arena:
        lines = ["| model | live bytes, arena off (MB) | arena predicted (MB) "
                 "| arena measured (MB) "
                 "| measured/predicted |", "|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['live'] / 1e6:,.1f} | {r['predicted'] / 1e6:,.1f} | "
                  f"{r['measured'] / 1e6:,.1f} | {r['ratio']:.4f} |" for r in rows]
        print("\n".join(lines))
        if args.out:
            args.out.write_text("\n".join(lines) + "\n")
        return 0
    lines = ["| model | nodes | activations at peak (MB) | predicted (MB) | measured (MB) | "
             "measured/predicted | order matches plan |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['nodes']} | {r['activations_at_peak'] / 1e6:,.1f} | "
                     f"{r['predicted'] / 1e6:,.1f} | {r['measured'] / 1e6:,.1f} | "
                     f"{r['ratio']:.4f} | {r['order']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 0 if all(abs(r["ratio"] - 1) <= 0.05 and r["order"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
