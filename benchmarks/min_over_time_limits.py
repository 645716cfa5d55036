"""Does `--budget min` get smaller, never larger, with more `--time-limit`?

A walk-through saw `memcc analyze` name 11.17 MB for a timm LCNet-050 step, `memcc compile
--budget min` 11.44 MB, and `analyze --time-limit 10` 11.63 MB: more search, a larger
answer (BENCHMARKS.md, "Session 39"). This exports small convnets in train mode (timm
LCNet-050, torchvision MobileNetV3-small; batch 4, 64 px), builds each, and prints the
budget `compile --budget min` names at each `--time-limit` and `analyze`'s smallest budget
at each of its limits, so a row whose budget grows with the limit shows.

    python benchmarks/min_over_time_limits.py [--models lcnet_050,mbv3] [--exporters ts,dyn]
        [--compile-limits 10,60] [--analyze-limits 1,10] [--keep DIR]

Needs torch, torchvision and timm to export.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def export(name: str, exporter: str, out: Path) -> None:
    import warnings

    import timm
    import torch
    import torchvision

    warnings.simplefilter("ignore")   # the exporters' own, on every BatchNorm
    torch.manual_seed(0)
    model = (torchvision.models.mobilenet_v3_small(num_classes=10) if name == "mbv3"
             else timm.create_model(name, num_classes=10)).train()
    x = torch.randn(4, 3, 64, 64)
    kw: dict = {"dynamo": exporter == "dyn"}
    if exporter == "dyn":
        kw["optimize"] = False
    else:
        kw.update(training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    torch.onnx.export(model, (x,), str(out), input_names=["input"], output_names=["logits"],
                      **kw)


def memcc(*args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "memcc", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-2000:])
    return r.stdout


def row(name: str, exporter: str, tmp: Path, compile_limits: list[int],
        analyze_limits: list[int]) -> dict:
    forward, step = tmp / f"{name}.{exporter}.onnx", tmp / f"{name}.{exporter}.step.onnx"
    export(name, exporter, forward)
    memcc("build", str(forward), "-o", str(step))
    out: dict = {"model": name, "exporter": exporter, "compile": {}, "analyze": {}}
    for t in compile_limits:
        report = tmp / f"{name}.{exporter}.{t}.report.json"
        memcc("compile", str(step), "--budget", "min", "--time-limit", str(t),
              "-o", str(tmp / "min.onnx"), "--report", str(report))
        out["compile"][t] = json.loads(report.read_text())["budget_bytes"]
    for t in analyze_limits:
        got = json.loads(memcc("analyze", str(step), "--time-limit", str(t), "--json"))
        out["analyze"][t] = got["smallest"]["budget_bytes"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="lcnet_050,mbv3")
    ap.add_argument("--exporters", default="ts,dyn")
    ap.add_argument("--compile-limits", default="10,60")
    ap.add_argument("--analyze-limits", default="1,10")
    ap.add_argument("--keep", type=Path, help="leave the exports and steps here")
    args = ap.parse_args()
    limits = [int(t) for t in args.compile_limits.split(",")]
    quick = [int(t) for t in args.analyze_limits.split(",")]
    with tempfile.TemporaryDirectory(prefix="memcc-min-limits-") as scratch:
        tmp = args.keep or Path(scratch)
        tmp.mkdir(parents=True, exist_ok=True)
        print("| model | exporter | " + " | ".join(f"compile {t} s" for t in limits) + " | "
              + " | ".join(f"analyze {t} s" for t in quick) + " | grows with time |")
        print("|---" * (3 + len(limits) + len(quick)) + "|")
        for name in args.models.split(","):
            for exporter in args.exporters.split(","):
                r = row(name, exporter, tmp, limits, quick)
                c = [r["compile"][t] for t in limits]
                a = [r["analyze"][t] for t in quick]
                grows = any(b > a_ for a_, b in zip(c, c[1:], strict=False)) or \
                    any(b > a_ for a_, b in zip(a, a[1:], strict=False))
                print(f"| {name} | {exporter} | " + " | ".join(f"{v:,}" for v in c + a)
                      + f" | {'yes' if grows else 'no'} |", flush=True)


if __name__ == "__main__":
    main()
