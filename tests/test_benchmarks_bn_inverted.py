"""benchmarks/variant_checks.py bn-inverted at a tiny size: every model BatchNorm on its
``inverted`` variant, the table printed. It iterated the backward's own
BatchNormalization nodes too, and lowering refused the first ('variants name nodes that
are not forward nodes'), so the figure docs/VARIANTS.md quotes could not be rerun."""

from __future__ import annotations

from benchmarks import variant_checks


def test_the_bn_inverted_benchmark_runs_the_model_batchnorms(capsys):
    rc = variant_checks.main(["bn-inverted", "--model",
                              "resnet18:batch=2,resolution=16,width=4"])
    assert rc in (0, None)
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    # one row per count of values per channel: 2 x 8 x 8 at the stem down to 2 x 1 x 1
    assert [int(r[0]) for r in rows] == [2, 8, 32, 128], out
    # the figures are the benchmark's to report (tests/test_variants.py holds the variant
    # to its tolerance); at 2 values per channel they reach 4e-4 here
    assert all(0 <= float(r[1]) < 1e-2 for r in rows), out
