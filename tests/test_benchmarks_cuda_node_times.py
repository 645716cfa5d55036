"""benchmarks/cuda_node_times.py's CPU mode: the code the GPU run uses, collect then fit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cuda_node_times as bench  # noqa: E402
from memcc.passes.analysis import cuda_node_times as cnt  # noqa: E402


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cnt")
    assert bench.main(["--collect", "--provider", "cpu", "--out", str(out),
                       "--models", "mlp", "gpt2", "--runs", "2"]) == 0
    return out / "records.json"


def test_collect_on_cpu_writes_per_node_records(records):
    data = json.loads(records.read_text())
    assert data["provider"] == "cpu" and data["errors"] == []
    assert [s["label"] for s in data["steps"]] == ["mlp", "gpt2"]
    for st in data["steps"]:
        measured = [r for r in st["records"] if r["us"] is not None]
        # Every node ORT runs was profiled (Constants become initializers and never run).
        assert {r["op_type"] for r in st["records"] if r["us"] is None} <= {"Constant"}
        assert st["nodes"] == len(measured) > 20 and st["wall_s"] > 0
        assert st["kernel_s"] == pytest.approx(sum(r["us"] for r in measured) * 1e-6)
        assert all(r["provider"] == "CPUExecutionProvider" for r in measured)
        mm = [r for r in measured if r["op_type"] in ("MatMul", "Gemm")]
        assert mm and all(r["flops"] > 0 and r["in_bytes"] > 0 and r["out_bytes"] > 0
                          for r in mm)


def test_fit_of_collected_records_prints_quality_and_writes(records, tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert bench.main(["--fit", str(records), "--write", str(out), "--gpu", "Test CPU"]) == 0
    printed = capsys.readouterr().out
    assert "per op type" in printed and "held out" in printed
    written = json.loads(out.read_text())
    assert written["gpu"] == "Test CPU" and written["provider"] == "cpu"
    assert {q["label"] for q in written["quality"]["steps"]} == {"mlp", "gpt2"}
    assert written["fitted_on"]["nodes"] == sum(
        s["nodes"] for s in json.loads(records.read_text())["steps"])


def test_fit_refuses_to_ship_cpu_times_as_a_gpu_calibration(records, capsys):
    target = cnt.DATA_DIR / "cuda_node_times_not_a_gpu.json"
    assert bench.main(["--fit", str(records), "--write", str(target)]) == 2
    assert "measured on cpu, not CUDA" in " ".join(capsys.readouterr().err.split())
    assert not target.exists()


def test_fit_of_a_bad_records_file_is_an_input_error(tmp_path, capsys):
    bad = tmp_path / "records.json"
    bad.write_text('{"steps": [{"records": []}]}')
    assert bench.main(["--fit", str(bad)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "records.json" in err and "not records from" in err
