"""benchmarks/variant_checks.py row-chunks at a tiny size: both steps built, planned,
measured and timed, the table printed."""

from __future__ import annotations

import re

from benchmarks import variant_checks


def test_the_row_chunks_benchmark_measures_both_steps(capsys):
    # 4p: the planner's 1 MiB margin is larger than this step, so no smaller budget fits;
    # the compile, measuring and timing paths run all the same.
    rc = variant_checks.main([
        "row-chunks", "--model", "gpt2:batch=1,seq_len=64,width=32,depth=1,heads=2,vocab_size=64",
        "--attention-chunks", "4", "--mlp-chunks", "2", "--fractions", "4p",
        "--rounds", "2", "--time-limit", "5"])
    assert rc == 0
    out = capsys.readouterr().out
    assert '"attention": {"chunks": 4, "regions": 1}' in out
    assert "largest relative difference" in out
    rows = [line for line in out.splitlines() if line.startswith("| whole")
            or line.startswith("| chunks 4/2")]
    labels = [r.split("|")[1].strip() for r in rows]
    assert labels == ["whole, as built", "whole, 400% peak", "chunks 4/2, as built",
                      "chunks 4/2, 400% peak"], out
    for r in rows:   # a measured peak in MB and a time against the whole step
        cells = [c.strip() for c in r.split("|")[1:-1]]
        assert float(cells[3]) > 0 and re.search(r"median \d", cells[5]), r
