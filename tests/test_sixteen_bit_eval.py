"""``memcc export --eval`` of a float16 model compiled for the CPU.

ONNX Runtime's CPU provider has no float16 BatchNormalization (nor Where, Gemm, ...), so
``memcc compile`` computes those nodes in float32 between Casts
(``passes/providers/sixteen_bit.py``). The BatchNorm then reads its running statistics
through Casts (the variance also through PyTorch's unbiasing Muls, themselves between
Casts), and the counter Dropout's last node writes its output through a Cast. ``--eval``
did not see the statistics as carried and kept the node in training mode, saying
"nothing to change"; with a Dropout the export failed outright (the restored Dropout's
output was written again by the Cast of a value nothing computed anymore). A step from
``memcc build`` alone was right all along; these tests compile.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from memcc.cli import app

# float16 has 11 significant bits (a relative step of 2**-10, ~1e-3); the ONNX model
# rounds to float16 between nodes where torch's CPU kernels round elsewhere, through a
# convolution, a BatchNorm, a pooling and a linear layer: a few float16 steps of the
# largest output, 1e-2 of it. The train-mode answer is ~0.1 of it away (asserted).
FP16_TOLERANCE = 1e-2


def _invoke(*args) -> str:
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r.output


def _module(dropout: float) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
        torch.nn.Dropout(dropout) if dropout else torch.nn.Identity(),
        torch.nn.Linear(8, 5)).train().half()


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: x for i in sess.get_inputs()})[0].astype(np.float32)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_compiled_float16_step_exports_batchnorm_and_dropout_in_eval_form(exporter, dropout,
                                                                         tmp_path):
    module = _module(dropout)
    x = torch.randn(4, 3, 16, 16).half()
    src = tmp_path / "m.onnx"
    kw = dict(dynamo=True, optimize=False) if exporter == "dynamo" else dict(
        dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    torch.onnx.export(module, (x,), str(src), input_names=["x"], output_names=["out"], **kw)
    np.savez(tmp_path / "data.npz", x=x.numpy(), labels=np.array([0, 1, 2, 3]))
    step, ck = tmp_path / "s.onnx", tmp_path / "ck"
    said = _invoke("compile", src, "--budget", "min", "--cost", "analytic", "--optimizer",
                   "sgd", "--lr", "0.1", "-o", step)
    assert "BatchNormalization 1" in said, said  # computed in float32: what this is about
    _invoke("train", step, "--data", tmp_path / "data.npz", "--steps", "2",
            "--checkpoint", ck)

    said = _invoke("export", step, "--checkpoint", ck, "-o", tmp_path / "eval.onnx", "--eval")
    assert "1 BatchNorm(s) read their running statistics" in said, said
    assert ("1 Dropout(s) pass their input through" in said) == bool(dropout), said
    _invoke("export", step, "--checkpoint", ck, "-o", tmp_path / "train.onnx")
    _invoke("export", step, "--checkpoint", ck, "-o", tmp_path / "w.safetensors")

    nodes = onnx.load(tmp_path / "eval.onnx").graph.node
    assert [n.op_type for n in nodes].count("BatchNormalization") == 1
    assert not any(a.name == "training_mode" and a.i for n in nodes for a in n.attribute)

    weights = safetensors.torch.load_file(tmp_path / "w.safetensors")
    missing, unexpected = module.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing), \
        (missing, unexpected)
    # Training moved the running statistics off their initial values (0 and 1): the
    # comparison below holds the trained ones.
    assert module[1].running_mean.abs().max() > 1e-3
    module.eval()
    with torch.no_grad():
        want = module(x).float().numpy()
    scale = float(np.abs(want).max())
    got = _run(tmp_path / "eval.onnx", x.numpy())
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= FP16_TOLERANCE * scale, (got, want)
    # The train-mode model normalises by the batch: another answer (the test can fail).
    assert np.abs(_run(tmp_path / "train.onnx", x.numpy()) - want).max() > \
        3 * FP16_TOLERANCE * scale


class _MaskedDrops(torch.nn.Module):
    """Dropout written as random masks (dynamo's in-place ``bernoulli_`` and HuggingFace's
    ``drop_path``): compiled in float16 for the CPU, their Div, Less, Add, Floor and Mul
    compute in float32 between Casts, which ``--eval`` must see through to pass ``x`` on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc1(x))
        if self.training:
            y = y * y.new_empty((y.shape[0], 1)).bernoulli_(0.9).div_(0.9)
            y = y.div(0.8) * (0.8 + torch.rand((y.shape[0], 1), dtype=y.dtype)).floor()
        return self.fc2(x + y)


def test_compiled_float16_random_masks_pass_through_in_eval(tmp_path):
    torch.manual_seed(0)
    module = _MaskedDrops().train().half()
    x = torch.randn(4, 6).half()
    src, step, ck = tmp_path / "m.onnx", tmp_path / "s.onnx", tmp_path / "ck"
    torch.onnx.export(module, (x,), dynamo=True, optimize=False, input_names=["x"],
                      output_names=["logits"]).save(str(src))
    np.savez(tmp_path / "data.npz", x=x.numpy(), labels=np.array([0, 1, 2, 0]))
    _invoke("compile", src, "--budget", "min", "--cost", "analytic", "--optimizer", "sgd",
            "--lr", "0.1", "-o", step)
    _invoke("train", step, "--data", tmp_path / "data.npz", "--steps", "1", "--checkpoint", ck)
    said = _invoke("export", step, "--checkpoint", ck, "-o", tmp_path / "e.onnx", "--eval")
    assert "2 Dropout(s) pass their input through" in said, said
    _invoke("export", step, "--checkpoint", ck, "-o", tmp_path / "w.safetensors")
    module.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"))
    with torch.no_grad():
        want = module.eval()(x).float().numpy()
    got = _run(tmp_path / "e.onnx", x.numpy())
    assert np.abs(got - want).max() <= FP16_TOLERANCE * np.abs(want).max(), (got, want)
