"""First use on models users write by hand in PyTorch: a VAE (with ``torch.randn_like``), a
DCGAN generator, ``nn.TransformerEncoder`` with a key padding mask, ``nn.MultiheadAttention``,
a Conv3d video classifier, message passing with ``index_add_`` / ``scatter_add``, a U-Net
(GroupNorm, nearest upsampling, PixelShuffle), a DLRM-like recommender with
``nn.EmbeddingBag``, a causal dilated Conv1d network and a model of einsum, cumsum, tanh
GELU, ``F.layer_norm`` without affine and causal ``F.scaled_dot_product_attention``.

Each case (model, exporter, train or eval mode, ``.dyn``: a symbolic batch axis named
``batch``, bound with ``--dim batch=B``) is exported as a user would, then each memcc
command runs in its own process as first_use_run.py runs them: ``build``, ``compile
--budget min --verify``, ``compile --budget 70% --verify`` (both ``--time-limit 20``),
``train --steps 2`` on data this script writes (valid indices and masks; memcc run's
synthetic feeds are checked by ``run --steps 2``), then the gradients: the model exported
again with every dropout rate 0 and no two parameters equal, built with ``--optimizer
none``, run in ORT, its loss and gradients against torch autograd on the same weights and
batch in float32 and float64 (first_use_grads.py's measure: per parameter, relative to the
larger of its largest gradient and 1e-3 of the largest over all parameters; the worst over
all). A VAE's noise is read from the step (memcc draws its own: README, "Randomness") and
given to torch's ``randn_like``.

    python benchmarks/handwritten_models.py --work /tmp/hw [--cases vae.ts.train,...]
        [--skip-commands] [--skip-grads] [--out rows.jsonl]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from first_use_grads import _deterministic, _worst  # noqa: E402
from first_use_run import _fail, _memcc  # noqa: E402

MB = 1e6


# --------------------------------------------------------------------------- models
class VAE(nn.Module):
    """Conv encoder, reparameterisation with ``randn_like``, ConvTranspose2d decoder; returns
    the reconstruction (``loss="recon"``) or its own loss, reconstruction MSE + KL."""

    def __init__(self, own_loss: bool = False, z: int = 8) -> None:
        super().__init__()
        self.own_loss = own_loss
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1),
                                 nn.ReLU(), nn.Flatten())
        self.mu, self.logvar = nn.Linear(16 * 4 * 4, z), nn.Linear(16 * 4 * 4, z)
        self.up = nn.Linear(z, 16 * 4 * 4)
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(8, 1, 4, 2, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        recon = self.dec(self.up(z).view(-1, 16, 4, 4))
        if not self.own_loss:
            return recon
        kl = -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())
        return F.mse_loss(recon, x) + 0.1 * kl


class Generator(nn.Module):
    """DCGAN's generator at 16 px: ConvTranspose2d, BatchNorm, ReLU, Tanh."""

    def __init__(self, nz: int = 16, ngf: int = 16) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2),
            nn.ReLU(True), nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False),
            nn.BatchNorm2d(ngf), nn.ReLU(True), nn.ConvTranspose2d(ngf, 3, 4, 2, 1, bias=False),
            nn.Tanh())

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class EncoderClassifier(nn.Module):
    """Token embedding + learned positions, ``nn.TransformerEncoder`` (batch_first) with a
    key padding mask (True = padding), masked mean pooling, a linear head."""

    def __init__(self, norm_first: bool, vocab: int = 100, d: int = 32, tokens: int = 16,
                 classes: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, d))
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True,
                                           norm_first=norm_first)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        y = self.enc(self.emb(ids) + self.pos, src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(y.dtype)
        return self.head((y * keep).sum(1) / keep.sum(1).clamp(min=1.0))


class MHAClassifier(nn.Module):
    """``nn.MultiheadAttention`` used directly: self-attention with a causal float mask,
    a residual, LayerNorm and a per-token head."""

    def __init__(self, d: int = 32, classes: int = 7, tokens: int = 12) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.attn = nn.MultiheadAttention(d, 4, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)
        self.register_buffer("causal", torch.triu(torch.full((tokens, tokens), float("-inf")),
                                                  1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        a, _ = self.attn(h, h, h, attn_mask=self.causal, need_weights=False)
        return self.head(self.norm(h + a))


class Video3d(nn.Module):
    """A small C3D-style video classifier: Conv3d, BatchNorm3d, MaxPool3d, AdaptiveAvgPool3d."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv3d(3, 8, 3, padding=1), nn.BatchNorm3d(8), nn.ReLU(), nn.MaxPool3d(2),
            nn.Conv3d(8, 16, 3, padding=1), nn.BatchNorm3d(16), nn.ReLU(),
            nn.MaxPool3d((1, 2, 2)), nn.AdaptiveAvgPool3d(1))
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.features(x), 1))


class MessagePassing(nn.Module):
    """Two message-passing layers over a batch of graphs (nodes [B, V, F], edges as src/dst
    [B, E]), summing messages with ``index_add_`` over the flattened nodes (PyG's batching)
    or with ``scatter_add`` along the node axis; per-node logits [B, V, classes]."""

    def __init__(self, how: str, feats: int = 8, width: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.how = how
        self.lin_in = nn.Linear(feats, width)
        self.msg = nn.ModuleList([nn.Linear(width, width) for _ in range(2)])
        self.upd = nn.ModuleList([nn.Linear(2 * width, width) for _ in range(2)])
        self.head = nn.Linear(width, classes)

    def _aggregate(self, m: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        b, v, w = m.shape
        if self.how == "index_add":
            off = (torch.arange(b, device=m.device) * v).unsqueeze(1)
            flat = m.reshape(b * v, w)
            msgs = flat.index_select(0, (src + off).reshape(-1))
            out = torch.zeros_like(flat).index_add_(0, (dst + off).reshape(-1), msgs)
            return out.reshape(b, v, w)
        msgs = torch.gather(m, 1, src.unsqueeze(-1).expand(-1, -1, w))
        return torch.zeros_like(m).scatter_add(1, dst.unsqueeze(-1).expand(-1, -1, w), msgs)

    def forward(self, x: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.lin_in(x))
        for msg, upd in zip(self.msg, self.upd, strict=True):
            agg = self._aggregate(msg(h), src, dst)
            h = F.relu(upd(torch.cat([h, agg], -1)))
        return self.head(h)


class UNet(nn.Module):
    """A two-level U-Net: GroupNorm, SiLU, max-pool down, nearest upsampling on one path
    and PixelShuffle on the other, skip concatenation; per-pixel logits [N, 4, H, W]."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(4, cout),
                                 nn.SiLU(), nn.Conv2d(cout, cout, 3, padding=1),
                                 nn.GroupNorm(4, cout), nn.SiLU())
        self.d1, self.d2, self.mid = block(3, 8), block(8, 16), block(16, 32)
        self.up2 = nn.Upsample(scale_factor=2, mode="nearest")
        self.red2 = nn.Conv2d(32, 16, 1)
        self.u2 = block(32, 16)
        self.up1 = nn.Sequential(nn.Conv2d(16, 32, 1), nn.PixelShuffle(2))  # 32 -> 8 ch
        self.u1 = block(16, 8)
        self.out = nn.Conv2d(8, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        m = self.mid(F.max_pool2d(s2, 2))
        y = self.u2(torch.cat([self.red2(self.up2(m)), s2], 1))
        y = self.u1(torch.cat([self.up1(y), s1], 1))
        return self.out(y)


class DLRM(nn.Module):
    """A DLRM-like recommender: a bottom MLP on dense features, two ``nn.EmbeddingBag``
    tables (mode sum over [N, bag] ids, mode mean over 1-D ids with per-sample offsets),
    pairwise dot-product interactions, a top MLP, 2-class logits."""

    def __init__(self, rows: int = 50, d: int = 16) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, d), nn.ReLU())
        self.bag_sum = nn.EmbeddingBag(rows, d, mode="sum")
        self.bag_mean = nn.EmbeddingBag(rows, d, mode="mean")
        self.top = nn.Sequential(nn.Linear(d + 3, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, dense: torch.Tensor, ids_a: torch.Tensor, ids_b: torch.Tensor,
                offsets_b: torch.Tensor) -> torch.Tensor:
        feats = torch.stack([self.bottom(dense), self.bag_sum(ids_a),
                             self.bag_mean(ids_b, offsets_b)], 1)          # [N, 3, d]
        inter = torch.bmm(feats, feats.transpose(1, 2))
        i, j = torch.triu_indices(3, 3, 1)
        return self.top(torch.cat([feats[:, 0], inter[:, i, j]], 1))


class CausalTCN(nn.Module):
    """A temporal convolutional network: Conv1d blocks with dilations 1, 2, 4 and causal
    (left) padding, residuals, per-step logits [N, T, classes]."""

    def __init__(self, cin: int = 6, width: int = 16, classes: int = 5) -> None:
        super().__init__()
        self.inp = nn.Conv1d(cin, width, 1)
        self.convs = nn.ModuleList([nn.Conv1d(width, width, 3, dilation=d) for d in (1, 2, 4)])
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # [N, C, T]
        h = self.inp(x)
        for conv in self.convs:
            pad = (conv.kernel_size[0] - 1) * conv.dilation[0]
            h = h + self.drop(F.relu(conv(F.pad(h, (pad, 0)))))
        return self.head(h.transpose(1, 2))


class OpsLM(nn.Module):
    """A token model of the ops hand-written models reach for: ``F.layer_norm`` without
    affine, ``F.scaled_dot_product_attention(is_causal=True)``, ``torch.einsum``, tanh GELU,
    ``torch.cumsum`` (a running mean over time); per-token logits [N, T, vocab]."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.w_o = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.w_1 = nn.Parameter(torch.randn(d, 2 * d) / d ** 0.5)
        self.w_2 = nn.Parameter(torch.randn(2 * d, d) / (2 * d) ** 0.5)
        self.out = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        b, t, d = x.shape
        q, k, v = self.qkv(F.layer_norm(x, (d,))).chunk(3, -1)
        q, k, v = (z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.einsum("bhtc,hcd->btd", a,
                             self.w_o.reshape(self.heads, d // self.heads, d))
        h = F.gelu(torch.einsum("btd,de->bte", F.layer_norm(x, (d,)), self.w_1),
                   approximate="tanh")
        x = x + torch.einsum("bte,ed->btd", h, self.w_2)
        steps = torch.arange(1, t + 1, dtype=x.dtype, device=x.device).reshape(1, t, 1)
        return self.out(x + torch.cumsum(x, 1) / steps)


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Spec:
    """A model: its constructor, input names, output name and loss (``ce``: cross-entropy
    over the last axis, ``ce1``: over axis 1, ``mse``: against ``target``, or ``mse_x``:
    against the first input (an autoencoder), ``none``: the output is the loss)."""

    make: object
    inputs: tuple[str, ...]
    loss: str
    output: str = "logits"


SPECS = {
    "vae": Spec(VAE, ("x",), "mse_x", "recon"),
    "vae_loss": Spec(lambda: VAE(own_loss=True), ("x",), "none", "loss"),
    "dcgan_g": Spec(Generator, ("z",), "mse", "image"),
    "encoder_post": Spec(lambda: EncoderClassifier(norm_first=False), ("ids", "pad"), "ce"),
    "encoder_pre": Spec(lambda: EncoderClassifier(norm_first=True), ("ids", "pad"), "ce"),
    "mha": Spec(MHAClassifier, ("x",), "ce"),
    "video3d": Spec(Video3d, ("video",), "ce"),
    "gnn_index_add": Spec(lambda: MessagePassing("index_add"), ("x", "src", "dst"), "ce"),
    "gnn_scatter_add": Spec(lambda: MessagePassing("scatter_add"), ("x", "src", "dst"), "ce"),
    "unet": Spec(UNet, ("x",), "ce1"),
    "dlrm": Spec(DLRM, ("dense", "ids_a", "ids_b", "offsets_b"), "ce"),
    "tcn": Spec(CausalTCN, ("x",), "ce"),
    "ops_lm": Spec(OpsLM, ("ids",), "ce"),
}

# name, model, exporter (torchscript / dynamo / dynamo_noopt), train?, batch, dynamic batch?
CASES = [
    ("vae.ts.train", "vae", "torchscript", True, 256, False),
    ("vae.noopt.train", "vae", "dynamo_noopt", True, 256, False),
    ("vae_loss.dynamo.train", "vae_loss", "dynamo", True, 256, False),
    ("vae_loss.ts.train", "vae_loss", "torchscript", True, 256, False),
    ("dcgan_g.ts.train", "dcgan_g", "torchscript", True, 128, False),
    ("dcgan_g.noopt.train", "dcgan_g", "dynamo_noopt", True, 128, False),
    ("encoder_post.ts.train", "encoder_post", "torchscript", True, 32, False),
    ("encoder_post.noopt.train", "encoder_post", "dynamo_noopt", True, 32, False),
    ("encoder_pre.dynamo.train", "encoder_pre", "dynamo", True, 32, False),
    ("encoder_pre.ts.eval", "encoder_pre", "torchscript", False, 32, False),
    ("mha.ts.train", "mha", "torchscript", True, 64, False),
    ("mha.noopt.train.dyn", "mha", "dynamo_noopt", True, 64, True),
    ("video3d.ts.train", "video3d", "torchscript", True, 8, False),
    ("video3d.noopt.train", "video3d", "dynamo_noopt", True, 8, False),
    ("gnn_index_add.ts.train", "gnn_index_add", "torchscript", True, 64, False),
    ("gnn_index_add.noopt.train", "gnn_index_add", "dynamo_noopt", True, 64, False),
    ("gnn_scatter_add.dynamo.train", "gnn_scatter_add", "dynamo", True, 64, False),
    ("gnn_scatter_add.ts.train", "gnn_scatter_add", "torchscript", True, 64, False),
    ("unet.ts.train", "unet", "torchscript", True, 8, False),
    ("unet.dynamo.train.dyn", "unet", "dynamo", True, 8, True),
    ("unet.noopt.eval", "unet", "dynamo_noopt", False, 8, False),
    ("dlrm.ts.train", "dlrm", "torchscript", True, 256, False),
    ("dlrm.noopt.train", "dlrm", "dynamo_noopt", True, 256, False),
    ("dlrm.dynamo.train", "dlrm", "dynamo", True, 256, False),
    ("tcn.ts.train", "tcn", "torchscript", True, 64, False),
    ("tcn.noopt.train", "tcn", "dynamo_noopt", True, 64, False),
    ("ops_lm.ts.train", "ops_lm", "torchscript", True, 32, False),
    ("ops_lm.noopt.train", "ops_lm", "dynamo_noopt", True, 32, False),
    ("ops_lm.dynamo.eval", "ops_lm", "dynamo", False, 32, False),
]


def batch(model: str, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` samples for a model: its inputs (valid ids, edges, offsets; a padding mask with
    the last 0-7 tokens padded) and its labels or target, seeded."""
    rng = np.random.default_rng(seed)
    f32 = np.float32

    def normal(*shape):
        return rng.standard_normal(shape, dtype=f32)
    if model.startswith("vae"):
        x = rng.random((n, 1, 16, 16), dtype=f32)
        return {"x": x} if model == "vae_loss" else {"x": x, "target": x.copy()}
    if model == "dcgan_g":
        return {"z": normal(n, 16, 1, 1), "target": np.tanh(normal(n, 3, 16, 16))}
    if model.startswith("encoder"):
        pad = np.arange(16)[None, :] >= 16 - rng.integers(0, 8, (n, 1))
        return {"ids": rng.integers(0, 100, (n, 16)), "pad": pad,
                "labels": rng.integers(0, 5, (n,))}
    if model == "mha":
        return {"x": normal(n, 12, 8), "labels": rng.integers(0, 7, (n, 12))}
    if model == "video3d":
        return {"video": normal(n, 3, 8, 16, 16), "labels": rng.integers(0, 10, (n,))}
    if model.startswith("gnn"):
        return {"x": normal(n, 10, 8), "src": rng.integers(0, 10, (n, 24)),
                "dst": rng.integers(0, 10, (n, 24)), "labels": rng.integers(0, 4, (n, 10))}
    if model == "unet":
        return {"x": normal(n, 3, 32, 32), "labels": rng.integers(0, 4, (n, 32, 32))}
    if model == "dlrm":
        return {"dense": normal(n, 13), "ids_a": rng.integers(0, 50, (n, 3)),
                "ids_b": rng.integers(0, 50, (2 * n,)), "offsets_b": 2 * np.arange(n),
                "labels": rng.integers(0, 2, (n,))}
    if model == "tcn":
        return {"x": normal(n, 6, 20), "labels": rng.integers(0, 5, (n, 20))}
    return {"ids": rng.integers(0, 64, (n, 16)), "labels": rng.integers(0, 64, (n, 16))}


def build_flags(case: tuple) -> list[str]:
    name, model, exporter, train, n, dyn = case
    loss = SPECS[model].loss
    flags = {"ce": [], "ce1": ["--class-axis", "1"], "mse": ["--loss", "mse"],
             "mse_x": ["--loss", "mse"], "none": ["--loss", "none"]}[loss]
    return flags + (["--dim", f"batch={n}"] if dyn else [])


def export(case: tuple, path: Path, model: nn.Module | None = None) -> nn.Module:
    """Export a case as a user would; returns the module (made from seed 0 if not given)."""
    name, mname, exporter, train, n, dyn = case
    spec = SPECS[mname]
    torch.manual_seed(0)
    model = model or spec.make()
    model.train(train)
    data = batch(mname, n)
    args = tuple(torch.from_numpy(data[k]) for k in spec.inputs)
    if exporter == "torchscript":
        axes = {k: {0: "batch"} for k in (*spec.inputs, spec.output)} if dyn else None
        torch.onnx.export(model, args, str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING if train
                          else torch.onnx.TrainingMode.EVAL, input_names=list(spec.inputs),
                          output_names=[spec.output], opset_version=17, dynamic_axes=axes)
    else:
        kw = {}
        if dyn:
            b = torch.export.Dim("batch")
            kw["dynamic_shapes"] = tuple({0: b} for _ in args)
        torch.onnx.export(model, args, str(path), dynamo=True, optimize=exporter == "dynamo",
                          input_names=list(spec.inputs), output_names=[spec.output], **kw)
    return model


# --------------------------------------------------------------------------- commands
def _report(path: Path) -> dict:
    rep = json.loads(path.read_text())
    v = rep.get("verification") or {}
    return {"budget_mb": round(rep["budget_bytes"] / MB, 2),
            "plan_mb": round(rep["plan"]["peak_bytes"] / MB, 2),
            "verify": v.get("ok"), "measured_mb": v.get("measured_peak_bytes") and
            round(v["measured_peak_bytes"] / MB, 2)}


def commands(case: tuple, w: Path, src: Path, timeout: float) -> dict:
    """build, compile min and 70% with --verify, run and train 2 steps; one process each."""
    row: dict = {}
    step = w / "step.onnx"
    flags = build_flags(case)
    rc, s, out, err = _memcc(["build", str(src), "-o", str(step), *flags], timeout)
    row["build"] = f"ok {s:.0f} s" if rc == 0 else _fail(rc, err)
    if rc:
        return row
    for key, budget in (("min", "min"), ("70%", "70%")):
        out_path = w / f"c{key.rstrip('%')}.onnx"
        rc, s, out, err = _memcc(["compile", str(step), "--budget", budget, "--verify",
                                  "--time-limit", "20", "-o", str(out_path)], timeout)
        rep = out_path.with_suffix(".report.json")
        row[key] = {**(_report(rep) if rep.exists() else {}), "s": round(s, 1),
                    **({} if rc == 0 else {"rc": rc, "err": _fail(rc, err)})}
    rc, s, out, err = _memcc(["run", str(step), "--steps", "2", "--json"], timeout)
    if rc == 0:
        r = json.loads(out[out.rfind("\n{") + 1:] if "\n{" in out else out[out.find("{"):])
        row["run"] = {"losses": [round(x, 4) for x in r["losses"]], "s": round(s, 1)}
    else:
        row["run"] = _fail(rc, err)
    data = w / "data.npz"
    np.savez(data, **batch(case[1], 4 * case[4], seed=1))
    rc, s, out, err = _memcc(["train", str(step), "--data", str(data), "--steps", "2",
                              "--json"], timeout)
    if rc == 0:
        r = json.loads(out[out.rfind("\n{") + 1:] if "\n{" in out else out[out.find("{"):])
        row["train"] = {"losses": [round(x, 4) for x in r["losses"]], "s": round(s, 1)}
    else:
        row["train"] = _fail(rc, err)
    return row


# --------------------------------------------------------------------------- gradients
def _torch_loss(spec: Spec, model: nn.Module, feeds: dict, dtype: torch.dtype,
                noise: np.ndarray | None) -> torch.Tensor:
    args = [torch.from_numpy(feeds[k]) for k in spec.inputs]
    args = [a.to(dtype) if a.is_floating_point() else a for a in args]
    real = torch.randn_like
    if noise is not None:
        torch.randn_like = lambda t, **kw: torch.from_numpy(noise).to(t.dtype)
    try:
        y = model(*args)
    finally:
        torch.randn_like = real
    if spec.loss == "none":
        return y
    if spec.loss.startswith("mse"):
        target = args[0] if spec.loss == "mse_x" else torch.from_numpy(feeds["target"])
        return F.mse_loss(y, target.to(dtype))
    labels = torch.from_numpy(feeds["labels"])
    if spec.loss == "ce":
        return F.cross_entropy(y.reshape(-1, y.shape[-1]), labels.reshape(-1))
    return F.cross_entropy(y, labels)


def _torch_grads(spec, model, feeds, dtype, noise):
    m = copy.deepcopy(model).to(dtype)
    loss = _torch_loss(spec, m, feeds, dtype, noise)
    loss.backward()
    return float(loss), {n: p.grad.double().numpy() for n, p in m.named_parameters()
                         if p.grad is not None}


def _run_step(step, path: Path, feeds: dict, extra: list[str]) -> dict[str, np.ndarray]:
    """The step's outputs on ``feeds``, plus the values named in ``extra`` (made outputs)."""
    import onnx
    import onnxruntime as ort

    from memcc.backend.onnx_file import save_graph
    model = onnx.load(str(save_graph(step, path)))
    for name in extra:
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    onnx.save(model, str(path))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    fed = {i.name for i in sess.get_inputs()}
    return dict(zip([o.name for o in sess.get_outputs()],
                    sess.run(None, {k: v for k, v in feeds.items() if k in fed}), strict=True))


def grads(case: tuple) -> dict:
    """memcc's loss and gradients (--optimizer none) against torch's, fp32 and fp64."""
    import onnx

    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    name, mname, exporter, train, n, dyn = case
    spec = SPECS[mname]
    torch.manual_seed(0)
    model = _deterministic(spec.make()).train(train)
    feeds = batch(mname, n)
    loss = {"ce": "cross-entropy", "ce1": "cross-entropy", "mse_x": "mse"}.get(spec.loss, spec.loss)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.onnx"
        export(case, path, model)
        noise = [nd.output[0] for nd in onnx.load(str(path)).graph.node
                 if nd.op_type in ("RandomNormalLike", "RandomNormal")]
        step = build_training_step(
            load_graph(path, {"batch": n} if dyn else None),
            BuildOptions(optimizer="none", loss=loss,
                         **({"class_axis": 1} if spec.loss == "ce1" else {})))
        out = _run_step(step, Path(tmp) / "s.onnx", feeds, noise)
    eps = out[noise[0]] if noise else None
    torch_values = {k: p.detach().numpy() for k, p in model.named_parameters()}
    memcc = {k[:-5]: v.astype(np.float64) for k, v in out.items() if k.endswith(".grad")
             and k[:-5] in torch_values and np.array_equal(
                 np.asarray(step.initializers[k[:-5]]).reshape(-1),
                 torch_values[k[:-5]].reshape(-1))}
    loss32, g32 = _torch_grads(spec, model, feeds, torch.float32, eps)
    loss64, g64 = _torch_grads(spec, model, feeds, torch.float64, eps)
    return {"loss_memcc": float(out["loss"]), "loss_torch32": loss32, "loss_torch64": loss64,
            "compared": len(set(memcc) & set(g64)), "of": len(g64),
            "vs32": _worst(memcc, g32), "vs64": _worst(memcc, g64), "t32_vs_64": _worst(g32, g64)}


def _grads_cell(r: dict) -> str:
    return (f"loss {r['loss_memcc']:.5f}/{r['loss_torch32']:.5f}, {r['compared']} of {r['of']},"
            f" fp32 {r['vs32'][0]:.1e}, fp64 {r['vs64'][0]:.1e} ({r['vs64'][1]}),"
            f" torch fp32 vs fp64 {r['t32_vs_64'][0]:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    ap.add_argument("--skip-commands", action="store_true")
    ap.add_argument("--skip-grads", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines, one row per case")
    a = ap.parse_args()
    wanted = set(a.cases.split(",")) if a.cases else None
    for case in CASES:
        if wanted is not None and case[0] not in wanted:
            continue
        w = a.work / case[0]
        w.mkdir(parents=True, exist_ok=True)
        row: dict = {"case": case[0]}
        t0 = time.perf_counter()
        try:
            export(case, w / "model.onnx")
            row["export"] = f"ok {time.perf_counter() - t0:.0f} s"
        except Exception as e:  # noqa: BLE001  (a row says why)
            row["export"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if row["export"].startswith("ok") and not a.skip_commands:
            row.update(commands(case, w, w / "model.onnx", a.timeout))
        if row["export"].startswith("ok") and not a.skip_grads:
            try:
                r = grads(case)
                row["grads"] = _grads_cell(r)
            except Exception as e:  # noqa: BLE001
                row["grads"] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(json.dumps(row), flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
