"""The CUDA node-time estimate (memcc/passes/analysis/cuda_node_times.py): its fit recovers known
coefficients, and ``--provider cuda`` without CUDA prices nodes with it and says so."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from memcc.cli import app
from memcc.errors import InputError
from memcc.passes.analysis import cuda_node_times as cnt
from models import build_model

runner = CliRunner()

# Known per-op coefficients (fixed s, s/byte, s/flop) the synthetic records are made from.
TRUTH = {
    "MatMul": (9e-6, 3e-13, 2e-14),
    "Add": (5e-6, 4e-13, 0.0),
    "Conv": (2e-5, 1e-13, 5e-14),
}
HOST_S = 2.0e-5


def _records(rng: np.random.Generator, op: str, n: int, noise: float) -> list[dict]:
    a, b, c = TRUTH[op]
    out = []
    for i in range(n):
        nbytes = float(rng.uniform(1e4, 4e8))
        # MatMul/Conv: FLOPs independent of bytes (the inner size varies); Add: tied to them.
        flops = nbytes / 12 if op == "Add" else nbytes * float(rng.uniform(1, 2000))
        t = (a + b * nbytes + c * flops) * float(np.exp(rng.normal(0, noise)))
        out.append({"node": f"{op}_{i}", "op_type": op, "in_bytes": nbytes * 2 / 3,
                    "out_bytes": nbytes / 3, "flops": flops, "us": t * 1e6})
    return out


def synthetic_steps(noise: float = 0.01, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    steps = []
    for k in range(2):
        recs = [r for op in TRUTH for r in _records(rng, op, 40, noise)]
        kernel = sum(r["us"] for r in recs) * 1e-6
        steps.append({"label": f"s{k}", "model": f"m{k}", "records": recs,
                      "wall_s": kernel + HOST_S * len(recs)})
    return steps


def synthetic_calibration(**kw) -> cnt.CudaNodeTimes:
    return cnt.fit(synthetic_steps(), gpu="Test GPU", onnxruntime="1.31.1",
                   date="2026-11-26", **kw)


def test_fit_recovers_known_coefficients():
    cal = synthetic_calibration()
    for op in ("MatMul", "Conv"):
        fit = cal.by_op[op]
        for got, want in zip((fit.fixed_s, fit.s_per_byte, fit.s_per_flop), TRUTH[op],
                             strict=True):
            assert got == pytest.approx(want, rel=0.1), (op, got, want)
    # Add: FLOPs and bytes are proportional, so only their sum is determined: its
    # predictions are, to the noise.
    for nbytes in (1e4, 1e6, 3e8):
        a, b, _ = TRUTH["Add"]
        assert cal.kernel_seconds("Add", nbytes, nbytes / 12) == \
            pytest.approx(a + b * nbytes, rel=0.03)
    # The host's share per node: what the steps took beyond their kernels.
    assert cal.host_s_per_node == pytest.approx(HOST_S, rel=1e-9)
    assert cal.fitted_on["nodes"] == 240 and cal.fitted_on["op_types"] == 3
    assert all(f.s_per_byte >= 0 and f.s_per_flop >= 0 and f.fixed_s >= 0
               for f in (*cal.by_op.values(), *cal.by_family.values(), cal.overall))


def test_rare_and_unseen_op_types_fall_back_to_their_family_then_all():
    steps = synthetic_steps()
    steps[0]["records"] += [{"node": "g", "op_type": "Gemm", "in_bytes": 1e6,
                             "out_bytes": 1e6, "flops": 1e9, "us": 50.0}]
    cal = cnt.fit(steps, gpu="g", onnxruntime="1", date="d")
    assert "Gemm" not in cal.by_op  # one node is too few for its own fit
    assert cal.fit_for("Gemm") is cal.by_family["matmul"]  # MatMul's nodes and Gemm's
    assert cal.fit_for("Erf") is cal.by_family["elementwise"]  # Add's family
    assert cal.fit_for("Softmax") is cal.overall  # no reduce was measured


def test_a_node_profiled_at_0_us_took_under_one():
    steps = synthetic_steps()
    steps[0]["records"] += [{"node": f"r{i}", "op_type": "Reshape", "in_bytes": 4e6 * i,
                             "out_bytes": 4e6 * i, "flops": 0.0, "us": 0} for i in range(1, 6)]
    cal = cnt.fit(steps, gpu="g", onnxruntime="1", date="d")
    assert cal.by_op["Reshape"].nodes == 5
    assert cal.kernel_seconds("Reshape", 8e6, 0.0) == pytest.approx(0.5e-6, rel=1e-3)


def test_nnls_clips_what_least_squares_makes_negative():
    x = np.linspace(0, 1, 20)
    a = np.stack([np.ones_like(x), x], axis=1)
    y = 1.0 - 0.5 * x  # the free fit's slope is -0.5
    coef = cnt.nnls(a, y)
    assert coef[1] == 0.0 and coef[0] == pytest.approx(y.mean())
    exact = cnt.nnls(a, 1.0 + 2.0 * x)
    assert exact == pytest.approx([1.0, 2.0])


def test_a_feature_no_node_has_gets_no_rate():
    fit = cnt.fit_op([(b, 0.0, 5e-6 + 1e-12 * b) for b in (1e3, 1e5, 1e7, 1e9)])
    assert fit.s_per_flop == 0.0 and fit.s_per_byte == pytest.approx(1e-12, rel=1e-6)
    assert fit.seconds(1e9, 1e12) == pytest.approx(5e-6 + 1e-3, rel=1e-6)


def test_calibration_round_trips_and_prices_every_node(tmp_path):
    cal = synthetic_calibration()
    path = tmp_path / "cuda_node_times_test.json"
    path.write_text(json.dumps(cal.to_json()))
    back = cnt.read_calibration(path)
    assert back.by_op["MatMul"] == cal.by_op["MatMul"] and back.gpu == "Test GPU"
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph

    g = build_training_step(load_graph(build_model("mlp", batch=4, width=8, depth=1)),
                            BuildOptions())
    costs = back.costs(g)
    assert costs.source == "cuda-calibrated"
    mm = next(n for n in g.nodes if n.op_type in ("MatMul", "Gemm"))
    nbytes, flops = cnt.node_features(g, mm)
    assert nbytes > 0 and flops > 0
    want = cal.kernel_seconds(mm.op_type, nbytes, flops) + HOST_S
    assert costs.of(mm) == pytest.approx(want)
    # A node a plan adds (not in the step) is priced by the same estimate.
    extra = onnx.helper.make_node(mm.op_type, list(mm.input), list(mm.output), name="new",
                                  **{a.name: onnx.helper.get_attribute_value(a)
                                     for a in mm.attribute})
    assert costs.price(extra, g) == pytest.approx(costs.of(mm))


def test_a_calibration_fitted_off_cuda_is_refused(tmp_path):
    cal = cnt.fit(synthetic_steps(), gpu="cpu", onnxruntime="1", date="d", provider="cpu")
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cal.to_json()))
    with pytest.raises(InputError, match="not CUDA ones"):
        cnt.read_calibration(path)


# ------------------------------------------------------------- --provider cuda without CUDA
@pytest.fixture
def no_cuda(monkeypatch):
    import memcc.backend.session as session

    monkeypatch.setattr(session, "cuda_unavailable_reason",
                        lambda: "onnxruntime-gpu is not installed (test)")
    monkeypatch.setattr(session, "cuda_available", lambda: False)
    monkeypatch.delenv(cnt.ENV, raising=False)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("cnt") / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=2, seq_len=16), str(path))
    return path


def _compile(model, tmp_path, *extra):
    rep = tmp_path / "r.json"
    r = runner.invoke(app, ["compile", str(model), "--budget", "1TB", "-o",
                            str(tmp_path / "c.onnx"), "--report", str(rep), "--provider",
                            "cuda", *extra])
    return r, (json.loads(rep.read_text()) if rep.exists() else None)


def test_cuda_auto_without_cuda_uses_the_calibration_and_says_so(
        no_cuda, tiny_gpt2, tmp_path, monkeypatch):
    cal = synthetic_calibration()
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal.to_json()))
    monkeypatch.setenv(cnt.ENV, str(path))
    r, report = _compile(tiny_gpt2, tmp_path)
    assert r.exit_code == 0, r.output
    assert report["cost_model"]["source"] == "cuda-calibrated"
    assert report["cost_model"]["calibration"]["gpu"] == "Test GPU"
    assert report["cost_model"]["calibration"]["file"] == str(path)
    assert any("node times measured on a GPU (Test GPU, onnxruntime 1.31.1, 2026-11-26; "
               "cal.json)" in w for w in report["warnings"])
    cost = next(p for p in report["passes"] if p["name"] == "cost_model")["summary"]
    assert cost["source"] == "cuda-calibrated" and "rates" not in cost
    # The step's summed node times are the calibration's, host share included.
    nodes = report["passes"][0]["summary"]["nodes"]
    assert cost["total_s"] > nodes * HOST_S


def test_cuda_auto_without_cuda_or_calibration_stays_nominal(
        no_cuda, tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setattr(cnt, "DATA_DIR", tmp_path / "none")
    r, report = _compile(tiny_gpt2, tmp_path)
    assert r.exit_code == 0, r.output
    assert report["cost_model"]["source"] == "analytic"
    assert "calibration" not in report["cost_model"]
    assert any("nominal GPU rates (no CUDA calibration" in w for w in report["warnings"])


def test_a_broken_calibration_file_is_an_input_error(no_cuda, tiny_gpt2, tmp_path,
                                                     monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu": "x"}')
    monkeypatch.setenv(cnt.ENV, str(bad))
    r, report = _compile(tiny_gpt2, tmp_path, "--cost", "analytic")
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert "bad.json" in text and "not a CUDA node-time calibration" in text
    assert report is None and not (tmp_path / "c.onnx").exists()


def test_tune_for_cuda_prices_sizes_with_the_calibration(no_cuda, tmp_path, monkeypatch):
    from memcc.tune import TuneOptions, tune

    path = tmp_path / "cal.json"
    path.write_text(json.dumps(synthetic_calibration().to_json()))
    monkeypatch.setenv(cnt.ENV, str(path))
    model = build_model("gpt2", batch=2, seq_len=16, dynamic_batch=True)
    result = tune(model, "1GB", "batch=1..4", TuneOptions(provider="cuda"))
    assert result.cost_source == "cuda-calibrated"


def test_shipped_calibrations_are_gpu_measured_and_complete(monkeypatch):
    """Whatever memcc/data ships is a CUDA fit that names its GPU, onnxruntime, date and
    what it was fitted on; with none shipped, there is no estimate (nominal rates)."""
    monkeypatch.delenv(cnt.ENV, raising=False)
    shipped = sorted(cnt.DATA_DIR.glob("cuda_node_times_*.json"))
    for path in shipped:
        cal = cnt.read_calibration(path)
        assert cal.provider == "cuda" and cal.gpu and cal.onnxruntime and cal.date
        assert cal.fitted_on["nodes"] > 0 and cal.fitted_on["steps"] > 0
        assert "quality" in cal.extra and "settings" in cal.extra
    chosen = cnt.default_calibration()
    assert (chosen is None) == (not shipped)


def test_the_shipped_calibration_is_found(monkeypatch):
    """``memcc/data`` ships one: compile for CUDA without a GPU estimates from it (a move of
    this module once pointed it at a folder that does not exist, and compile fell back to
    nominal rates without a word)."""
    monkeypatch.delenv(cnt.ENV, raising=False)
    cal = cnt.default_calibration()
    assert cal is not None and cal.gpu
