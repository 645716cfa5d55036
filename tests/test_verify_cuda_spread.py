"""``--verify`` on CUDA compares against the step's own run-to-run difference.

Measured on an H100 (BENCHMARKS.md, "CUDA on an H100"): two runs of one ResNet-50 step give
different gradients, so a plan could fail a fixed rtol 1e-5 comparison through no fault of
its own. On CUDA the original runs twice, and an output passes within rtol 1e-5 or within
``SPREAD_FACTOR`` times what the original's two runs differ by. No GPU here: the CUDA runs
are replaced by CPU runs with noise the size of an irreproducible kernel's, which is what
the comparison has to tell from a wrong plan.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from memcc.backend import verify
from memcc.backend.verify import SPREAD_FACTOR, compare_outputs, run_to_run_spread
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from models import build_model


def test_an_output_may_differ_by_the_originals_own_spread_and_no_more():
    rng = np.random.default_rng(0)
    ref = {"g": rng.standard_normal(1000).astype(np.float32),
           "step": np.array(3, np.int64)}
    noisy = {"g": ref["g"] + np.float32(1e-3), "step": ref["step"]}
    assert compare_outputs(ref, noisy, exact=False)  # beyond rtol 1e-5
    own = run_to_run_spread(ref, {"g": ref["g"] + np.float32(5e-4), "step": ref["step"]})
    assert set(own) == {"g"} and abs(own["g"] - 5e-4) < 1e-6  # floats only
    assert not compare_outputs(ref, noisy, exact=False, spread=own)
    tight = {"g": 1e-3 / (2 * SPREAD_FACTOR)}
    problems = compare_outputs(ref, noisy, exact=False, spread=tight)
    assert problems and "own runs differ by" in problems[0]
    # An output the original reproduced exactly gets no slack from the others' spread.
    assert compare_outputs(ref, noisy, exact=False, spread={"g": 0.0})
    # Variants' stated tolerance and the spread: either suffices.
    assert not compare_outputs(ref, noisy, exact=False, tolerance=1e-6, spread=own)


def _step():
    return build_training_step(load_graph(build_model("mlp", batch=8, width=16, depth=2)),
                               BuildOptions())


def _fake_cuda(monkeypatch, plan_error: float):
    """CUDA replaced: every run of the original adds fresh noise of 1e-6 to each float
    output, and the plan's runs add ``plan_error`` on top."""
    calls = {"n": 0}
    real = verify.step_outputs

    def step_outputs(graph, feeds, provider, written=None):
        assert provider == "cuda"
        calls["n"] += 1
        out = real(graph, feeds, "cpu", written)
        rng = np.random.default_rng(calls["n"])
        extra = plan_error if graph.metadata.get("test.plan") else 0.0
        return {k: (v + (rng.standard_normal(v.shape) * 1e-6 + extra).astype(v.dtype)
                    if v.dtype.kind == "f" else v) for k, v in out.items()}

    def run_steps(path, request):
        return SimpleNamespace(measured_peak_bytes=1, predicted_peak_bytes=1,
                               order_matches_plan=True, executed_order_mismatch=None,
                               measurement_method="fake", step_time_s=0.0)

    monkeypatch.setattr(verify, "step_outputs", step_outputs)
    monkeypatch.setattr(verify, "run_steps", run_steps)
    return calls


def test_verify_on_cuda_runs_the_original_twice_and_says_so(monkeypatch):
    step = _step()
    plan = step.copy()
    plan.metadata["test.plan"] = "1"
    calls = _fake_cuda(monkeypatch, plan_error=0.0)
    report = verify.verify_rewrite(step, plan, budget=1 << 30,
                                   how=verify.VerifyRun(provider="cuda"))
    assert calls["n"] == 3  # the original twice, the plan once
    assert report["ok"], report["problems"]
    assert report["irreproducible_outputs"] > 0
    assert "run-to-run" in report["comparison"]


def test_verify_on_cuda_still_fails_a_plan_off_by_more_than_the_spread(monkeypatch):
    step = _step()
    plan = step.copy()
    plan.metadata["test.plan"] = "1"
    _fake_cuda(monkeypatch, plan_error=1e-2)
    report = verify.verify_rewrite(step, plan, budget=1 << 30,
                                   how=verify.VerifyRun(provider="cuda"))
    assert not report["ok"] and report["outputs_differing"] > 0
    assert any("own runs differ by" in p for p in report["problems"])


def test_verify_on_cpu_runs_the_original_once_and_demands_the_same_bits():
    step = _step()
    report = verify.verify_rewrite(step, step.copy(), budget=1 << 40,
                                   how=verify.VerifyRun(provider="cpu"))
    assert report["comparison"] == "bit-identical"
    assert report["irreproducible_outputs"] is None
