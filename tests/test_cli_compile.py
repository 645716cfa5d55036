"""``memcc build / compile / run / report`` as a user runs them, through the console entry."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from memcc.cli import app
from memcc.sizes import parse_size
from models import build_model

runner = CliRunner()


@pytest.fixture(scope="module")
def gpt2_file(tmp_path_factory):
    import onnx

    d = tmp_path_factory.mktemp("cli")
    path = d / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=8, seq_len=128), str(path))
    return path


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_build_then_run_trains(gpt2_file, tmp_path):
    step = tmp_path / "step.onnx"
    r = invoke("build", gpt2_file, "-o", step, "--optimizer", "adamw")
    assert r.exit_code == 0, r.output
    r = invoke("run", step, "--steps", "4", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["steps"] == 4 and out["losses"][-1] < out["losses"][0]
    assert out["order_matches_plan"] is True
    assert out["measured_peak_bytes"] > 0 and out["predicted_peak_bytes"] > 0


def test_compile_verify_fits_and_matches(gpt2_file, tmp_path):
    out, rep = tmp_path / "c.onnx", tmp_path / "c.json"
    base = invoke("compile", gpt2_file, "--budget", "1TB", "-o", out, "--report", rep,
                  "--cost", "analytic")
    assert base.exit_code == 0, base.output
    peak = json.loads(rep.read_text())["baseline"]["peak_bytes"]
    budget = int(peak * 0.8)
    r = invoke("compile", gpt2_file, "--budget", budget, "-o", out, "--report", rep,
               "--cost", "analytic", "--verify")
    assert r.exit_code == 0, r.output
    report = json.loads(rep.read_text())
    for key in ("budget_bytes", "baseline", "plan", "passes", "compile_time_s", "solver"):
        assert key in report
    assert report["plan"]["fits"] and report["plan"]["peak_bytes"] <= budget
    v = report["verification"]
    assert v["ok"] and v["comparison"] == "bit-identical" and v["order_matches_plan"]
    assert v["measured_peak_bytes"] <= budget
    assert report["plan"]["overhead"] >= 0
    assert {p["name"] for p in report["passes"]} >= {"load", "cost_model", "plan", "rewrite",
                                                     "verify"}


def test_too_small_budget_fails_before_writing(gpt2_file, tmp_path):
    out, rep = tmp_path / "x.onnx", tmp_path / "x.json"
    r = invoke("compile", gpt2_file, "--budget", "1MB", "-o", out, "--report", rep,
               "--cost", "analytic", "--time-limit", "20")
    assert r.exit_code == 2
    assert "does not fit" in r.output
    assert not list(tmp_path.iterdir()), "nothing may be written when nothing fits"
    need = re.search(r"Use --budget (\d+) or more", r.output.replace("\n", " "))
    assert need, r.output
    # The budget it names is one that works.
    ok = invoke("compile", gpt2_file, "--budget", need.group(1), "-o", out, "--report", rep,
                "--cost", "analytic", "--time-limit", "20")
    assert ok.exit_code == 0, ok.output
    assert json.loads(rep.read_text())["plan"]["fits"]


def test_budget_min_and_byte_identical_output(gpt2_file, tmp_path):
    a, b = tmp_path / "a.onnx", tmp_path / "b.onnx"
    for path in (a, b):
        # A generous limit: the search is cut by wall time only as a safety net, and an
        # identical output needs both runs to finish their search.
        r = invoke("compile", gpt2_file, "--budget", "min", "-o", path, "--cost", "analytic",
                   "--time-limit", "300")
        assert r.exit_code == 0, r.output
    assert a.read_bytes() == b.read_bytes()
    report = json.loads((tmp_path / "a.report.json").read_text())
    assert report["budget_was_min"] and report["plan"]["fits"]
    assert report["plan"]["peak_bytes"] < report["baseline"]["peak_bytes"]


def test_report_prints_tables_and_plots(gpt2_file, tmp_path):
    out = tmp_path / "c.onnx"
    assert invoke("compile", gpt2_file, "--budget", "1TB", "-o", out,
                  "--cost", "analytic").exit_code == 0
    png = tmp_path / "t.png"
    r = invoke("report", tmp_path / "c.report.json", "--plot", png)
    assert r.exit_code == 0, r.output
    assert "baseline" in r.output and "passes" in r.output
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("bad", [["report", "nope.json"], ["run", "nope.onnx"],
                                 ["compile", "nope.onnx", "--budget", "1GB"],
                                 ["build", "nope.onnx", "-o", "x.onnx"]])
def test_missing_files_are_clear_errors(bad, tmp_path):
    r = invoke(*bad)
    assert r.exit_code == 2 and "no such file" in r.output


def test_bad_budget_and_strategy(gpt2_file):
    r = invoke("compile", gpt2_file, "--budget", "6 parsecs")
    assert r.exit_code == 2 and "cannot read size" in r.output
    r = invoke("compile", gpt2_file, "--budget", "1GB", "--strategy", "magic")
    assert r.exit_code == 2 and "--strategy" in r.output


@pytest.mark.parametrize("text,value", [("6GB", 6 * 10**9), ("6GiB", 6 * 2**30),
                                        ("512MiB", 512 * 2**20), ("1.5KB", 1500),
                                        ("123", 123), ("2TB", 2 * 10**12)])
def test_sizes(text, value):
    assert parse_size(text) == value
