"""Training steps built from transformers models, as torch.onnx writes them, vs torch autograd.

Each architecture is built from a small transformers config (no download, random weights,
seeded), exported three ways (TorchScript; dynamo with the exporter's optimizer; dynamo
without it, the form that keeps PyTorch's parameter names), built into a memcc step
(``optimizer none``) and run in ONNX Runtime; loss and every parameter gradient are compared
with the torch module's own autograd on the same batch (exported weight copies and splits are
matched by value, as in tests/test_exports_grad.py). Models with BatchNorm or Dropout run in
train mode (dropout probabilities set to 0, so both sides are deterministic), others in eval
mode. A case that cannot match says why: the export failed, the exported file itself does not
compute torch's forward (an exporter problem), or memcc refused it (its message).

    nice -n 10 python benchmarks/transformers_sweep.py [ARCH ...] [--forms ts,dynamo,noopt]
        [--write docs/EXPORTS.md] [--row-chunks K]

``--row-chunks K`` builds every step with its attentions and MLPs over K row chunks where
``memcc/frontend/row_chunks.py`` finds them (``memcc build --attention-chunks K
--mlp-chunks K``); each row then also says how many of each were split.

``--pad`` puts each text model's pad token into the batch (the last two positions), which
the default batch avoids: torch gives an ``nn.Embedding(padding_idx=...)`` row no gradient,
memcc too where the dynamo exporter recorded ``padding_idx``; a TorchScript file does not.

``--write`` replaces the sweep table between the ``sweep:start``/``sweep:end`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers as T  # noqa: E402
from test_exports_grad import parameter_groups  # noqa: E402

from memcc.backend.verify import step_outputs  # noqa: E402
from memcc.errors import MemccError  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.exported import ExportWarning  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.frontend.row_chunks import ATTENTION, MLP, find_regions  # noqa: E402

FORMS = ("torchscript", "dynamo", "dynamo-noopt")
BN_FOLDED = ("train-mode BatchNorm written in inference form and folded into the "
             "convolutions: no batch statistics left (memcc warns)")
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
LM = dict(vocab_size=100, max_position_embeddings=64, **SMALL)
VOCAB = 100
IMG = 32


@dataclass(frozen=True)
class Arch:
    """One architecture: how to build it and what it eats ('text', 'image', 'seq2seq')."""

    make: Callable[[], torch.nn.Module]
    kind: str = "text"
    what: str = ""


def _decoder(cls: str, cfg: str, **kw) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(T, cls)(getattr(T, cfg)(**{**LM, **kw}))


ARCHS: dict[str, Arch] = {
    # decoder LMs
    "gpt2": Arch(lambda: T.GPT2LMHeadModel(T.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64)), what="tied"),
    "llama": Arch(_decoder("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=1)),
    "mistral": Arch(_decoder("MistralForCausalLM", "MistralConfig", num_key_value_heads=1)),
    "qwen2": Arch(_decoder("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=1)),
    "qwen3": Arch(_decoder("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=1,
                           head_dim=16)),
    "phi3": Arch(_decoder("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=1,
                          pad_token_id=0)),
    "phi": Arch(_decoder("PhiForCausalLM", "PhiConfig")),
    "gemma": Arch(_decoder("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=1,
                           head_dim=16), what="tied"),
    "gpt_neox": Arch(_decoder("GPTNeoXForCausalLM", "GPTNeoXConfig")),
    "opt": Arch(lambda: T.OPTForCausalLM(T.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        ffn_dim=64, max_position_embeddings=64, word_embed_proj_dim=32))),
    "bloom": Arch(lambda: T.BloomForCausalLM(T.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=2))),
    "falcon": Arch(lambda: T.FalconForCausalLM(T.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2))),
    "olmo": Arch(_decoder("OlmoForCausalLM", "OlmoConfig", num_key_value_heads=1)),
    # encoders
    "bert": Arch(lambda: T.BertForSequenceClassification(T.BertConfig(**LM))),
    "bert_mlm": Arch(lambda: T.BertForMaskedLM(T.BertConfig(**LM)), what="tied"),
    "roberta": Arch(lambda: T.RobertaForSequenceClassification(T.RobertaConfig(
        **{**LM, "max_position_embeddings": 70}))),
    "distilbert": Arch(lambda: T.DistilBertForSequenceClassification(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=64))),
    "albert": Arch(lambda: T.AlbertForSequenceClassification(T.AlbertConfig(
        embedding_size=16, **LM)), what="shared layers"),
    "electra": Arch(lambda: T.ElectraForSequenceClassification(T.ElectraConfig(
        embedding_size=16, **LM))),
    "deberta_v2": Arch(lambda: T.DebertaV2ForSequenceClassification(T.DebertaV2Config(
        **LM)), what="relative positions"),
    # encoder-decoder
    "t5": Arch(lambda: T.T5ForConditionalGeneration(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
        decoder_start_token_id=0)), kind="seq2seq"),
    "bart": Arch(lambda: T.BartForConditionalGeneration(T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64)), kind="seq2seq"),
    "marian": Arch(lambda: T.MarianMTModel(T.MarianConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        decoder_start_token_id=0)), kind="seq2seq", what="tied"),
    # vision
    "vit": Arch(lambda: T.ViTForImageClassification(T.ViTConfig(
        image_size=IMG, patch_size=8, num_labels=5, **SMALL)), kind="image"),
    "deit": Arch(lambda: T.DeiTForImageClassification(T.DeiTConfig(
        image_size=IMG, patch_size=8, num_labels=5, **SMALL)), kind="image"),
    "beit": Arch(lambda: T.BeitForImageClassification(T.BeitConfig(
        image_size=IMG, patch_size=8, num_labels=5, use_relative_position_bias=True,
        **SMALL)), kind="image", what="relative positions"),
    "swin": Arch(lambda: T.SwinForImageClassification(T.SwinConfig(
        image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=5)), kind="image", what="windows"),
    "dinov2": Arch(lambda: T.Dinov2ForImageClassification(T.Dinov2Config(
        image_size=IMG, patch_size=8, num_labels=5, **SMALL)), kind="image"),
    "convnext": Arch(lambda: T.ConvNextForImageClassification(T.ConvNextConfig(
        num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5,
        image_size=IMG)), kind="image"),
    "resnet": Arch(lambda: T.ResNetForImageClassification(T.ResNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
        num_labels=5)), kind="image"),
    "mobilenet_v2": Arch(lambda: T.MobileNetV2ForImageClassification(T.MobileNetV2Config(
        num_channels=3, image_size=IMG, depth_multiplier=0.35, num_labels=5)), kind="image"),
    "efficientnet": Arch(lambda: T.EfficientNetForImageClassification(T.EfficientNetConfig(
        image_size=IMG, width_coefficient=0.1, depth_coefficient=0.1, hidden_dim=128,
        num_labels=5)),
        kind="image", what="SiLU, squeeze-excite"),
    "regnet": Arch(lambda: T.RegNetForImageClassification(T.RegNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
        num_labels=5)), kind="image"),
    "swinv2": Arch(lambda: T.Swinv2ForImageClassification(T.Swinv2Config(
        image_size=IMG, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, num_labels=5)), kind="image", what="windows, log-spaced position MLP"),
    "mobilevit": Arch(lambda: T.MobileViTForImageClassification(T.MobileViTConfig(
        image_size=IMG, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 48],
        num_labels=5)), kind="image", what="conv + attention, SiLU"),
    "segformer": Arch(lambda: T.SegformerForSemanticSegmentation(T.SegformerConfig(
        num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[8, 16],
        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
        decoder_hidden_size=16, num_labels=5)), kind="image", what="segmentation head"),
}


class Logits(torch.nn.Module):
    """transformers models return ModelOutput objects; exporters want one tensor."""

    def __init__(self, model: torch.nn.Module, kind: str) -> None:
        super().__init__()
        self.m, self.kind = model, kind

    def forward(self, *args):
        if self.kind == "image":
            return self.m(pixel_values=args[0]).logits
        if self.kind == "seq2seq":
            return self.m(input_ids=args[0], attention_mask=args[1],
                          decoder_input_ids=args[2]).logits
        return self.m(input_ids=args[0], attention_mask=args[1]).logits


def has_train_behaviour(model: torch.nn.Module) -> bool:
    return any(isinstance(m, (torch.nn.Dropout, torch.nn.modules.batchnorm._BatchNorm))
               for m in model.modules())


def make(name: str, pad_tokens: bool = False) -> tuple[Logits, tuple, list[str], bool]:
    """Seeded model with unique parameter values (so exported copies can be matched)."""
    arch = ARCHS[name]
    torch.manual_seed(0)
    model = arch.make()
    training = has_train_behaviour(model)
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
        for attr_name, value in list(vars(mod).items()):
            # functional dropout and stochastic depth keep their rates as float attributes
            # (attention_dropout, drop_prob, dropout_rate): zero them too, for determinism
            if "drop" in attr_name and isinstance(value, float):
                setattr(mod, attr_name, 0.0)
        if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.reshape(-1)
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                p.add_(0.02 * torch.randn_like(p))
    model.train(training)
    gen = torch.Generator().manual_seed(1)
    if arch.kind == "image":
        return Logits(model, "image"), (torch.randn(2, 3, IMG, IMG, generator=gen),), \
            ["pixel_values"], training
    # Token ids avoid the special tokens 0-2: nn.Embedding(padding_idx=...) keeps the
    # padding row's gradient at zero in torch, and a TorchScript file does not record
    # padding_idx (the dynamo exporter does, and memcc honours it; README: coverage), so a
    # batch without padding is what all three forms agree on.
    ids = torch.randint(3, VOCAB, (2, 8), generator=gen)
    if pad_tokens and getattr(model.config, "pad_token_id", None) is not None:
        # ``--pad``: the model's pad token in each sequence's last two positions (attended
        # to: what is checked is the padding row's gradient, which torch keeps at zero).
        ids[:, -2:] = int(model.config.pad_token_id)
    mask = torch.ones(2, 8, dtype=torch.long)
    if arch.kind == "seq2seq":
        dec = torch.randint(3, VOCAB, (2, 6), generator=gen)
        return Logits(model, "seq2seq"), (ids, mask, dec), \
            ["input_ids", "attention_mask", "decoder_input_ids"], training
    return Logits(model, "text"), (ids, mask), ["input_ids", "attention_mask"], training


@contextlib.contextmanager
def quiet():
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export(wrapper: Logits, args: tuple, names: list[str], training: bool, form: str,
           path: Path) -> None:
    m = copy.deepcopy(wrapper)
    with torch.no_grad(), quiet():
        if form == "torchscript":
            mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
            torch.onnx.export(m, args, str(path), dynamo=False, input_names=names,
                              output_names=["logits"], training=mode,
                              do_constant_folding=not training, opset_version=18)
        else:
            torch.onnx.export(m, args, dynamo=True, optimize=form == "dynamo",
                              input_names=names, output_names=["logits"],
                              verbose=False).save(str(path), external_data=False)


@dataclass
class Result:
    arch: str
    form: str
    mode: str
    status: str  # "match", "mismatch", "export failed", "export problem", "memcc refused"
    detail: str
    seconds: float

    @property
    def ok(self) -> bool:
        return self.status == "match"


def _first_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = re.sub(r"/tmp/[^ :]*/", "", text)
    return f"{type(exc).__name__}: {text[:limit]}"


def run_case(name: str, form: str, tmp: Path, row_chunks: int = 1,
             pad_tokens: bool = False) -> Result:
    t0 = time.perf_counter()
    wrapper, args, names, training = make(name, pad_tokens)
    mode = "train" if training else "eval"

    def result(status: str, detail: str) -> Result:
        return Result(name, form, mode, status, detail, time.perf_counter() - t0)

    path = tmp / f"{name}-{form}.onnx"
    try:
        export(wrapper, args, names, training, form, path)
    except Exception as exc:  # the exporter's failure, not memcc's
        return result("export failed", _first_line(exc, 160))
    feeds = {n: a.numpy() for n, a in zip(names, args, strict=True)}
    logits = wrapper(*args)
    classes = logits.shape[-1]
    labels = np.random.default_rng(0).integers(0, classes, size=tuple(logits.shape[:-1]))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, classes),
                                             torch.from_numpy(labels).reshape(-1))
    loss.backward()

    def export_problem() -> Result | None:
        if _export_matches_torch(path, feeds, logits.detach().numpy()):
            return None
        why = (BN_FOLDED if form != "torchscript" and _has_batchnorm(wrapper) and training
               else "the exported file's forward differs from torch's")
        return result("export problem", why)

    try:
        with quiet(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExportWarning)
            forward = load_graph(path)
            split = {kind: len(find_regions(forward, kind)) if row_chunks > 1 else 0
                     for kind in (ATTENTION, MLP)}
            opts = BuildOptions(optimizer="none",
                                attention_chunks=row_chunks if split[ATTENTION] else 1,
                                mlp_chunks=row_chunks if split[MLP] else 1)
            step = build_training_step(forward, opts, source=path.name)
            out = step_outputs(step, {**feeds, "labels": labels.astype(np.int64)}, "cpu")
        bn_folded = any(issubclass(w.category, ExportWarning)
                        and "folded them into the convolutions" in str(w.message)
                        for w in caught)
    except MemccError as exc:
        return export_problem() or result("memcc refused", _first_line(exc))
    except Exception as exc:  # a traceback in a sweep is a memcc bug: say so
        return result("memcc crashed", _first_line(exc))
    named = [(n, p) for n, p in wrapper.named_parameters() if p.grad is not None]
    tparams = {n: p.detach().numpy() for n, p in named}
    tgrads = {n: p.grad.numpy() for n, p in named}
    oparams = {k[:-5]: step.initializers[k[:-5]] for k in out if k.endswith(".grad")}
    floor = 1e-3 * max(float(np.abs(g).max()) for g in tgrads.values())
    worst, covered = 0.0, set()
    groups = parameter_groups(oparams, tparams)
    for onnx_members, torch_members in groups:
        got = sum((out[f"{o}.grad"].T if tr else out[f"{o}.grad"]).astype(np.float64)
                  for o, tr in onnx_members)
        ref = sum(tgrads[t].astype(np.float64) for t in torch_members)
        worst = max(worst, float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), floor))
        covered |= set(torch_members)
    matched = {o for members, _ in groups for o, _ in members}
    for tname, oname, rows in _folded_copies(oparams, tparams, matched, covered):
        # The exporter's optimizer folded a lookup with constant indices (position
        # embeddings at a static length) into a copy of some rows, or a broadcast (a class
        # token expanded to the batch) into a bigger copy: those copies train.
        ref = tgrads[tname].astype(np.float64)
        g = out[f"{oname}.grad"].astype(np.float64)
        if rows is None:
            lead = g.ndim - ref.ndim
            axes = tuple(range(lead)) + tuple(
                lead + i for i, d in enumerate(ref.shape) if d == 1 and g.shape[lead + i] != 1)
            got = g.sum(axis=axes, keepdims=True).reshape(ref.shape)
        else:
            got = np.zeros_like(ref)
            got[rows] = g.reshape(got[rows].shape)
        worst = max(worst, float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), floor))
        covered.add(tname)
    loss_err = abs(float(out["loss"]) - loss.item()) / max(1.0, abs(loss.item()))
    detail = (f"loss err {loss_err:.0e}, grad err {worst:.0e}, "
              f"{len(covered)}/{len(tgrads)} params, {len(step.nodes)} nodes"
              + (f", {split[ATTENTION]} attentions and {split[MLP]} MLPs in {row_chunks} "
                 "row chunks" if row_chunks > 1 else ""))
    ok = loss_err <= 1e-3 and worst <= 1e-3 and len(covered) == len(tgrads)
    if not ok and bn_folded:  # memcc itself warned: the file has no batch statistics
        return result("export problem", f"{BN_FOLDED} ({detail})")
    if not ok and loss_err > 1e-3:
        return export_problem() or result("mismatch", detail)
    if not ok and worst <= 1e-3 and loss_err <= 1e-3:
        folded = sorted(set(tgrads) - covered)
        return result("export problem", (
            f"constant folding turned {len(folded)} parameter(s) into derived constants "
            f"(e.g. {folded[0].removeprefix('m.')}), trained as separate tensors; every "
            f"other gradient matches ({detail})"))
    return result("match" if ok else "mismatch", detail)


def _folded_copies(oparams: dict[str, np.ndarray], tparams: dict[str, np.ndarray],
                   matched: set[str], covered: set[str]):
    """(torch name, ONNX name, row slice or None) where an unmatched ONNX parameter holds
    consecutive rows of an unmatched torch parameter, or (None) the torch parameter
    broadcast to a bigger shape."""
    for oname, v in oparams.items():
        if oname in matched:
            continue
        flat = v.reshape(-1, v.shape[-1]) if v.ndim else v
        for tname, t in tparams.items():
            if tname in covered or t.size <= 1:
                continue
            try:
                if t.shape != v.shape and np.array_equal(np.broadcast_to(t, v.shape), v):
                    yield tname, oname, None
                    break
            except ValueError:
                pass
            if t.ndim != 2 or flat.ndim != 2 or t.shape[1] != flat.shape[1]:
                continue
            k = flat.shape[0]
            for a in range(t.shape[0] - k + 1):
                if np.array_equal(t[a:a + k], flat):
                    yield tname, oname, slice(a, a + k)
                    break


def _has_batchnorm(model: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _export_matches_torch(path: Path, feeds: dict[str, np.ndarray], ref: np.ndarray) -> bool:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        got = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})[0]
    except Exception:
        return True  # let memcc's own load say what is wrong
    return got.shape == ref.shape and bool(np.allclose(got, ref, rtol=1e-3, atol=1e-4))


def table(results: list[Result]) -> str:
    forms = [f for f in FORMS if any(r.form == f for r in results)]
    lines = ["| architecture | mode | " + " | ".join(forms) + " |",
             "|---|---|" + "---|" * len(forms)]
    by = {(r.arch, r.form): r for r in results}
    for arch in dict.fromkeys(r.arch for r in results):
        mode = next(r.mode for r in results if r.arch == arch)
        what = ARCHS[arch].what
        cells = []
        for f in forms:
            r = by.get((arch, f))
            cells.append("-" if r is None else
                         ("match" if r.ok else f"**{r.status}**: {r.detail}")
                         .replace("|", "/"))
        lines.append(f"| {arch}{f' ({what})' if what else ''} | {mode} | "
                     + " | ".join(cells) + " |")
    n_ok = sum(r.ok for r in results)
    lines.append("")
    lines.append(f"{n_ok} of {len(results)} cases match torch "
                 f"({100.0 * n_ok / max(len(results), 1):.0f}%).")
    return "\n".join(lines)


def versions() -> str:
    import onnx
    import onnxruntime
    import onnxscript

    return (f"torch {torch.__version__}, transformers {T.__version__}, onnxscript "
            f"{onnxscript.__version__}, onnx {onnx.__version__}, onnxruntime "
            f"{onnxruntime.__version__}")


def write(doc: Path, body: str) -> None:
    text = doc.read_text()
    start, end = "<!-- sweep:start -->", "<!-- sweep:end -->"
    block = f"{start}\n{body}\n{end}"
    if start in text and end in text:
        text = text[:text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.write_text(text)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archs", nargs="*", help=f"default: all ({', '.join(ARCHS)})")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--write", type=Path, help="put the table into this markdown file")
    ap.add_argument("--row-chunks", type=int, default=1,
                    help="attentions and MLPs over this many row chunks where found")
    ap.add_argument("--pad", action="store_true",
                    help="put the pad token in every text batch (TorchScript files do not "
                         "record padding_idx: their cases then mismatch, as README says)")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    forms = [f for f in a.forms.split(",") if f]
    results: list[Result] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for name in a.archs or list(ARCHS):
            for form in forms:
                r = run_case(name, form, Path(d), a.row_chunks, a.pad)
                results.append(r)
                print(f"{name}/{form}/{r.mode}: {r.status}: {r.detail} ({r.seconds:.0f} s)",
                      flush=True)
    cmd = "nice -n 10 python benchmarks/transformers_sweep.py" + \
        (" " + " ".join(a.archs) if a.archs else "") + \
        (f" --forms {a.forms}" if a.forms != ",".join(FORMS) else "") + \
        (f" --write {a.write}" if a.write else "") + \
        (f" --row-chunks {a.row_chunks}" if a.row_chunks > 1 else "") + \
        (" --pad" if a.pad else "")
    body = (f"Generated by `{cmd}` on "
            f"{datetime.now(timezone.utc):%Y-%m-%d} ({versions()}; "
            f"{time.perf_counter() - t0:.0f} s on this machine).\n\n{table(results)}")
    print(body)
    if a.write:
        write(a.write, body)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
