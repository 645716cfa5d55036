"""What the CLI says on stderr while it works, found wanting by the first-use audit of
session 36: memcc's warnings about an input as ``warning:`` lines naming the user's file,
never as Python's ``memcc/frontend/build.py:111: ExportWarning:`` with memcc's source line
under it (what ``compile`` and ``analyze`` printed; only ``build`` formatted them), and a
line for each row-chunk setting compile plans (the status line dropped them at once)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]


def _made_up_names_model(path: Path) -> None:
    """One MatMul whose weight has a TorchScript exporter's made-up name."""
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "onnx::MatMul_3")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "onnx::MatMul_3"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_compile_prints_a_line_for_each_row_chunk_setting_it_plans(tmp_path, monkeypatch):
    """... and, off a terminal (a log), a line for each stage with the seconds since the
    compile began, once it has run ``QUIET_S`` seconds (0 here), on stderr only."""
    from typer.testing import CliRunner

    from memcc.cli import app
    from models import build_model

    monkeypatch.setattr("memcc.cli.log_progress.QUIET_S", 0.0)
    model = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=1, seq_len=16, width=16, depth=1, heads=2,
                          vocab_size=256), str(model))
    r = CliRunner().invoke(app, ["compile", str(model), "--budget", "min", "--cost",
                                 "analytic", "--time-limit", "1", "-o", str(tmp_path / "c.onnx")])
    assert r.exit_code == 0, r.output
    assert "row chunks: planning the step built with loss 8" in r.output, r.output
    for stage in ("load", "cost_model", "plan", "rewrite"):
        assert re.search(rf"^compiling: {stage} \.\.\. \(at \d+\.\d s\)$", r.stderr,
                         re.MULTILINE), r.stderr
    assert "compiling:" not in r.stdout and "wrote " in r.stdout, r.stdout


def test_analyze_prints_an_export_warning_as_a_warning_line(tmp_path):
    model = tmp_path / "m.onnx"
    _made_up_names_model(model)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(  # python -m memcc: the command where its script is not on PATH
        [sys.executable, "-m", "memcc", "analyze", str(model), "--loss", "mse",
         "--no-smallest", "--json"], capture_output=True, text=True, env=env, cwd=tmp_path,
        timeout=120)
    assert r.returncode == 0, r.stderr
    assert "warning:" in r.stderr and "onnx::MatMul_3" in r.stderr and str(model) in r.stderr
    assert "ExportWarning" not in r.stderr and "build.py" not in r.stderr, r.stderr
    assert "report_parameters(" not in r.stderr, r.stderr
    # ... and in the JSON's "warnings", which README says holds what went to stderr (the
    # export's warnings were missing there and from compile reports).
    assert any("onnx::MatMul_3" in w for w in json.loads(r.stdout)["warnings"]), r.stdout


def test_compile_says_an_export_warning_once_though_it_builds_again_for_row_chunks(tmp_path):
    """Compile builds a forward model again for each row-chunk setting it plans; each build
    warned about the export again (the sweep of session 24: a dynamo MobileNetV3's two
    warnings, 88 folded parameters, printed twice), now each is said once."""
    from typer.testing import CliRunner

    from memcc.cli import app

    w1 = numpy_helper.from_array(np.ones((4, 16), np.float32), "onnx::MatMul_1")
    w2 = numpy_helper.from_array(np.ones((16, 3), np.float32), "onnx::MatMul_2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "onnx::MatMul_1"], ["h"]),
         helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "onnx::MatMul_2"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 64, 3])], [w1, w2])
    model = tmp_path / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    r = CliRunner().invoke(app, ["compile", str(model), "--budget", "min", "--cost",
                                 "analytic", "--time-limit", "1", "--loss", "mse",
                                 "-o", str(tmp_path / "c.onnx")])
    assert r.exit_code == 0, r.output
    assert "row chunks: planning the step built with mlp" in r.stderr, r.stderr
    said = [line for line in r.stderr.splitlines() if "onnx::MatMul_1" in line]
    assert len(said) == 1, r.stderr
    report = json.loads((tmp_path / "c.report.json").read_text())
    assert sum("onnx::MatMul_1" in w for w in report["warnings"]) == 1, report["warnings"]


def test_analyze_says_its_search_is_not_bounded_by_its_limit(tmp_path, monkeypatch):
    """``analyze`` said "smallest reachable peak (up to 1 s)" and then took a minute on an
    EfficientNet-B0 (the sweep of session 24): the segmentations run whatever the limit."""
    from typer.testing import CliRunner

    from memcc.cli import app

    monkeypatch.setattr("memcc.cli.log_progress.QUIET_S", 0.0)
    model = tmp_path / "m.onnx"
    _made_up_names_model(model)
    r = CliRunner().invoke(app, ["analyze", str(model), "--loss", "mse"])
    assert r.exit_code == 0, r.output
    assert re.search(r"smallest reachable peak \(solves up to 1 s, and \d+ sqrt\(n\) "
                     r"segmentations of \d+ nodes simulated as compile does; --no-smallest "
                     r"skips this\)", r.stderr), r.stderr


def test_help_piped_keeps_every_flag_name_whole():
    """Piped (a pager, a file), rich laid help out at 80 columns and cut seven of compile's
    entries, flag names included (``--attention-chu…``): piped help is 120 wide."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH")}
    env["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-m", "memcc", "compile", "--help"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "--attention-chunks" in r.stdout
    assert "…" not in r.stdout


def test_a_long_stage_is_said_again_while_it_runs(monkeypatch):
    """Off a terminal a stage that runs on is said again every ``HEARTBEAT_S``: a refused
    compile's smallest-budget search printed nothing for 50 s after its first line."""
    import time

    from memcc.cli import log_progress

    monkeypatch.setattr(log_progress, "HEARTBEAT_S", 0.2)
    lines: list[str] = []
    with log_progress.LogProgress("compiling", lines.append, quiet_s=0.05) as log:
        log("plan ...")
        time.sleep(0.7)
        log("rewrite ...")
    time.sleep(0.3)   # nothing is said once the command is done
    assert lines[0] == "compiling: plan ... (at 0.0 s)"
    beats = [ln for ln in lines if "still running" in ln]
    assert beats and all(ln.startswith("compiling: plan, still running (at ") for ln in beats)
    assert lines[-1].startswith("compiling: rewrite ... (at ")


def test_ctrl_c_in_tune_and_compile_says_what_was_written(tmp_path, monkeypatch):
    """Compile said "interrupted: nothing was written"; tune exited 130 with no word (a
    walk-through's Ctrl-C). Both say it now, through one function."""
    from typer.testing import CliRunner

    import memcc.api
    import memcc.cli.tuning
    from memcc.cli import app

    def stop(*_args, **_kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(memcc.cli.tuning, "_tune_and_write", stop)
    monkeypatch.setattr(memcc.api, "compile_model", stop)
    model = Path(__file__).resolve().parents[1] / "examples" / "gpt2-small.onnx"
    for args in (["tune", str(model), "--budget", "10MB", "--dim", "batch=1..4", "-o",
                  str(tmp_path / "t.onnx")],
                 ["compile", str(model), "--budget", "10MB", "-o", str(tmp_path / "c.onnx")]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 130, r.output
        assert "interrupted: nothing was written" in r.output, r.output
    assert not list(tmp_path.iterdir())
