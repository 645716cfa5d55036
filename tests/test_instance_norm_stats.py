"""``InstanceNorm(track_running_stats=True)`` exported in train mode is not called eval mode.

torch.export records no mutation of an ``InstanceNorm``'s running statistics in train mode
(eager torch updates them; the exported ``instance_norm`` normalizes each sample by its own
statistics and drops the update), so the signature looked like a BatchNorm exported in eval
mode, and build warned "exported with the module in eval mode ... trains with frozen
statistics": false, the step normalizes as torch does. It now says what is true: the
running statistics stay as exported (``memcc/frontend/norm_modes.py``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from memcc import api


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.InstanceNorm2d(4, affine=True, track_running_stats=True)
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x)))).square().mean()


def _build_warnings(tmp_path: Path, train: bool, optimize: bool) -> list[str]:
    torch.manual_seed(0)
    module = _Net().train(train)
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 3, 6, 6),), dynamo=True, optimize=optimize,
                          verbose=False).save(str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.build(path, tmp_path / "s.onnx", options=api.BuildOptions(loss="none"))
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("optimize", [False, True])
def test_train_mode_instance_norm_with_running_stats_is_not_called_eval_mode(tmp_path,
                                                                             optimize):
    said = _build_warnings(tmp_path, True, optimize)
    assert not [m for m in said if "eval mode:" in m], said
    assert [m for m in said if "1 InstanceNorm(track_running_stats=True) layer(s) (e.g. "
            "'norm') exported in train mode" in m], said


def test_eval_mode_instance_norm_is_still_called_eval_mode(tmp_path):
    said = _build_warnings(tmp_path, False, False)
    assert [m for m in said if "exported with the module in eval mode" in m], said
    assert not [m for m in said if "InstanceNorm(track_running_stats=True)" in m], said
