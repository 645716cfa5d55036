"""TorchScript scope names that are no PyTorch module do not make up tied names.

``_read_scope_ties`` reads a tie from a node in a module without initializers of its own
that reads another module's parameter (GPT-2's ``/model/lm_head/Transpose`` on
``transformer.wte.weight``). TorchScript also names scopes that are no module: a module
called a second time runs under ``layer_1`` (ALBERT's one shared layer), and a
parametrization runs under the attribute it computes (weight norm's ``norm/weight/weight.0``
reads ``norm.parametrizations.weight.original0``). Those are the parameter's own module at
work: recorded as ties, they gave ``layer_1.weight`` and ``norm.weight.0.original0``, names
the module does not have, and a strict ``load_state_dict`` failed on them.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import safetensors.torch
import torch
from torch import nn

from memcc import api
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import read_export_map
from memcc.trainer import Trainer

VOCAB, BATCH, SEQ = 16, 2, 5


class Inner(nn.Module):
    """A module whose child its parent calls past it (OPT's causal-LM head calls
    ``self.model.decoder``: TorchScript's scope is ``model/decoder`` for the module
    ``model.model.decoder``)."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(8, 8)


class SharedLayer(nn.Module):
    """One layer run twice, a weight-normed layer, a module called past its parent, and a
    head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.emb = nn.Embedding(VOCAB, 8)
        self.layer = nn.Linear(8, 8)
        self.norm = nn.utils.parametrizations.weight_norm(nn.Linear(8, 8))
        self.head = nn.Linear(8, VOCAB, bias=False)  # GPT-2's lm_head: no bias
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.layer(torch.tanh(self.layer(self.emb(ids))))
        return self.head(self.norm(self.inner.decoder(x)))


def test_repeated_calls_and_parametrizations_load_strictly(tmp_path):
    torch.manual_seed(0)
    module = SharedLayer().train()
    path = tmp_path / "shared.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randint(0, VOCAB, (BATCH, SEQ)),), str(path),
                          dynamo=False, input_names=["ids"], output_names=["logits"],
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None  # the tied head is still read from the scopes
    names = {n for held in emap.stands_for.values() for n in held}
    assert names == set(module.state_dict()), names ^ set(module.state_dict())
    assert emap.stands_for["emb.weight"] == ("emb.weight", "head.weight")

    api.build(path, tmp_path / "step.onnx", options=BuildOptions(optimizer="sgd", lr=0.5))
    trainer = Trainer(tmp_path / "step.onnx")
    rng = np.random.default_rng(0)
    trainer.step({"ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64),
                  "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)})
    weights = safetensors.torch.load_file(str(trainer.export(tmp_path / "w.safetensors")))
    torch.manual_seed(0)
    fresh = SharedLayer()
    fresh.load_state_dict(weights, strict=True)
    trained = trainer.parameters()
    for name in ("layer.weight", "norm.parametrizations.weight.original0",
                 "inner.decoder.weight"):
        assert torch.equal(fresh.state_dict()[name], torch.from_numpy(trained[name])), name
        assert not torch.equal(fresh.state_dict()[name], module.state_dict()[name]), name
