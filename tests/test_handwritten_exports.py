"""Models users write by hand in PyTorch, as torch.onnx exports them
(benchmarks/handwritten_models.py runs the whole first-use sweep on them).

- ``nn.TransformerEncoder`` deep-copies its layer: its layers hold equal values until the
  first step, but torch trains them apart. memcc must not call them weight tying split by
  the exporter (``optimize=False``: two PyTorch names), and where TorchScript's eval-mode
  export stored one as an Identity of the other (memcc keeps them one tensor, since shared
  storage looks the same), it must say so and how to export them apart.
- ``nn.EmbeddingBag`` is exported as a Loop over the bags: the refusal must name the node
  and say what to write instead, with either exporter.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from exports import _quiet

from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph


class _Clones(torch.nn.Module):
    """Two deep-copied linear layers (as nn.TransformerEncoder makes its layers) and a head."""

    def __init__(self) -> None:
        super().__init__()
        layer = torch.nn.Linear(6, 6)
        self.layers = torch.nn.ModuleList([copy.deepcopy(layer) for _ in range(2)])
        self.head = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _export(module, args, path, **kw) -> None:
    torch.manual_seed(0)
    with _quiet():
        torch.onnx.export(module, args, str(path), input_names=["x"],
                          output_names=["logits"], **kw)


def _messages(path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_training_step(load_graph(path), BuildOptions(optimizer="none"))
    return [str(w.message) for w in caught]


def test_deep_copied_layers_are_not_called_tied_weights(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "clones.onnx"
    _export(_Clones().train(), (torch.randn(4, 6),), path, dynamo=True, optimize=False)
    msgs = _messages(path)
    assert not any("weight tying" in m for m in msgs), msgs


def test_torchscript_eval_dedup_of_deep_copied_layers_warns(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "clones_ts.onnx"
    _export(_Clones().eval(), (torch.randn(4, 6),), path, dynamo=False, opset_version=17)
    tied = [m for m in _messages(path) if "deep-copied" in m and "Identity" not in m]
    assert tied and "layers.1.weight -> layers.0.weight" in tied[0], tied
    assert "TrainingMode.TRAINING" in tied[0] and "optimize=False" in tied[0]


class _Bags(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(20, 4, mode="sum")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bag(x)


@pytest.mark.parametrize("dynamo", [False, True])
def test_embedding_bag_refusal_says_what_to_write_instead(tmp_path, dynamo):
    path = tmp_path / "bags.onnx"
    _export(_Bags().train(), (torch.randint(0, 20, (3, 5)),), path, dynamo=dynamo,
            **({"optimize": False} if dynamo else {"opset_version": 17}))
    with pytest.raises(InputError) as e:
        load_graph(path)
    msg = str(e.value)
    assert "node '" in msg and "nn.EmbeddingBag" in msg and ".sum(1)" in msg, msg
