"""benchmarks/cuda_kernel_forms.py on the CPU at tiny shapes: every form computes what it
claims, the JSON carries what the GPU session reads, and the forms are built as described.

Tolerance: every form's outputs are float32 and the reference float64 numpy; sums over at
most a few hundred elements, centred statistics and one-pass E[x^2] - E[x]^2 on data whose
channel means are up to 2 standard deviations off zero stay within 1e-4 of the largest
reference magnitude (measured: at most about 4e-7 at these shapes). A wrong axis, a mean
taken as a sum or a lost scale factor is off by far more than that.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import cuda_kernel_forms as kf

TOL = 1e-4
SUM_FORMS = {"a_leading", "b_transpose", "c_two_stage", "c2_two_stage_leading",
             "d_reshape_02", "e_matmul"}
FORWARD_FORMS = {"a_leading", "b_transpose", "c_two_stage", "d_one_pass"}
BACKWARD_FORMS = {"a_leading", "b_transpose", "c_two_stage", "d_two_stage_sumsq",
                  "e_saved_stats"}
MATMUL_FORMS = {"a_transpose_matmul", "b_fused_matmul"}


def test_quick_cpu_run_writes_every_form_within_tolerance(tmp_path):
    assert kf.main(["--provider", "cpu", "--quick", "--rounds", "1",
                    "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel_forms.json").read_text())
    assert result["provider"] == "cpu" and result["preset"] == "quick"
    assert result["rounds"] == 1 and result["tolerance"] == TOL
    assert result["reference"] == "numpy float64" and result["skipped"] == []
    assert result["floor_ms"] > 0 and result["torch_targets"] == []  # no torch on cpu/auto
    expected = {"sum": SUM_FORMS, "bn_forward": FORWARD_FORMS,
                "bn_backward": BACKWARD_FORMS, "matmul": MATMUL_FORMS}
    shapes = [[4, c, h, w] for c, h, w in kf.PRESETS["quick"]["bn"]]
    seen = [(e["group"], json.dumps(e["shape"])) for e in result["groups"]]
    assert seen == [(g, json.dumps(s)) for s in shapes
                    for g in ("sum", "bn_forward", "bn_backward")] + [
        ("matmul", json.dumps(["attention", [1, 2, 32, 16], [1, 2, 32, 16]])),
        ("matmul", json.dumps(["linear", [64, 24], [64, 48]]))]
    for entry in result["groups"]:
        forms = {r["form"]: r for r in entry["forms"]}
        assert set(forms) == expected[entry["group"]], entry["group"]
        assert entry["fastest"] in forms and entry["fastest_any"] in forms
        # Every form is deterministic on the CPU: the deterministic winner is the winner.
        assert entry["fastest_deterministic"] == entry["fastest"]
        default = "a_transpose_matmul" if entry["group"] == "matmul" else "b_transpose"
        assert entry["default_form"] == default
        assert entry["speedup_vs_default"] == pytest.approx(
            forms[default]["median_ms"] / forms[entry["fastest"]]["median_ms"], rel=0.05)
        for name, r in forms.items():
            where = f"{entry['group']} {entry['shape']} {name}"
            assert 0 <= r["rel_error"] <= TOL, (where, r["rel_error"], r["worst_output"])
            assert r["deterministic"] is True, where  # the CPU provider: same bits
            assert r["median_ms"] > 0 and r["spread_ms"] == 0.0 and r["rounds"] == 1, where
            assert r["nodes"] >= 1 and r["description"] and "error" not in r, where


def test_forms_are_built_as_described():
    shape = (2, 3, 4, 5)

    def ops(graph):
        return [n.op_type for n in graph.nodes if n.op_type != "Constant"]

    sums = kf.sum_forms(shape)
    assert ops(sums["a_leading"][1]) == ["ReduceSum"]
    assert ops(sums["b_transpose"][1]) == ["Transpose", "ReduceSum"]  # memcc's: [C], no Reshape
    assert ops(sums["c_two_stage"][1]) == ["Reshape", "ReduceSum", "Transpose", "ReduceSum"]
    forward = kf.bn_forward_forms(shape)
    assert "BatchNormalization" in ops(forward["a_leading"][1])
    assert ops(forward["b_transpose"][1]).count("Transpose") == 2
    backward = kf.bn_backward_forms(shape)
    rule = backward["a_leading"][1]
    producers = rule.producers()
    per_channel = [n for n in rule.nodes if kf.per_channel_reduction(rule, n, producers)]
    assert [n.op_type for n in per_channel] == ["ReduceMean", "ReduceMean", "ReduceSum",
                                               "ReduceSum"]  # memcc's rule, as emitted
    for name in ("c_two_stage", "d_two_stage_sumsq", "e_saved_stats"):
        g = backward[name][1]
        p = g.producers()
        assert not [n for n in g.nodes if kf.per_channel_reduction(g, n, p)], name
        # Only [N, C] tensors are transposed: no activation-sized copy.
        for n in g.nodes:
            if n.op_type == "Transpose":
                assert len(g.info[n.input[0]].shape) == 2, name
    # Mul(centred, centred) gone, the scale by 1/count (a [C] Mul) added.
    assert ops(backward["d_two_stage_sumsq"][1]).count("Mul") == \
        ops(backward["c_two_stage"][1]).count("Mul")
    squares = [n for n in backward["c_two_stage"][1].nodes
               if n.op_type == "Mul" and n.input[0] == n.input[1]]
    assert len(squares) == 1 and not [n for n in backward["d_two_stage_sumsq"][1].nodes
                                      if n.op_type == "Mul" and n.input[0] == n.input[1]]
    assert "ReduceSumSquare" in ops(backward["d_two_stage_sumsq"][1])
    assert "ReduceMean" not in ops(backward["e_saved_stats"][1])


def test_torch_reference_matches_numpy():
    """The GPU run computes the float64 reference with torch (``reference_backend``): the
    same formulas, checked here on torch's CPU tensors."""
    import torch
    data = kf.bn_data((3, 4, 5, 6), seed=1)
    numpy_ref = kf.bn_reference(data)
    torch_ref = kf.bn_reference(data, lambda a: torch.from_numpy(a).to(torch.float64),
                                lambda t: t.numpy())
    assert set(numpy_ref) == set(torch_ref)
    for k, v in numpy_ref.items():
        np.testing.assert_allclose(torch_ref[k], v, rtol=1e-12, atol=1e-12, err_msg=k)


def test_bad_groups_exit_2_and_write_nothing(tmp_path, capsys):
    assert kf.main(["--provider", "cpu", "--quick", "--groups", "sum,nope",
                    "--out", str(tmp_path / "o")]) == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_form_that_fails_is_reported_and_the_others_still_run():
    """The GPU session has one try: a form ORT cannot load becomes a row with its error."""
    shape = (2, 3, 4, 5)
    forms = kf.sum_forms(shape)
    broken = forms["a_leading"][1].copy()
    broken.nodes[-1].op_type = "NoSuchReduce"
    case = kf.Case("sum", list(shape), {"x": np.ones(shape, np.float32)},
                   {"s": np.full(3, 40.0)},
                   {"a_leading": forms["a_leading"], "broken": ("bad op", broken)})
    rows = {r["form"]: r for r in kf.run_onnx_case(case, "cpu", 1, 1, 0.0)}
    assert rows["a_leading"]["rel_error"] == 0.0 and "error" not in rows["a_leading"]
    assert "NoSuchReduce" in rows["broken"]["error"] and rows["broken"]["median_ms"] is None
    assert kf.fastest(list(rows.values()), TOL) == ("a_leading", "a_leading")
    assert "failed: " in kf.markdown({"group": "sum", "shape": list(shape),
                                      "forms": list(rows.values()), "fastest": "a_leading",
                                      "fastest_any": "a_leading"})


def test_torch_target_on_the_cpu(tmp_path):
    """Group 5 runs on the GPU by default; ``--torch on`` runs the same code on torch's CPU
    so its rows and the target line are checked here."""
    assert kf.main(["--provider", "cpu", "--quick", "--rounds", "1", "--torch", "on",
                    "--groups", "bn_forward,bn_backward,torch", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel_forms.json").read_text())
    torch_entries = [e for e in result["groups"] if e["group"] == "torch"]
    assert len(torch_entries) == len(kf.PRESETS["quick"]["bn"])
    for e in torch_entries:
        assert e["fastest"] is None  # forward and forward + backward are different jobs
        forms = {r["form"]: r for r in e["forms"]}
        assert set(forms) == {"torch_forward", "torch_forward_backward"}
        assert all(0 <= r["rel_error"] <= TOL and "error" not in r for r in forms.values())
        assert forms["torch_forward"]["worst_output"] == "y"
    targets = result["torch_targets"]
    assert [t["shape"] for t in targets] == [e["shape"] for e in torch_entries]
    for t in targets:
        assert t["torch_ms"] > 0 and t["ort_ms"] > 0 and t["ort_cuda_default_ms"] > 0
        assert t["ort_forward"] in FORWARD_FORMS and t["ort_backward"] in BACKWARD_FORMS


def test_budget_spent_skips_every_case_and_says_so(tmp_path):
    assert kf.main(["--provider", "cpu", "--quick", "--rounds", "1", "--budget-s", "0",
                    "--groups", "sum,matmul", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "kernel_forms.json").read_text())
    assert result["groups"] == []
    assert result["skipped"] == [f"sum {[4, c, h, w]}" for c, h, w in kf.PRESETS["quick"]["bn"]
                                 ] + ["matmul ['attention', [1, 2, 32, 16]]",
                                      "matmul ['linear', [64, 24, 48]]"]


def test_tf32_twins_on_cuda_only():
    """On CUDA each form with a MatMul runs once more with ``use_tf32=0`` (session option
    only; the graph is the same); the CPU run has no such rows."""
    shape = (2, 3, 4, 5)
    case = kf.Case("sum", list(shape), {}, {}, kf.sum_forms(shape))
    assert set(case.with_tf32_twins("cpu").forms) == SUM_FORMS and not case.options
    twins = kf.Case("matmul", [], {}, {}, kf.matmul_forms("linear", (8, 4, 6)))
    twins.with_tf32_twins("cuda")
    assert set(twins.forms) == MATMUL_FORMS | {f"{f}_tf32_off" for f in MATMUL_FORMS}
    assert twins.options == {f"{f}_tf32_off": {"use_tf32": "0"} for f in MATMUL_FORMS}
    case.with_tf32_twins("cuda")
    assert set(case.forms) == SUM_FORMS | {"e_matmul_tf32_off"}
    assert case.forms["e_matmul_tf32_off"][1] is case.forms["e_matmul"][1]
