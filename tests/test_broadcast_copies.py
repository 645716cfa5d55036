"""A parameter the dynamo exporter folded broadcast to the batch trains once.

``optimize=True`` folds ``cls_token.expand(batch, -1, -1)`` (DeiT, ViT in train mode) into a
batch-sized initializer ``expand`` and drops ``cls_token``. memcc trained ``expand`` as a
made-up parameter of its own: every batch slot got its own token, and a walk-through's DeiT
gave 4 different answers for one image in 4 slots (spread 0.953). The step now computes
``expand`` as ``Expand(cls_token)`` (``folded_copies.recompute_broadcast_copies``).
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from exports import _quiet
from torch import nn
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import read_export_map
from memcc.frontend.export_signature import ExportNote, ExportWarning
from memcc.frontend.folded_copies import row_lookups
from memcc.step import TrainingStep
from memcc.trainer import Trainer

LR = 0.5
SGD = BuildOptions(optimizer="sgd", lr=LR, momentum=0.0)


class _ClsToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.cls_token = nn.Parameter(torch.randn(1, 1, 8, generator=g))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        h = torch.cat([cls, self.proj(x)], dim=1)
        return self.head(torch.tanh(h).mean(1))


def _export(tmp_path):
    torch.manual_seed(0)
    module = _ClsToken().train()
    x = torch.randn(4, 5, 8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "cls.onnx"
    with _quiet():
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"])
    return path, module, x.numpy()


def _cli(*args: str) -> str:
    r = CliRunner().invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return r.output


def _one_step_each(step_path, module: nn.Module, x: torch.Tensor, labels: np.ndarray,
                   tmp_path) -> tuple[Trainer, dict, str]:
    """One SGD step of the step by memcc (checkpointed and exported as safetensors) and the
    same step of ``module`` by torch (its gradients summed over the batch): the trainer, to
    go on, memcc's exported weights and what export said."""
    trainer = Trainer(step_path)
    trainer.step({"x": x.numpy(), "labels": labels})
    trainer.save(tmp_path / "ck1")
    nn.functional.cross_entropy(module(x), torch.from_numpy(labels)).backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= LR * p.grad
    said = _cli("export", str(step_path), "--checkpoint", str(tmp_path / "ck1"),
                "-o", str(tmp_path / "w1.safetensors"))
    return trainer, safetensors.torch.load_file(str(tmp_path / "w1.safetensors")), said


def _build_quietly(path: Path, step_path: Path):
    """``memcc build`` of ``path`` under plain SGD, its export warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        return api.build(path, step_path, options=SGD)


def test_a_token_broadcast_to_the_batch_trains_once_as_its_parameter(tmp_path):
    path, module, x = _export(tmp_path)
    emap = read_export_map(onnx.load(str(path)))
    assert "cls_token" in emap.folded  # as exported: "folded into constants"
    step_path = tmp_path / "s.onnx"
    graph = _build_quietly(path, step_path)
    params = TrainingStep.of(graph).parameters
    batch_sized = [t.name for t in onnx.load(str(path)).graph.initializer
                   if tuple(t.dims) == (4, 1, 8)]  # the folded expand
    assert batch_sized and "cls_token" in params and not set(batch_sized) & set(params)
    labels = np.array([0, 1, 2, 1], dtype=np.int64)
    # One SGD step, as torch takes it (the token's gradient summed over the batch).
    trainer, got, _ = _one_step_each(step_path, module, torch.from_numpy(x), labels,
                                     tmp_path)
    assert got["cls_token"].shape == module.cls_token.shape
    for name, p in module.state_dict().items():
        err = float((got[name] - p).abs().max() / p.abs().max())
        assert err <= 1e-4, f"{name}: {err:.2e} from torch's SGD step"
    for _ in range(3):
        trainer.step({"x": x, "labels": labels})
    trainer.save(tmp_path / "ck")
    for out, flags in (("w.safetensors", ()), ("eval.onnx", ("--eval",))):
        _cli("export", str(step_path), "--checkpoint", str(tmp_path / "ck"),
             "-o", str(tmp_path / out), *flags)
    module.load_state_dict(safetensors.torch.load_file(str(tmp_path / "w.safetensors")),
                           strict=True)
    sess = ort.InferenceSession(str(tmp_path / "eval.onnx"), providers=["CPUExecutionProvider"])
    same = np.repeat(x[:1], 4, axis=0)
    rows = sess.run(None, {sess.get_inputs()[0].name: same})[0]
    assert np.abs(rows - rows[0]).max() == 0.0, rows  # one token for every slot
    with torch.no_grad():
        theirs = module.eval()(torch.from_numpy(same)).numpy()
    assert np.abs(rows - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())


def test_a_copy_whose_first_axis_is_no_batch_is_not_taken_for_a_broadcast(tmp_path):
    """Only a copy whose first axis is an input's (the batch the exporter traced at) is a
    broadcast: a zero-initialized weight copied by some op fits one as well."""
    from memcc.frontend.folded_copies import recompute_broadcast_copies

    path, _, _ = _export(tmp_path)
    model = onnx.load(str(path))
    emap = read_export_map(model)
    assert recompute_broadcast_copies(onnx.load(str(path)), emap) is not emap
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 3  # another batch
    assert recompute_broadcast_copies(model, emap) is emap


class _Masked(nn.Module):
    """A mask computed from a buffer and sizes alone, expanded to the batch: the
    optimizer folds it into a batch-sized initializer (DeiT's ``val_78``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.register_buffer("pos", torch.arange(5).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (self.pos[None, :, None] < 3).float().expand(x.shape[0], -1, 8) * -1.0
        return self.fc(x + mask).mean(1)


def test_a_constant_repeated_over_the_batch_is_not_trained(tmp_path):
    """Trained as found, each batch slot got a mask of its own; torch computes the same
    constant every step (``folded_copies.constant_broadcasts``)."""
    torch.manual_seed(0)
    module = _Masked().train()
    x = torch.randn(4, 5, 8)
    path = tmp_path / "m.onnx"
    with _quiet():
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"])
    batch_sized = [t.name for t in onnx.load(str(path)).graph.initializer
                   if tuple(t.dims) == (4, 5, 8)]
    assert batch_sized  # the folded mask, as the exporter wrote it
    with pytest.warns(ExportNote, match="repeated over the batch"):
        graph = api.build(path, tmp_path / "s.onnx",
                          options=SGD)
    assert not set(batch_sized) & set(TrainingStep.of(graph).parameters)
    labels = np.array([0, 1, 2, 1], dtype=np.int64)
    _, got, _ = _one_step_each(tmp_path / "s.onnx", module, x, labels, tmp_path)
    for name in ("fc.weight", "fc.bias"):
        want = module.state_dict()[name]
        assert float((got[name] - want).abs().max()) <= 1e-5 * float(want.abs().max()), name


SEQ, OFFSET = 5, 2


class _Positions(nn.Module):
    """BART's learned positions in small: rows ``arange(S) + 2`` of a table, expanded to
    the batch. At static shapes the optimizer folds the lookup into a batch-sized
    initializer whose ``folded_from`` record names the table beside ``arange``, ``add``
    and ``index``: the rows, not the table ([12, 8])."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.pos = nn.Embedding(12, 8)
        with torch.no_grad():
            self.pos.weight.copy_(torch.randn(12, 8, generator=g))
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        p = self.pos.weight[torch.arange(s) + OFFSET].expand(b, -1, -1)
        return self.head(torch.tanh(self.proj(x) + p).mean(1))


@pytest.mark.parametrize("batch", [4, 1])
def test_a_folded_lookup_of_rows_trains_under_its_own_name_not_the_table_s(tmp_path, batch):
    """The lookup's rows train once for every batch slot, as torch's do, but under a
    made-up name: written under the table's name, the [1, 5, 8] rows made a strict=False
    load fail on the [12, 8] table (BART's ``embed_positions``). At batch 1 (GPT-2's
    ``wpe``, BERT's position table: no broadcast) the exporter's copy itself trains. Build
    and export say that the table is not written, naming it, and how to train it."""
    torch.manual_seed(0)
    module = _Positions().train()
    x = torch.randn(batch, SEQ, 8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "pos.onnx"
    with _quiet():
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"])
    batch_sized = [t.name for t in onnx.load(str(path)).graph.initializer
                   if tuple(t.dims) == (batch, SEQ, 8)]
    if not batch_sized:
        pytest.skip("this torch does not fold the position lookup at static shapes")
    step_path = tmp_path / "s.onnx"
    with pytest.warns(ExportWarning, match="pos.weight was folded into a lookup of some of "
                                           "its rows") as caught:
        graph = api.build(path, step_path, options=SGD)
    assert any("optimize=False" in str(w.message) for w in caught)
    params = TrainingStep.of(graph).parameters
    rows = f"{batch_sized[0]}.rows" if batch > 1 else batch_sized[0]
    assert "pos.weight" not in params and rows in params
    assert tuple(graph.initializers[rows].shape) == (1, SEQ, 8)  # one slot, shared
    labels = np.array([0, 1, 2, 1][:batch], dtype=np.int64)
    _, got, output = _one_step_each(step_path, module, x, labels, tmp_path)
    said = " ".join(output.split())
    assert "'pos.weight' (its rows trained as" in said and "not written" in said
    assert "optimize=False" in said
    assert "pos.weight" not in got
    # The rows trained as torch trains them: its table's rows 2..6 after the same step.
    want = module.pos.weight.detach()[OFFSET:OFFSET + SEQ]
    assert float((got[rows][0] - want).abs().max()) <= 1e-5 * float(want.abs().max())
    fresh = _Positions()
    result = fresh.load_state_dict(got, strict=False)  # failed on the table's shape
    assert result.missing_keys == ["pos.weight"] and result.unexpected_keys == [rows]
    assert torch.equal(fresh.pos.weight, _Positions().pos.weight)  # torch keeps its table
    model = onnx.load(str(path))
    assert row_lookups(model, read_export_map(model)) == {batch_sized[0]: "pos.weight"}


def test_a_broadcast_whose_parameter_has_another_size_is_a_lookup(tmp_path):
    """The record's names are the exporter's convention; where the file gives the folded
    parameter's shape too, a copy neither of whose sizes (whole, one slot) is the
    parameter's is no broadcast of it, whatever the record says."""
    path, _, _ = _export(tmp_path)
    model = onnx.load(str(path))
    emap = read_export_map(model)
    assert not row_lookups(model, emap)  # cls_token and constants: a broadcast
    model.graph.value_info.append(
        onnx.helper.make_tensor_value_info("cls_token", onnx.TensorProto.FLOAT, [2, 8]))
    assert row_lookups(model, emap) == {"expand": "cls_token"}


TYPES_SEQ, TYPES_D = 5, 8


class _TokenTypes(nn.Module):
    """BERT's token-type and position embeddings in small: a type table looked up at a
    buffer of zeros (``token_type_ids``) and a position table at a buffer ``arange(S)``
    (``position_ids``), both expanded to the batch. At static shapes the optimizer folds
    each lookup into an initializer [B, S, d]; the type lookup holds row 0 at every
    position."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.tok = nn.Embedding(2, TYPES_D)
        self.pos = nn.Embedding(TYPES_SEQ, TYPES_D)
        with torch.no_grad():
            self.tok.weight.copy_(torch.randn(2, TYPES_D, generator=g))
            self.pos.weight.copy_(torch.randn(TYPES_SEQ, TYPES_D, generator=g))
        self.register_buffer("ids", torch.zeros(1, TYPES_SEQ, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("pid", torch.arange(TYPES_SEQ).unsqueeze(0), persistent=False)
        self.head = nn.Linear(TYPES_D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = x + self.tok(self.ids.expand(b, s)) + self.pos(self.pid.expand(b, s))
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("batch", [4, 1])
def test_a_lookup_of_one_row_at_every_position_trains_one_vector(tmp_path, batch):
    """BERT's token-type lookup at a buffer of zeros holds row 0 at every position: torch
    trains that one row, its gradient summed over batch and positions, where memcc trained
    one copy per position (each its own step, none torch's). It now trains one vector
    ``Expand``-ed to the lookup's shape; the position lookup (a buffer of positions, rows
    all different) still trains one vector per position."""
    torch.manual_seed(0)
    module = _TokenTypes().train()
    x = torch.randn(batch, TYPES_SEQ, TYPES_D, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "types.onnx"
    with _quiet():
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"])
    model = onnx.load(str(path))
    folded = {p: n for n, p in row_lookups(model, read_export_map(model)).items()}
    if set(folded) != {"tok.weight", "pos.weight"}:
        pytest.skip("this torch does not fold the embedding lookups at static shapes")
    step_path = tmp_path / "s.onnx"
    graph = _build_quietly(path, step_path)
    params = TrainingStep.of(graph).parameters
    types = f"{folded['tok.weight']}.rows"
    positions = f"{folded['pos.weight']}.rows" if batch > 1 else folded["pos.weight"]
    assert types in params and positions in params
    labels = np.array([0, 1, 2, 1][:batch], dtype=np.int64)
    _, got, _ = _one_step_each(step_path, module, x, labels, tmp_path)
    # The type vector took torch's step for row 0 (summed over batch and positions).
    want = module.tok.weight.detach()[0]
    err = float((got[types].reshape(-1, TYPES_D) - want).abs().max() / want.abs().max())
    assert err <= 1e-6, f"token-type vector {err:.2e} from torch's row 0"
    assert tuple(got[types].shape) == (1, 1, TYPES_D)  # one vector, not one per position
    # The positions still train one row each: torch's rows 0..S-1 after the same step.
    want = module.pos.weight.detach()
    assert tuple(got[positions].shape) == (1, TYPES_SEQ, TYPES_D)
    err = float((got[positions][0] - want).abs().max() / want.abs().max())
    assert err <= 1e-6, f"position rows {err:.2e} from torch's"
    for name in ("head.weight", "head.bias"):
        want = module.state_dict()[name]
        assert float((got[name] - want).abs().max()) <= 1e-5 * float(want.abs().max()), name


@pytest.mark.parametrize("module_class,fill", [(_Positions, "zeros"),
                                               (_Positions, "one row"),
                                               (_TokenTypes, "zeros")])
def test_equal_positions_of_a_table_of_equal_rows_keep_one_vector_each(tmp_path,
                                                                      module_class, fill):
    """Equal positions do not prove one row: a position table whose rows are equal at
    export (zero-initialised, or one row repeated) looked up at ``arange(S)``
    (``_Positions``: the record names ``arange``) or a zero-initialised one at a buffer of
    positions (``_TokenTypes``' ``pid``: constant-filled) gives equal positions too, and
    torch trains each row apart. None is collapsed to one vector; nor is a zero-initialised
    type table, whose values cannot tell."""
    from memcc.frontend.folded_copies import recompute_broadcast_copies

    module = module_class().train()
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Embedding):
                m.weight.copy_(m.weight[:1].clone() if fill == "one row" else 0.0)
    x = torch.randn(4, SEQ, 8)
    path = tmp_path / "zero.onnx"
    with _quiet():
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"])
    model = onnx.load(str(path))
    emap = read_export_map(model)
    emap = replace(emap, lookups=row_lookups(model, emap))
    if not emap.lookups:
        pytest.skip("this torch does not fold the embedding lookups at static shapes")
    emap = recompute_broadcast_copies(model, emap)
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    assert {inits[n] for n in emap.lookups} == {(1, SEQ, 8)}, emap.lookups
