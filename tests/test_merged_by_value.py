"""Parameters of different attributes that the dynamo exporter's optimizer merged by value.

With ``optimize=True`` the exporter stores initializers of equal values once. ConvNeXt-V2's
GRN holds ``weight`` and ``bias`` both zeros at init: the file keeps ``grn.weight`` and the
node written for ``add(mul, grn.bias)`` reads it (``Add(mul_1, grn.weight)``). memcc read a
merge only between parameters of one attribute (weight with weight), so it called
``grn.bias`` folded ("stays fixed at its value at export") while the step trained it as
``grn.weight``, and ``memcc export`` wrote no value for it: PyTorch with the exported
weights then computed another model than the exported ONNX one. The records pair them:
the FX node names one parameter no initializer holds, and its nodes read one initializer
it does not name, which the other parameter's own FX node reads.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import safetensors.torch
import torch
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions
from memcc.frontend.export_map import read_export_map
from memcc.frontend.export_signature import ExportWarning
from memcc.trainer import Trainer


class _Grn(torch.nn.Module):
    """``gamma * h + beta + h`` with ``gamma`` and ``beta`` both zeros at init."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        self.gamma = torch.nn.Parameter(torch.zeros(6))
        self.beta = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.head(self.gamma * h + self.beta + h)


def _export(tmp_path: Path) -> tuple[Path, torch.nn.Module, np.ndarray]:
    torch.manual_seed(0)
    module, x = _Grn().train(), torch.randn(4, 6)
    path = tmp_path / "grn.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=True,
                          input_names=["x"], output_names=["logits"], verbose=False)
    return path, module, x.numpy()


def _cli_export(step: Path, ckpt: Path, out: Path, *flags: str) -> None:
    r = CliRunner().invoke(app, ["export", str(step), "--checkpoint", str(ckpt), "-o",
                                 str(out), *flags])
    assert r.exit_code == 0, r.output


def test_a_bias_merged_into_a_weight_is_trained_and_written_as_one(tmp_path):
    path, module, x = _export(tmp_path)
    file = onnx.load(str(path))
    held = {t.name for t in file.graph.initializer}
    assert "gamma" in held and "beta" not in held  # the exporter merged them
    emap = read_export_map(file)
    assert emap is not None and emap.merged == {"gamma": ("beta",)}
    assert not emap.folded and not emap.unused
    step = tmp_path / "s.onnx"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        api.build(path, step, options=BuildOptions(optimizer="sgd", lr=0.5, momentum=0.0))
    said = " ".join(str(w.message) for w in caught)
    assert "beta" in said and "folded" not in said, said
    trainer = Trainer(step)
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    for _ in range(2):
        trainer.step({"x": x, "labels": labels})
    trainer.save(tmp_path / "ck")
    _cli_export(step, tmp_path / "ck", tmp_path / "w.safetensors")
    _cli_export(step, tmp_path / "ck", tmp_path / "eval.onnx", "--eval")
    saved = safetensors.torch.load_file(str(tmp_path / "w.safetensors"))
    assert torch.equal(saved["beta"], saved["gamma"]) and saved["gamma"].abs().max() > 0
    module.load_state_dict(saved, strict=False)
    module.eval()
    with torch.no_grad():
        want = module(torch.from_numpy(x)).numpy()
    sess = ort.InferenceSession(str(tmp_path / "eval.onnx"),
                                providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
