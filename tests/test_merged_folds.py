"""Parameters whose folded constant the dynamo exporter's optimizer merged with another's.

DeiT's ``distillation_token`` and ``cls_token`` are both zeros at init: the optimizer folds
each ``token.expand(B, -1, -1)`` into a constant, stores the equal constants once, and the
``cat`` reads ``expand`` twice. memcc called the distillation token "not read by the
exported model" and trained it, unwarned, as the cls token. Mamba's ``A_log`` holds the same
``log(arange)`` table in every layer: layer 1's folded ``-exp(A_log)`` was merged into layer
0's, and memcc said layer 1's ``A_log`` was not read, where the step trains one value for
both (``memcc/frontend/merged_folds.py``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import safetensors.torch
import torch
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_signature import ExportWarning
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep
from memcc.trainer import Trainer

LR = 0.5


class _Tokens(torch.nn.Module):
    """Two zero tokens before the patches, as DeiT's distilled model has them."""

    def __init__(self) -> None:
        super().__init__()
        self.patch, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3)
        self.cls_token = torch.nn.Parameter(torch.zeros(1, 1, 8))
        self.dist_token = torch.nn.Parameter(torch.zeros(1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        h = torch.cat([self.cls_token.expand(b, -1, -1), self.dist_token.expand(b, -1, -1),
                       self.patch(x)], dim=1)
        return self.head(torch.tanh(h).mean(dim=1))


class _Decay(torch.nn.Module):
    """``x * -exp(A_log)`` with Mamba's ``A_log``, equal in every layer at init."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, 5, dtype=torch.float32)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x) * -torch.exp(self.A_log).unsqueeze(0))


class _Layers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Decay(), _Decay()])
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _export(module: torch.nn.Module, x: torch.Tensor, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"], verbose=False)


def _build(path: Path, step: Path) -> str:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        api.build(path, step, options=BuildOptions(optimizer="sgd", lr=LR, momentum=0.0))
    return " ".join(str(w.message) for w in caught)


def _train_and_export(step: Path, feeds: dict, tmp_path: Path) -> tuple[dict, str]:
    trainer = Trainer(step)
    for _ in range(2):
        trainer.step(feeds)
    trainer.save(tmp_path / "ck")
    out = tmp_path / "w.safetensors"
    r = CliRunner().invoke(app, ["export", str(step), "--checkpoint", str(tmp_path / "ck"),
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    return safetensors.torch.load_file(str(out)), r.output


def test_a_token_merged_into_the_cls_tokens_fold_is_named_and_written(tmp_path):
    torch.manual_seed(0)
    module, x = _Tokens().train(), torch.randn(2, 5, 4)
    path, step = tmp_path / "tokens.onnx", tmp_path / "s.onnx"
    _export(module, x, path)
    said = _build(path, step)
    assert "dist_token -> cls_token" in said and "optimize=False" in said, said
    assert "not read by the exported model" not in said, said
    labels = np.array([0, 2], dtype=np.int64)
    saved, _ = _train_and_export(step, {"x": x.numpy(), "labels": labels}, tmp_path)
    # Trained as one tied parameter, and written under both names: torch with the two
    # tokens one Parameter computes the same two SGD steps.
    tied = _Tokens()
    tied.load_state_dict(module.state_dict())
    tied.dist_token = tied.cls_token
    opt = torch.optim.SGD(tied.parameters(), lr=LR)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(tied(x), torch.from_numpy(labels)).backward()
        opt.step()
    want = tied.cls_token.detach()
    assert want.abs().max() > 0
    for name in ("cls_token", "dist_token"):
        assert torch.allclose(saved[name], want, rtol=1e-5, atol=1e-6), name


def test_a_table_merged_into_another_layers_fold_is_called_merged_not_unread(tmp_path):
    torch.manual_seed(0)
    module, x = _Layers().train(), torch.randn(4, 4)
    path, step = tmp_path / "layers.onnx", tmp_path / "s.onnx"
    _export(module, x, path)
    said = _build(path, step)
    assert "layers.1.A_log with layers.0.A_log (trained as one" in said, said
    assert "optimize=False" in said and "not read by the exported model" not in said, said
    kinds = TrainingStep.of(load_graph(step)).folded_parameters()
    assert kinds["layers.1.A_log"].startswith("merged; with layers.0.A_log"), kinds
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    _, output = _train_and_export(step, {"x": x.numpy(), "labels": labels}, tmp_path)
    assert "'layers.1.A_log' held the same values as another parameter" in output, output


class _Rms(torch.nn.Module):
    """Gemma's RMSNorm: ``x * (1 + weight)``, which the optimizer folds into ``add_N``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)
        self.weight = torch.nn.Parameter(0.1 * torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(h * (1.0 + self.weight))


def test_export_says_why_a_weight_folded_into_one_plus_weight_is_not_written(tmp_path):
    torch.manual_seed(0)
    module, x = _Rms().train(), torch.randn(4, 4)
    path, step = tmp_path / "rms.onnx", tmp_path / "s.onnx"
    _export(module, x, path)
    built = " ".join(_build(path, step).split())
    # build says the same, not "a lookup of some of its rows" (no table was looked up)
    assert "folded 1 PyTorch parameter(s) into values computed from them: " \
        "weight into 'add" in built, built
    assert "lookup of some of its rows" not in built, built
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    saved, output = _train_and_export(step, {"x": x.numpy(), "labels": labels}, tmp_path)
    assert "weight" not in saved
    said = " ".join(output.split())
    assert "'weight' was folded with constants the file does not keep" in said, said
    assert "optimize=False" in said and "rows it looked up" not in said, said
