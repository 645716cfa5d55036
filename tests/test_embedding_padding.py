"""``nn.Embedding(padding_idx=P)``: torch never passes the padding row a gradient.

ONNX's Gather has no padding row, so a step differentiating the Gather as written moves row
P wherever the batch holds token P (BERT's word embeddings have ``padding_idx`` =
``pad_token_id``). The dynamo exporter keeps P in the FX call it records on the Gather
(``aten.embedding.default(%w, %ids, P)``), and memcc's Gather rule zeroes the gradient of
the positions that read row P (``memcc/frontend/gradients/shape_ops.py`` ``padding_row``).
The TorchScript exporter drops P: README says so.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from onnx import helper
from threads import run_at_threads

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.gradients.shape_ops import padding_row
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep

LR = 0.5


class _Tagger(torch.nn.Module):
    """A token tagger whose output layer shares the embedding (weight tying): row 0 gets
    a gradient through the output layer, but none through the lookup."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4, padding_idx=0)
        self.out = torch.nn.Linear(4, 7, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.out(torch.tanh(self.emb(ids))), target)


def _inputs() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[0, 1, 2, 0], [3, 0, 5, 6]])  # token 0, the padding, three times
    return {"ids": ids, "target": torch.randn(2, 4, 7, generator=gen)}


def _torch_step(module: torch.nn.Module, inputs: dict[str, torch.Tensor]
                ) -> dict[str, np.ndarray]:
    m = copy.deepcopy(module)
    m(**inputs).backward()
    with torch.no_grad():
        return {n: (p - LR * p.grad).numpy() for n, p in m.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_padding_row_gets_no_gradient_from_the_lookup(tmp_path, tied):
    torch.manual_seed(0)
    module = _Tagger(tied)
    with torch.no_grad():  # a padding row that is not zero: its lookups still count forward
        module.emb.weight[0] = 0.3
    inputs = _inputs()
    path = tmp_path / "m.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (), kwargs=inputs, dynamo=True, optimize=False,
                          verbose=False).save(str(path))
    step = build_training_step(load_graph(path), BuildOptions(
        loss="none", optimizer="sgd", lr=LR, momentum=0.0))
    want = _torch_step(module, inputs)
    held = TrainingStep.of(step).state_dict_names()  # torch's name -> the step's (tied)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads, out in run_at_threads(step, feeds, threads=(1, 2)).items():
        for name, value in want.items():
            got = out[f"{held[name]}.new"]
            change = np.abs(value - module.state_dict()[name].numpy()).max()
            err = np.abs(got - value).max() / change
            assert err < 1e-5, (threads, name, err)
        row = out[f"{held['emb.weight']}.new"][0]
        if not tied:  # the padding row stays as it was, exactly
            np.testing.assert_array_equal(row, np.full(4, 0.3, np.float32))


def test_only_an_embedding_lookup_with_a_padding_row_is_masked():
    fx = "pkg.torch.onnx.fx_node"

    def gather(record: str, axis: int = 0):
        node = helper.make_node("Gather", ["w", "i"], ["y"], axis=axis)
        node.metadata_props.add(key=fx, value=record)
        return node

    call = ("%embedding : [num_users=1] = call_function[target=torch.ops.aten.embedding."
            "default](args = (%p_emb_weight, %ids, {}), kwargs = {{}})")
    assert padding_row(gather(call.format(3))) == 3
    assert padding_row(gather(call.format(-1))) is None  # torch's "no padding row"
    assert padding_row(gather(call.format(3), axis=1)) is None
    assert padding_row(helper.make_node("Gather", ["w", "i"], ["y"])) is None  # TorchScript
