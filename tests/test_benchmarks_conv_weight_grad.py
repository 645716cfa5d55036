"""benchmarks/conv_weight_grad.py: every formulation of a Conv's weight gradient computes
torch's dW, and the run writes the figures the report reads."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from benchmarks import conv_weight_grad as cwg  # noqa: E402

# A strided, padded 3x3 layer (which also crops the batch-swapped Conv's extra tap), a
# strided 1x1 layer, and a strided depthwise layer: every form of every kind runs.
SHAPES = ["2x4x9x9:6x4x3x3:s2:p1", "2x8x6x6:12x8x1x1:s2", "3x8x7x7:8x1x3x3:s2:p1:g8"]


def test_every_form_matches_torch_and_the_json_has_the_fields(tmp_path, capsys):
    out = tmp_path / "cwg.json"
    argv = [a for s in SHAPES for a in ("--shape", s)] + ["--rounds", "1", "--out", str(out)]
    assert cwg.main(argv) == 0
    data = json.loads(out.read_text())
    assert {"batch", "resolution", "threads", "rounds", "onnxruntime", "torch"} <= set(
        data["meta"])
    rows = data["shapes"]
    assert [r["kind"] for r in rows] == ["spatial", "pointwise", "depthwise"]
    for row in rows:
        assert set(row["forms"]) == set(cwg.FORMS[row["kind"]]), row["label"]
        for form, v in row["forms"].items():
            assert "error" not in v, (row["label"], form, v)
            assert v["max_rel_err"] <= 1e-4, (row["label"], form, v["max_rel_err"])
            assert v["median_ms"] > 0 and v["nodes"] >= 1
        torch_ms = row["torch"]
        assert torch_ms["median_ms"] == min(torch_ms["onednn_ms"], torch_ms["native_ms"]) > 0
        assert torch_ms["max_rel_err"] <= 1e-4
        assert row["fastest"] in row["forms"]
        assert row["ratio_to_torch"] == pytest.approx(
            row["forms"][row["fastest"]]["median_ms"] / row["torch"]["median_ms"])
    summary = data["summary"]
    assert summary["shapes"] == 3 and 0 <= summary["within_2x_of_torch"] <= 3
    assert summary["errors"] == {}
    printed = capsys.readouterr().out
    assert "| fastest | torch (oneDNN) | torch (native) | fastest/torch |" in printed
    assert "within 2x of torch on" in printed


def test_memcc_form_is_the_rule_memcc_emits():
    """1x1 layers take the MatMul rule, k x k ones the Conv over batch-swapped tensors."""
    pointwise = cwg.form_model(cwg.parse_shape("2x8x6x6:12x8x1x1"), "memcc")
    spatial = cwg.form_model(cwg.parse_shape("2x4x9x9:6x4x3x3:p1"), "memcc")
    assert "MatMul" in {n.op_type for n in pointwise.graph.node}
    assert "Conv" not in {n.op_type for n in pointwise.graph.node}
    assert [n.op_type for n in spatial.graph.node if n.op_type == "Conv"] == ["Conv"]
    assert [i.name for i in spatial.graph.input] == ["x", "gy"]


@pytest.mark.parametrize("spec", ["8x4x9x9", "8x4x9x9:6x5x3x3", "2x4x3x3:4x4x5x5",
                                  "2x4x9x9:6x4x3x3:q1"])
def test_bad_shapes_exit_2_naming_the_flag(spec, capsys):
    with pytest.raises(SystemExit) as exc:
        cwg.main(["--shape", spec])
    assert exc.value.code == 2
    assert f"--shape {spec!r}" in capsys.readouterr().err
