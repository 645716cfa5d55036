"""``memcc compile --budget min --verify`` on transformers' MobileViT, whose inexact plan
first failed ``--verify`` though it was as accurate as the step as built; prints the
verification fields that say how many outputs passed only within 4x what one ulp of the
batch moves the step as built (``memcc/backend/verify.py`` ``input_sensitivity``).

    python benchmarks/verify_sensitivity.py [--batch 4] [--resolution 64] [--time-limit 20]

The model: a tiny MobileViT config (random weights, nothing downloaded) in ``train()``
mode, exported by ``torch.onnx.export(..., dynamo=False, training=TRAINING)``. The plan
(and so whether it uses inexact variants at all) depends on the node times measured on the
machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


class _Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def export(path: Path, batch: int, resolution: int) -> None:
    import transformers as T

    torch.manual_seed(0)
    config = T.MobileViTConfig(
        image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32],
        num_attention_heads=2, num_labels=5, hidden_dropout_prob=0,
        attention_probs_dropout_prob=0, classifier_dropout_prob=0)
    module = _Logits(T.MobileViTForImageClassification(config)).train()
    x = torch.randn(batch, 3, resolution, resolution)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, input_names=["pixel_values"],
                          output_names=["logits"])


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--time-limit", type=float, default=20)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model, out = Path(tmp) / "mobilevit.onnx", Path(tmp) / "mobilevit.min.onnx"
        export(model, args.batch, args.resolution)
        cmd = [sys.executable, "-m", "memcc", "compile", str(model), "--budget", "min",
               "--verify", "--time-limit", str(args.time_limit), "-o", str(out)]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        report = json.loads(out.with_suffix(".report.json").read_text()) \
            if out.with_suffix(".report.json").exists() else {}
    v = report.get("verification") or {}
    print(json.dumps({"batch": args.batch, "resolution": args.resolution, "exit": r.returncode,
                      "variants": ((report.get("plan") or {}).get("variants") or {}).get("by_kind"),
                      **{k: v.get(k) for k in ("ok", "comparison", "outputs_compared",
                                               "input_sensitive_outputs",
                                               "outputs_judged_by_gradient", "problems")}},
                     indent=1))
    return 0 if r.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
