"""First use on models memcc was not built around: torchvision, timm and small transformers
models exported by torch.onnx in train mode, each compiled at ``--budget min`` with
``--verify``.

    pip install torchvision timm        # not test dependencies: only this script needs them
    python benchmarks/export_sweep.py                       # every model, two exporters
    python benchmarks/export_sweep.py --models tv_mobilenet_v3_small timm_levit --exporters dynamo
    python benchmarks/export_sweep.py --eval ...      # exported in eval mode
    python benchmarks/export_sweep.py --at 0.6 ...    # a budget of 60% of the step as built

For each model and exporter: export (batch 8, 64x64 unless the model needs another size;
the transformers models take 32 token ids, or 32x32 images, with dropout 0.1),
``memcc compile --budget 1TB`` for the step as built, then ``memcc compile --budget min
--verify`` as a user would run it, each in its own process. Prints one markdown row per case
from the reports: the peaks predicted and measured, the predicted overhead, what the verify
line said, and the compile time. A row that failed says why (the first problem of the
report, or the error).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

EXPORTERS = ("torchscript", "dynamo_noopt", "dynamo")


def _models() -> dict:
    import timm
    import torchvision.models as tv

    return {**_transformers_models(), **{
        "tv_resnet18": lambda: tv.resnet18(num_classes=10),
        "tv_mobilenet_v3_small": lambda: tv.mobilenet_v3_small(num_classes=10),
        "tv_efficientnet_b0": lambda: tv.efficientnet_b0(num_classes=10),
        "tv_squeezenet1_1": lambda: tv.squeezenet1_1(num_classes=10),
        "tv_shufflenet_v2_x0_5": lambda: tv.shufflenet_v2_x0_5(num_classes=10),
        "tv_convnext_tiny": lambda: tv.convnext_tiny(num_classes=10),
        "tv_densenet121": lambda: tv.densenet121(num_classes=10),
        "tv_regnet_y_400mf": lambda: tv.regnet_y_400mf(num_classes=10),
        "tv_vit": lambda: tv.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
                                               num_heads=2, hidden_dim=32, mlp_dim=64,
                                               num_classes=10),
        "tv_swin_t": lambda: tv.swin_t(num_classes=10),
        "timm_vit_tiny": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10,
                                                   img_size=32, patch_size=8),
        "timm_resnet26d": lambda: timm.create_model("resnet26d", num_classes=10),
        "timm_efficientnet_b0": lambda: timm.create_model("efficientnet_b0", num_classes=10),
        "timm_convnext_atto": lambda: timm.create_model("convnext_atto", num_classes=10),
        "timm_mixer": lambda: timm.create_model("mixer_s32_224", num_classes=10, img_size=64),
        "timm_mobilevit_xxs": lambda: timm.create_model("mobilevit_xxs", num_classes=10),
        "timm_deit_tiny": lambda: timm.create_model("deit_tiny_patch16_224", num_classes=10,
                                                    img_size=32, patch_size=8),
        "timm_regnetx_002": lambda: timm.create_model("regnetx_002", num_classes=10),
        "timm_ghostnet": lambda: timm.create_model("ghostnet_100", num_classes=10),
        "timm_levit": lambda: timm.create_model("levit_128s", num_classes=10),
    }}


def _transformers_models() -> dict:
    """Small transformers models with dropout 0.1 (GPT-2's and BERT's default; set for Llama's
    attention and ViT, whose default is 0): token ids or images in, logits out."""
    import torch
    import transformers as tf

    class Logits(torch.nn.Module):
        def __init__(self, model: torch.nn.Module, key: str, out: str = "logits") -> None:
            super().__init__()
            self.model, self.key, self.out = model, key, out

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return getattr(self.model(**{self.key: x}), self.out)

    small = dict(num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                 vocab_size=500, max_position_embeddings=64)
    return {
        "hf_gpt2": lambda: Logits(tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=64, n_layer=2, n_head=2, vocab_size=500, n_positions=64)), "input_ids"),
        "hf_bert": lambda: Logits(tf.BertForSequenceClassification(tf.BertConfig(
            hidden_size=64, num_labels=3, **small)), "input_ids"),
        "hf_llama": lambda: Logits(tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=64, num_key_value_heads=1, attention_dropout=0.1, **small)),
            "input_ids"),
        "hf_vit": lambda: Logits(tf.ViTForImageClassification(tf.ViTConfig(
            image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=128, num_labels=5,
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)), "pixel_values"),
        # More architectures, each at its default dropout (0 where the config says so).
        "hf_distilbert": lambda: Logits(tf.DistilBertForSequenceClassification(
            tf.DistilBertConfig(dim=64, n_layers=2, n_heads=2, hidden_dim=128, vocab_size=500,
                                max_position_embeddings=64, num_labels=3)), "input_ids"),
        "hf_roberta": lambda: Logits(tf.RobertaForSequenceClassification(tf.RobertaConfig(
            hidden_size=64, num_labels=3, pad_token_id=1, **small)), "input_ids"),
        "hf_albert": lambda: Logits(tf.AlbertForSequenceClassification(tf.AlbertConfig(
            hidden_size=64, embedding_size=32, num_labels=3, **small)), "input_ids"),
        "hf_opt": lambda: Logits(tf.OPTForCausalLM(tf.OPTConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, ffn_dim=128,
            vocab_size=500, max_position_embeddings=64, word_embed_proj_dim=64)),
            "input_ids"),
        "hf_gpt_neo": lambda: Logits(tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
            hidden_size=64, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
            window_size=16, vocab_size=500, max_position_embeddings=64)), "input_ids"),
        "hf_bloom": lambda: Logits(tf.BloomForCausalLM(tf.BloomConfig(
            hidden_size=64, n_layer=2, n_head=2, vocab_size=500)), "input_ids"),
        "hf_phi": lambda: Logits(tf.PhiForCausalLM(tf.PhiConfig(
            hidden_size=64, partial_rotary_factor=0.5, **small)), "input_ids"),
        "hf_qwen2": lambda: Logits(tf.Qwen2ForCausalLM(tf.Qwen2Config(
            hidden_size=64, num_key_value_heads=2, **small)), "input_ids"),
        "hf_gemma": lambda: Logits(tf.GemmaForCausalLM(tf.GemmaConfig(
            hidden_size=64, num_key_value_heads=2, head_dim=32, **small)), "input_ids"),
        "hf_gpt_neox": lambda: Logits(tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(
            hidden_size=64, **small)), "input_ids"),
        "hf_t5_encoder": lambda: Logits(tf.T5EncoderModel(tf.T5Config(
            d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2, vocab_size=500)),
            "input_ids", "last_hidden_state"),
        "hf_mobilebert": lambda: Logits(tf.MobileBertForSequenceClassification(
            tf.MobileBertConfig(hidden_size=64, embedding_size=32, intra_bottleneck_size=32,
                                true_hidden_size=32, num_feedforward_networks=2,
                                num_labels=3, **small)), "input_ids"),
        "hf_convnext": lambda: Logits(tf.ConvNextForImageClassification(tf.ConvNextConfig(
            hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 2, 1], num_labels=5)),
            "pixel_values"),
        "hf_swin": lambda: Logits(tf.SwinForImageClassification(tf.SwinConfig(
            image_size=32, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
            window_size=4, num_labels=5)), "pixel_values"),
    }


RESOLUTION = {"tv_vit": 32, "timm_vit_tiny": 32, "timm_deit_tiny": 32, "timm_levit": 224,
              "hf_vit": 32, "hf_convnext": 32, "hf_swin": 32}
HF_IMAGES = {"hf_vit", "hf_convnext", "hf_swin"}   # the other hf_ models take token ids


def _takes_tokens(name: str) -> bool:
    """Token ids [batch, 32] below 500 in, rather than images."""
    return name.startswith("hf_") and name not in HF_IMAGES


def export(name: str, exporter: str, path: Path, batch: int, train: bool = True) -> None:
    import torch

    torch.manual_seed(0)
    model = _models()[name]()
    model.train(train)
    res = RESOLUTION.get(name, 64)
    x = (torch.randint(0, 500, (batch, 32)) if _takes_tokens(name)
         else torch.randn(batch, 3, res, res))
    if exporter == "torchscript":
        torch.onnx.export(model, (x,), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING if train
                          else torch.onnx.TrainingMode.EVAL, do_constant_folding=False,
                          input_names=["x"], output_names=["logits"], opset_version=17)
    else:
        torch.onnx.export(model, (x,), str(path), dynamo=True,
                          optimize=exporter == "dynamo", input_names=["x"],
                          output_names=["logits"])


def compile_step(path: Path, out: Path, budget: str, verify: bool, time_limit: int
                 ) -> tuple[int, float, str, dict | None]:
    cmd = ["memcc", "compile", str(path), "--budget", budget, "-o", str(out),
           "--cost", "analytic", "--time-limit", str(time_limit)] + (["--verify"] if verify else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    report = out.with_suffix(".report.json")
    data = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, seconds, proc.stdout + proc.stderr, data


def one(name: str, exporter: str, out_dir: Path, batch: int, time_limit: int,
        at: float | None = None, train: bool = True) -> str:
    """One row: ``at`` None compiles at ``--budget min``; else at that fraction of the
    step's peak as built, and where that is refused, at the budget the refusal names.
    ``train=False`` exports the model in eval mode (no dropout, BatchNorm from its running
    statistics), into files named ``*.eval.onnx``."""
    base = out_dir / f"{name}.{exporter}{'' if train else '.eval'}"
    path = Path(f"{base}.onnx")
    try:
        if not path.exists():
            with contextlib.redirect_stdout(sys.stderr):   # the exporter's progress lines
                export(name, exporter, path, batch, train)
    except Exception as exc:  # noqa: BLE001 - an exporter failure is a row, not a crash
        return f"| {name} | {exporter} | export failed: {type(exc).__name__}: {str(exc)[:80]} |"
    for stale in out_dir.glob(f"{base.name}.min*"):
        stale.unlink()
    rc, _, text, as_built = compile_step(path, Path(f"{base}.built.onnx"), "1TB", False,
                                         time_limit)
    if rc != 0 or as_built is None:
        last = text.strip().splitlines()[-1][:120] if text.strip() else f"exit {rc}"
        return f"| {name} | {exporter} | as-built compile failed: {last} |"
    baseline = as_built["baseline"]["peak_bytes"]
    budget, out, note = "min", Path(f"{base}.min.onnx"), ""
    if at is not None:
        budget, out = str(int(at * baseline)), Path(f"{base}.at.onnx")
    rc, seconds, text, rep = compile_step(path, out, budget, True, time_limit)
    refused = at is not None and rc != 0
    named = re.search(r"Use --budget (\d+)", text) if refused else None
    if named:
        note = f" (refused {int(budget):,} B; compiled at the {int(named.group(1)):,} B it named)"
        rc, seconds, text, rep = compile_step(path, out, named.group(1), True, time_limit)
    elif refused and "--budget min finds" in text:  # below the floor: refused before search
        rc, seconds, text, rep = compile_step(path, out, "min", True, time_limit)
        note = f" (refused {int(budget):,} B below its floor; compiled at --budget min" + (
            f", {rep['budget_bytes']:,} B)" if rep and rep.get("budget_bytes") else ")")
    if rep is None or "verification" not in rep or rep["verification"] is None:
        last = text.strip().splitlines()[-1][:120] if text.strip() else f"exit {rc}"
        return f"| {name} | {exporter} | {baseline / 1e6:.1f} | | | | | compile failed: {last} |"
    v, plan = rep["verification"], rep["plan"]
    measured = v.get("measured_peak_bytes")
    ratio = f"{measured / plan['peak_bytes']:.3f}" if measured else ""
    verdict = (("OK: " + v["comparison"]) if v["ok"] else "FAILED: " + v["problems"][0][:90]) \
        + note
    return (f"| {name} | {exporter} | {baseline / 1e6:.1f} | {plan['peak_bytes'] / 1e6:.1f} | "
            f"{(measured or 0) / 1e6:.1f} | {ratio} | {100 * plan['overhead']:.1f}% | "
            f"{verdict} | {seconds:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", help="default: all")
    ap.add_argument("--exporters", nargs="*", default=["torchscript", "dynamo_noopt"],
                    choices=EXPORTERS)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--time-limit", type=int, default=30)
    ap.add_argument("--out", default="export_sweep", help="folder for exports and reports")
    ap.add_argument("--eval", action="store_true",
                    help="export in eval mode (no dropout, BatchNorm from running statistics)")
    ap.add_argument("--at", type=float, help="compile at this fraction of the peak as built "
                    "(and at the budget a refusal names) instead of --budget min")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = args.models or list(_models())
    print("| model | exporter | as built (MB) | plan (MB) | measured (MB) | "
          "measured/plan | predicted overhead | verify | compile (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        for exporter in args.exporters:
            print(one(name, exporter, out_dir, args.batch, args.time_limit, args.at,
                      not args.eval),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
