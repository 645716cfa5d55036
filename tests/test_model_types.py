"""Models a user who already trains in 16 bits exports (``memcc/frontend/model_types.py``).

A twelfth walk-through found two: a model exported under ``torch.autocast`` built without a
word and its step failed at ``memcc run`` with ONNX Runtime's type error about a temporary
file (the exporter writes a LayerNorm's bfloat16 input beside its float32 weight, which
ONNX forbids; now computed in float32 as torch computes it, and other such mixes refused
at build); and a ``.half()`` model trained with AdamW went NaN from the second step,
silently, as torch's AdamW makes it (eps is 0 in float16).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper
from sgd_steps import memcc_sgd_steps

from memcc import api
from memcc.errors import InputError
from memcc.frontend.export_signature import ExportWarning
from memcc.frontend.load import load_graph
from memcc.passes.providers.sixteen_bit import for_provider
from memcc.trainer import Trainer


class Net(torch.nn.Module):
    """Linear, LayerNorm, ReLU, Linear: the LayerNorm is what autocast's export breaks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.ln = torch.nn.LayerNorm(32)
        self.fc2 = torch.nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.ln(self.fc1(x))))


def _export(module: torch.nn.Module, x: torch.Tensor, path: Path) -> Path:
    torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    return path


def _autocast_sgd(module: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor,
                  steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """torch's SGD (lr 0.1) of a copy of ``module`` run under CPU bfloat16 autocast."""
    m = copy.deepcopy(module)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x).float(), labels)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses, {k: v.detach().numpy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("threads", [1, 2])
def test_an_export_under_autocast_trains_as_torchs_autocast(tmp_path, threads):
    """Before: built, then ``run`` failed on "Type parameter (T) of Optype
    (LayerNormalization) bound to different types" in ``session.onnx``. The LayerNorm now
    computes in float32 and returns bfloat16, as torch's: 3 SGD steps within bfloat16's
    rounding of torch's under autocast (measured: losses 1e-7 relative, weights 1e-3 of their
    change, where torch's float32 steps are 2.5e-3 of it away)."""
    torch.manual_seed(0)
    module = Net()
    x, labels = torch.randn(4, 8), torch.randint(0, 5, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        path = _export(copy.deepcopy(module), x, tmp_path / "autocast.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.build(path, tmp_path / "step.onnx",
                  options=api.BuildOptions(lr=0.1, momentum=0.0))
    assert any("LayerNormalization node '/ln/LayerNormalization'" in str(w.message)
               for w in caught)
    step, _ = for_provider(load_graph(tmp_path / "step.onnx"), "cpu")
    losses, state = memcc_sgd_steps(step, {"x": x.numpy(), "labels": labels.numpy()}, 3,
                                    threads)
    want_losses, want = _autocast_sgd(module, x, labels, 3)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    start = module.state_dict()
    for name, value in want.items():
        change = float(np.abs(value - start[name].numpy()).max())
        assert np.abs(state[name] - value).max() <= 1e-2 * change, name


def test_a_mixed_binding_without_sixteen_bits_is_refused_without_the_autocast_hint(tmp_path):
    """Any op fed two types for one of its type parameters, not only autocast's."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    w = helper.make_tensor("w", TensorProto.DOUBLE, [3], np.ones(3))
    graph = helper.make_graph([helper.make_node("LayerNormalization", ["x", "w"], ["y"],
                                                name="norm")], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(InputError) as e:
        api.build(tmp_path / "m.onnx", tmp_path / "s.onnx", options=api.BuildOptions(loss="mse"))
    text = str(e.value)
    assert ("LayerNormalization node 'norm' binds its type T to 2 element types, float (x); "
            "double (w)") in text
    assert "autocast" not in text


def test_a_bfloat16_conv_the_loader_cannot_run_is_named_not_blamed_on_dim(tmp_path):
    """The dynamo exporter's autocast convnet (opset 20): shape inference leaves values
    unknown, the loader's run of the model to read them fails on the bfloat16 Conv, which
    Conv takes from opset 22 only. Before: "Check the sizes bound with --dim"."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                              torch.nn.Flatten(), torch.nn.Linear(4, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.onnx.export(net, (torch.randn(2, 3, 8, 8),), dynamo=True, optimize=False,
                          input_names=["x"], output_names=["logits"]).save(
                              str(tmp_path / "m.onnx"))
    with pytest.raises(InputError) as e:
        api.build(tmp_path / "m.onnx", tmp_path / "s.onnx")
    text = str(e.value)
    assert "Conv node" in text and "bfloat16" in text and "does not take at opset" in text
    assert "--precision bf16" in text and "--dim" not in text


def test_a_sixteen_bit_model_the_loader_cannot_run_for_shapes_is_told_why(tmp_path):
    """transformers GPT-2 exported by dynamo under autocast: 70 shapes unknown to ONNX's
    inference (an ``arange`` of the sequence length), and ORT's CPU provider has no bfloat16
    Gemm to run the model for them. Here the same in four nodes: a Range of a Shape, and a
    bfloat16 Gemm. Before: "Check the sizes bound with --dim"."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    outs = [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, None),
            helper.make_tensor_value_info("r", TensorProto.INT64, None)]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.ones(12, np.float32)),
             helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("one", TensorProto.INT64, [], [1])]
    nodes = [helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
             helper.make_node("Cast", ["w"], ["wb"], to=TensorProto.BFLOAT16),
             helper.make_node("Gemm", ["xb", "wb"], ["y"], name="gemm"),
             helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"]),
             helper.make_node("Range", ["zero", "n", "one"], ["r"])]
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], outs, inits),
                                opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "m.onnx")
    with pytest.raises(InputError) as e:
        api.build(tmp_path / "m.onnx", tmp_path / "s.onnx", options=api.BuildOptions(loss="mse"))
    text = str(e.value)
    assert "no 16-bit kernel" in text and "Gemm" in text and "--precision bf16" in text
    assert "--dim" not in text


def _half_step(tmp_path: Path, optimizer: str) -> tuple[Path, list[warnings.WarningMessage]]:
    torch.manual_seed(1)
    path = _export(Net().half(), torch.randn(4, 8).half(), tmp_path / "half.onnx")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        api.build(path, tmp_path / f"{optimizer}.onnx",
                  options=api.BuildOptions(optimizer=optimizer, lr=1e-3))
    return tmp_path / f"{optimizer}.onnx", [w for w in caught
                                             if issubclass(w.category, ExportWarning)]


def test_sixteen_bit_parameters_are_said_to_train_without_master_weights(tmp_path):
    _, said = _half_step(tmp_path, "sgd")
    text = " ".join(str(w.message) for w in said)
    assert "6 trained parameter(s) are float16" in text, text
    assert "no float32 master weights" in text and "--precision bf16" in text
    assert "AdamW" not in text   # the NaN is AdamW's on float16 only


def test_adamw_on_float16_parameters_goes_non_finite_as_torchs_and_is_warned(tmp_path):
    """The warning's claim, held against torch: one AdamW step of the ``.half()`` model
    leaves non-finite weights in both (fc1's rows behind dead ReLUs, ``eps`` 0 in float16)."""
    step, said = _half_step(tmp_path, "adamw")
    assert any("infinite or NaN update" in str(w.message) for w in said)
    torch.manual_seed(1)
    module = Net().half()
    torch.manual_seed(0)
    x, labels = torch.randn(4, 8).half(), torch.randint(0, 5, (4,))
    ref = copy.deepcopy(module)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    F.cross_entropy(ref(x).float(), labels).backward()
    opt.step()
    trainer = Trainer(step)
    trainer.step({"x": x.numpy(), "labels": labels.numpy()})
    weights = trainer.state_dict()
    for name in ("fc1.weight", "fc2.weight"):
        ours = np.isfinite(weights[name])
        theirs = np.isfinite(dict(ref.named_parameters())[name].detach().numpy())
        assert not theirs.all() and not ours.all(), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_precision_on_a_sixteen_bit_model_names_its_weights(tmp_path, dtype):
    """``--precision`` finds no float32 product to cast on a ``.half()`` model: the refusal
    says the weights are 16-bit already and to export the float32 module."""
    torch.manual_seed(1)
    path = _export(Net().to(dtype), torch.randn(4, 8).to(dtype), tmp_path / "m.onnx")
    with pytest.raises(InputError, match=r"no float32 matrix product") as info:
        api.build(path, tmp_path / "s.onnx", options=api.BuildOptions(precision="fp16"))
    name = "float16" if dtype == torch.float16 else "bfloat16"
    assert f"weights are {name} already" in str(info.value)
    assert ".half()" in str(info.value)
