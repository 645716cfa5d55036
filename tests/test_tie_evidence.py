"""A tie between PyTorch names is inferred only where the file's records allow it.

The dynamo exporter's optimizer folds a position table's static-length lookup into a
constant (ALBERT's and BART's ``embedding_2``, recorded ``folded_from`` the table): the
table's placeholder is then read by no node, like the earlier name of a tied weight. It is
folded, not an alias of the tied word embedding that another ``nn.Embedding`` (same
parameter names) reads, and ``memcc export`` must not write the word embedding under its
name (a [256, 32] tensor under a [64, 32] name; where the shapes agree, a silent wrong load).
Where the file gives both tensors' shapes, a tie between different shapes is never made.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import safetensors.torch
import torch
from torch import nn

from memcc import api
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import FOLDED_FROM_PROP, read_export_map
from memcc.frontend.export_signature import ExportWarning
from memcc.frontend.folded_copies import row_lookups
from memcc.trainer import Trainer

VOCAB, BATCH, SEQ = 16, 2, 6


class TiedPositions(nn.Module):
    """ALBERT's embeddings in small: a word embedding tied to the decoder, and a position
    table of the same shape looked up at a static length."""

    def __init__(self) -> None:
        super().__init__()
        self.word, self.pos = nn.Embedding(VOCAB, 8), nn.Embedding(VOCAB, 8)
        self.register_buffer("position_ids", torch.arange(VOCAB).unsqueeze(0),
                             persistent=False)
        self.decoder = nn.Linear(8, VOCAB)
        self.decoder.weight = self.word.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.word(ids) + self.pos(self.position_ids[:, :ids.shape[1]]))


def _export(path: Path) -> tuple[nn.Module, Path]:
    torch.manual_seed(0)
    module = TiedPositions().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, (torch.randint(0, VOCAB, (BATCH, SEQ)),),
                                 input_names=["ids"], output_names=["logits"], dynamo=True,
                                 optimize=True, verbose=False)
    prog.save(str(path), external_data=False)
    return module, path


def test_a_folded_position_table_is_no_alias_of_the_tied_embedding(tmp_path):
    module, path = _export(tmp_path / "tp.onnx")
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None
    assert emap.stands_for["decoder.weight"] == ("decoder.weight", "word.weight")
    assert "pos.weight" in emap.folded
    assert not any("pos.weight" in names for names in emap.stands_for.values())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        api.build(path, tmp_path / "step.onnx", options=BuildOptions(optimizer="sgd", lr=0.5))
    # folded into a lookup of some of its rows (``ExportMap.lookups``), said as such
    folded = [str(w.message) for w in caught
              if "folded into a lookup of some of its rows" in str(w.message)]
    assert folded and "pos.weight was folded" in folded[0]
    lookups = row_lookups(onnx.load(str(path)), emap)
    assert lookups and set(lookups.values()) == {"pos.weight"}
    trainer = Trainer(tmp_path / "step.onnx")
    rng = np.random.default_rng(0)
    trainer.step({"ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64),
                  "labels": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)})
    weights = safetensors.torch.load_file(str(trainer.export(tmp_path / "w.safetensors")))
    assert "pos.weight" not in weights
    trained = torch.from_numpy(trainer.parameters()["decoder.weight"])
    assert torch.equal(weights["word.weight"], trained)
    torch.manual_seed(0)
    fresh = TiedPositions()
    result = fresh.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["pos.weight"]
    # the folded lookup (``embedding_1``), trained under the exporter's name: no PyTorch name
    assert all(k not in module.state_dict() for k in result.unexpected_keys)
    assert torch.equal(fresh.pos.weight, module.pos.weight)  # the table as exported


def test_no_tie_between_tensors_of_different_shapes(tmp_path):
    """Without the ``folded_from`` record only names are left, which would tie the table
    to the word embedding; a shape the file gives for it ([12, 8], the word embedding's
    being [16, 8]) rules the tie out, and the name is called unused instead."""
    _, path = _export(tmp_path / "tp.onnx")
    model = onnx.load(str(path))
    for v in model.graph.value_info:
        kept = [p for p in v.metadata_props if p.key != FOLDED_FROM_PROP]
        del v.metadata_props[:]
        v.metadata_props.extend(kept)
    model.graph.value_info.append(
        onnx.helper.make_tensor_value_info("pos.weight", onnx.TensorProto.FLOAT, [12, 8]))
    emap = read_export_map(model)
    assert emap is not None
    assert emap.stands_for["decoder.weight"] == ("decoder.weight", "word.weight")
    assert "pos.weight" in emap.unused
