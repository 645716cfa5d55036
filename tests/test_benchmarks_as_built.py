"""benchmarks/as_built_vs_eager.py at a tiny size: both sides measured, the ratio printed."""

from __future__ import annotations

import json

from benchmarks import as_built_vs_eager


def test_the_eager_comparison_measures_both_sides(tmp_path, capsys):
    out = tmp_path / "eager.json"
    rc = as_built_vs_eager.main(["--batch", "2", "--seq-len", "16", "--vocab", "64",
                                 "--width", "32", "--depth", "1", "--heads", "2",
                                 "--forms", "dynamo", "--steps", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    eager = data["eager"]["peak_bytes"]
    row = data["memcc"]["dynamo"]
    assert "error" not in row, row
    # Parameters, momentum and batch alone are on both sides: neither peak can be below them.
    assert eager > data["eager"]["parameter_bytes"] > 0
    for kind in ("step", "in_place"):
        measured = row[kind]["measured_peak_bytes"]
        assert measured > 2 * data["eager"]["parameter_bytes"]
        assert row[kind]["predicted_peak_bytes"] > 0
    table = capsys.readouterr().out
    assert "| dynamo |" in table and "/ eager" in table
