"""The planner's work (``memcc/passes/planning/work.py``): compile judges its plans without
Python's full garbage collections, and leaves the collector as it found it."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from memcc.compiler import CompileOptions, compile_model, pipeline
from memcc.passes.planning.work import FULL_COLLECTION_EVERY, few_full_collections

MODEL = Path(__file__).resolve().parents[1] / "examples" / "resnet18-small.onnx"


def test_plans_are_judged_without_full_collections_and_the_thresholds_come_back(
        monkeypatch, tmp_path):
    before = gc.get_threshold()
    seen: list[tuple[int, int, int]] = []
    real = pipeline._plan

    def plan(*args):
        seen.append(gc.get_threshold())
        return real(*args)

    monkeypatch.setattr(pipeline, "_plan", plan)
    compile_model(MODEL, CompileOptions(budget="min", cost="analytic", time_limit=2),
                  output=tmp_path / "out.onnx")
    assert seen == [(*before[:2], max(before[2], FULL_COLLECTION_EVERY))]
    assert gc.get_threshold() == before
    with pytest.raises(RuntimeError), few_full_collections():
        raise RuntimeError("a plan that fails")
    assert gc.get_threshold() == before
