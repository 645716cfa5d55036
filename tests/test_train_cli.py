"""``memcc train`` and ``memcc export`` as a user runs them: killed runs resume bit-identically,
bad data stops before any step, and trained weights go back into PyTorch."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx_files import mlp_step_and_data
from typer.testing import CliRunner

from memcc.backend import checkpoint as ckpt
from memcc.cli import app
from memcc.trainer import TrainOptions, train
from models import mlp

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    """A small MLP step (about 0.2M parameters, so a checkpoint write takes a moment) and
    60 samples: 7 batches of 8 per epoch, so 30 steps cross four epoch boundaries."""
    return mlp_step_and_data(tmp_path_factory.mktemp("train_cli"), batch=8, in_features=64,
                             width=256, depth=2, samples=60)


def _train_args(step, data, ck):
    return ["train", str(step), "--data", str(data), "--steps", "30", "--checkpoint", str(ck),
            "--save-every", "5", "--seed", "4", "--threads", "1", "--resume", "--json"]


def test_three_sigkills_then_resume_give_the_uninterrupted_parameters(mlp_run, tmp_path):
    step, data = mlp_run
    reference = tmp_path / "straight"
    train(TrainOptions(step=step, data=data, steps=30, seed=4, checkpoint=reference,
                       save_every=5, threads=1))
    ck = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memcc.cli", *_train_args(step, data, ck)]
    rng = random.Random(13)
    outcomes = []
    for _ in range(3):  # kill at a random moment after the run has written a new checkpoint
        before = ckpt.latest(ck)
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while proc.poll() is None and ckpt.latest(ck) == before:
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.03))
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        outcomes.append(proc.returncode)
    final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    assert json.loads(final.stdout)["steps"] == 30
    got, want = ckpt.load(ck), ckpt.load(reference)
    assert got.step == want.step == 30
    assert got.data_state == want.data_state
    assert got.tensors.keys() == want.tensors.keys()
    for name in want.tensors:
        np.testing.assert_array_equal(got.tensors[name], want.tensors[name], err_msg=name,
                                      strict=True)
    print(f"kill outcomes (returncode, -9 = killed mid-run): {outcomes}")


def test_sigkill_then_resume_with_dropout_gives_the_uninterrupted_run(tmp_path):
    """A model with Dropout 0.1 (masks drawn from the step's carried counter): the CLI run
    killed at a random moment after its first checkpoint and resumed with --resume ends bit
    for bit where an uninterrupted run ends. Before the counter, every tensor differed."""
    step, data = mlp_step_and_data(tmp_path, batch=8, in_features=64, width=128, depth=2,
                                   samples=40, seed=1, optimizer="adamw", dropout=0.1)
    reference = tmp_path / "straight"
    train(TrainOptions(step=step, data=data, steps=30, seed=4, checkpoint=reference,
                       save_every=5, threads=1))
    ck = tmp_path / "killed"
    cmd = [sys.executable, "-m", "memcc.cli", *_train_args(step, data, ck)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while proc.poll() is None and ckpt.latest(ck) is None:
        time.sleep(0.002)
    time.sleep(random.Random(7).uniform(0.0, 0.03))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    killed_at = ckpt.load(ck).step
    final = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    out = json.loads(final.stdout)
    assert out["steps"] == 30 and out["start_step"] == killed_at
    got, want = ckpt.load(ck), ckpt.load(reference)
    assert got.step == want.step == 30 and int(got.tensors["dropout.step"]) == 30
    assert got.tensors.keys() == want.tensors.keys()
    for name in want.tensors:
        np.testing.assert_array_equal(got.tensors[name], want.tensors[name], err_msg=name,
                                      strict=True)
    print(f"killed with the newest checkpoint at step {killed_at} (returncode "
          f"{proc.returncode})")


def test_bad_data_stops_before_any_step_and_writes_nothing(mlp_run, tmp_path):
    step, _ = mlp_run
    bad = tmp_path / "bad.npz"
    np.savez(bad, input=np.zeros((60, 63), np.float32), labels=np.zeros(60, np.int64))
    ck = tmp_path / "ck"
    r = invoke("train", step, "--data", bad, "--steps", "3", "--checkpoint", ck)
    assert r.exit_code == 2
    assert "array 'input' has shape [60, 63]" in r.output and "[N, 64]" in r.output
    assert not ck.exists()


@pytest.mark.parametrize("args, message", [
    (["--save-every", "5"], "--save-every and --resume need --checkpoint DIR"),
    (["--steps", "3", "--epochs", "1"], "give --steps or --epochs, not both"),
])
def test_option_errors(mlp_run, args, message):
    step, data = mlp_run
    r = invoke("train", step, "--data", data, *args)
    assert r.exit_code == 2 and message in r.output


def test_batch_size_check_reports_and_trains_nothing(mlp_run, tmp_path):
    step, data = mlp_run
    r = invoke("train", step, "--data", data, "--epochs", "2", "--batch-size-check",
               "--checkpoint", tmp_path / "ck")
    assert r.exit_code == 0, r.output
    assert "60 samples in 1 file(s), batch size 8: 7 batches per epoch" in r.output
    assert "14 steps" in r.output and not (tmp_path / "ck").exists()
    # README: write the data "in the dtype and per-sample shape --batch-size-check names"
    said = " ".join(r.output.split())
    assert "per sample: " in said and "float32" in said and "int64" in said, said


def test_installed_package_never_imports_torch():
    code = ("import sys, memcc, memcc.cli, memcc.trainer, memcc.backend.checkpoint; "
            "memcc.Trainer; sys.exit(int('torch' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


# ---------------------------------------------------------------------------- PyTorch
def _torch_export(path):
    """Linear -> BatchNorm1d (training mode: running statistics are carried) -> ReLU ->
    Linear, exported by the TorchScript exporter, whose initializer names are the module's
    ``state_dict`` names."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(12, 32)
            self.bn = nn.BatchNorm1d(32)
            self.fc2 = nn.Linear(32, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x))))

    torch.manual_seed(0)
    net = Net().train()
    with warnings.catch_warnings():  # the TorchScript exporter's deprecation notices
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(8, 12),), str(path), dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, opset_version=17,
                          input_names=["input"], output_names=["logits"],
                          do_constant_folding=False)
    return net


def test_pytorch_round_trip_train_50_steps_export_and_load_state_dict(tmp_path):
    import torch
    from test_trainer import _copying_loop

    net = _torch_export(tmp_path / "net.onnx")
    step = tmp_path / "step.onnx"
    assert invoke("build", tmp_path / "net.onnx", "-o", step).exit_code == 0
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 12), dtype=np.float32)
    np.savez(tmp_path / "data.npz", input=x, labels=rng.integers(0, 4, 64))
    r = invoke("train", step, "--data", tmp_path / "data.npz", "--steps", "50",
               "--checkpoint", tmp_path / "ck", "--threads", "1", "--json")
    assert r.exit_code == 0, r.output
    result = json.loads(r.output)
    assert result["steps"] == 50 and result["losses"][-1] < result["losses"][0]
    assert result["samples_per_s"] > 0 and result["steady_samples_per_s"] > 0
    for fmt, name in (("safetensors", "w.safetensors"), ("onnx", "trained.onnx")):
        r = invoke("export", step, "--checkpoint", tmp_path / "ck", "-o", tmp_path / name,
                   "--format", fmt)
        assert r.exit_code == 0, r.output

    from safetensors.torch import load_file

    batch = x[:8]
    with torch.no_grad():
        untrained = net(torch.from_numpy(batch)).numpy()
    weights = load_file(str(tmp_path / "w.safetensors"))
    assert set(weights) == {n for n, _ in net.named_parameters()} | {
        "bn.running_mean", "bn.running_var"}
    # strict: every key found (BatchNorm fills its num_batches_tracked, which no ONNX holds)
    net.load_state_dict(weights, strict=True)
    with torch.no_grad():
        want = net(torch.from_numpy(batch)).numpy()
    assert not np.allclose(want, untrained, rtol=1e-3)  # the trained weights arrived
    got = ort.InferenceSession(str(tmp_path / "trained.onnx")).run(None, {"input": batch})[0]
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel <= 1e-5, rel
    onnx.checker.check_model(onnx.load(str(tmp_path / "trained.onnx")))

    # The running mean comes out of the BatchNorm kernel, updated through a second buffer,
    # not in place; the running variance of this PyTorch model is the Mul that makes it
    # PyTorch's (frontend/running_variance.py), which writes in place. Still the copying
    # runner's numbers.
    from memcc import Trainer

    trainer = Trainer(step, threads=1)
    assert set(trainer.in_place.refused) == {"bn.running_mean.new"}
    feeds = {"input": batch, "labels": rng.integers(0, 4, 8)}
    losses = [trainer.step(feeds) for _ in range(3)]
    ref_losses, ref_state = _copying_loop(step, feeds, 3)
    assert losses == ref_losses
    for name, value in ref_state.items():
        np.testing.assert_array_equal(trainer.state_dict()[name], value, err_msg=name)


def test_a_compiled_step_trains_the_same_bits_and_resumes_the_original_checkpoint(tmp_path):
    """A checkpoint belongs to the carried values, not to the schedule: the step rewritten by
    memcc compile (recomputation) continues a run of the step it came from."""
    from memcc import Trainer
    from memcc.backend.runner import synthetic_feeds
    from models import build_model

    onnx.save(build_model("gpt2", batch=4, seq_len=32, width=32), str(tmp_path / "g.onnx"))
    step, compiled = tmp_path / "step.onnx", tmp_path / "step.memcc.onnx"
    assert invoke("build", tmp_path / "g.onnx", "-o", step, "--optimizer", "adamw"
                  ).exit_code == 0
    # Recompute only: a variant of the equivalent tier would round differently.
    r = invoke("compile", step, "--budget", "min", "--strategy", "sqrtn", "--cost", "analytic",
               "--no-variants", "-o", compiled)
    assert r.exit_code == 0, r.output
    original = Trainer(step, threads=1)
    feeds = synthetic_feeds(original.graph, seed=0)
    for _ in range(2):
        original.step(feeds)
    original.save(tmp_path / "ck")
    resumed = Trainer.resume(tmp_path / "ck", compiled, threads=1)
    assert resumed.steps_done == 2
    assert [original.step(feeds) for _ in range(2)] == [resumed.step(feeds) for _ in range(2)]
    a, b = original.state_dict(), resumed.state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_exporting_weights_warns_about_names_the_exporter_made_up(tmp_path):
    forward = mlp.build(batch=8, in_features=12, width=16, depth=1, num_classes=4,
                        linear="matmul")
    for t in forward.graph.initializer:
        if t.name == "layers.0.weight":
            t.name = "onnx::MatMul_12"
    for n in forward.graph.node:
        n.input[:] = ["onnx::MatMul_12" if x == "layers.0.weight" else x for x in n.input]
    onnx.save(forward, str(tmp_path / "f.onnx"))
    step = tmp_path / "step.onnx"
    assert invoke("build", tmp_path / "f.onnx", "-o", step).exit_code == 0
    from memcc import Trainer

    Trainer(step, threads=1).save(tmp_path / "ck")
    r = invoke("export", step, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "w.safetensors")
    assert r.exit_code == 0, r.output
    assert "'onnx::MatMul_12'" in r.output and "load_state_dict will not find" in r.output
    r = invoke("export", step, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "m.onnx")
    assert r.exit_code == 0 and "load_state_dict" not in r.output
    # A format the file's name contradicts is written, and said (it was silent).
    r = invoke("export", step, "--checkpoint", tmp_path / "ck", "-o", tmp_path / "t.onnx",
               "--format", "safetensors")
    assert r.exit_code == 0 and "--format safetensors writes safetensors into" in \
        " ".join(r.output.split())


def test_plain_output_reports_progress_steps_and_the_checkpoint(mlp_run, tmp_path):
    step, data = mlp_run
    ck = tmp_path / "ck"
    r = invoke("train", step, "--data", data, "--steps", "3", "--checkpoint", ck,
               "--threads", "1")
    assert r.exit_code == 0, r.output
    assert "trained steps 1-3 of 3; final loss" in r.output and "samples/s" in r.output
    # Off a terminal, whole progress lines (the bar's last frame was cut at 80 columns).
    lines = [line for line in r.output.splitlines() if line.startswith("train ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"], r.output
    assert all("samples/s" in line and "…" not in line for line in lines), r.output
    assert f"checkpoint: {ck / 'ckpt-000000003.safetensors'}" in r.output
    r = invoke("train", step, "--data", data, "--steps", "3", "--checkpoint", ck, "--resume")
    assert r.exit_code == 0 and "nothing to do: already at step 3 of 3" in r.output


def test_a_new_run_into_a_directory_with_checkpoints_is_refused(mlp_run, tmp_path):
    step, data = mlp_run
    ck = tmp_path / "ck"
    assert invoke("train", step, "--data", data, "--steps", "2", "--checkpoint", ck
                  ).exit_code == 0
    r = invoke("train", step, "--data", data, "--steps", "4", "--checkpoint", ck)
    assert r.exit_code == 2 and "already holds a run's checkpoints" in r.output
    assert "--resume" in r.output


def test_without_data_train_says_what_the_data_must_hold(mlp_run):
    """--batch-size-check without --data names each data input's per-sample shape and dtype
    (what README tells a user to write); a run without --data is refused with the same."""
    step, _ = mlp_run
    check = invoke("train", step, "--batch-size-check")
    assert check.exit_code == 0, check.output
    assert "'input': samples of shape [64] dtype float32" in check.output
    assert "'labels'" in check.output and "values in [0," in check.output
    missing = invoke("train", step)
    assert missing.exit_code == 2
    assert "--data is missing" in missing.output and "'input'" in missing.output


def test_a_loss_that_is_no_number_stops_training_and_saves_nothing_of_it(tmp_path):
    """A learning rate of 1e4 sends the GPT-2's loss to nan in a few steps. Training went
    on (exit 0, nothing said) and its nan checkpoints pushed the good ones out of --keep;
    now it stops at that step, says so with the losses before it, and every checkpoint
    left holds finite values."""
    from onnx_files import diverging_gpt2_step_and_data, said_it_diverged

    step, data = diverging_gpt2_step_and_data(tmp_path, samples=32)
    r = invoke("train", step, "--data", data, "--steps", "40",
               "--checkpoint", tmp_path / "ck", "--save-every", "1", "--threads", "1")
    assert r.exit_code != 0
    assert "memcc build --lr" in said_it_diverged(r.output, tmp_path / "ck")
