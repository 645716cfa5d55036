"""Constants the dynamo exporter's optimizer folded from buffers and sizes are not trained.

With ``optimize=True`` the optimizer folds what it can compute at export into made-up
initializers: the ones and zeros ``InstanceNorm2d`` without affine and ``LayerNorm(
elementwise_affine=False)`` are written with (``val_3`` <- ``['conv2d', 'val_0', ...]``,
the activation's shape), ``BCEWithLogitsLoss``'s ``pos_weight - 1`` (``sub`` <- the buffer).
memcc trained them as parameters under made-up names, so from the second step on the model
was another one than torch's. Their ``folded_from`` records name no parameter
(``memcc/frontend/export_map.py`` ``_folded_constants``): they are constants now.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import torch
from sgd_steps import memcc_sgd_steps, torch_sgd_steps

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_map import read_export_map
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep

LR = 0.5


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.norm = torch.nn.InstanceNorm2d(4)
        self.ln = torch.nn.LayerNorm(4, elementwise_affine=False)
        self.head = torch.nn.Linear(4, 5)
        self.loss = torch.nn.BCEWithLogitsLoss(pos_weight=torch.linspace(0.5, 2.0, 5))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.norm(self.conv(x)).mean((2, 3)))
        return self.loss(self.head(h), y)


def test_folded_buffers_and_norm_constants_stay_fixed(tmp_path):
    torch.manual_seed(0)
    module = _Net()
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(2, 3, 6, 6, generator=gen),
              "y": (torch.rand(2, 5, generator=gen) > 0.5).float()}
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (), kwargs=inputs, dynamo=True, optimize=True,
                          verbose=False).save(str(path))
    model = onnx.load(str(path))
    emap = read_export_map(model)
    made_up = {t.name for t in model.graph.initializer
               if t.data_type == onnx.TensorProto.FLOAT} - set(module.state_dict())
    assert len(made_up) >= 3 and set(emap.constants) == made_up, (made_up, emap.constants)

    step = build_training_step(load_graph(path), BuildOptions(
        loss="none", optimizer="sgd", lr=LR, momentum=0.0))
    assert set(TrainingStep.of(step).state_dict_names()) == {
        n for n, _ in module.named_parameters()}
    assert set(TrainingStep.of(step).parameter_sources()) == {
        "conv.weight", "conv.bias", "head.weight", "head.bias"}
    want, _ = torch_sgd_steps(module, inputs, 3, LR)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        got, _ = memcc_sgd_steps(step, feeds, 3, threads)
        np.testing.assert_allclose(got, want, rtol=1e-5)
