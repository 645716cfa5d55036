"""The first-use sweep's models (BENCHMARKS.md, "First use on models memcc was not tuned
on"): 15 torchvision and timm models with random weights from their own constructors,
exported as a new user exports them. torchvision and timm are not memcc's dependencies:

    pip install timm torchvision      # versions matching the installed torch
    python benchmarks/first_use_models.py --out /tmp/sweep/out [--cases levit.ts.train,...]

writes ``<out>/<case>.onnx`` per case (name: model, exporter, train or eval mode, ``.dyn``
for a symbolic batch axis named ``batch``, bound with ``--dim batch=B``); the memcc
commands the sweep ran on them are listed in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def _torchvision_schemas() -> None:
    """torchvision's PyPI wheel is built against CUDA torch: with a CPU torch its ``_C.so``
    does not load and its import fails registering fakes for ``nms``/``qnms``; defining
    the two schemas first lets the pure-Python models import."""
    try:
        import torchvision  # noqa: F401
    except (RuntimeError, ImportError):
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _torchvision_schemas.lib = lib  # kept alive


def ctors():
    import timm
    import torchvision.models as tv
    from torchvision.models.densenet import DenseNet
    return {
        "tv_resnet18": lambda: tv.resnet18(num_classes=10),
        "tv_mobilenet_v3_small": lambda: tv.mobilenet_v3_small(num_classes=10),
        "tv_efficientnet_b0": lambda: tv.efficientnet_b0(num_classes=10),
        "tv_densenet_small": lambda: DenseNet(growth_rate=12, block_config=(2, 2, 2),
                                              num_init_features=16, num_classes=10),
        "tv_shufflenet_v2": lambda: tv.shufflenet_v2_x0_5(num_classes=10),
        "tv_squeezenet1_1": lambda: tv.squeezenet1_1(num_classes=10),
        "tv_regnet_y_400mf": lambda: tv.regnet_y_400mf(num_classes=10),
        "timm_convnext_atto": lambda: timm.create_model("convnext_atto", num_classes=10),
        "timm_resnet10t": lambda: timm.create_model("resnet10t", num_classes=10),
        "timm_vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10,
                                                   img_size=32, patch_size=8, drop_rate=0.1),
        "timm_deit_tiny": lambda: timm.create_model("deit_tiny_patch16_224", num_classes=10,
                                                    img_size=32, patch_size=8),
        "timm_mobilevit_xxs": lambda: timm.create_model("mobilevit_xxs", num_classes=10),
        "timm_levit": lambda: timm.create_model("levit_128s", num_classes=10, img_size=64),
        "timm_poolformer": lambda: timm.create_model("poolformer_s12", num_classes=10),
        "timm_edgenext": lambda: timm.create_model("edgenext_xx_small", num_classes=10),
    }

# name, model, exporter, train?, batch, px, dynamic batch axis?
CASES = [
    ("resnet18.ts.train", "tv_resnet18", "torchscript", True, 4, 64, False),
    ("mobilenetv3.dynamo.train", "tv_mobilenet_v3_small", "dynamo", True, 4, 64, False),
    ("efficientnet.noopt.train", "tv_efficientnet_b0", "dynamo_noopt", True, 4, 64, False),
    ("densenet.ts.eval", "tv_densenet_small", "torchscript", False, 4, 64, False),
    ("shufflenet.noopt.eval", "tv_shufflenet_v2", "dynamo_noopt", False, 4, 64, False),
    ("squeezenet.ts.train.dyn", "tv_squeezenet1_1", "torchscript", True, 4, 64, True),
    ("regnet.dynamo.train", "tv_regnet_y_400mf", "dynamo", True, 2, 64, False),
    ("convnext_atto.ts.train", "timm_convnext_atto", "torchscript", True, 4, 64, False),
    ("resnet10t.noopt.train", "timm_resnet10t", "dynamo_noopt", True, 4, 64, False),
    ("vit_tiny.noopt.train", "timm_vit_tiny", "dynamo_noopt", True, 4, 32, False),
    ("deit_tiny.ts.eval", "timm_deit_tiny", "torchscript", False, 4, 32, False),
    ("mobilevit.dynamo.train", "timm_mobilevit_xxs", "dynamo", True, 2, 64, False),
    ("levit.ts.train", "timm_levit", "torchscript", True, 2, 64, False),
    ("poolformer.noopt.train.dyn", "timm_poolformer", "dynamo_noopt", True, 2, 32, True),
    ("edgenext.ts.train", "timm_edgenext", "torchscript", True, 4, 64, False),
]


def export(case, path):
    name, model_name, exporter, train, batch, px, dyn = case
    torch.manual_seed(0)
    model = ctors()[model_name]()
    model.train(train)
    x = torch.randn(batch, 3, px, px)
    if exporter == "torchscript":
        torch.onnx.export(model, (x,), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING if train
                          else torch.onnx.TrainingMode.EVAL, do_constant_folding=False,
                          input_names=["x"], output_names=["logits"], opset_version=17,
                          dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}} if dyn else None)
    else:
        kw = {"dynamic_shapes": ({0: torch.export.Dim("batch")},)} if dyn else {}
        torch.onnx.export(model, (x,), str(path), dynamo=True, optimize=exporter == "dynamo",
                          input_names=["x"], output_names=["logits"], **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    a = ap.parse_args()
    _torchvision_schemas()
    a.out.mkdir(parents=True, exist_ok=True)
    wanted = set(a.cases.split(",")) if a.cases else None
    for case in CASES:
        if wanted is None or case[0] in wanted:
            export(case, a.out / f"{case[0]}.onnx")
            print(a.out / f"{case[0]}.onnx", flush=True)


if __name__ == "__main__":
    main()
