"""``BatchNorm(track_running_stats=False)`` exported by dynamo trains as torch trains it.

Without running statistics torch normalizes by the batch's in both modes
(``_native_batch_norm_legit.no_stats``), and the dynamo exporter writes that as an
inference-form ``BatchNormalization`` over a mean and a biased variance it computes just
before. A walk-through found memcc warning "the step trains with frozen statistics" and
taking those two values for constants: the forward was torch's, but the gradient lacked
their terms (the convolution before the norm 0.59 relative off torch after 2 SGD steps, the
loss 6.2e-4). The BatchNormalization gradient now passes into a mean and variance the
forward computes (``gradients/nn.py`` ``_statistics_grads``), and build says nothing.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from sgd_steps import memcc_sgd_steps, torch_sgd_steps

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_signature import ExportWarning
from memcc.frontend.load import load_graph

LR = 0.5
STEPS = 3


class _Untracked(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4, track_running_stats=False)
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.bn(self.conv(x))).mean((2, 3))
        return torch.nn.functional.mse_loss(self.fc(h), t)


@pytest.mark.parametrize("optimize", [False, True])
def test_batch_statistics_pass_their_gradient(tmp_path, optimize):
    torch.manual_seed(0)
    module = _Untracked()
    with torch.no_grad():  # a scale and shift of their own, so that their gradients show
        module.bn.weight.uniform_(0.5, 1.5)
        module.bn.bias.uniform_(-0.5, 0.5)
    gen = torch.Generator().manual_seed(1)
    inputs = {"x": torch.randn(3, 2, 5, 5, generator=gen), "t": torch.randn(3, 3, generator=gen)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module), (), kwargs=inputs, dynamo=True,
                          optimize=optimize, verbose=False).save(str(tmp_path / "m.onnx"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # no "frozen statistics"
        step = build_training_step(load_graph(tmp_path / "m.onnx"), BuildOptions(
            loss="none", optimizer="sgd", lr=LR, momentum=0.0))
    want_losses, want = torch_sgd_steps(module, inputs, STEPS, LR)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        got, state = memcc_sgd_steps(step, feeds, STEPS, threads)
        np.testing.assert_allclose(got, want_losses, rtol=1e-5)
        for name in ("conv.weight", "bn.weight", "bn.bias", "fc.weight"):
            old = module.state_dict()[name].numpy()
            np.testing.assert_allclose(state[name] - old, want[name] - old, rtol=1e-4,
                                       atol=1e-6, err_msg=name)
