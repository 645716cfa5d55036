"""benchmarks/pointwise_grad_forms.py: every shorter spelling of a 1x1 weight gradient
computes memcc's dW, on flattened, batched and strided layers."""

from __future__ import annotations

from benchmarks import pointwise_grad_forms as pgf
from benchmarks.conv_weight_grad import parse_shape


def test_every_form_gives_memccs_weight_gradient():
    for spec in ("2x24x3x3:20x24x1x1", "2x16x6x6:8x16x1x1", "2x8x7x7:12x8x1x1:s2"):
        row = pgf.measure(parse_shape(spec), list(pgf.FORMS), threads=1, rounds=1)
        assert row["memcc_ms"] > 0
        for name, v in row["forms"].items():
            assert v["difference"] <= 1e-6, (spec, name, v)


def test_the_run_prints_a_row_per_layer(capsys):
    assert pgf.main(["--shape", "2x8x4x4:12x8x1x1", "--rounds", "1", "--forms", "einsum"]) == 0
    out = capsys.readouterr().out
    assert "x2x8x4x4 w12x8x1x1 s1 x1 (batched): memcc" in out and "einsum" in out
