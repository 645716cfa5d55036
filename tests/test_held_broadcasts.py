"""A value the dynamo exporter folded from a parameter broadcast trains as that parameter.

``nn.RNN`` exported with ``optimize=True`` runs its first step on the zero initial state:
``linear(zeros, weight_hh_l0, bias_hh_l0)`` is folded into ``linear_1`` [1, B, H], which is
``bias_hh_l0`` broadcast; the other steps read ``bias_hh_l0``. memcc trained ``linear_1`` as
a made-up parameter, so ``bias_hh_l0`` lacked the first step's gradient: a walk-through's
SGD step was 0.37 (relative) off torch's on it. The step now computes ``linear_1`` as
``Expand(bias_hh_l0)`` (``folded_values.recompute_held_broadcasts``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from sgd_steps import memcc_sgd_steps, torch_sgd_steps

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_map import FOLDED_FROM_PROP, literal_list, read_export_map
from memcc.frontend.folded_values import recompute_held_broadcasts
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.step import TrainingStep

LR = 0.5
STEPS = 3


class _Rnn(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.RNN(4, 6, batch_first=True)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.head(self.rnn(x)[0]), t)



def _folded_from_bias(model: onnx.ModelProto, emap) -> str:
    """The one initializer ``recompute_held_broadcasts`` takes in the RNN's export."""
    taken = set(recompute_held_broadcasts(_copy(model), emap).computed) - set(emap.computed)
    assert len(taken) == 1, taken
    return taken.pop()


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _zero(model: onnx.ModelProto, names: set[str]) -> None:
    for t in model.graph.initializer:
        if t.name in names:
            t.CopyFrom(onnx.numpy_helper.from_array(
                np.zeros_like(onnx.numpy_helper.to_array(t)), t.name))

class _CellOnce(torch.nn.Module):
    """A cell run once on ``hx=None``: its ``bias_hh`` is read at the zero state only."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.cell = getattr(torch.nn, kind)(4, 6)
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.cell(x)
        return torch.nn.functional.mse_loss(self.head(h[0] if isinstance(h, tuple) else h), t)


def _export(module: torch.nn.Module, inputs: dict, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (), kwargs=inputs, dynamo=True, optimize=True,
                          verbose=False).save(str(path))


def _build(path: Path) -> Graph:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_training_step(load_graph(path), BuildOptions(
            loss="none", optimizer="sgd", lr=LR, momentum=0.0))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[torch.nn.Module, dict, Path]:
    torch.manual_seed(0)
    module = _Rnn()
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(2, 5, 4, generator=gen), "t": torch.randn(2, 5, 3, generator=gen)}
    path = tmp_path_factory.mktemp("rnn") / "m.onnx"
    _export(module, inputs, path)
    return module, inputs, path


def test_rnn_first_step_bias_trains_as_the_bias(exported):
    module, inputs, path = exported
    step = _build(path)
    holder = TrainingStep.of(step).state_dict_names()["rnn.bias_hh_l0"]
    want_losses, want = torch_sgd_steps(module, inputs, STEPS, LR)
    old = module.rnn.bias_hh_l0.detach().numpy()
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        got, state = memcc_sgd_steps(step, feeds, STEPS, threads)
        np.testing.assert_allclose(got, want_losses, rtol=1e-5)
        np.testing.assert_allclose(state[holder] - old, want["rnn.bias_hh_l0"] - old, rtol=1e-4,
                                   atol=1e-6)
    sources = TrainingStep.of(step).parameter_sources()
    assert [op[:7] for op in sources[holder].get("folded_copies", {}).values()] == ["Expand("]


def test_a_constant_filled_fold_is_left_as_found(exported):
    """A zero bias broadcasts to any zeros: the values cannot say the fold was the bias."""
    model = onnx.load(str(exported[2]))
    emap = read_export_map(model)
    folded = _folded_from_bias(model, emap)
    _zero(model, {folded, "rnn.bias_hh_l0"})
    assert recompute_held_broadcasts(model, emap).computed == emap.computed
    assert folded in {t.name for t in model.graph.initializer}


def test_a_fold_beside_a_held_zero_parameter_is_left_as_found(exported):
    """``b1 + b2`` with a zero ``b2`` equals ``b1`` broadcast too: which one gave the value
    (and so which gets the gradient) is not in the arrays."""
    model = onnx.load(str(exported[2]))
    emap = read_export_map(model)
    folded = _folded_from_bias(model, emap)
    record = next(p for v in model.graph.value_info if v.name == folded
                  for p in v.metadata_props if p.key == FOLDED_FROM_PROP)
    record.value = str([*literal_list(record.value), "rnn.bias_ih_l0"])
    assert _folded_from_bias(model, emap) == folded  # a random second bias: still taken
    _zero(model, {"rnn.bias_ih_l0"})
    assert recompute_held_broadcasts(model, emap).computed == emap.computed


@pytest.mark.parametrize("kind", ["RNNCell", "LSTMCell"])
def test_a_cell_run_once_trains_its_bias_once_not_per_batch_slot(tmp_path, kind):
    """No initializer holds ``bias_hh``: the folded ``linear`` [B, H] trains as one slot."""
    torch.manual_seed(0)
    module = _CellOnce(kind)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(3, 4, generator=gen), "t": torch.randn(3, 3, generator=gen)}
    _export(module, inputs, tmp_path / "m.onnx")
    step = _build(tmp_path / "m.onnx")
    want, _ = torch_sgd_steps(module, inputs, STEPS, LR)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        got, _ = memcc_sgd_steps(step, feeds, STEPS, threads)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    slots = [p for p, s in TrainingStep.of(step).parameter_sources().items()
             if p.endswith(".slot")]
    assert len(slots) == 1, slots
