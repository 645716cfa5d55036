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
