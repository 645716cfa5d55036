"""BatchNorm's running variance as PyTorch updates it, for PyTorch's models.

ONNX's (and ORT's) training-mode BatchNormalization updates the running variance with the
batch's population variance, PyTorch with the unbiased one (``n / (n - 1)`` times it).
The gradients never show the difference; the module in eval mode does (a BatchNorm1d over
a batch of 2 gets half its batch's share). A step built from a ``torch.onnx`` export now
carries PyTorch's update (``memcc/frontend/running_variance.py``); other producers keep
ONNX's.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from exports import DYNAMO_NOOPT, export
from onnx import TensorProto, helper
from threads import run_at_threads

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.running_variance import FED_SUFFIX
from memcc.graph import Graph
from memcc.passes.providers.provider_step import for_provider


class _Heads(torch.nn.Module):
    """BatchNorm2d over 2 x 6 x 6 values per channel and BatchNorm1d over 2."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.bn2d = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)
        self.bn1d = torch.nn.BatchNorm1d(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn2d(self.conv(x)))
        return self.bn1d(self.fc(torch.flatten(y, 1)))


def _export_heads(exporter: str, path: Path) -> tuple[torch.nn.Module, np.ndarray]:
    torch.manual_seed(0)
    module = _Heads().train()
    with torch.no_grad():  # running statistics unlike the fresh ones
        for bn in (module.bn2d, module.bn1d):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8, 8)
    if exporter == "torchscript":
        torch.onnx.export(copy.deepcopy(module), (x,), str(path), dynamo=False,
                          input_names=["x"], output_names=["logits"],
                          training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    else:
        torch.onnx.export(copy.deepcopy(module), (x,), str(path), dynamo=True,
                          optimize=False, input_names=["x"],
                          output_names=["logits"]).save(str(path))
    return module, x.numpy()


def _one_step(step: Graph, feeds: dict[str, np.ndarray]) -> dict[int, dict[str, np.ndarray]]:
    return run_at_threads(step, feeds, threads=(1, 2), repeats=1)


def _start_from_the_steps_statistics(module: torch.nn.Module, step: Graph) -> None:
    """A train-mode export runs the module once, so the file's running statistics are a
    step ahead of a module exported as is: start torch from the step's."""
    with torch.no_grad():
        for name, m in module.named_modules():
            for stat in ("running_mean", "running_var"):
                if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                    getattr(m, stat).copy_(torch.from_numpy(
                        np.array(step.initializers[f"{name}.{stat}"])))


@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_running_statistics_are_pytorchs(exporter, tmp_path):
    module, x = _export_heads(exporter, tmp_path / "heads.onnx")
    step = build_training_step(load_graph(tmp_path / "heads.onnx"),
                               BuildOptions(optimizer="sgd", lr=0.0))
    assert sum(n.name.endswith(FED_SUFFIX) for n in step.nodes) == 2
    feeds = {"x": x, "labels": np.array([1, 3], np.int64)}
    _start_from_the_steps_statistics(module, step)
    module(torch.from_numpy(x))  # one train-mode forward updates torch's statistics
    cuda_form = for_provider(step, "cuda")[0]  # BatchNorm as reductions (run here on CPU)
    for graph, tol in ((step, 1e-6), (cuda_form, 1e-5)):
        for threads, out in _one_step(graph, feeds).items():
            for bn in ("bn2d", "bn1d"):
                for stat in ("running_mean", "running_var"):
                    want = getattr(getattr(module, bn), stat).numpy()
                    got = out[f"{bn}.{stat}.new"]
                    err = np.abs(got - want).max() / np.abs(want).max()
                    assert err <= tol, (graph is step, threads, bn, stat, err)
    # ONNX's own update is another answer here (the test can fail): the batch's share of
    # BatchNorm1d's variance would be half PyTorch's.
    var = module.fc(torch.flatten(torch.relu(module.bn2d(module.conv(torch.from_numpy(x)))), 1))
    assert float(var.var(0, unbiased=True).mean()) > 1.5 * float(var.var(0, unbiased=False).mean())


def test_other_producers_keep_onnxs_population_variance():
    """A model not from PyTorch (here written with onnx.helper): ONNX's definition."""
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, [3], v) for n, v in (
        ("s", np.ones(3)), ("b", np.zeros(3)), ("m", np.zeros(3)), ("v", np.ones(3)))]
    inits.append(helper.make_tensor("w", TensorProto.FLOAT, [3, 4],
                                    rng.standard_normal(12)))
    g = helper.make_graph(
        [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "m1", "v1"],
                          training_mode=1, momentum=0.9),
         helper.make_node("MatMul", ["y", "w"], ["logits"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 4])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="a-converter")
    step = build_training_step(load_graph(model), BuildOptions(optimizer="sgd", lr=0.0))
    assert not any(n.name.endswith(FED_SUFFIX) for n in step.nodes)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    out = _one_step(step, {"x": x, "labels": np.zeros(4, np.int64)})[1]
    np.testing.assert_allclose(out["v.new"], 0.9 + 0.1 * x.var(0), rtol=1e-6)


def test_batch_chunked_stem_updates_pytorchs_running_variance(tmp_path):
    """``--batch-chunks`` writes the stem's running update itself from the chunks' sums
    (frontend/batch_chunks.py): it is fed the same ``var / k`` and gives PyTorch's
    statistics within the stem's stated 1e-4."""
    path, module, inputs, dims = export("convnet", "torchscript", training=True)
    graph = load_graph(path, dims)
    whole = build_training_step(graph, BuildOptions(optimizer="sgd", lr=0.0))
    chunked = build_training_step(graph, BuildOptions(optimizer="sgd", lr=0.0,
                                                       batch_chunks=2))
    feeds = {**inputs, "labels": np.zeros(inputs["x"].shape[0], np.int64)}
    _start_from_the_steps_statistics(module, whole)
    module.train()(torch.from_numpy(inputs["x"]))
    want = {f"{name}.{stat}": getattr(m, stat).numpy() for name, m in module.named_modules()
            if isinstance(m, torch.nn.BatchNorm2d) for stat in ("running_mean", "running_var")}
    for step, tol in ((whole, 1e-6), (chunked, 1e-4)):
        # In order as written (ORT sorts a file it runs; memcc's liveness does not): the
        # chunks read the divided running variance before the node's old place.
        made = {*step.inputs, *step.initializers}
        for n in step.nodes:
            assert all(i in made for i in n.input if i), (n.name, set(n.input) - made)
            made.update(n.output)
        out = _one_step(step, feeds)[2]
        for name, value in want.items():
            err = np.abs(out[f"{name}.new"] - value).max() / np.abs(value).max()
            assert err <= tol, (step is whole, name, err)


@pytest.mark.parametrize("momentum", [None, 1.0, 0.1])
def test_statistics_of_the_last_batch_alone_are_named(tmp_path, momentum):
    """TorchScript fixes ``BatchNorm(momentum=None)``'s cumulative factor at export (1 for a
    fresh module: ONNX momentum 0), so the step keeps each batch's statistics alone where
    torch averages them: build says so (the file cannot tell it from momentum=1.0)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3),
                                 torch.nn.BatchNorm2d(4, momentum=momentum)).train()
    path = tmp_path / "m.onnx"
    torch.onnx.export(module, (torch.randn(2, 3, 6, 6),), str(path), dynamo=False,
                      input_names=["x"], training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        build_training_step(load_graph(path), BuildOptions(loss="mse"))
    named = [w for w in seen if "have momentum 0" in str(w.message)]
    assert len(named) == (0 if momentum == 0.1 else 1), [str(w.message) for w in seen]
