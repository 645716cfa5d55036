"""The first-use sweeps' models (BENCHMARKS.md, "First use on models memcc was not tuned
on" and session 29's): torchvision, timm and transformers models with random weights from
their own constructors, exported as a new user exports them. torchvision and timm are not
memcc's dependencies (install them in a venv of their own: torchvision's import breaks
transformers' beside the CPU torch the tests use):

    pip install timm torchvision      # versions matching the installed torch
    python benchmarks/first_use_models.py --out /tmp/sweep/out [--cases levit.ts.train,...]

writes ``<out>/<case>.onnx`` per case (name: model, exporter, train or eval mode, ``.dyn``
for a symbolic batch axis named ``batch``, bound with ``--dim batch=B``); the memcc
commands the sweep ran on them are listed in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import inspect
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
        # session 29: models no earlier sweep ran
        "tv_mnasnet0_5": lambda: tv.mnasnet0_5(num_classes=10),
        "tv_googlenet": lambda: tv.googlenet(num_classes=10, aux_logits=False,
                                             init_weights=True),
        "tv_vit": lambda: tv.VisionTransformer(image_size=32, patch_size=8, num_layers=2,
                                               num_heads=2, hidden_dim=64, mlp_dim=128,
                                               dropout=0.1, num_classes=10),
        "timm_ghostnet_050": lambda: timm.create_model("ghostnet_050", num_classes=10),
        "timm_mixnet_s": lambda: timm.create_model("mixnet_s", num_classes=10),
        "timm_efficientnet_lite0": lambda: timm.create_model("tf_efficientnet_lite0",
                                                             num_classes=10),
        "timm_nf_resnet26": lambda: timm.create_model("nf_resnet26", num_classes=10),
        "timm_xcit_nano": lambda: timm.create_model("xcit_nano_12_p8_224", num_classes=10,
                                                    img_size=32),
        "timm_dla34": lambda: timm.create_model("dla34", num_classes=10),
        "timm_repvgg_a0": lambda: timm.create_model("repvgg_a0", num_classes=10),
        "timm_fastvit_t8": lambda: timm.create_model("fastvit_t8", num_classes=10),
        # stochastic depth: a random draw per sample in train mode
        "timm_convnext_atto_dp": lambda: timm.create_model("convnext_atto", num_classes=10,
                                                           drop_path_rate=0.2),
        "timm_vit_tiny_dp": lambda: timm.create_model("vit_tiny_patch16_224", num_classes=10,
                                                      img_size=32, patch_size=8,
                                                      drop_path_rate=0.2),
        # session 30: Col2Im (VOLO's outlook attention), a SequenceAt of unequal parts
        "timm_volo": lambda: timm.create_model("volo_d1_224", num_classes=10, img_size=64),
        "timm_efficientvit_m0": lambda: timm.create_model("efficientvit_m0", num_classes=10,
                                                          img_size=64),
    }

# name, model, exporter, train?, batch, px, dynamic batch axis?
# (px: tokens for a transformers text model)
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
    # session 29
    ("mnasnet.noopt.train", "tv_mnasnet0_5", "dynamo_noopt", True, 4, 64, False),
    ("googlenet.ts.train", "tv_googlenet", "torchscript", True, 4, 64, False),
    ("tv_vit.noopt.train", "tv_vit", "dynamo_noopt", True, 4, 32, False),
    ("ghostnet.ts.train", "timm_ghostnet_050", "torchscript", True, 4, 64, False),
    ("mixnet.noopt.train.dyn", "timm_mixnet_s", "dynamo_noopt", True, 4, 64, True),
    ("efficientnet_lite.dynamo.eval", "timm_efficientnet_lite0", "dynamo", False, 4, 64, False),
    ("nf_resnet.ts.train", "timm_nf_resnet26", "torchscript", True, 2, 64, False),
    ("xcit.noopt.eval", "timm_xcit_nano", "dynamo_noopt", False, 4, 32, False),
    ("dla.ts.train", "timm_dla34", "torchscript", True, 2, 64, False),
    ("repvgg.noopt.train", "timm_repvgg_a0", "dynamo_noopt", True, 2, 64, False),
    ("fastvit.ts.train", "timm_fastvit_t8", "torchscript", True, 2, 64, False),
    ("convnext_dp.noopt.train", "timm_convnext_atto_dp", "dynamo_noopt", True, 4, 32, False),
    ("vit_dp.ts.train", "timm_vit_tiny_dp", "torchscript", True, 4, 32, False),
    # transformers models (batch, tokens or px)
    ("llama.dynamo.eval", "hf_llama", "dynamo", False, 4, 32, False),
    ("t5.ts.train", "hf_t5", "torchscript", True, 4, 32, False),
    ("deberta.noopt.train", "hf_deberta_v2", "dynamo_noopt", True, 4, 32, False),
    ("segformer.noopt.train", "hf_segformer", "dynamo_noopt", True, 2, 32, False),
    ("swin.ts.train", "hf_swin", "torchscript", True, 4, 32, False),
    ("bart.noopt.eval.dyn", "hf_bart", "dynamo_noopt", False, 4, 16, True),
    ("qwen3.noopt.train", "hf_qwen3", "dynamo_noopt", True, 4, 32, False),
    # recurrent models (session 30; batch, tokens): torch modules, no timm or torchvision
    ("lstm_lm.ts.train", "rnn_lstm_lm", "torchscript", True, 8, 35, False),
    ("lstm_lm.noopt.train", "rnn_lstm_lm", "dynamo_noopt", True, 8, 35, False),
    ("gru_clf.dynamo.train.dyn", "rnn_gru_clf", "dynamo", True, 8, 48, True),
    ("gru_clf.ts.eval", "rnn_gru_clf", "torchscript", False, 8, 48, False),
    # transformers audio models (session 30; batch, samples or mel frames). wav2vec2 and
    # HuBERT do not export with dynamo (torch.export fails on their feature extractor).
    ("wav2vec2.ts.train", "audio_wav2vec2", "torchscript", True, 2, 1600, False),
    ("hubert.ts.eval", "audio_hubert", "torchscript", False, 2, 1600, False),
    ("whisper.noopt.train", "audio_whisper", "dynamo_noopt", True, 2, 100, False),
    # timm models whose dynamo exports memcc refused before session 30
    ("volo.noopt.train", "timm_volo", "dynamo_noopt", True, 2, 64, False),
    ("efficientvit_m0.noopt.train", "timm_efficientvit_m0", "dynamo_noopt", True, 2, 64,
     False),
    # segmentation models (session 31): logits [N, 5, px, px], built with --class-axis 1
    # --ignore-index 255 (labels [N, px, px]). TorchScript refuses UperNet's pooling to 3
    # and 6 cells of a 2 x 2 map (its last stage at 64 px): 192 px, 6 x 6, there.
    ("fcn_resnet50.ts.train", "seg_fcn_resnet50", "torchscript", True, 2, 64, False),
    ("fcn_resnet50.noopt.train", "seg_fcn_resnet50", "dynamo_noopt", True, 2, 64, False),
    ("fcn_resnet50.ts.eval", "seg_fcn_resnet50", "torchscript", False, 2, 64, False),
    ("deeplabv3_mnv3.ts.train", "seg_deeplabv3_mnv3", "torchscript", True, 2, 64, False),
    ("deeplabv3_mnv3.noopt.train", "seg_deeplabv3_mnv3", "dynamo_noopt", True, 2, 64, False),
    ("lraspp_mnv3.ts.train", "seg_lraspp_mnv3", "torchscript", True, 2, 64, False),
    ("lraspp_mnv3.noopt.train", "seg_lraspp_mnv3", "dynamo_noopt", True, 2, 64, False),
    ("segformer_seg.ts.train", "seg_segformer", "torchscript", True, 2, 64, False),
    ("segformer_seg.noopt.train", "seg_segformer", "dynamo_noopt", True, 2, 64, False),
    ("upernet.ts.train", "seg_upernet", "torchscript", True, 2, 192, False),
    ("upernet.noopt.train", "seg_upernet", "dynamo_noopt", True, 2, 64, False),
    # ... and two at 4 x 256 px, where activations, not weights, make most of the step
    ("lraspp_mnv3_256.ts.train", "seg_lraspp_mnv3", "torchscript", True, 4, 256, False),
    ("segformer_seg_256.noopt.train", "seg_segformer", "dynamo_noopt", True, 4, 256, False),
]


def _audio(model_name: str, batch: int, size: int):
    """A transformers audio classifier at a small size (layer drop off: an export traces
    one draw of it), its waveform (``size`` samples) or log-mel input (``size`` frames)."""
    import transformers as T
    speech = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=64, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2),
                  conv_kernel=(10, 3, 3), num_labels=10, num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=4, apply_spec_augment=False, layerdrop=0.0)
    if model_name == "audio_wav2vec2":
        model = T.Wav2Vec2ForSequenceClassification(T.Wav2Vec2Config(**speech))
    elif model_name == "audio_hubert":
        model = T.HubertForSequenceClassification(T.HubertConfig(**speech))
    else:
        model = T.WhisperForAudioClassification(T.WhisperConfig(
            d_model=32, encoder_layers=2, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
            num_mel_bins=16, max_source_positions=size // 2, num_labels=10,
            encoder_layerdrop=0.0))
    key = "input_features" if model_name == "audio_whisper" else "input_values"
    x = torch.randn(batch, 16, size) if model_name == "audio_whisper" \
        else torch.randn(batch, size)
    return _Logits(model, key), (x,), [key]


class _Logits(torch.nn.Module):
    """A transformers model called with one named input; its logits."""

    def __init__(self, model: torch.nn.Module, key: str) -> None:
        super().__init__()
        self.m, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m(**{self.key: x}).logits


class WordLM(torch.nn.Module):
    """PyTorch's word_language_model example at a small size: embedding, two LSTM layers
    with dropout between them, a projection to the vocabulary. (Two modules, not
    ``nn.LSTM(num_layers=2, dropout=0.2)``: torch.onnx's TorchScript exporter refuses an
    LSTM's own dropout in training mode.)"""

    def __init__(self, vocab: int = 2000, width: int = 128) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.rnn1 = torch.nn.LSTM(width, width, batch_first=True)
        self.rnn2 = torch.nn.LSTM(width, width, batch_first=True)
        self.drop = torch.nn.Dropout(0.2)
        self.out = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn1(self.drop(self.emb(input_ids)))
        y, _ = self.rnn2(self.drop(y))
        return self.out(self.drop(y))


class GRUClassifier(torch.nn.Module):
    """A sentence classifier: embedding, bidirectional GRU, max over time, a linear head."""

    def __init__(self, vocab: int = 2000, width: int = 64, classes: int = 5) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.rnn = torch.nn.GRU(width, width, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(2 * width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.emb(input_ids))
        return self.head(y.amax(dim=1))


class _Segmenter(torch.nn.Module):
    """A segmentation model's per-pixel logits at the image's size: torchvision's ``out``
    entry, or a transformers model's logits (``upsample``: from SegFormer's quarter size,
    as its own loss does; UperNet's are at the image's size already)."""

    def __init__(self, model: torch.nn.Module, upsample: bool = False) -> None:
        super().__init__()
        self.m, self.upsample = model, upsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not hasattr(self.m, "config"):
            return self.m(x)["out"]
        y = self.m(pixel_values=x).logits
        if not self.upsample:
            return y
        return torch.nn.functional.interpolate(y, size=x.shape[2:], mode="bilinear",
                                               align_corners=False)


def _segmenter(model_name: str) -> torch.nn.Module:
    """A segmentation model of 5 classes, random weights, no auxiliary head."""
    if model_name == "seg_segformer":
        import transformers as T
        return _Segmenter(T.SegformerForSemanticSegmentation(T.SegformerConfig(
            num_encoder_blocks=4, depths=[1, 1, 1, 1], hidden_sizes=[16, 32, 48, 64],
            decoder_hidden_size=32, num_labels=5, image_size=64)), upsample=True)
    if model_name == "seg_upernet":
        import transformers as T
        return _Segmenter(T.UperNetForSemanticSegmentation(T.UperNetConfig(
            backbone_config=T.ConvNextConfig(hidden_sizes=[16, 32, 48, 64],
                                             depths=[1, 1, 1, 1],
                                             out_features=["stage1", "stage2", "stage3",
                                                           "stage4"]),
            hidden_size=32, use_auxiliary_head=False, num_labels=5)))
    import torchvision.models.segmentation as tvs
    make = {"seg_fcn_resnet50": tvs.fcn_resnet50,
            "seg_deeplabv3_mnv3": tvs.deeplabv3_mobilenet_v3_large,
            "seg_lraspp_mnv3": tvs.lraspp_mobilenet_v3_large}[model_name]
    extra = {} if model_name == "seg_lraspp_mnv3" else {"aux_loss": False}
    return _Segmenter(make(weights=None, weights_backbone=None, num_classes=5, **extra))


def _inputs(model_name: str, batch: int, size: int):
    """(module, example inputs, input names) for a case: an image model's one image batch,
    or a transformers model (``hf_<arch>``, benchmarks/transformers_sweep.py's configs)
    with token ids of ``size`` tokens (images of ``size`` px for its vision models)."""
    if model_name.startswith("audio_"):
        return _audio(model_name, batch, size)
    if model_name.startswith("rnn_"):
        model = {"rnn_lstm_lm": WordLM, "rnn_gru_clf": GRUClassifier}[model_name]()
        return model, (torch.randint(0, 2000, (batch, size)),), ["input_ids"]
    if model_name.startswith("seg_"):
        return _segmenter(model_name), (torch.randn(batch, 3, size, size),), ["x"]
    if not model_name.startswith("hf_"):
        return ctors()[model_name](), (torch.randn(batch, 3, size, size),), ["x"]
    import transformers_sweep as hf
    arch = hf.ARCHS[model_name[3:]]
    model = hf.Logits(arch.make(), arch.kind)
    if arch.kind == "image":
        return model, (torch.randn(batch, 3, size, size),), ["pixel_values"]
    ids = torch.randint(3, hf.VOCAB, (batch, size))
    mask = torch.ones(batch, size, dtype=torch.long)
    if arch.kind == "seq2seq":
        dec = torch.randint(3, hf.VOCAB, (batch, size // 2 + 1))
        return model, (ids, mask, dec), ["input_ids", "attention_mask", "decoder_input_ids"]
    return model, (ids, mask), ["input_ids", "attention_mask"]


def export(case, path, module=None):
    """Export the case (``module``: its (model, inputs, input names), already made)."""
    name, model_name, exporter, train, batch, px, dyn = case
    torch.manual_seed(0)
    model, args, names = module or _inputs(model_name, batch, px)
    model.train(train)
    if exporter == "torchscript":
        axes = {n: {0: "batch"} for n in [*names, "logits"]} if dyn else None
        torch.onnx.export(model, args, str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING if train
                          else torch.onnx.TrainingMode.EVAL, do_constant_folding=False,
                          input_names=names, output_names=["logits"], opset_version=17,
                          dynamic_axes=axes)
    else:
        batch_dim = torch.export.Dim("batch")
        shapes = tuple({0: batch_dim} for _ in args)
        if inspect.signature(model.forward).parameters.keys() == {"args"}:
            shapes = (shapes,)  # forward(*args): one entry, the tuple of its arguments
        kw = {"dynamic_shapes": shapes} if dyn else {}
        torch.onnx.export(model, args, str(path), dynamo=True, optimize=exporter == "dynamo",
                          input_names=names, output_names=["logits"], **kw)


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
