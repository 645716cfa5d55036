"""``memcc export --eval`` of a spectral-normed model computes what torch's eval mode does.

The forward exported in train mode runs the power iteration (``u = W v / |W v|``, then
``v``) before it divides the weight by ``u . W v``; torch's eval mode runs none and divides
by the vectors the last training step stored. The eval export kept the iteration, one more
from the trained weight: a walk-through measured the outputs 3.6e-3 to 3.4e-2 of their
largest off torch's eval of the same weights (a conv and a linear layer, 1 and 3
iterations, both spectral norms, 5 SGD steps); here the eval loss was 1.5e-2 and 1.6e-2
relative off. Eval mode now reads the stored vectors (``memcc/trainer/eval_mode.py``).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from sgd_steps import memcc_sgd_steps
from threads import run_at_threads

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep
from memcc.trainer.export import ExportRequest, export_weights

NORMS = {"parametrization": torch.nn.utils.parametrizations.spectral_norm,
         "hook": torch.nn.utils.spectral_norm}


class _Normed(torch.nn.Module):
    """A spectral-normed layer before a plain one; returns its loss, so that the step and
    the eval model read the same batch."""

    def __init__(self, norm: str) -> None:
        super().__init__()
        self.fc1 = NORMS[norm](torch.nn.Linear(4, 6))
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc(torch.tanh(self.fc1(x))), t)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_the_eval_export_reads_the_stored_vectors(norm: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    module = _Normed(norm)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(5, 4, generator=gen), "t": torch.randn(5, 3, generator=gen)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module), (), kwargs=inputs, dynamo=True,
                          optimize=False, verbose=False).save(str(tmp_path / "m.onnx"))
        step = build_training_step(load_graph(tmp_path / "m.onnx"), BuildOptions(
            loss="none", optimizer="sgd", lr=0.5, momentum=0.0))
    spec = TrainingStep.of(step)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        state = memcc_sgd_steps(step, feeds, 3, threads)[1]
        notes: list[str] = []
        weights = export_weights(step, spec, state, ExportRequest(tmp_path / "w.safetensors"))
        model = export_weights(step, spec, state, ExportRequest(tmp_path / "e.onnx",
                                                                eval_mode=True),
                               warn=notes.append)
        assert any("1 spectral norm(s) read their stored vectors" in n for n in notes), notes
        theirs = copy.deepcopy(module)
        theirs.load_state_dict({k: torch.from_numpy(v)
                                for k, v in load_file(str(weights)).items()})
        with torch.no_grad():
            want = float(theirs.eval()(**inputs))
        for got in run_at_threads(load_graph(model), feeds, threads=(1, 2)).values():
            np.testing.assert_allclose(float(next(iter(got.values()))), want, rtol=1e-6)
