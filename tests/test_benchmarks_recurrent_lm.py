"""benchmarks/recurrent_lm.py at a toy size: the export, memcc's smallest budget and the
interleaved step times come back as numbers (the figures themselves are BENCHMARKS.md's)."""

from __future__ import annotations

from benchmarks import recurrent_lm


def test_a_tiny_word_lm_runs_through(tmp_path):
    a = recurrent_lm.parse(["--batch", "2", "--seq", "5", "--width", "8", "--vocab", "40",
                            "--rounds", "2", "--time-limit", "3", "--work", str(tmp_path)])
    out = recurrent_lm.run(a)
    low = out["min"]
    assert 0 < low["plan_peak_mb"] <= low["planned_step_peak_mb"], low
    assert low["budget_mb"] >= low["plan_peak_mb"], low
    for side in ("memcc_s", "torch_eager_s"):
        spread = out["step"][side]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"], out["step"]
