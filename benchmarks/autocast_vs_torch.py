"""memcc's 16-bit steps against PyTorch autocast on zoo models: loss and gradient errors.

For each zoo model and precision: the forward ONNX graph interpreted in torch in float64
(``tests/torch_reference.py``: the exact reference), the same interpreter under
``torch.autocast("cpu", dtype)`` ("PyTorch autocast"), and memcc's step built with
``--precision`` as the CPU provider runs it. Prints the three losses and, over the
gradients, the median and largest relative error (``|g - g64| / |g64|``) of memcc and of
torch, and the two tensors where memcc's error is largest against torch's. The assertions
on these figures are in tests/test_autocast_numerics.py; this prints them.

    python benchmarks/autocast_vs_torch.py --models resnet18 gpt2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from threads import run_once  # noqa: E402
from torch_reference import torch_loss_and_grads  # noqa: E402

from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.providers.provider_step import for_provider  # noqa: E402
from models import build_model, make_feeds, make_labels  # noqa: E402

TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b), 1e-30))


def compare(name: str, precision: str, options: dict) -> dict:
    model = build_model(name, **options)
    feeds, labels = make_feeds(model, seed=0), make_labels(model, seed=0)
    ref_loss, ref = torch_loss_and_grads(model, feeds, labels=labels, double=True)
    with torch.autocast("cpu", dtype=TYPES[precision]):
        t_loss, tg = torch_loss_and_grads(model, feeds, labels=labels)
    step = for_provider(build_training_step(load_graph(model), BuildOptions(
        optimizer="none", precision=precision, loss_scale="none")), "cpu")[0]
    out = run_once(step, {**feeds, "labels": labels}, 2)
    em = {k: _rel(out[f"{k}.grad"], v) for k, v in ref.items()}
    et = {k: _rel(tg[k], v) for k, v in ref.items()}
    worst = sorted(ref, key=lambda k: em[k] / max(et[k], 1e-7))[-2:]
    return {"model": name, "precision": precision, "loss_float64": ref_loss,
            "loss_torch": t_loss, "loss_memcc": float(out[step.metadata["memcc.loss"]]),
            "median_error_memcc": float(np.median(list(em.values()))),
            "median_error_torch": float(np.median(list(et.values()))),
            "max_error_memcc": max(em.values()), "max_error_torch": max(et.values()),
            "worst": {k: [em[k], et[k]] for k in worst}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "gpt2"])
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp16"],
                    choices=sorted(TYPES))
    ap.add_argument("--options", default="{}", help="zoo sizes as JSON, for every model")
    args = ap.parse_args(argv)
    for name in args.models:
        for precision in args.precisions:
            print(json.dumps(compare(name, precision, json.loads(args.options))), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
