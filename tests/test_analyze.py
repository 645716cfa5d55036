"""``memcc analyze``: the step as built, its breakdown and the smallest budget, agreeing with
what ``memcc compile`` reports for the same model and options (issue 35, item 9)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from memcc.cli import app
from memcc.compiler import CompileOptions, compile_model
from models import build_model

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("analyze") / "gpt2.onnx"
    onnx.save(build_model("gpt2"), str(path))
    return path


def _analyze(*args) -> dict:
    r = runner.invoke(app, ["analyze", *map(str, args), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("provider, arena", [("cpu", False), ("cpu", True), ("cuda", False)])
def test_peak_and_breakdown_are_compile_baselines(gpt2, provider, arena):
    flags = ["--provider", provider, *(["--arena"] if arena else []), "--no-smallest"]
    got = _analyze(gpt2, *flags)
    report = compile_model(gpt2, CompileOptions(budget="1TB", cost="analytic",
                                                provider=provider, arena=arena)).report
    assert got["peak_bytes"] == report["baseline"]["peak_bytes"]
    assert got["peak_node"] == report["baseline"]["peak_node"]
    assert got["breakdown_at_peak"] == report["baseline"]["breakdown_at_peak"]
    assert got["allocator"] == ("cuda-arena" if provider == "cuda" else
                                "arena" if arena else "malloc")
    assert got["smallest"] is None
    # Kernels and bytes per step (issue 30): the compile report's, with their op types.
    assert (got["kernels"], got["bytes_moved"]) == (report["baseline"]["kernels"],
                                                    report["baseline"]["bytes_moved"])
    assert sum(t["kernels"] for t in got["traffic_by_op"].values()) == got["kernels"] > 0
    totals = got["totals"]
    assert totals["parameters"] == report["passes"][0]["summary"]["parameter_bytes"]
    assert totals["optimizer_state"] == totals["parameters"]  # SGD momentum: one each
    assert totals["gradients"] == totals["parameters"]
    assert 0 < totals["saved_for_backward"] < got["peak_bytes"]


def test_smallest_is_what_budget_min_plans(gpt2):
    """The same search as compile's --budget min (sqrt(n) here: searches that never stop on
    the clock, so the answers must be equal, not merely bounded), over the step as built:
    compile without row chunks (with them it may reach lower: test_chunk_choice.py)."""
    from memcc.frontend.build import BuildOptions

    got = _analyze(gpt2, "--strategy", "sqrtn")
    report = compile_model(gpt2, CompileOptions(
        budget="min", cost="analytic", strategy="sqrtn",
        build=BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1))).report
    smallest = got["smallest"]
    assert smallest["exact"] is True
    assert smallest["peak_bytes"] == report["plan"]["peak_bytes"]
    assert smallest["budget_bytes"] == report["budget_bytes"]
    assert smallest["lower_bound_bytes"] <= smallest["peak_bytes"] < got["peak_bytes"]
    assert got["peak_bytes"] == report["baseline"]["peak_bytes"]


def test_a_search_cut_short_says_it_is_an_upper_bound(gpt2):
    """With no time for the ILP the answer is the sqrt(n) plans' and polish's: an upper
    bound of --budget min's, and said to be one."""
    r = runner.invoke(app, ["analyze", str(gpt2), "--time-limit", "0.01"])
    assert r.exit_code == 0, r.output
    assert "peak as built" in r.output and "at the peak:" in r.output
    assert "an estimate" in r.output and "upper bound" in r.output
    assert "no plan goes under" in r.output and "smallest budget" in r.output


def test_text_output_names_every_part(gpt2):
    r = runner.invoke(app, ["analyze", str(gpt2), "--no-smallest", "--optimizer", "adamw"])
    assert r.exit_code == 0, r.output
    for part in ("peak as built", "parameters", "optimizer state", "activations",
                 "gradients", "saved for backward", "not searched", "kernels",
                 "read and written"):
        assert part in r.output, part
    adam = _analyze(gpt2, "--no-smallest", "--optimizer", "adamw")["totals"]
    assert adam["optimizer_state"] > 2 * adam["parameters"]  # two moments and a step count


def test_a_missing_model_is_a_clean_error(tmp_path):
    r = runner.invoke(app, ["analyze", str(tmp_path / "nope.onnx")])
    assert r.exit_code == 2 and "nope.onnx" in r.output


def test_the_lower_bound_on_cuda_counts_what_the_session_holds(gpt2):
    """On CUDA every device peak holds the session's own bytes: the lower bound "no plan
    goes under" holds them too (it was the live bytes alone: 90.92 MB for a ResNet-18 step
    whose floor compile states as 254.66 MB)."""
    from memcc.passes.planning.floor import runtime_bytes

    got = _analyze(gpt2, "--provider", "cuda", "--strategy", "sqrtn")["smallest"]
    assert runtime_bytes("cuda") < got["lower_bound_bytes"] <= got["peak_bytes"]


def test_on_cuda_the_smallest_budget_counts_the_state_in_host_memory(tmp_path):
    """With offload on (CUDA's default) --budget min also plans with the optimizer state in
    host memory; analyze answers the same budget, and says so (it answered the budget with
    the state on the device: 347.74 MB for a ResNet-18 step compiled at 300.66 MB). Width
    128: momentum tensors past the 64 KiB a copy is worth."""
    from memcc.frontend.build import BuildOptions

    gpt2 = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", width=128, vocab_size=512), str(gpt2))
    got = _analyze(gpt2, "--provider", "cuda", "--strategy", "sqrtn")["smallest"]
    report = compile_model(gpt2, CompileOptions(
        budget="min", cost="analytic", strategy="sqrtn", provider="cuda",
        build=BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1))).report
    assert got["state_in_host_memory"] is report["offloaded_state"]["used"] is True
    assert got["budget_bytes"] == report["budget_bytes"]
    kept = _analyze(gpt2, "--provider", "cuda", "--strategy", "sqrtn", "--no-offload")
    assert kept["smallest"]["state_in_host_memory"] is False
    assert kept["smallest"]["budget_bytes"] > got["budget_bytes"]
