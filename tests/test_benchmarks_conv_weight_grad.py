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


# ------------------------------------------------------------------ the run around the forms
TINY = ["2x4x6x6:4x4x3x3:p1", "2x4x6x6:6x4x1x1", "2x4x6x6:4x1x3x3:p1:g4"]


def _argv(out, *extra):
    return [a for s in TINY for a in ("--shape", s)] + ["--rounds", "1", "--out", str(out),
                                                         *extra]


def test_budget_stops_new_shapes_and_lists_the_rest(tmp_path, capsys):
    out = tmp_path / "cwg.json"
    assert cwg.main(_argv(out, "--budget-s", "0")) == 0
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["shapes"]] == TINY[:1]  # the first shape always runs
    assert data["skipped"] == [f"custom {cwg.parse_shape(s).label}" for s in TINY[1:]]
    assert data["complete"] is True and data["pending"] == []
    assert data["meta"]["budget_s"] == 0
    assert "skipped (over --budget-s 0)" in capsys.readouterr().out


def test_the_json_is_rewritten_after_every_shape_so_a_killed_run_keeps_its_rows(
        tmp_path, monkeypatch):
    out = tmp_path / "cwg.json"
    real = cwg.measure_shape
    calls = []

    def killed_on_the_second(s, cfg):
        calls.append(s.name)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a timeout's signal does between two shapes
        return real(s, cfg)

    monkeypatch.setattr(cwg, "measure_shape", killed_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        cwg.main(_argv(out))
    data = json.loads(out.read_text())
    assert data["complete"] is False
    assert [r["name"] for r in data["shapes"]] == TINY[:1]
    assert data["pending"] == [f"custom {cwg.parse_shape(s).label}" for s in TINY[1:]]
    assert data["summary"]["shapes"] == 1 and data["meta"]["elapsed_s"] >= 0
    assert not (tmp_path / "cwg.json.tmp").exists()


def test_a_form_or_a_shape_that_fails_becomes_an_error_row(tmp_path, monkeypatch, capsys):
    """Out of memory in one form's session, or in the whole shape (torch's tensors on the
    GPU), is reported in the JSON; the other forms and shapes are still measured."""
    out = tmp_path / "cwg.json"
    real_form, real_torch = cwg.form_model, cwg._torch_fns

    def form_model(s, form):
        if form == "einsum":
            raise MemoryError("Failed to allocate memory for requested buffer")
        return real_form(s, form)

    def torch_fns(s, x, gy, provider="cpu"):
        if s.kind == "pointwise":
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
        return real_torch(s, x, gy, provider)

    monkeypatch.setattr(cwg, "form_model", form_model)
    monkeypatch.setattr(cwg, "_torch_fns", torch_fns)
    assert cwg.main(_argv(out)) == 0
    spatial, pointwise, depthwise = json.loads(out.read_text())["shapes"]
    assert spatial["forms"]["einsum"] == {
        "error": "MemoryError: Failed to allocate memory for requested buffer"}
    assert spatial["fastest"] != "einsum" and spatial["forms"]["memcc"]["median_ms"] > 0
    assert pointwise["error"] == "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert "forms" not in pointwise and depthwise["fastest"] in depthwise["forms"]
    summary = json.loads(out.read_text())["summary"]
    assert summary["shapes"] == 2 and list(summary["failed_shapes"]) == [pointwise["label"]]
    assert summary["errors"] == {spatial["label"]: {
        "einsum": "MemoryError: Failed to allocate memory for requested buffer"}}
    assert f"shape failed: {pointwise['label']}" in capsys.readouterr().out


def test_a_form_slower_than_slow_ms_is_timed_once_outside_the_rounds(tmp_path):
    out = tmp_path / "cwg.json"
    assert cwg.main(["--shape", TINY[0], "--rounds", "3", "--slow-ms", "1e-6",
                     "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["shapes"]
    for form, v in row["forms"].items():
        assert v["slow"] is True and v["rounds"] == 1, form
        assert v["median_ms"] == v["min_ms"] > 0 and "vs_memcc" not in v
    assert row["fastest_ms"] == min(v["median_ms"] for v in row["forms"].values())


def test_without_slow_ms_every_form_is_timed_in_every_round(tmp_path):
    out = tmp_path / "cwg.json"
    assert cwg.main(["--shape", TINY[1], "--rounds", "3", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["shapes"]
    assert {v["rounds"] for v in row["forms"].values()} == {3}
    assert not any(v.get("slow") for v in row["forms"].values())
    assert set(row["torch"]) == {"median_ms", "kernel", "onednn_ms", "native_ms",
                                 "max_rel_err"}


def test_cuda_that_is_not_there_exits_2_before_anything_is_written(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(cwg, "cuda_problem", lambda: "no GPU on this machine")
    out = tmp_path / "cwg.json"
    assert cwg.main(_argv(out, "--provider", "cuda")) == 2
    err = capsys.readouterr().err
    assert "--provider cuda: no GPU on this machine" in err and "--provider cpu" in err
    assert not out.exists()


def test_tf32_is_said_to_ort_and_loosens_the_tolerance_only_on_cuda():
    on, off, cpu = cwg.RunConfig("cuda"), cwg.RunConfig("cuda", tf32=False), cwg.RunConfig()
    assert on.session_settings().cuda_options == {"use_tf32": "1"}
    assert off.session_settings().cuda_options == {"use_tf32": "0"}
    assert cpu.session_settings().cuda_options is None
    assert cpu.session_settings().intra_op_threads == 2
    assert on.tolerance == cwg.TF32_TOL > off.tolerance == cpu.tolerance == cwg.FP32_TOL


def test_shapes_run_most_network_time_first():
    a = cwg.parse_shape("2x4x9x9:6x4x3x3:s2:p1")  # out 5x5
    assert a.flops == 2 * 2 * 6 * 4 * 3 * 3 * 5 * 5
    b = cwg.parse_shape("2x8x6x6:12x8x1x1")
    many_b = cwg.ConvShape(b.x, b.w, count=3)
    assert b.flops < a.flops < 3 * b.flops
    assert cwg.order_by_cost([b, a, many_b]) == [many_b, a, b]


@pytest.mark.parametrize(("flags", "message"), [
    (["--budget-s", "-1"], "--budget-s -1"),
    (["--slow-ms", "0"], "--slow-ms 0"),
    (["--out", "/nonexistent-folder/x.json"], "--out /nonexistent-folder/x.json"),
    (["--provider", "gpu"], "--provider"),
])
def test_bad_run_flags_exit_2_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cwg.main(["--shape", TINY[0], *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
