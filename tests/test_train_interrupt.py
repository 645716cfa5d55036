"""Ctrl-C (SIGINT) or SIGTERM during ``memcc train``: the steps done so far are not lost.

The run stops after the step that was running, saves that step's checkpoint (atomically, as
every checkpoint is), says where and how to resume, and exits with 128 + the signal's
number (130 for SIGINT); a resumed run ends bit for bit where an uninterrupted one does.
The model has no Dropout (its resume is tested apart), so only the saved step matters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from onnx_files import mlp_step_and_data

from memcc.backend import checkpoint as ckpt
from memcc.trainer import TrainingInterrupted, TrainOptions, train

ROOT = Path(__file__).resolve().parents[1]
TOTAL = 3000


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny MLP (no Dropout) whose steps take well under a millisecond, and its data."""
    return mlp_step_and_data(tmp_path_factory.mktemp("interrupt"), batch=4, in_features=8,
                             width=16, depth=1, num_classes=3, samples=40)


def _assert_same(got: ckpt.Checkpoint, want: ckpt.Checkpoint) -> None:
    assert got.step == want.step and got.data_state == want.data_state
    assert got.tensors.keys() == want.tensors.keys()
    for name in want.tensors:
        np.testing.assert_array_equal(got.tensors[name], want.tensors[name], err_msg=name,
                                      strict=True)


def test_sigint_saves_the_last_step_and_resume_matches_an_uninterrupted_run(tiny_run,
                                                                              tmp_path):
    """Checkpoints every 1000 steps; Ctrl-C a few steps into a run (continued from step 5,
    so that the moment the loop starts is known); the steps since step 5 are saved."""
    step, data = tiny_run
    ck = tmp_path / "ck"
    train(TrainOptions(step=step, data=data, steps=5, seed=3, checkpoint=ck, threads=1))
    cmd = [sys.executable, "-m", "memcc.cli", "train", str(step), "--data", str(data),
           "--steps", str(TOTAL), "--checkpoint", str(ck), "--save-every", "1000",
           "--seed", "3", "--threads", "1", "--resume", "--json"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stderr.readline()  # said just before the first step
    assert "resuming from" in first, first
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, errors = proc.communicate(timeout=120)
    assert proc.returncode == 130, errors
    done = json.loads(out)
    assert done["interrupted"] == "SIGINT"
    assert 5 < done["steps"] < TOTAL, done["steps"]
    saved = ckpt.load(ck)
    assert saved.step == done["steps"] and Path(done["checkpoint"]) == saved.path
    assert f"checkpoint of step {saved.step}: {saved.path}" in errors
    assert "continue with: memcc train" in errors and "--resume" in errors

    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["start_step"] == saved.step
    straight = tmp_path / "straight"
    train(TrainOptions(step=step, data=data, steps=TOTAL, seed=3, checkpoint=straight,
                       save_every=1000, threads=1))
    _assert_same(ckpt.load(ck), ckpt.load(straight))


def test_sigterm_stops_after_the_running_step_and_saves_it(tiny_run, tmp_path):
    step, data = tiny_run

    def on_step(p) -> None:
        if p.step == 7:  # delivered on this thread before the next step begins
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(TrainingInterrupted) as stopped:
        train(TrainOptions(step=step, data=data, steps=50, seed=3, checkpoint=tmp_path / "ck",
                           save_every=1000, threads=1), on_step=on_step)
    assert stopped.value.signum == signal.SIGTERM
    assert stopped.value.result.steps_done == 7
    assert ckpt.load(tmp_path / "ck").step == 7
    # The handlers are put back: the test process still dies of SIGTERM as it did before.
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL

    straight = tmp_path / "straight"
    train(TrainOptions(step=step, data=data, steps=7, seed=3, checkpoint=straight, threads=1))
    _assert_same(ckpt.load(tmp_path / "ck"), ckpt.load(straight))


def test_a_second_sigint_gives_up_the_step_and_keeps_the_last_checkpoint(tiny_run, tmp_path):
    step, data = tiny_run

    def on_step(p) -> None:
        if p.step == 12:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(KeyboardInterrupt):
        train(TrainOptions(step=step, data=data, steps=50, seed=3, checkpoint=tmp_path / "ck",
                           save_every=10, threads=1), on_step=on_step)
    assert ckpt.load(tmp_path / "ck").step == 10
