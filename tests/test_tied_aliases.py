"""Tied parameters of a dynamo ``optimize=False`` export go back under every PyTorch name.

torch.export traces a tensor with several ``state_dict`` names (a tied embedding, BERT's
LM-head bias) through its last name's placeholder only, and the ONNX file holds that one
initializer. ``memcc export`` must still write the trained tensor under each of the
module's names, so that README's strict ``load_state_dict`` works: GPT-2's
``transformer.wte.weight`` (its module looks up ``lm_head.weight``), T5's
``shared.weight`` (the module that runs as ``encoder.embed_tokens``) and BERT's
``cls.predictions.bias`` (its ``decoder.bias``). ``memcc build`` must not call such an alias
untrained, and ``--freeze`` matches a parameter by any of its PyTorch names.
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
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import read_export_map
from memcc.frontend.export_signature import ExportWarning
from memcc.step import TrainingStep
from memcc.trainer import Trainer

BATCH, SEQ, VOCAB = 2, 8, 100
# model -> (a name the file holds, the tied aliases the module has for it)
TIED = {
    "gpt2": ("model.lm_head.weight", ["model.transformer.wte.weight"]),
    "bert_mlm": ("model.cls.predictions.decoder.bias", ["model.cls.predictions.bias"]),
    "t5": ("model.lm_head.weight", ["model.shared.weight", "model.encoder.embed_tokens.weight",
                                    "model.decoder.embed_tokens.weight"]),
}


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs, return_dict=True).logits


def _model(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A one-layer, width-32 transformers model with tied embeddings, and its inputs."""
    import transformers as T

    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    inputs = {"input_ids": ids, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.int64)}
    if name == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB,
                                           n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0))
    elif name == "bert_mlm":
        m = T.BertForMaskedLM(T.BertConfig(vocab_size=VOCAB, hidden_size=32,
                                           num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=64, max_position_embeddings=SEQ,
                                           hidden_dropout_prob=0.0,
                                           attention_probs_dropout_prob=0.0))
    else:  # eager attention: torch 2.13's export of T5's sdpa path fails on a view
        m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=VOCAB, d_model=32, d_ff=64,
                                                    d_kv=16, num_heads=2, num_layers=1,
                                                    num_decoder_layers=1, dropout_rate=0.0,
                                                    attn_implementation="eager"))
        inputs["decoder_input_ids"] = torch.roll(ids, 1, dims=1)
    return Logits(m).train(), inputs


def _export(module: nn.Module, inputs: dict[str, torch.Tensor], path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, (), kwargs=inputs, dynamo=True, optimize=False,
                                 output_names=["logits"], verbose=False)
    prog.save(str(path), external_data=False)
    return path


def _build(path: Path, out: Path, freeze: tuple[str, ...] = ()
           ) -> tuple[TrainingStep, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        graph = api.build(path, out, options=BuildOptions(optimizer="sgd", lr=0.5,
                                                          momentum=0.0, freeze=freeze))
    return TrainingStep.of(graph), [str(w.message) for w in caught
                                    if issubclass(w.category, ExportWarning)]


@pytest.mark.parametrize("name", list(TIED))
def test_tied_aliases_are_written_and_load_strictly(tmp_path, name):
    module, inputs = _model(name)
    path = _export(module, inputs, tmp_path / f"{name}.onnx")
    emap = read_export_map(onnx.load(str(path)))
    held, aliases = TIED[name]
    assert emap is not None and not emap.unused
    assert {n for names in emap.stands_for.values() for n in names} == set(module.state_dict())
    assert set(aliases) <= set(emap.stands_for[held])

    step, msgs = _build(path, tmp_path / "step.onnx")
    assert not any("not read by the exported model" in m for m in msgs), msgs
    assert set(aliases) <= set(step.parameter_sources()[held]["pytorch_names"])
    trainer = Trainer(tmp_path / "step.onnx")
    labels = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int64)
    trainer.step({**{k: v.numpy() for k, v in inputs.items()}, "labels": labels})
    trained = torch.from_numpy(trainer.parameters()[held])
    weights = trainer.export(tmp_path / "w.safetensors")

    fresh = _model(name)[0]
    fresh.load_state_dict(safetensors.torch.load_file(str(weights)), strict=True)
    state = fresh.state_dict()
    assert not torch.equal(trained, module.state_dict()[held])  # trained, not as exported
    for n in (held, *aliases):
        assert torch.equal(state[n], trained), n


def test_freeze_matches_a_tied_alias(tmp_path):
    """GPT-2's dynamo export holds the tied embedding as lm_head.weight: a pattern for
    transformer.wte freezes it; one matching nothing names the aliases in its error."""
    module, inputs = _model("gpt2")
    path = _export(module, inputs, tmp_path / "gpt2.onnx")
    step, _ = _build(path, tmp_path / "step.onnx", freeze=("model.transformer.wte*",))
    assert "model.lm_head.weight" not in step.parameters
    assert "model.transformer.wpe.weight" in step.parameters
    with pytest.raises(InputError, match="matches no trainable parameter") as err:
        _build(path, tmp_path / "step2.onnx", freeze=("model.transformer.wtx*",))
    assert "model.lm_head.weight = model.transformer.wte.weight" in str(err.value)


class _Spare(nn.Module):
    """A module its parent never calls, and a head with an unread parameter of its own
    beside two children with one of that name: no record says whose alias either is."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 3)
        self.spare = nn.Linear(4, 3)
        self.head = nn.Module()
        self.head.a, self.head.b = nn.Linear(3, 3), nn.Linear(3, 3)
        self.head.bias = nn.Parameter(torch.zeros(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.b(self.head.a(self.used(x)))


def test_unread_parameters_without_a_known_alias_stay_unused(tmp_path):
    path = _export(_Spare(), {"x": torch.randn(2, 4)}, tmp_path / "spare.onnx")
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None
    assert emap.unused == ("head.bias", "spare.bias", "spare.weight")
