"""benchmarks/cuda_runtime.py on the CPU: every variant prints a line from run_steps."""

from __future__ import annotations

import json

from benchmarks import cuda_runtime


def test_cpu_mode_prints_every_variant(capsys):
    assert cuda_runtime.main(["--provider", "cpu", "--models", "mlp", "--steps", "2",
                              "--variants", "default,det"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["model"], r["variant"]) for r in rows] == [("mlp", "default"), ("mlp", "det")]
    for r in rows:
        assert "error" not in r, r
        assert len(r["losses"]) == 2 and r["order_matches_plan"] is True
        assert r["measured_peak_bytes"] > 0
    assert rows[0]["losses"] == rows[1]["losses"]  # --deterministic changes nothing on CPU


def test_forms_build_each_step_as_issue_30_left_it_and_as_before(capsys):
    """The forms run here as on a GPU (the CPU provider runs the CUDA-rewritten BatchNorm
    too): the step without fusions and the one whose BatchNorm backward recomputes its
    statistics train to the same losses as the current one, within rounding."""
    assert cuda_runtime.main(["--provider", "cpu", "--models", "resnet18", "--steps", "2",
                              "--variants", "default",
                              "--forms", "current,unfused,no-bn-reuse"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["form"] for r in rows] == ["current", "unfused", "no-bn-reuse"]
    for r in rows:
        assert "error" not in r, r
    assert rows[1]["losses"] == rows[0]["losses"]  # the fusions keep the bits
    assert abs(rows[2]["losses"][1] - rows[0]["losses"][1]) <= 1e-4 * abs(rows[0]["losses"][1])
