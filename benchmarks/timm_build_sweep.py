"""Does ``memcc build`` take every timm architecture a user might export? A wide, shallow
sweep (session 30, BENCHMARKS.md "Fifty timm architectures"): each model with random
weights and 10 classes, at 64 px where it accepts ``img_size`` (else its default size),
batch 2, exported in training mode by TorchScript (opset 17, no constant folding) or by
dynamo without its optimizer, then ``memcc build`` in its own process. One line per model:
``ok``, the exporter's failure (torch's side) or memcc's error. The deeper checks (compile,
verify, gradients against torch) are ``first_use_run.py`` and ``first_use_grads.py``.

    pip install timm torchvision      # in a venv of their own (see first_use_models.py)
    python benchmarks/timm_build_sweep.py --out DIR [--exporter ts|dynamo] [--models a,b]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings
from pathlib import Path

import first_use_models as fu
import torch

MODELS = (
    "sequencer2d_s,mobilevitv2_050,efficientformer_l1,efficientformerv2_s0,coat_lite_tiny,"
    "pit_ti_224,tnt_s_patch16_224,nest_tiny,gcvit_xxtiny,coatnet_nano_rw_224,cait_xxs24_224,"
    "resmlp_12_224,gmlp_ti16_224,mixer_s16_224,hrnet_w18_small,resnest14d,skresnet18,"
    "cspresnet50,dpn68,hgnetv2_b0,ghostnetv2_100,lcnet_050,tinynet_e,rexnet_100,inception_v3,"
    "selecsls42b,regnetz_b16,ecaresnet26t,botnet26t_256,halonet26t,lambda_resnet26t,"
    "volo_d1_224,visformer_tiny,convit_tiny,eva02_tiny_patch14_224,repghostnet_050,"
    "mambaout_femto,starnet_s1,hiera_tiny_224,davit_tiny,focalnet_tiny_srf,"
    "inception_next_tiny,efficientvit_b0,efficientvit_m0,tresnet_m,crossvit_tiny_240,"
    "twins_svt_small,maxvit_nano_rw_256,res2net50_14w_8s,convmixer_768_32").split(",")


def sweep_one(name: str, exporter: str, out: Path) -> str:
    import timm

    torch.manual_seed(0)
    try:
        try:
            model, px = timm.create_model(name, num_classes=10, img_size=64), 64
        except TypeError:
            model = timm.create_model(name, num_classes=10)
            px = model.default_cfg.get("input_size", (3, 224, 224))[-1]
        model.train()
        path = out / f"{name}.{exporter}.onnx"
        x = torch.randn(2, 3, px, px)
        if exporter == "ts":
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=17,
                              training=torch.onnx.TrainingMode.TRAINING,
                              do_constant_folding=False)
        else:
            torch.onnx.export(model, (x,), str(path), dynamo=True, optimize=False)
    except Exception as exc:  # noqa: BLE001 - the exporter's failure is the row
        return f"{name}: export failed ({type(exc).__name__}: {str(exc).splitlines()[0][:150]})"
    p = subprocess.run([sys.executable, "-c", "from memcc.cli import main; main()", "build",
                        str(path), "-o", str(out / f"{name}.{exporter}.step.onnx")],
                       capture_output=True, text=True)
    said = (p.stdout + p.stderr).strip().splitlines()
    return f"{name} ({px} px): " + ("ok" if p.returncode == 0 else
                                    f"memcc: {said[-1][:300] if said else p.returncode}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--exporter", choices=("ts", "dynamo"), default="ts")
    ap.add_argument("--models", default=",".join(MODELS))
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    fu._torchvision_schemas()
    a.out.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        print(sweep_one(name, a.exporter, a.out), flush=True)


if __name__ == "__main__":
    main()
