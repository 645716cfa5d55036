"""Small torch models exported by the real torch.onnx exporters, as test fixtures.

memcc has to accept what users actually feed it: graphs written by ``torch.onnx.export`` with
the TorchScript exporter (``dynamo=False``) and with the dynamo exporter (``dynamo=True``,
onnxscript), in eval and in training mode. Hand-built ONNX graphs miss the exporters' habits
(Shape->Gather->Concat arithmetic, folded BatchNorm, decomposed LayerNorm/GELU, Where masks,
local functions), so the frontend and gradient rules are tested against these files.

``export(name, exporter, tmp_path=None, training=False)`` returns
``(onnx_path, torch_module, example_inputs, dims)``. Each (name, exporter, training, dropout)
is exported once per test run: into the directory ``MEMCC_TEST_EXPORTS`` names, which
tests/conftest.py makes for the run and pytest-xdist's workers share (a file lock makes one
worker export while another waits for it), else into a temp dir of the process. Callers get a
fresh deep copy of the torch module, so mutating it (training steps, BatchNorm statistics)
cannot leak between tests.

Determinism: every family takes a ``dropout`` probability, and ``export`` defaults it to 0.0.
Eval-mode exports drop Dropout whatever p is, and the returned module is in eval mode, so torch
and ORT agree exactly. Training-mode exports with p=0 keep the graph deterministic (TorchScript
still writes ``Dropout(ratio=0, training_mode=True)``; dynamo writes ``Identity``), so
gradients can be compared with torch autograd. Pass ``dropout=0.1`` to see the real Dropout
form (random in ORT; compare shapes only). Weights come from ``torch.manual_seed(0)``;
BatchNorm affine parameters and running statistics are randomised so BN is not an identity.

Known exporter divergence: the dynamo exporter writes BatchNormalization in inference form
(running statistics, ``training_mode=0``) even for a module in ``train()`` mode, because
onnxscript's torch_lib forces ``training = False`` in ``aten__native_batch_norm_legit_functional``
(see ``DYNAMO_TRAIN_BN_DIVERGES``); so its training exports of BatchNorm models do not match
torch's train-mode forward.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import ctypes
import fcntl
import functools
import io
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import nn

EXPORTERS = ("torchscript", "dynamo")
# The dynamo exporter without its optimizer (``optimize=False``): the form that keeps
# PyTorch's parameter names. Accepted by ``export`` but not swept by the EXPORTERS tests.
DYNAMO_NOOPT = "dynamo_noopt"

# Families whose dynamo training export differs from torch's train-mode forward (BatchNorm).
DYNAMO_TRAIN_BN_DIVERGES = frozenset({"convnet", "mobilenet_block", "hf_resnet"})


# --------------------------------------------------------------------------- modules
def _randomize_batchnorm(module: nn.Module, gen: torch.Generator) -> None:
    """Fresh BN layers are identities in eval mode, which would hide BN handling bugs."""
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                n = m.num_features
                m.weight.copy_(1.0 + 0.2 * torch.randn(n, generator=gen))
                m.bias.copy_(0.2 * torch.randn(n, generator=gen))
                m.running_mean.copy_(0.1 * torch.randn(n, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(n, generator=gen))


class _BasicBlock(nn.Module):
    """ResNet basic block; a strided block projects the skip with a 1x1 conv."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + self.skip(x))


class ConvNet(nn.Module):
    """Tiny ResNet: stem conv/BN/ReLU/MaxPool, two residual blocks, global pool, Linear."""

    def __init__(self, dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(), nn.MaxPool2d(2))
        self.block1 = _BasicBlock(8, 8, 1)
        self.block2 = _BasicBlock(8, 16, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block2(self.block1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(y), 1))


class StemAct(nn.Module):
    """A stem of Conv, BatchNorm and a smooth activation (MobileNetV3's HardSwish,
    EfficientNet's SiLU, which the exporters write as x * Sigmoid(x)), one conv block, a
    global pool and a Linear: what ``--batch-chunks`` splits besides ResNet's Relu stem."""

    def __init__(self, act: nn.Module, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), act)
        self.block = nn.Sequential(nn.Conv2d(8, 12, 3, 1, 1, bias=False), nn.BatchNorm2d(12),
                                   nn.ReLU())
        self.fc = nn.Linear(12, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.block(self.stem(x)).mean(dim=(2, 3)))


def _same_pad(size: int | torch.Tensor, k: int, s: int) -> tuple:
    """TF 'SAME' padding computed from the runtime size, the way timm's pad_same does it.

    Under TorchScript tracing sizes are 0-d tensors; staying in tensor ops keeps the pad
    arithmetic in the graph (Shape/Gather/Div/Ceil/Clip...), where Python ``math.ceil``/``max``
    would bake the example's pads into constants.
    """
    if isinstance(size, torch.Tensor):
        total = torch.clamp(((size / s).ceil() - 1) * s + k - size, min=0).to(torch.int64)
    else:
        total = max((math.ceil(size / s) - 1) * s + k - size, 0)
    return total // 2, total - total // 2


class MobileNetBlock(nn.Module):
    """Depthwise-separable block with ReLU6 and TF-same F.pad computed from the input size."""

    def __init__(self, dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        self.expand = nn.Sequential(nn.Conv2d(3, 16, 1, bias=False), nn.BatchNorm2d(16),
                                    nn.ReLU6())
        self.dw = nn.Conv2d(16, 16, 3, 2, 0, groups=16, bias=False)
        self.dw_bn = nn.BatchNorm2d(16)
        self.pw = nn.Conv2d(16, 24, 1, bias=False)
        self.pw_bn = nn.BatchNorm2d(24)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(24, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.expand(x)
        ph = _same_pad(y.shape[-2], 3, 2)
        pw = _same_pad(y.shape[-1], 3, 2)
        y = F.pad(y, (pw[0], pw[1], ph[0], ph[1]))
        y = F.relu6(self.dw_bn(self.dw(y)))
        y = F.relu6(self.pw_bn(self.pw(y)))
        return self.fc(self.drop(y.mean(dim=(2, 3))))


class HardSwishSE(nn.Module):
    """MobileNetV3's pattern: Hardswish after a conv and a squeeze-excite gate with
    Hardsigmoid, Hardswish and Dropout in the head. ORT has no HardSwish kernel and inlines
    its ONNX function, which memcc must do first (``frontend.ort_kernels``)."""

    def __init__(self, dropout: float = 0.0, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16),
                                  nn.Hardswish())
        self.se_down = nn.Conv2d(16, 8, 1)
        self.se_up = nn.Conv2d(8, 16, 1)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.Hardswish(), nn.Dropout(dropout),
                                  nn.Linear(32, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        gate = F.hardsigmoid(self.se_up(F.relu(self.se_down(y.mean((2, 3), keepdim=True)))))
        return self.head((y * gate).mean((2, 3)))


class StdConv(nn.Module):
    """timm's NF-ResNet pattern: a convolution whose weight is standardised per output
    channel by ``F.batch_norm(w, None, None, training=True)`` (ScaledStdConv2d), then a
    BatchNorm with running statistics. TorchScript writes the first as a training-mode
    BatchNormalization whose "running" inputs are computed from the weight and whose
    running outputs nothing reads: batch statistics with no state to carry."""

    def __init__(self, dropout: float = 0.0, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.gain = nn.Parameter(torch.ones(6, 1, 1, 1))
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.conv.weight.reshape(1, 6, -1), None, None, training=True,
                         momentum=0.0, eps=1e-5).reshape_as(self.conv.weight)
        y = F.conv2d(x, self.gain * w, self.conv.bias, padding=1)
        return self.fc(F.relu(self.bn(y)).mean(dim=(2, 3)))


class Recurrent(nn.Module):
    """An embedding, a recurrent layer and a classifier over the last and the mean hidden
    state: torch.onnx writes ``nn.LSTM`` / ``nn.GRU`` as ONNX LSTM / GRU nodes (W, R and B
    computed from torch's gate-ordered weights), which memcc unrolls over the steps."""

    def __init__(self, rnn: nn.Module, classes: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = nn.Linear(2 * width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(self.emb(input_ids))
        return self.head(torch.cat([y[:, -1], y.mean(1)], dim=-1))


class TopKMixture(nn.Module):
    """A mixture of experts routed by ``torch.topk``: each token's router probabilities,
    its top 2 of 4 experts renormalised and scattered into dense weights, every expert run
    densely and summed by those weights (how small MoE layers are written when the
    experts' grouped kernels do not export). The router learns through TopK's values."""

    def __init__(self, dropout: float = 0.0, classes: int = 4, width: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, width)
        self.router = nn.Linear(width, 4)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(width, 16), nn.GELU(),
                                                   nn.Linear(16, width)) for _ in range(4))
        self.head = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        probs = self.router(h).softmax(-1)
        top, idx = probs.topk(2, dim=-1)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        mixed = sum(weights[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return self.head((h + mixed).mean(1))


class SpatialTransformer(nn.Module):
    """A spatial transformer network: a small localisation net predicts an affine warp
    (``F.affine_grid``) and the image is resampled by it (``F.grid_sample``, bilinear)
    before the classifier: gradients reach the localisation net through the grid."""

    def __init__(self, dropout: float = 0.0, classes: int = 4) -> None:
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(4, 6))
        with torch.no_grad():
            self.loc[-1].weight.mul_(0.1)
            self.loc[-1].bias.copy_(torch.tensor([1.0, 0.1, 0.0, -0.1, 1.0, 0.0]))
        self.head = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.head(F.grid_sample(x, grid, align_corners=False))


class Segmenter(nn.Module):
    """A fully convolutional segmenter as torchvision's FCN heads are made: a strided
    Conv/BatchNorm/ReLU backbone, a 1x1 classifier, and the class scores upsampled
    bilinearly back to the image's size: logits [N, classes, H, W], the class axis 1 as
    torch's ``cross_entropy`` takes it (``memcc build --class-axis 1``)."""

    def __init__(self, dropout: float = 0.0, classes: int = 4) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6),
                                  nn.ReLU())
        self.classifier = nn.Conv2d(6, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.classifier(self.body(x))
        return F.interpolate(scores, size=x.shape[-2:], mode="bilinear", align_corners=False)


class ConvNeXtBlock(nn.Module):
    """ConvNeXt block: 7x7 depthwise conv, channels-last LayerNorm, Linear/GELU(erf), scale."""

    def __init__(self, dropout: float = 0.0, classes: int = 10, dim: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, dim, 2, 2)
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))
        self.drop = nn.Dropout(dropout)
        self.head_norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pw2(self.act(self.pw1(self.norm(y))))
        y = self.drop(self.gamma * y).permute(0, 3, 1, 2)
        x = x + y
        return self.head(self.head_norm(x.mean(dim=(-2, -1))))


class _Attention(nn.Module):
    """Hand-written multi-head self-attention (explicit scale, softmax, head reshapes)."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        att = self.drop(att.softmax(dim=-1))
        return self.proj((att @ v).transpose(1, 2).reshape(b, n, c))


class ViT(nn.Module):
    """Tiny ViT: patch conv, cls token, position embedding, one hand-written pre-norm block
    and one ``nn.TransformerEncoderLayer`` (MultiheadAttention), LayerNorm, Linear head."""

    def __init__(self, dropout: float = 0.0, classes: int = 10, dim: int = 32,
                 heads: int = 2, image: int = 16, patch: int = 4) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos = nn.Parameter(0.02 * torch.randn(1, (image // patch) ** 2 + 1, dim))
        self.norm1 = nn.LayerNorm(dim)
        self.attn = _Attention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(2 * dim, dim))
        self.layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout, activation="gelu",
                                                batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        x = self.layer(x)
        return self.head(self.norm(x[:, 0]))


class MLP(nn.Module):
    """Linear/ReLU/Dropout/LeakyReLU/Sigmoid stack (Sigmoid as a gate, as in GLU-style MLPs)."""

    def __init__(self, dropout: float = 0.0, classes: int = 8) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Dropout(dropout),
                                  nn.Linear(32, 32), nn.LeakyReLU(0.1), nn.Dropout(dropout))
        self.gate = nn.Linear(32, 32)
        self.out = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return self.out(h * torch.sigmoid(self.gate(h)))


class _LogitsOnly(nn.Module):
    """Transformers models return ModelOutput objects; exporters want plain tensors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class GPT2Logits(_LogitsOnly):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits


class GPT2NoMaskLogits(_LogitsOnly):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class BertLogits(_LogitsOnly):
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def _gpt2(dropout: float, wrapper: type[_LogitsOnly] = GPT2Logits) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  bos_token_id=0, eos_token_id=0)
    return wrapper(transformers.GPT2LMHeadModel(cfg))


def _bert(dropout: float) -> nn.Module:
    import transformers

    cfg = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=64,
                                  max_position_embeddings=32, num_labels=3,
                                  hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout)
    return BertLogits(transformers.BertForSequenceClassification(cfg))


def _llama(dropout: float) -> nn.Module:
    """RMSNorm (Pow/ReduceMean/Sqrt), rotary embeddings (Sin/Cos, Slice, Neg, Concat),
    grouped-query attention (Expand) and SiLU: what current decoder exports look like."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   attention_dropout=dropout)
    return GPT2Logits(transformers.LlamaForCausalLM(cfg))


class ImageLogits(_LogitsOnly):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def _hf_resnet(dropout: float) -> nn.Module:
    import transformers

    cfg = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                    depths=[1, 1], num_labels=5)
    return ImageLogits(transformers.ResNetForImageClassification(cfg))


# --------------------------------------------------------------------------- families
def _image(sizes: dict[str, int], gen: torch.Generator, hw: int = 16) -> dict[str, torch.Tensor]:
    h, w = sizes.get("height", hw), sizes.get("width", hw)
    return {"x": torch.randn(sizes["batch"], 3, h, w, generator=gen)}


def _tokens(sizes: dict[str, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, 100, (sizes["batch"], sizes["seq"]), generator=gen)}


def _tokens_mask(sizes: dict[str, int], gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = _tokens(sizes, gen)
    mask = torch.ones(sizes["batch"], sizes["seq"], dtype=torch.int64)
    mask[1:, -2:] = 0  # padded tail on every sequence but the first: the mask must matter
    out["attention_mask"] = mask
    return out


@dataclass(frozen=True)
class Family:
    """How to build, feed and export one model family.

    ``axes`` names the dynamic axes per input (and ``out_axes`` for the output), with the
    names given to the TorchScript exporter and to ``torch.export.Dim``; what names end up in
    the file is up to the exporter, so ``export`` reads them back from the graph.
    """

    build: Callable[[float], nn.Module]
    inputs: Callable[[dict[str, int], torch.Generator], dict[str, torch.Tensor]]
    axes: dict[str, dict[int, str]]
    out_axes: dict[int, str]
    sizes: dict[str, int] = field(default_factory=lambda: {"batch": 2})
    # Users write dynamo dynamic_shapes both ways: named ``Dim("batch")`` keeps the name in
    # the file, ``Dim.DYNAMIC`` gives sympy names like ``s31``; the fixtures use both.
    dynamo_named_dims: bool = True


_BATCH = {"x": {0: "batch"}}
_TOKENS_MASK = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}
_SEQ = {"batch": 2, "seq": 8}
FAMILIES: dict[str, Family] = {
    "convnet": Family(ConvNet, _image, _BATCH, {0: "batch"}),
    "mobilenet_block": Family(
        MobileNetBlock, lambda s, g: _image(s, g, 15),
        {"x": {0: "batch", 2: "height", 3: "width"}}, {0: "batch"},
        {"batch": 2, "height": 15, "width": 15}),
    "convnext_block": Family(ConvNeXtBlock, _image, _BATCH, {0: "batch"},
                             dynamo_named_dims=False),
    "vit": Family(ViT, _image, _BATCH, {0: "batch"}),
    "gpt2": Family(_gpt2, _tokens_mask, _TOKENS_MASK, {0: "batch", 1: "seq"}, _SEQ),
    "gpt2_nomask": Family(lambda p: _gpt2(p, GPT2NoMaskLogits), _tokens,
                          {"input_ids": {0: "batch", 1: "seq"}}, {0: "batch", 1: "seq"}, _SEQ),
    "bert": Family(_bert, _tokens_mask, _TOKENS_MASK, {0: "batch"}, _SEQ,
                   dynamo_named_dims=False),
    "llama": Family(_llama, _tokens_mask, _TOKENS_MASK, {0: "batch", 1: "seq"}, _SEQ),
    "hf_resnet": Family(_hf_resnet, lambda s, g: _image(s, g, 32), _BATCH, {0: "batch"},
                        dynamo_named_dims=False),
    "mlp": Family(lambda p: MLP(p), lambda s, g: {"x": torch.randn(s["batch"], 20, generator=g)},
                  _BATCH, {0: "batch"}, dynamo_named_dims=False),
}


def _hf_vit(dropout: float) -> nn.Module:
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, num_labels=5,
                                 hidden_dropout_prob=dropout,
                                 attention_probs_dropout_prob=dropout)
    return ImageLogits(transformers.ViTForImageClassification(cfg))


class ConvBN(nn.Module):
    """Conv/BatchNorm/ReLU/pool/Linear: the smallest model whose train mode matters."""

    def __init__(self, dropout: float = 0.0, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))


# Families used by a few tests only (not swept by the EXPORTERS x FAMILIES tests, which CI's
# time budget cannot grow by).
EXTRA_FAMILIES: dict[str, Family] = {
    "hf_vit": Family(_hf_vit, _image, _BATCH, {0: "batch"}),
    "conv_bn": Family(ConvBN, lambda s, g: _image(s, g, 8), _BATCH, {0: "batch"}),
    "hardswish_se": Family(HardSwishSE, lambda s, g: _image(s, g, 8), _BATCH, {0: "batch"}),
    "std_conv": Family(StdConv, lambda s, g: _image(s, g, 8), _BATCH, {0: "batch"}),
    "lstm": Family(lambda p: Recurrent(nn.LSTM(8, 6, batch_first=True)), _tokens,
                   {"input_ids": {0: "batch"}}, {0: "batch"}, _SEQ),
    "stn": Family(SpatialTransformer, lambda s, g: _image(s, g, 12), _BATCH, {0: "batch"}),
    "segmenter": Family(Segmenter, lambda s, g: _image(s, g, 8), _BATCH, {0: "batch"}),
    "hardswish_stem": Family(lambda p: StemAct(nn.Hardswish()), lambda s, g: _image(s, g, 16),
                             _BATCH, {0: "batch"}),
    "silu_stem": Family(lambda p: StemAct(nn.SiLU()), lambda s, g: _image(s, g, 16), _BATCH,
                        {0: "batch"}),
    "moe": Family(TopKMixture, _tokens, {"input_ids": {0: "batch"}}, {0: "batch"}, _SEQ),
    "gru": Family(lambda p: Recurrent(nn.GRU(8, 6, num_layers=2, batch_first=True,
                                             bidirectional=True)), _tokens,
                  {"input_ids": {0: "batch"}}, {0: "batch"}, _SEQ),
}


def family(name: str) -> Family:
    return FAMILIES[name] if name in FAMILIES else EXTRA_FAMILIES[name]


def build_module(name: str, dropout: float = 0.0, fresh: bool = False) -> nn.Module:
    """The family's module with seeded weights (same weights on every call). ``fresh``
    keeps the constant-filled parameters of a fresh model (LayerNorm ones, zero biases),
    which the dynamo exporter's optimizer merges and folds away."""
    torch.manual_seed(0)
    module = family(name).build(dropout)
    _randomize_batchnorm(module, torch.Generator().manual_seed(1))
    if not fresh:
        _jitter_constant_parameters(module, torch.Generator().manual_seed(2))
    return module


def _jitter_constant_parameters(module: nn.Module, gen: torch.Generator) -> None:
    """Fresh LayerNorm weights are all ones and biases all zeros. Exporters deduplicate equal
    initializers, and equal values make it impossible to tell which exported initializer is
    which torch parameter; a small perturbation makes every parameter unique."""
    with torch.no_grad():
        for p in module.parameters():
            flat = p.detach().reshape(-1)
            if flat.numel() > 1 and bool((flat == flat[0]).all()):
                p.add_(0.02 * torch.randn(p.shape, generator=gen))


def make_inputs(name: str, sizes: dict[str, int] | None = None, seed: int = 0
                ) -> dict[str, torch.Tensor]:
    """Inputs for ``name`` at the given logical sizes (default: the export example sizes)."""
    fam = family(name)
    return fam.inputs({**fam.sizes, **(sizes or {})}, torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- export
_SESSION_DIR: Path | None = None
# Set by tests/conftest.py for the run: the directory every test process exports into.
SHARED_DIR_ENV = "MEMCC_TEST_EXPORTS"


def _session_dir() -> Path:
    global _SESSION_DIR
    if _SESSION_DIR is None:
        shared = os.environ.get(SHARED_DIR_ENV)
        if shared:
            _SESSION_DIR = Path(shared)
            _SESSION_DIR.mkdir(parents=True, exist_ok=True)
        else:
            _SESSION_DIR = Path(tempfile.mkdtemp(prefix="memcc-exports-"))
            atexit.register(shutil.rmtree, _SESSION_DIR, True)
    return _SESSION_DIR


@contextlib.contextmanager
def _exclusive(path: Path):
    """Hold ``path``'s lock file: the processes of one run export each case once, the
    others wait for the file rather than export it again (an export takes seconds)."""
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _silence_fds():
    """A failing TorchScript export dumps its whole IR graph through C stdio (its log switch
    is forced on in torch 2.13), past Python's sys.stdout; point fds 1 and 2 at /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).fflush(None)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


@contextlib.contextmanager
def _quiet():
    """The exporters print progress and warnings (TracerWarning, torchvision missing).
    Errors still raise with their message."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), _silence_fds():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _export_torchscript(module: nn.Module, fam: Family, inputs: dict[str, torch.Tensor],
                        path: Path, training: bool) -> None:
    mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(
        module, tuple(inputs.values()), str(path), dynamo=False,
        input_names=list(inputs), output_names=["logits"],
        dynamic_axes={**fam.axes, "logits": fam.out_axes},
        training=mode, do_constant_folding=not training,
    )


def _export_dynamo(module: nn.Module, fam: Family, inputs: dict[str, torch.Tensor],
                   path: Path, training: bool, *, optimize: bool = True) -> None:
    dim_objs: dict[str, object] = {}

    def dim(name: str) -> object:
        if not fam.dynamo_named_dims:
            return torch.export.Dim.DYNAMIC
        return dim_objs.setdefault(name, torch.export.Dim(name, min=1))

    shapes = {arg: {ax: dim(d) for ax, d in axes.items()} for arg, axes in fam.axes.items()}
    prog = torch.onnx.export(module, (), kwargs=inputs, dynamo=True, dynamic_shapes=shapes,
                             output_names=["logits"], verbose=False, optimize=optimize)
    prog.save(str(path), external_data=False)


@functools.cache
def _export_cached(name: str, exporter: str, training: bool, dropout: float,
                   fresh: bool = False
                   ) -> tuple[Path, nn.Module, dict[str, np.ndarray], dict[str, int], float]:
    if exporter not in (*EXPORTERS, DYNAMO_NOOPT):
        raise ValueError(f"exporter must be one of {EXPORTERS + (DYNAMO_NOOPT,)}, "
                         f"got {exporter!r}")
    fam = family(name)
    module = build_module(name, dropout, fresh)
    module.train(training)
    inputs = make_inputs(name)
    path = _session_dir() / (f"{name}-{exporter}-{'train' if training else 'eval'}-p{dropout}"
                             f"{'-fresh' if fresh else ''}.onnx")
    fn = {"torchscript": _export_torchscript, "dynamo": _export_dynamo,
          DYNAMO_NOOPT: functools.partial(_export_dynamo, optimize=False)}[exporter]
    done = path.with_name(path.name + ".json")
    with _exclusive(path):
        if done.exists():
            seconds = json.loads(done.read_text())["seconds"]
        else:
            partial = path.with_name(path.stem + ".partial.onnx")
            t0 = time.perf_counter()
            with _quiet():
                fn(copy.deepcopy(module), fam, inputs, partial, training)
            seconds = time.perf_counter() - t0
            os.replace(partial, path)
            done.write_text(json.dumps({"seconds": seconds}))
    dims = _read_dims(onnx.load(str(path), load_external_data=False), inputs)
    arrays = {k: v.numpy() for k, v in inputs.items()}
    return path, module, arrays, dims, seconds


def _read_dims(model: onnx.ModelProto, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
    """Map each symbolic input dim name the exporter wrote to the example's size."""
    dims: dict[str, int] = {}
    for vi in model.graph.input:
        if vi.name not in inputs:
            continue
        shape = inputs[vi.name].shape
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param:
                dims[d.dim_param] = int(shape[i])
    return dims


def export(name: str, exporter: str, tmp_path: Path | None = None, training: bool = False,
           dropout: float = 0.0, fresh: bool = False
           ) -> tuple[Path, nn.Module, dict[str, np.ndarray], dict[str, int]]:
    """Export ``name`` with ``exporter`` ('torchscript' or 'dynamo'), once per process.

    Returns the .onnx path (a copy inside ``tmp_path`` when given, so the caller may write
    next to it), a fresh copy of the torch module in the exported mode, the example inputs
    (numpy, keyed by graph input name) and ``dims``: symbolic dim name -> example size, ready
    for ``load_graph(path, dims)``. ``fresh``: weights as a fresh model has them (see
    ``build_module``), not made unique.
    """
    path, module, arrays, dims, _ = _export_cached(name, exporter, training, float(dropout),
                                                   fresh)
    if tmp_path is not None:
        dst = Path(tmp_path) / path.name
        shutil.copyfile(path, dst)
        path = dst
    module = copy.deepcopy(module)
    module.train(training)
    return path, module, {k: v.copy() for k, v in arrays.items()}, dict(dims)


def export_seconds(name: str, exporter: str, training: bool = False, dropout: float = 0.0
                   ) -> float:
    """How long the (cached) export took, for reports on test cost."""
    return _export_cached(name, exporter, training, float(dropout))[4]


def dim_names(name: str, dims: dict[str, int], path: Path) -> dict[str, str]:
    """Exporter dim name -> the family's logical size name (batch/seq/height/width).

    Lets a test rebind the same logical size under whichever name the exporter chose.
    """
    model = onnx.load(str(path), load_external_data=False)
    out: dict[str, str] = {}
    for vi in model.graph.input:
        axes = family(name).axes.get(vi.name, {})
        for i, d in enumerate(vi.type.tensor_type.shape.dim):
            if d.dim_param and i in axes:
                out[d.dim_param] = axes[i]
    return out


def torch_forward(module: nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """Run the module on numpy inputs without touching the caller's copy (BN stats)."""
    m = copy.deepcopy(module)
    with torch.no_grad():
        return m(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
