"""benchmarks/heap_overhead.py: both probes run and report what they measured."""

from __future__ import annotations

from benchmarks import heap_overhead
from memcc.backend.onnx_file import save_graph
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from models import build_model


def test_tiny_tensors_are_measured_against_their_prediction():
    rows = heap_overhead.tiny(200, [16], runs=1)
    assert [r["case"] for r in rows] == ["chain 16", "held 16"]
    held = rows[1]
    # 200 held values of 64 bytes: predicted at least their bytes, measured at least that.
    assert held["predicted"] >= 200 * 64 and min(held["measured"]) >= held["predicted"]


def test_prefixes_of_a_step_grow_towards_the_whole_step(tmp_path):
    step = build_training_step(load_graph(build_model("mlp", batch=8, in_features=16,
                                                      width=32, depth=2)), BuildOptions())
    path = save_graph(step, tmp_path / "mlp.onnx")
    rows = heap_overhead.prefix(str(path), [5, 10**6], runs=1)
    assert rows[0]["predicted"] <= rows[1]["predicted"]
    assert all(min(r["measured"]) > 0 for r in rows)


def test_whole_steps_are_measured_against_the_budget_min_would_give(tmp_path):
    step = build_training_step(load_graph(build_model("mlp", batch=8, in_features=16,
                                                      width=32, depth=2)), BuildOptions())
    path = save_graph(step, tmp_path / "mlp.onnx")
    for in_place in (False, True):
        [row] = heap_overhead.steps([str(path)], 2, in_place)
        assert row["small_buffers"] > 0 and len(row["measured"]) == 2
        assert min(row["measured"]) > 0
        # the budget keeps the margin, 1 MiB and the heap allowance above the prediction
        assert row["budget"] > row["predicted"] + (1 << 20) + 1024 * row["small_buffers"]
