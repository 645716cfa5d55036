"""Gradients of training steps built from transformers models vs torch autograd.

Builds tiny models from configs (no download) of many transformers families, exports each
with both torch.onnx exporters in train and eval mode, builds the memcc step (optimizer
none), and compares loss and parameter gradients with the torch module's own autograd
(exported weight copies and splits are matched by value, as in tests/test_exports_grad.py).

    python benchmarks/transformers_sweep.py [FAMILY ...]

One line per case: loss (memcc vs torch), the worst relative gradient error (against each
tensor's scale, floored at 1e-3 of the largest gradient) and how many torch parameters were
matched. Cases whose torch loss already differs from the export's are export problems
(functional dropout in train mode, dynamo's BatchNorm folding), not gradient ones; OPT in
eval mode differs only in the embedding's padding row, which torch's ``padding_idx`` freezes
and the ONNX file does not record.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from test_exports_grad import parameter_groups  # noqa: E402

from memcc.backend.verify import step_outputs  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
IMAGE = {"vit", "convnext", "resnet", "mobilenet_v2"}
CASES = {
    "llama": lambda: T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=100, num_key_value_heads=1, max_position_embeddings=64, **SMALL)),
    "mistral": lambda: T.MistralForCausalLM(T.MistralConfig(
        vocab_size=100, num_key_value_heads=1, max_position_embeddings=64, **SMALL)),
    "gpt_neox": lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        vocab_size=100, max_position_embeddings=64, **SMALL)),
    "opt": lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=32)),
    "distilbert": lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=100, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=64)),
    "roberta": lambda: T.RobertaForSequenceClassification(T.RobertaConfig(
        vocab_size=100, max_position_embeddings=70, **SMALL)),
    "bert_mlm": lambda: T.BertForMaskedLM(T.BertConfig(
        vocab_size=100, max_position_embeddings=64, **SMALL)),
    "gpt2": lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)),
    "vit": lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=32, patch_size=8, num_labels=5, **SMALL)),
    "convnext": lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5,
        image_size=32)),
    "resnet": lambda: T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=5)),
    "mobilenet_v2": lambda: T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        num_channels=3, image_size=32, depth_multiplier=0.35, num_labels=5)),
}


class Logits(torch.nn.Module):
    def __init__(self, model: torch.nn.Module, image: bool) -> None:
        super().__init__()
        self.m, self.image = model, image

    def forward(self, *args):
        if self.image:
            return self.m(pixel_values=args[0]).logits
        return self.m(input_ids=args[0], attention_mask=args[1]).logits


def build(name: str, training: bool) -> tuple[Logits, tuple, list[str]]:
    torch.manual_seed(0)
    model = CASES[name]()
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
    with torch.no_grad():  # unique values, so exported weight copies can be matched
        for p in model.parameters():
            flat = p.reshape(-1)
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                p.add_(0.02 * torch.randn_like(p))
    model.train(training)
    if name in IMAGE:
        return Logits(model, True), (torch.randn(2, 3, 32, 32),), ["pixel_values"]
    ids = torch.randint(0, 100, (2, 8))
    return Logits(model, False), (ids, torch.ones(2, 8, dtype=torch.long)), \
        ["input_ids", "attention_mask"]


def run_case(name: str, exporter: str, training: bool, tmp: Path) -> str:
    wrapper, args, names = build(name, training)
    path = tmp / f"{name}-{exporter}-{training}.onnx"
    with torch.no_grad():
        if exporter == "torchscript":
            mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(copy.deepcopy(wrapper), args, str(path), dynamo=False,
                              input_names=names, output_names=["logits"], training=mode,
                              do_constant_folding=not training, opset_version=17)
        else:
            torch.onnx.export(copy.deepcopy(wrapper), args, dynamo=True, input_names=names,
                              output_names=["logits"], verbose=False).save(str(path))
    step = build_training_step(load_graph(path), BuildOptions(optimizer="none"))
    logits = wrapper(*args)
    classes = logits.shape[-1]
    labels = np.random.default_rng(0).integers(0, classes, size=tuple(logits.shape[:-1]))
    feeds = {n: a.numpy() for n, a in zip(names, args, strict=True)}
    out = step_outputs(step, {**feeds, "labels": labels.astype(np.int64)}, "cpu")
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, classes),
                                             torch.from_numpy(labels).reshape(-1))
    loss.backward()
    named = [(n, p) for n, p in wrapper.named_parameters() if p.grad is not None]
    tparams = {n: p.detach().numpy() for n, p in named}
    tgrads = {n: p.grad.numpy() for n, p in named}
    oparams = {k[:-5]: step.initializers[k[:-5]] for k in out if k.endswith(".grad")}
    floor = 1e-3 * max(float(np.abs(g).max()) for g in tgrads.values())
    worst, covered = 0.0, set()
    for onnx_members, torch_members in parameter_groups(oparams, tparams):
        got = sum((out[f"{o}.grad"].T if tr else out[f"{o}.grad"]).astype(np.float64)
                  for o, tr in onnx_members)
        ref = sum(tgrads[t].astype(np.float64) for t in torch_members)
        worst = max(worst, float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), floor))
        covered |= set(torch_members)
    return (f"loss {float(out['loss']):.5f} vs torch {loss.item():.5f}, gradient error "
            f"{worst:.1e}, matched {len(covered)}/{len(tgrads)} parameters, "
            f"{len(step.nodes)} nodes")


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as d:
        for name in argv or list(CASES):
            for exporter in ("torchscript", "dynamo"):
                for training in (True, False):
                    tag = f"{name}/{exporter}/{'train' if training else 'eval'}"
                    try:
                        print(f"{tag}: {run_case(name, exporter, training, Path(d))}",
                              flush=True)
                    except Exception as exc:  # report and go on: this is a survey
                        first = str(exc).splitlines()[0][:200] if str(exc) else ""
                        print(f"{tag}: FAILED {type(exc).__name__}: {first}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
