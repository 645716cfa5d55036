"""What ``memcc export`` writes of a dynamo ``optimize=False`` export beyond its parameters.

A persistent buffer the model reads (BART's ``final_logits_bias``) is in the module's
``state_dict``, so the strict load README promises wants it: the step holds it as a
constant, and export writes that value under its name; a non-persistent buffer
(``position_ids``) is not written. A parameter no node reads, whose module has several
children with a parameter of its attribute (ALBERT's ``predictions.bias``: tied to
``decoder.bias``, beside ``dense.bias`` and ``LayerNorm.bias``), has no record saying which
it is a second name of: it is left out, and build and export name the candidates. A
second head off the loss path (torchvision's ``aux_classifier``), and weights ``--freeze``
keeps fixed, are in the step but not trained: export writes them with the values of the
exported model, as torch leaves them, so that a strict load finds them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import safetensors.torch
import torch
from torch import nn

from memcc import api
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import read_export_map
from memcc.frontend.export_signature import ExportWarning
from memcc.step import TrainingStep
from memcc.trainer import Trainer

VOCAB, BATCH, SEQ = 16, 2, 5


class Head(nn.Module):
    """ALBERT's MLM head in small: its own bias, tied to the decoder's."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(VOCAB))
        self.dense = nn.Linear(8, 8)
        self.decoder = nn.Linear(8, VOCAB)
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(torch.tanh(self.dense(x)))


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = Head()
        self.register_buffer("final_bias", torch.randn(1, VOCAB))  # persistent
        self.register_buffer("position_ids", torch.arange(SEQ), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids) + self.position_ids.unsqueeze(-1).to(torch.float32) * 0.01
        return self.head(x) + self.final_bias


def _export(path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    module = WithBuffers().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, (torch.randint(0, VOCAB, (BATCH, SEQ)),),
                                 input_names=["ids"], output_names=["logits"], dynamo=True,
                                 optimize=False, verbose=False)
    prog.save(str(path), external_data=False)
    return module, path


def _build(path: Path, out: Path) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        graph = api.build(path, out, options=BuildOptions(optimizer="sgd", lr=0.5))
    return graph, [str(w.message) for w in caught if issubclass(w.category, ExportWarning)]


def test_a_persistent_buffer_is_written_with_its_value(tmp_path):
    module, path = _export(tmp_path / "m.onnx")
    _build(path, tmp_path / "step.onnx")
    trainer = Trainer(tmp_path / "step.onnx")
    rng = np.random.default_rng(0)
    trainer.step({"ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64),
                  "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)})
    weights = safetensors.torch.load_file(str(trainer.export(tmp_path / "w.safetensors")))
    assert torch.equal(weights["final_bias"], module.final_bias)  # a constant: as exported
    assert "position_ids" not in weights  # not in the state_dict
    torch.manual_seed(0)
    fresh = WithBuffers()
    result = fresh.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["head.bias"] and not result.unexpected_keys


def test_an_unread_parameter_with_several_candidates_is_named_with_them(tmp_path):
    _, path = _export(tmp_path / "m.onnx")
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None and emap.unused == ("head.bias",)
    assert emap.maybe_tied == {"head.bias": ("head.decoder.bias", "head.dense.bias")}
    graph, msgs = _build(path, tmp_path / "step.onnx")
    told = [m for m in msgs if "not read by the exported" in m]
    assert told and "head.bias may be a second name of one of head.decoder.bias, " \
        "head.dense.bias" in told[0]
    assert TrainingStep.of(graph).folded_parameters() == {
        "head.bias": "unused; maybe a second name of one of head.decoder.bias, head.dense.bias"}


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_batchnorm_s_step_counter_is_no_warning_and_loads_strictly(tmp_path):
    """``num_batches_tracked`` is a persistent buffer the step does not keep; torch's
    BatchNorm loads a state_dict without it, strictly, so export does not warn of it (the
    persistent-buffer warning named it on every dynamo convnet)."""
    from memcc.trainer.export import export_checkpoint

    torch.manual_seed(0)
    module = WithBatchNorm().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, (torch.randn(BATCH, 3, 8, 8),), input_names=["x"],
                                 output_names=["logits"], dynamo=True, optimize=False)
    prog.save(str(tmp_path / "m.onnx"), external_data=False)
    _build(tmp_path / "m.onnx", tmp_path / "step.onnx")
    trainer = Trainer(tmp_path / "step.onnx")
    rng = np.random.default_rng(0)
    trainer.step({"x": rng.standard_normal((BATCH, 3, 8, 8)).astype(np.float32),
                  "labels": rng.integers(0, VOCAB, BATCH).astype(np.int64)})
    trainer.save(tmp_path / "ck")
    told: list[str] = []
    out = export_checkpoint(tmp_path / "step.onnx", tmp_path / "ck", tmp_path / "w.safetensors",
                            warn=told.append)
    assert not any("num_batches_tracked" in m for m in told)
    weights = safetensors.torch.load_file(str(out))
    WithBatchNorm().load_state_dict(weights, strict=True)


class TwoHeads(nn.Module):
    """A second output head off the loss path (the loss reads the first output only)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.aux = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.head(h), self.aux(h)


@pytest.mark.parametrize("case", ["torchscript", "dynamo", "dynamo-3d-optimized", "frozen"])
def test_weights_the_step_does_not_train_are_written_unchanged(tmp_path, case):
    """Left out, they made a strict load_state_dict fail, without a word from export. With
    ``optimize=True`` and 3-D input the second head's weight is a pre-transposed ``val_N``
    copy only: written back transposed under its name (``memcc.untrained_copies``)."""
    from memcc.trainer.export import export_checkpoint

    torch.manual_seed(0)
    module = TwoHeads().train()
    x = torch.randn(4, 5, 8) if case.endswith("3d-optimized") else torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(tmp_path / "m.onnx"), input_names=["x"],
                          output_names=["out", "aux"], dynamo=case.startswith("dynamo"),
                          optimize=case.endswith("optimized"))
        api.build(tmp_path / "m.onnx", tmp_path / "step.onnx",
                  options=BuildOptions(optimizer="sgd", lr=0.5,
                                       freeze=("body.*",) if case == "frozen" else ()))
    trainer = Trainer(tmp_path / "step.onnx")
    labels = np.array([0, 1, 2, 3], dtype=np.int64)
    for _ in range(2):
        trainer.step({"x": x.numpy(), "labels": labels[:, None].repeat(5, 1)
                      if x.ndim == 3 else labels})
    trainer.save(tmp_path / "ck")
    told: list[str] = []
    out = export_checkpoint(tmp_path / "step.onnx", tmp_path / "ck", tmp_path / "w.safetensors",
                            warn=told.append)
    weights = safetensors.torch.load_file(str(out))
    fresh = TwoHeads()
    fresh.load_state_dict(weights, strict=True)
    fixed = ("body", "aux") if case == "frozen" else ("aux",)
    for name, value in module.state_dict().items():
        same = torch.equal(weights[name], value)
        assert same == name.startswith(fixed), name  # the rest trained
    said = [m for m in told if "does not train" in m]
    assert said and all(f"{m}.weight" in said[0] for m in fixed), told
