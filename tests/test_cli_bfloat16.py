"""A model exported after ``.to(torch.bfloat16)``: what each command does with its step.

numpy has no bfloat16, and onnxruntime's Python API (1.31) neither feeds ``ml_dtypes``'
bfloat16 arrays (``memcc run`` failed with "Actual: (tensor(string)), expected:
(tensor(bfloat16))", ``compile --verify`` with a traceback, "Numpy_type 256 can't be
converted to MLDataType", exit 1) nor returns bfloat16 outputs. Building and planning need
no run and work; every command that would run the step refuses it up front, exit 2, naming
its bfloat16 inputs and what to do (``step_feeds.refuse_bfloat16_feeds``). A ``--precision
bf16`` step (float32 inputs and outputs, bfloat16 inside) still runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from memcc.cli import app
from memcc.errors import InputError


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """The bfloat16 MLP (batch 4, and a symbolic batch for tune), its step, a float32
    copy and data."""
    d = tmp_path_factory.mktemp("bf16")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(4, 8)
    torch.onnx.export(m, (x,), str(d / "m32.onnx"), dynamo=False, input_names=["x"],
                      output_names=["y"])
    m = m.to(torch.bfloat16)
    xb = x.to(torch.bfloat16)
    torch.onnx.export(m, (xb,), str(d / "m.onnx"), dynamo=False, input_names=["x"],
                      output_names=["y"])
    torch.onnx.export(m, (xb,), str(d / "md.onnx"), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "batch"}})
    np.savez(d / "data.npz", x=x.numpy(), labels=np.array([0, 1, 2, 3]))
    r = invoke("build", d / "m.onnx", "-o", d / "s.onnx")
    assert r.exit_code == 0, r.output   # building needs no run
    return d


def _refused(r, doing: str) -> None:
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and "tensor(string)" not in r.output, r.output
    text = " ".join(r.output.split())
    assert f"cannot {doing}" in text, text
    assert "1 bfloat16 input(s) ('x')" in text, text
    # the weights are named as what they are, not as inputs (a walk-through's snag)
    assert "8 bfloat16 parameter(s) or state ('0.weight', " in text, text  # and momenta
    assert "--precision bf16" in text and "float16" in text, text


def test_run_is_refused_naming_the_bfloat16_inputs(files):
    _refused(invoke("run", files / "s.onnx", "--steps", "1"), "run the step")


def test_train_is_refused_before_the_data_is_checked(files, tmp_path):
    # The data check asked for bfloat16 arrays ("Save the array as bfloat16"), which no
    # .npz can hold; the step is the reason, said first.
    r = invoke("train", files / "s.onnx", "--data", files / "data.npz", "--steps", "1",
               "--checkpoint", tmp_path / "ck")
    _refused(r, "train the step")
    assert "Save the array" not in r.output
    from memcc import Trainer

    with pytest.raises(InputError, match="bfloat16 input"):
        Trainer(files / "s.onnx")
    # Without --data (and with --batch-size-check), train describes the arrays to write:
    # none can be, so it refuses instead (a re-check found it describing bfloat16 arrays).
    for extra in ([], ["--batch-size-check"]):
        r = invoke("train", files / "s.onnx", "--steps", "1", *extra)
        _refused(r, "train the step")
        assert "dtype bfloat16" not in r.output


def test_compile_plans_with_estimated_costs_and_refuses_what_runs_the_step(files, tmp_path):
    r = invoke("compile", files / "m.onnx", "--budget", "min", "-o", tmp_path / "a.onnx")
    assert r.exit_code == 0, r.output
    assert "node times estimated, not measured" in " ".join(r.output.split()), r.output
    r = invoke("compile", files / "m.onnx", "--budget", "min", "--cost", "analytic", "-o",
               tmp_path / "b.onnx")
    assert r.exit_code == 0, r.output
    r = invoke("compile", files / "m.onnx", "--budget", "min", "--verify", "-o",
               tmp_path / "c.onnx")
    _refused(r, "verify the plan")
    assert not (tmp_path / "c.onnx").exists()
    r = invoke("compile", files / "m.onnx", "--budget", "min", "--cost", "measured", "-o",
               tmp_path / "d.onnx")
    _refused(r, "measure its node times")
    assert "--cost analytic" in r.output
    # The compiled step is refused by run as the built one is.
    _refused(invoke("run", tmp_path / "b.onnx", "--steps", "1"), "run the step")


def test_tune_measure_is_refused_and_tune_without_it_works(files):
    args = ["tune", files / "md.onnx", "--budget", "10MB", "--dim", "batch=1..16"]
    r = invoke(*args)
    assert r.exit_code == 0, r.output
    _refused(invoke(*args, "--measure"), "measure the sizes")
    _refused(invoke(*args, "--cost", "measured"), "measure its node times")


def test_a_precision_bf16_step_still_runs(files, tmp_path):
    """Its inputs, outputs and master weights are float32: nothing to refuse."""
    step = tmp_path / "p.onnx"
    r = invoke("build", files / "m32.onnx", "--precision", "bf16", "-o", step)
    assert r.exit_code == 0, r.output
    r = invoke("run", step, "--steps", "1")
    assert r.exit_code == 0, r.output
