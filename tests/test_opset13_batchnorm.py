"""BatchNorm exported in training mode at opset 13 trains as in torch.

Before opset 14 ONNX's BatchNormalization has no ``training_mode``: TorchScript's
``training=TrainingMode.TRAINING, opset_version=13`` export writes the node with its
running-statistics outputs (and the saved mean and variance), which ORT runs with batch
statistics. memcc read it as frozen (gradients 67-88% off torch's), warned that it was in
inference form, and ``compile --budget min --verify`` crashed ORT. At load memcc now reads
such a model as opset 14 writes it (``memcc/frontend/batchnorm_opset13.py``).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from torch import nn

from memcc.backend.verify import step_outputs
from memcc.errors import InputError
from memcc.frontend import batchnorm_opset13
from memcc.frontend.batchnorm_opset13 import lift_training_batchnorm
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_signature import ExportNote, ExportWarning
from memcc.frontend.load import load_graph

RTOL = 1e-5


def _net() -> nn.Module:
    """Conv, BatchNorm, Relu twice (convs without bias: its gradient under a train-mode
    BatchNorm is zero but for rounding), and a Linear head."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                      nn.Conv2d(8, 6, 3, bias=False), nn.BatchNorm2d(6), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 5)).train()
    with torch.no_grad():  # statistics and affine parameters unlike the fresh ones
        for bn in (m[1], m[4]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return m


def _batch() -> dict[str, np.ndarray]:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(4, 3, 10, 10, generator=g).numpy(),
            "target": torch.randn(4, 5, generator=g).numpy()}


def _export(module: nn.Module, opset: int, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module), (torch.from_numpy(_batch()["x"]),), str(path),
                          dynamo=False, training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, opset_version=opset,
                          input_names=["x"], output_names=["out"])
    return path


def _step(path: Path):
    """The step (mse, no update), one run's outputs and the warnings of its build."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        step = build_training_step(load_graph(path), BuildOptions(loss="mse", optimizer="none"))
    return step, step_outputs(step, _batch(), "cpu"), caught


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-12)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[nn.Module, dict[int, Path]]:
    d = tmp_path_factory.mktemp("opset13_bn")
    module = _net()
    return module, {o: _export(module, o, d / f"m{o}.onnx") for o in (13, 14)}


def test_opset13_training_batchnorm_trains_as_torch(exported):
    """Loss, every gradient and the running statistics are torch's train-mode step's; the
    build notes the rewrite and no longer calls the BatchNorms inference form."""
    module, paths = exported
    file = onnx.load(str(paths[13]))
    assert file.opset_import[0].version == 13
    assert [len(n.output) for n in file.graph.node if n.op_type == "BatchNormalization"] == \
        [5, 5]
    step, out, caught = _step(paths[13])
    notes = [str(w.message) for w in caught if issubclass(w.category, ExportNote)]
    assert any("opset 13" in n and "2 such node(s)" in n for n in notes), notes
    assert not any("inference form" in str(w.message) for w in caught)
    assert step.opset >= 14
    m = copy.deepcopy(module).train()
    with torch.no_grad():  # the export ran the module once: start from the file's values
        for name, v in m.state_dict().items():
            if name in step.initializers:
                v.copy_(torch.from_numpy(np.array(step.initializers[name])))
    batch = _batch()
    loss = F.mse_loss(m(torch.from_numpy(batch["x"])), torch.from_numpy(batch["target"]))
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= RTOL * abs(loss.item())
    for name, p in m.named_parameters():
        err = _rel(out[f"{name}.grad"], p.grad.numpy())
        assert err <= RTOL, (name, err)
    for name in ("1", "4"):
        for stat in ("running_mean", "running_var"):
            err = _rel(out[f"{name}.{stat}.new"], getattr(m[int(name)], stat).numpy())
            assert err <= RTOL, (name, stat, err)


def test_opset13_step_is_opset14s(exported):
    """The same model exported at opset 14: the same step outputs, bit for bit."""
    _, paths = exported
    _, out13, _ = _step(paths[13])
    _, out14, _ = _step(paths[14])
    assert sorted(out13) == sorted(out14)
    for name, v in out14.items():
        assert np.array_equal(out13[name], v), (name, _rel(out13[name], v))


def test_opset13_compile_min_budget_verifies(exported, tmp_path):
    """``memcc compile --budget min --verify`` (which crashed ORT) plans and verifies it; a
    subprocess, so that a crash fails the test and not the run."""
    _, paths = exported
    r = subprocess.run(
        [sys.executable, "-m", "memcc", "compile", str(paths[13]), "--loss", "mse",
         "--budget", "min", "--verify", "--cost", "analytic", "--time-limit", "1",
         "-o", str(tmp_path / "c.memcc.onnx")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify   OK" in r.stdout, r.stdout


def _handwritten(outputs: list[str], graph_outputs: list[str], opset: int = 13,
                 after: str = "Relu") -> onnx.ModelProto:
    """x -> BatchNormalization(outputs) -> ``after``; ``graph_outputs`` beside its result."""
    c = 3
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [c], np.full(c, v, np.float32))
             for n, v in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0))]
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], outputs,
                              name="bn", momentum=0.9),
             helper.make_node(after, [outputs[0]], ["y"])]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
          for n in ["y", *graph_outputs]]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, c])], vi, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def test_read_saved_statistics_are_refused_naming_the_node():
    model = _handwritten(["y0", "rm", "rv", "sm", "sv"], ["sv"])
    with pytest.raises(InputError, match=r"BatchNormalization node 'bn'.*'sv'.*"
                                         r"opset_version >= 14"):
        lift_training_batchnorm(model, "m.onnx")


def test_unread_saved_statistics_are_dropped():
    model = _handwritten(["y0", "rm", "rv", "sm", "sv"], [])
    with pytest.warns(ExportNote):
        assert lift_training_batchnorm(model, "m.onnx") == ["BatchNormalization node 'bn'"]
    bn = model.graph.node[0]
    assert model.opset_import[0].version == 14
    assert list(bn.output) == ["y0", "rm", "rv"]
    assert helper.get_attribute_value(bn.attribute[-1]) == 1


@pytest.mark.parametrize("opset", [13, 14])
def test_inference_form_and_later_opsets_stay(opset):
    """A BatchNorm with Y alone, or any model past opset 13: left as it is."""
    for outputs in (["y0"], ["y0", "rm", "rv"]) if opset == 14 else (["y0"],):
        model = _handwritten(outputs, [], opset=opset)
        before = model.SerializeToString()
        assert lift_training_batchnorm(model, "m.onnx") == []
        assert model.SerializeToString() == before


def test_an_op_opset14_changed_is_refused(monkeypatch):
    """Were an op's meaning other at 14 (none is today), the model is refused, not bumped."""
    monkeypatch.setattr(batchnorm_opset13, "_SAME_AT_14",
                        batchnorm_opset13._SAME_AT_14 - {"Relu"})
    model = _handwritten(["y0", "rm", "rv"], [])
    with pytest.raises(InputError, match="uses Relu, which opset 14 changed"):
        lift_training_batchnorm(model, "m.onnx")
    assert model.opset_import[0].version == 13
