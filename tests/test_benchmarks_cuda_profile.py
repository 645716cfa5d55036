"""benchmarks/cuda_profile.py on the CPU: the code path the GPU run takes (issue 30)."""

from __future__ import annotations

import json

import onnx
import pytest

from benchmarks import cuda_profile
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from models import build_model


def test_profile_sums_kernel_time_per_op_type_after_the_warm_up(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(build_model("resnet18", batch=2, resolution=32, width=8), str(src))
    step = build_training_step(load_graph(src), BuildOptions())
    path = tmp_path / "step.onnx"
    onnx.save(step.to_model(), str(path))
    out = tmp_path / "p.json"
    rc = cuda_profile.main([f"r18={path}", "--provider", "cpu", "--runs", "2",
                            "--out", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["runs"] == 2 and len(row["run_wall_ms"]) == 2
    ops = {r["op_type"]: r for r in row["op_types"]}
    assert "Conv" in ops and ops["Conv"]["nodes"] > 0
    assert abs(sum(r["share"] for r in row["op_types"]) - 1.0) < 1e-9
    assert abs(sum(r["ms_per_step"] for r in row["op_types"])
               - row["kernel_ms_per_step"]) < 1e-6
    # Kernel time of a step is part of its wall time.
    assert row["kernel_ms_per_step"] <= max(row["run_wall_ms"])
    assert row["not_on_provider"] == []
    slow = row["slowest_nodes"]
    assert 0 < len(slow) <= cuda_profile.SLOWEST_NODES
    assert [r["ms_per_step"] for r in slow] == sorted((r["ms_per_step"] for r in slow),
                                                      reverse=True)
    assert slow[0]["ms_per_step"] <= row["kernel_ms_per_step"] and slow[0]["outputs"]
    conv = next(r for r in slow if r["op_type"] == "Conv")
    assert conv["node"] in {n.name for n in step.nodes}


def test_a_missing_step_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cuda_profile.main([f"x={tmp_path / 'nope.onnx'}", "--provider", "cpu"])
    assert exc.value.code == 2
    assert "NAME=PATH of an existing step file" in capsys.readouterr().err
