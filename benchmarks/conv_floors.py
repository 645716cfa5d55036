"""``memcc compile --budget min`` on convnets exported from transformers in train mode, with
the floor each plan stops at and the bound under it (issue 31).

    python benchmarks/conv_floors.py [--models rn_8_96,mnv2_b16_128,...] [--out rows.jsonl]

Each model is built from a transformers config (ResNet, MobileNetV2, ConvNeXt; random
weights, nothing downloaded) in ``train()`` mode, exported with ``torch.onnx.export(...,
dynamo=False, training=TrainingMode.TRAINING, do_constant_folding=False,
opset_version=18)`` on a random batch, then compiled by this tree's ``memcc compile
--budget min --cost analytic`` in a child process. One JSON line per model: the step as
built's and the plan's predicted peak, their ratio, the node at the plan's peak, its
breakdown, the picked strategy, compile seconds, and the bound: the bytes every plan holds
all step (inputs, parameters, optimizer state) plus three tensors the size of the largest
training-mode BatchNorm input (the BatchNorm backward's last elementwise node reads gy and
x, or y, and writes dx; ORT's CPU Mul/Sub/Add write a new buffer), the smallest any plan of
memcc's decisions (recompute, gradient-rule variants) can reach at that node. Bytes as the
liveness model counts them (``liveness.allocation_bytes``: large buffers in whole pages).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# name: (family, config, batch, resolution)
RESNET = "resnet"
TV_RESNET = "tv_resnet"
MODELS: dict[str, tuple[str, dict, int, int]] = {
    "rn_8_96": (RESNET, dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]), 8, 96),
    "rn_32_b4_64": (RESNET, dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                 depths=[1, 1, 2, 1]), 4, 64),
    "rn_32_b16_128": (RESNET, dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                   depths=[1, 1, 2, 1]), 16, 128),
    "rn_32_2222_96": (RESNET, dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                   depths=[2, 2, 2, 2]), 8, 96),
    "rn_16_basic_96": (RESNET, dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                    depths=[2, 2, 2, 2], layer_type="basic"), 8, 96),
    "rn_32_basic_b32_128": (RESNET, dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
                                         depths=[2, 2, 2, 2], layer_type="basic"), 32, 128),
    "rn_32_3463_64": (RESNET, dict(embedding_size=32, hidden_sizes=[64, 128, 256, 512],
                                   depths=[3, 4, 6, 3]), 8, 64),
    "rn50_b32_128": (RESNET, dict(embedding_size=16, hidden_sizes=[64, 128, 256, 512],
                                  depths=[3, 4, 6, 3]), 32, 128),
    "mnv2_b16_128": ("mobilenet_v2", dict(image_size=128, depth_multiplier=0.35), 16, 128),
    "convnext_b16_64": ("convnext", dict(hidden_sizes=[32, 64, 128, 256],
                                         depths=[1, 1, 2, 1], image_size=64), 16, 64),
    # torchvision's resnet18 layout, written out here (torchvision is not installed)
    "tv_resnet18_b32_224": (TV_RESNET, dict(blocks=[2, 2, 2, 2]), 32, 224),
}


def tv_resnet(blocks: list[int], classes: int = 10):
    """torchvision's ResNet with BasicBlocks (``resnet18`` for [2, 2, 2, 2]): 7x7 stem with
    BatchNorm, ReLU and 3x3 max pooling, four stages of 64-512 channels, a 1x1 projection
    with BatchNorm where the shape changes, global average pooling, one Linear."""
    from torch import nn

    def conv_bn(cin: int, cout: int, k: int, stride: int) -> list:
        return [nn.Conv2d(cin, cout, k, stride, k // 2, bias=False), nn.BatchNorm2d(cout)]

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.body = nn.Sequential(*conv_bn(cin, cout, 3, stride), nn.ReLU(),
                                      *conv_bn(cout, cout, 3, 1))
            self.skip = (nn.Sequential(*conv_bn(cin, cout, 1, stride))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return (self.body(x) + self.skip(x)).relu()

    layers, cin = [*conv_bn(3, 64, 7, 2), nn.ReLU(), nn.MaxPool2d(3, 2, 1)], 64
    for i, n in enumerate(blocks):
        cout = 64 << i
        for j in range(n):
            layers.append(Block(cin, cout, 2 if j == 0 and i > 0 else 1))
            cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def export(name: str, path: Path) -> None:
    """The model ``name`` in train mode, exported as the module doc says."""
    import torch

    family, cfg, batch, res = MODELS[name]
    torch.manual_seed(0)
    module = (tv_resnet(**cfg) if family == TV_RESNET else hf_model(family, cfg)).train()
    torch.onnx.export(module, (torch.randn(batch, 3, res, res),), str(path), dynamo=False,
                      input_names=["x"], output_names=["logits"],
                      training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                      opset_version=18)


def hf_model(family: str, cfg: dict):
    """The transformers image classifier of ``family`` from ``cfg``, giving logits."""
    import torch
    import transformers as T

    config, model = {
        RESNET: (T.ResNetConfig, T.ResNetForImageClassification),
        "mobilenet_v2": (T.MobileNetV2Config, T.MobileNetV2ForImageClassification),
        "convnext": (T.ConvNextConfig, T.ConvNextForImageClassification),
    }[family]

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model(config(num_channels=3, num_labels=10, **cfg))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.model(pixel_values=x).logits

    return Logits()


def bound(path: Path) -> dict:
    """The bytes held all step and the largest training-mode BatchNorm input."""
    from memcc.compiler.loading import load_step
    from memcc.compiler.options import CompileOptions
    from memcc.passes.analysis.liveness import allocation_bytes

    g, _ = load_step(path, str(path), CompileOptions())
    persistent = sum(allocation_bytes(g.info[v].nbytes)
                     for v in set(g.inputs) | set(g.initializers) if v in g.info)
    bn = max((allocation_bytes(g.info[n.input[0]].nbytes) for n in g.nodes
              if n.op_type == "BatchNormalization"), default=0)
    return {"persistent_bytes": persistent, "largest_batchnorm_input_bytes": bn,
            "bound_bytes": persistent + 3 * bn}


def compile_min(path: Path, out: Path) -> dict:
    """``memcc compile --budget min --cost analytic`` by this tree, and its report."""
    cmd = [sys.executable, "-c", "import sys; from memcc.cli import app; sys.argv[0] = "
           "'memcc'; app()", "compile", str(path), "--budget", "min", "--cost", "analytic",
           "-o", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return json.loads(out.with_suffix(".report.json").read_text())


def _replanned(report: dict) -> int | None:
    """The smallest-peak plan's peak where ``--budget min`` kept a plan made again for time
    at its budget instead (``compiler/min_replan.py``), else None."""
    plan_pass = next((p for p in report.get("passes", []) if p.get("name") == "plan"), {})
    again = (plan_pass.get("summary") or {}).get("replanned_at_smallest")
    return None if again is None else again["smallest_peak_plan"]["peak_bytes"]


def row(name: str, tmp: Path) -> dict:
    path = tmp / f"{name}.onnx"
    export(name, path)
    report = compile_min(path, tmp / f"{name}.min.onnx")
    built, plan = report["baseline"]["peak_bytes"], report["plan"]["peak_bytes"]
    chunks = report.get("row_chunks") or {}
    # The baseline is the chosen setting's step as built; the share is of the unchunked one.
    whole = [c for c in chunks.get("candidates") or []
             if not any(n > 1 for n in c["chunks"].values()) and "as_built_peak_bytes" in c]
    if whole:
        built = whole[0]["as_built_peak_bytes"]
    b = bound(path)
    return {"model": name, "as_built_bytes": built, "min_bytes": plan,
            "chunks": {k: n for k, n in (chunks.get("chosen") or {}).items() if n > 1},
            "added_time": next((c.get("added_time") for c in chunks.get("candidates") or []
                                if c.get("chosen")), None),
            "min_share": round(plan / built, 4), "peak_node": report["plan"]["peak_node"],
            # the budget --budget min names (the plan may peak under it: planned again for
            # time at that budget, compiler/min_replan.py: then the smallest-peak plan's peak)
            "budget_bytes": report["budget_bytes"],
            "budget_share": round(report["budget_bytes"] / built, 4),
            "smallest_peak_replaced": _replanned(report),
            "breakdown_at_peak": report["plan"]["breakdown_at_peak"],
            "picked": report["plan"]["picked_strategy"],
            "compile_s": round(report["compile_time_s"], 1),
            **b, "bound_share": round(b["bound_bytes"] / built, 4)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS),
                    help="comma-separated, from: " + ", ".join(MODELS))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory(prefix="memcc-conv-floors-") as tmp:
        for name in names:
            line = json.dumps(row(name, Path(tmp)))
            print(line, flush=True)
            if args.out:
                with args.out.open("a") as f:
                    f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
