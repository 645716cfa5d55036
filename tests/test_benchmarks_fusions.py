"""benchmarks/fusions.py runs and reports what it claims (tiny sizes, no torch)."""

from __future__ import annotations

import json

from benchmarks import fusions


def test_the_fusion_benchmark_pairs_both_steps_and_finds_the_same_bits(tmp_path, capsys):
    out = tmp_path / "f.json"
    assert fusions.main(["--tiny", "--rounds", "2", "--models", "zoo-gpt2",
                         "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["same_bits"] is True
    assert row["nodes_fused"] < row["nodes_unfused"] and row["bytes_saved"] > 0
    assert row["ratio"]["rounds"] == 2 and row["fused_median_s"] > 0
    assert "| zoo-gpt2 |" in capsys.readouterr().out
