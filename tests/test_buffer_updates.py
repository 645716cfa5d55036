"""A buffer the forward writes (not BatchNorm's) is carried as torch writes it, gradient-free.

A walk-through trained a module that centres its features by a running mean kept in a
buffer (``ema.mul_(0.9).add_(0.1 * h.mean(0))`` under ``torch.no_grad()``), exported by
dynamo: memcc read the buffer as exported at every step and differentiated through the new
value, so the losses left torch's from the second step on (1.2e-2 relative after a few SGD
steps, the buffer 100% off after 20). The write is the program's ``BUFFER_MUTATION`` output;
the step now carries that value into the buffer and passes no gradient through it
(``frontend/buffer_updates.py``).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from sgd_steps import memcc_sgd_steps, torch_sgd_steps

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_signature import ExportNote, ExportWarning
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.step import TrainingStep
from memcc.trainer.export import ExportRequest, export_weights

LR = 0.5
STEPS = 3


class _Centred(torch.nn.Module):
    """Features centred by their running mean, a buffer written in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc = torch.nn.Linear(6, 3)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.nn.functional.mse_loss(self.fc(h - self.ema), t)


class _BiasCorrected(torch.nn.Module):
    """A running mean corrected for its start at zero by a step counter, an int64 buffer
    the forward increments (``steps += 1``), as Adam corrects its moments."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc = torch.nn.Linear(6, 3)
        self.register_buffer("ema", torch.zeros(6))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        with torch.no_grad():
            self.steps += 1
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return torch.nn.functional.mse_loss(self.fc(h - self.ema / (1 - 0.9 ** self.steps)), t)


class _SpectralNormed(torch.nn.Module):
    """``spectral_norm``'s power iteration writes ``_u`` from ``_v`` and then ``_v`` from
    ``_u`` under ``torch.no_grad()``, and the weight is divided by ``u . W v`` with both
    vectors constants; the old ``_u`` is never read, so the exporter drops that buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 6))
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc(torch.tanh(self.fc1(x))), t)


class _Cached(torch.nn.Module):
    """The last step's features kept in a buffer (read before the write, else the exporter
    drops the buffer): copied detached and read back after (``detach``), or copied under
    ``torch.no_grad()`` (not read after), where the value written is the model's own;
    ``centred``: the features centred by a running mean, another buffer written."""

    def __init__(self, detach: bool, centred: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc = torch.nn.Linear(6, 3)
        self.register_buffer("cache", torch.zeros(5, 6))
        self.register_buffer("ema", torch.full((6,), 0.1))
        self.detach, self.centred = detach, centred

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x) - self.ema if self.centred else self.fc1(x))
        if self.centred:  # read after the write, else the exporter drops the new value
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        last = self.cache.mean() + self.ema.mean()
        if self.detach:
            self.cache.copy_(h.detach())
            return torch.nn.functional.mse_loss(self.fc(h) + last + self.cache.mean(), t)
        with torch.no_grad():
            self.cache.copy_(h)
        return torch.nn.functional.mse_loss(self.fc(h) + last, t)


def _export(module: torch.nn.Module, inputs: dict, path: Path, optimize: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(module), (), kwargs=inputs, dynamo=True,
                          optimize=optimize, verbose=False).save(str(path))


def _build(path: Path) -> Graph:
    return build_training_step(load_graph(path), BuildOptions(
        loss="none", optimizer="sgd", lr=LR, momentum=0.0))


@pytest.fixture(scope="module")
def module_and_inputs() -> tuple[torch.nn.Module, dict]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return _Centred(), {"x": torch.randn(5, 4, generator=gen),
                        "t": torch.randn(5, 3, generator=gen)}


def _trains_as_torch(module: torch.nn.Module, inputs: dict, step: Graph, buffer: str,
                     weights: tuple[str, ...] = ("fc1.weight", "fc1.bias")) -> None:
    spec = TrainingStep.of(step)
    assert spec.state[f"{buffer}.new"] == buffer
    assert buffer not in spec.parameters
    want_losses, want = torch_sgd_steps(module, inputs, STEPS, LR)
    feeds = {k: v.numpy() for k, v in inputs.items()}
    for threads in (1, 2):
        got, state = memcc_sgd_steps(step, feeds, STEPS, threads)
        np.testing.assert_allclose(got, want_losses, rtol=1e-5)
        for name in (buffer, *weights):  # fc1's gradient: none via the buffer
            old = module.state_dict()[name].numpy()
            np.testing.assert_allclose(state[name] - old, want[name] - old, rtol=1e-4,
                                       atol=1e-6, err_msg=name)


def test_a_written_buffer_is_carried_and_passes_no_gradient(module_and_inputs, tmp_path):
    module, inputs = module_and_inputs
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)  # nothing lost, nothing to warn of
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "ema")


def test_a_detached_copy_read_back_passes_no_gradient(module_and_inputs, tmp_path):
    """The exporter's ``detach`` is an Identity, the buffer's value alone: cut there."""
    _, inputs = module_and_inputs
    module = _Cached(detach=True)
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "cache")


@pytest.mark.parametrize("centred", [False, True])
def test_a_copy_of_the_models_own_value_keeps_its_gradient(module_and_inputs, tmp_path,
                                                           centred):
    """``cache.copy_(h)`` under no_grad writes ``h`` itself, which the model reads too:
    cutting its node would leave ``fc1`` untrained. Carried, not cut, and named; also
    where ``h`` read another written buffer (``centred``), since the batch reaches it."""
    _, inputs = module_and_inputs
    module = _Cached(detach=False, centred=centred)
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportWarning, match="copies into 1 buffer.*'cache'"):
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "cache")


def test_a_written_step_counter_counts(module_and_inputs, tmp_path):
    """``steps + 1`` reads an int64 initializer and a constant: the load folded it into a
    constant 1 (shape arithmetic's rule), so ``steps.new`` was 1 at every step and the
    correction stayed the first step's (3.8e-2 relative off torch's third loss)."""
    _, inputs = module_and_inputs
    torch.manual_seed(0)
    module = _BiasCorrected()
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "ema")
    got = memcc_sgd_steps(step, {k: v.numpy() for k, v in inputs.items()}, STEPS, 1)[1]
    assert int(got["steps"]) == STEPS


def test_spectral_norms_vectors_pass_no_gradient(module_and_inputs, tmp_path):
    """``_u``'s new value is computed from ``_v``, another buffer the forward writes, not
    from its own: it was taken for a copy of the model's own value and passed gradient
    into the weight through ``u . W v`` (2.7e-3 relative off torch after 2 SGD steps, where
    torch's float32 is 1.4e-6 off its float64). Its node is cut though the file does not
    hold the buffer, and build notes that, where it warned of a write it "cannot carry"."""
    _, inputs = module_and_inputs
    torch.manual_seed(0)
    module = _SpectralNormed()
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportNote, match=r"overwrites 1 buffer.*weight\.0\._u'") as record:
        step = _build(tmp_path / "m.onnx")
    # neither "cannot carry" nor "copies into": the step trains as torch does
    assert not [w for w in record if type(w.message) is ExportWarning]
    _trains_as_torch(module, inputs, step, "fc1.parametrizations.weight.0._v",
                     ("fc1.parametrizations.weight.original", "fc1.bias"))


def test_spectral_norms_unread_vector_is_carried_and_exported(module_and_inputs, tmp_path):
    """The file does not hold ``_u``, which torch's eval mode reads (it divides by
    ``u . W v`` without iterating): memcc export wrote the module's weights without it, a
    strict load failed, and with ``strict=False`` the module kept its fresh ``_u`` (here the
    eval loss 1.3% off torch's). The step carries the value written, from zeros."""
    _, inputs = module_and_inputs
    torch.manual_seed(0)
    module = _SpectralNormed()
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportNote, match="carries the last"):
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "fc1.parametrizations.weight.0._u",
                     ("fc1.parametrizations.weight.original",))
    state = memcc_sgd_steps(step, {k: v.numpy() for k, v in inputs.items()}, STEPS, 1)[1]
    out = export_weights(step, TrainingStep.of(step), state,
                         ExportRequest(tmp_path / "w.safetensors"))
    ours, theirs = copy.deepcopy(module), copy.deepcopy(module)
    ours.load_state_dict({k: torch.from_numpy(v) for k, v in load_file(str(out)).items()})
    opt = torch.optim.SGD(theirs.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        theirs(**inputs).backward()
        opt.step()
    with torch.no_grad():
        np.testing.assert_allclose(float(ours.eval()(**inputs)), float(theirs.eval()(**inputs)),
                                   rtol=1e-5)


class _EvoNormed(torch.nn.Module):
    """timm's ``EvoNorm2dB0`` in train mode: its own ``running_var``, written and read in
    eval mode alone, so the exporter drops the write (nothing the loss reads needs it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc = torch.nn.Linear(6, 3)
        self.norm = torch.nn.Module()
        self.norm.register_buffer("running_var", torch.ones(6))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        var = h.var(0, unbiased=False)
        with torch.no_grad():
            self.norm.running_var.copy_(0.9 * self.norm.running_var + 0.1 * var)
        return torch.nn.functional.mse_loss(self.fc(h / (var + 1e-5).sqrt()), t)


def test_a_running_var_of_no_batchnorm_is_not_taken_for_one(module_and_inputs, tmp_path):
    """The builder skipped every written ``*.running_var`` as BatchNorm's, which it carries
    by the node: EvoNorm's write was lost with nothing said (the buffer 100% of its change
    off torch's after 2 steps, and missing from ``memcc export``)."""
    _, inputs = module_and_inputs
    _export(_EvoNormed(), inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportWarning, match=r"writes 1 buffer.*'norm\.running_var'"):
        _build(tmp_path / "m.onnx")


def test_a_write_the_file_lost_is_named(module_and_inputs, tmp_path):
    """The optimizer folds ``0.9 * ema`` into a constant: no buffer is left to carry."""
    module, inputs = module_and_inputs
    _export(module, inputs, tmp_path / "m.onnx", optimize=True)
    with pytest.warns(ExportWarning, match="writes 1 buffer.*'ema'.*optimize=False"):
        _build(tmp_path / "m.onnx")


class _SmoothedFeatures(torch.nn.Module):
    """Features smoothed by the last step's (``f = 0.9 * buf + 0.1 * h``, with gradient),
    kept in the buffer under ``torch.no_grad()``: the value written is computed from the
    buffer's old value, as an update is, but it is the model's own; ``read_after``: the
    model also reads the buffer after the write, which the file cannot tell from ``f``."""

    def __init__(self, read_after: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.fc = torch.nn.Linear(6, 3)
        self.register_buffer("smooth", torch.full((5, 6), 0.1))
        self.read_after = read_after

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        f = 0.9 * self.smooth + 0.1 * torch.tanh(self.fc1(x))
        with torch.no_grad():
            self.smooth.copy_(f)
        out = self.fc(f)
        return torch.nn.functional.mse_loss(out * self.smooth.mean() if self.read_after
                                            else out, t)


def test_a_copy_computed_from_the_buffers_old_value_keeps_its_gradient(module_and_inputs,
                                                                       tmp_path):
    """``f`` reads the buffer's old value, so its node was cut as an update's: ``fc1``,
    which reaches the loss through ``f`` alone, was left out of the step with nothing said
    (its weights never trained, the third loss 4.3e-3 relative off torch's at lr 0.5). A cut that
    takes every path from a parameter to the loss away is not torch's: kept, and named."""
    _, inputs = module_and_inputs
    torch.manual_seed(0)
    module = _SmoothedFeatures(read_after=False)
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportWarning, match=r"'smooth' with 'add'.*'fc1\.bias' reaches"):
        step = _build(tmp_path / "m.onnx")
    _trains_as_torch(module, inputs, step, "smooth")


def test_a_copy_read_back_after_the_write_is_named(module_and_inputs, tmp_path):
    """Read back after the write, the buffer's value is ``f``'s own name in the file, which
    passes gradient where torch passes none: that cannot be told from the file, so build
    names the buffer and says what makes it exact (``copy_(f.detach())``)."""
    _, inputs = module_and_inputs
    module = _SmoothedFeatures(read_after=True)
    _export(module, inputs, tmp_path / "m.onnx", optimize=False)
    with pytest.warns(ExportWarning, match=r"'smooth' with 'add'.*copy_\(x\.detach\(\)\)"):
        step = _build(tmp_path / "m.onnx")
    assert "fc1.weight" in TrainingStep.of(step).parameters
