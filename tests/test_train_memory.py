"""``memcc train`` shows the memory the plan counts, not the process's resident size: with
the CPU arena the step's peak measured as ``--verify`` measures it, next to the prediction
for the step as it trains; with malloc the resident size, named so (issue 35, item 9)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from memcc.cli import app
from memcc.compiler import CompileOptions, compile_model

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """The quick start's GPT-2 step as built (about 18 MB), for the arena and for malloc."""
    d = tmp_path_factory.mktemp("train_memory")
    out = {}
    for arena in (True, False):
        path = d / f"step.{'arena' if arena else 'malloc'}.onnx"
        compile_model(ROOT / "examples" / "gpt2-small.onnx",
                      CompileOptions(budget="1TB", cost="analytic", arena=arena), output=path)
        out[arena] = path
    rng = np.random.default_rng(0)
    data = d / "data.npz"
    np.savez(data, input_ids=rng.integers(0, 96, (40, 128)), labels=rng.integers(0, 96, (40, 128)))
    return out, data


def test_arena_training_measures_the_step_the_plan_counts(steps):
    paths, data = steps
    # In a process of its own, as a user runs it: the measurement reads the process's peak
    # resident size, which whatever else a long test process does would disturb.
    r = subprocess.run([sys.executable, "-c", "from memcc.cli import app; app()", "train",
                        str(paths[True]), "--data", str(data), "--steps", "4", "--threads", "1",
                        "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    memory = json.loads(r.stdout)["memory"]
    assert memory["allocator"] == "arena" and memory["measured_steps"] == 4
    predicted, measured = memory["predicted_peak_bytes"], memory["measured_peak_bytes"]
    assert "arena" in memory["prediction"] and "VmHWM" in memory["measurement_method"]
    # The step's memory, not the process's (which holds ORT, numpy and the session: over
    # 100 MB here, against a step of about 18 MB).
    assert measured < memory["rss_bytes"] / 2
    assert 0.8 < measured / predicted < 1.25, (measured, predicted)
    print(f"measured {measured:,} predicted {predicted:,}")

    text = runner.invoke(app, ["train", str(paths[True]), "--data", str(data), "--steps", "2",
                               "--threads", "1"])
    assert text.exit_code == 0, text.output
    assert "memory: step peak" in text.output and "(arena)," in text.output
    assert "predicted for this meter" in text.output


def test_malloc_training_names_the_resident_size_and_measures_nothing(steps):
    paths, data = steps
    r = runner.invoke(app, ["train", str(paths[False]), "--data", str(data), "--steps", "2",
                            "--json"])
    assert r.exit_code == 0, r.output
    memory = json.loads(r.stdout)["memory"]
    assert memory["allocator"] == "malloc" and memory["measured_peak_bytes"] is None
    assert memory["rss_bytes"] > memory["predicted_peak_bytes"] > 0
    text = runner.invoke(app, ["train", str(paths[False]), "--data", str(data), "--steps", "2"])
    assert "not measured with malloc" in text.output and "resident" in text.output
