"""`memcc export` of BatchNorm statistics the step does not train.

A BatchNorm in inference form (a dynamo export made in eval mode, or one the exporter's
optimizer wrote so) reads its running statistics as initializers the step keeps frozen: they
are no carried state, so a checkpoint does not hold them. `memcc export` to safetensors
looked each written weight up in the checkpoint alone and ended in a KeyError traceback;
it now writes the step's own value for them.

A fresh BatchNorm's statistics hold the same values as its weight and bias, and the dynamo
exporter's optimizer stores them once; those weights were then left untrained, taken for
statistics. The statistics get initializers of their own (``exported.statistics_apart``).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import safetensors.numpy
import torch
from torch import nn
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_signature import ExportWarning
from memcc.step import TrainingStep
from memcc.trainer import Trainer


class MixedConv(nn.Module):
    """MixNet's mixed convolution: two kernels' outputs joined, then BatchNorm. The BatchNorm
    follows a Concat, so the dynamo exporter's optimizer cannot fold it into a convolution
    and writes it in inference form."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3, padding=1, bias=False)
        self.b = nn.Conv2d(3, 4, 5, padding=2, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn(torch.cat([self.a(x), self.b(x)], 1)))
        return self.fc(y.mean((2, 3)))


def _export(tmp_path: Path, *, training: bool, fresh: bool) -> tuple[Path, nn.Module, np.ndarray]:
    torch.manual_seed(0)
    module = MixedConv()
    if not fresh:  # values of its own for every BatchNorm tensor (none merged by value)
        with torch.no_grad():
            module.bn.weight.uniform_(0.5, 1.5)
            module.bn.bias.normal_()
            module.bn.running_mean.normal_()
            module.bn.running_var.uniform_(0.5, 1.5)
    module.train(training)
    x = torch.randn(4, 3, 8, 8)
    path = tmp_path / "model.onnx"
    prog = torch.onnx.export(module, (x,), dynamo=True, optimize=True, verbose=False,
                             output_names=["logits"])
    prog.save(str(path), external_data=False)
    return path, module, x.numpy()


def _train_and_export(path: Path, x: np.ndarray, tmp_path: Path) -> tuple[Path, Path]:
    step = tmp_path / "step.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        api.build(path, step, options=BuildOptions(optimizer="sgd", lr=0.5, momentum=0.0))
    trainer = Trainer(step)
    for _ in range(2):
        trainer.step({"x": x, "labels": np.array([0, 1, 2, 0], np.int64)})
    trainer.save(tmp_path / "ck")
    weights, fwd = tmp_path / "w.safetensors", tmp_path / "fwd.onnx"
    for out in (weights, fwd):
        r = CliRunner().invoke(app, ["export", str(step), "--checkpoint", str(tmp_path / "ck"),
                                     "-o", str(out)])
        assert r.exit_code == 0, r.output
        assert "Traceback" not in r.output
    return weights, fwd


def _torch_and_onnx(module: nn.Module, weights: Path, fwd: Path, x: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The module with the written weights loaded (in the mode it was exported in), the
    exported ONNX model's logits, and the module's keys the file left out."""
    result = module.load_state_dict(
        {k: torch.from_numpy(v.copy()) for k, v in safetensors.numpy.load_file(
            str(weights)).items()}, strict=False)
    assert not result.unexpected_keys, result
    with torch.no_grad():
        theirs = module(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(str(fwd), providers=["CPUExecutionProvider"])
    ours = sess.run(None, {"x": x})[0]
    return theirs, ours, list(result.missing_keys)


def test_frozen_batchnorm_statistics_are_written_from_the_step(tmp_path):
    """An eval-mode dynamo export: the BatchNorm reads `bn.running_mean` and `bn.running_var`,
    which the step does not train or carry. They are written with the step's values (before:
    `KeyError: 'bn.running_mean'`), and the module loading the file in eval mode computes
    what the exported ONNX model does."""
    path, module, x = _export(tmp_path, training=False, fresh=False)
    stats = {k: module.state_dict()[k].numpy().copy() for k in ("bn.running_mean",
                                                              "bn.running_var")}
    weights, fwd = _train_and_export(path, x, tmp_path)
    written = safetensors.numpy.load_file(str(weights))
    for k, v in stats.items():
        np.testing.assert_array_equal(written[k], v)
    theirs, ours, missing = _torch_and_onnx(module, weights, fwd, x)
    assert set(missing) <= {"bn.num_batches_tracked"}, missing
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def _torch_trained(module: nn.Module, x: np.ndarray) -> dict[str, np.ndarray]:
    """``module`` trained as ``_train_and_export`` trains the step: two SGD steps (lr 0.5)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(module(torch.from_numpy(x)),
                                    torch.tensor([0, 1, 2, 0])).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("training", [True, False])
def test_statistics_stored_as_the_weights_are_given_their_own(tmp_path, training):
    """A fresh BatchNorm's running variance and mean hold its weight's ones and its bias's
    zeros, and the dynamo exporter's optimizer stores them once: `BatchNormalization(x,
    bn.weight, bn.bias, bn.bias, bn.weight)`. The weight and bias, read as statistics, were
    not trained (4 parameters, not 6), and in train mode the layer kept frozen statistics.
    The statistics get their own initializers under the buffers' names: the step trains
    what torch trains (in train mode with batch statistics and running statistics carried),
    and the module loading the file computes the exported ONNX model."""
    path, module, x = _export(tmp_path, training=training, fresh=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        graph = api.build(path, tmp_path / "check.onnx", options=BuildOptions())
    said = " ".join(str(w.message) for w in caught)
    assert "BatchNorm running statistic(s) as the weights" in said, said
    assert not any("folded them into the convolutions" in str(w.message) for w in caught)
    assert {"bn.weight", "bn.bias"} <= set(TrainingStep.of(graph).parameters)
    reference = _torch_trained(copy.deepcopy(module), x)
    weights, fwd = _train_and_export(path, x, tmp_path)
    written = safetensors.numpy.load_file(str(weights))
    for k in ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "fc.weight"):
        np.testing.assert_allclose(written[k], reference[k], rtol=1e-4, atol=1e-5, err_msg=k)
    assert not np.allclose(written["bn.weight"], 1.0)  # trained
    module.eval()  # the exported ONNX model as inference runs it, against torch's eval
    r = CliRunner().invoke(app, ["export", str(tmp_path / "step.onnx"), "--checkpoint",
                                 str(tmp_path / "ck"), "--eval", "-o", str(fwd)])
    assert r.exit_code == 0, r.output
    theirs, ours, missing = _torch_and_onnx(module, weights, fwd, x)
    assert set(missing) <= {"bn.num_batches_tracked"}, missing
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
