"""benchmarks/pareto.py's timing children at a tiny size: the allocator each one times
under, and the memory each one holds, measured."""

from __future__ import annotations

from benchmarks import pareto
from benchmarks.steps import build_step


def test_timing_allocators_and_held_memory(tmp_path):
    step_path = tmp_path / "step.onnx"
    _, live, act, _ = build_step("gpt2", {"batch": 4, "seq_len": 64, "width": 64, "depth": 1,
                                          "heads": 2, "vocab_size": 256}, step_path,
                                 lambda _msg: None)
    job = pareto.prepare_timing_job("v0", step_path, tmp_path)
    held = {a: pareto.held_bytes(job, a, 2, 120) for a in ("exact", *pareto.ALLOCATORS)}
    # One buffer per mmap is the tightest a process can hold the step: the activations
    # and gradients the liveness analysis predicts, give or take page rounding.
    assert 0.8 * act <= held["exact"] <= 2 * live.peak_bytes, (held, act)
    for allocator in pareto.ALLOCATORS:
        assert held[allocator] >= 0.9 * held["exact"], (allocator, held)
        timed = pareto.time_ort([job], 2, 1, 0, 120, allocator=allocator)
        assert len(timed["times"]["v0"]) >= 2
        assert ("arena" in timed["method"]) == (allocator == "arena"), timed["method"]
    # Each later step against the first, in a child of its own.
    other = pareto.prepare_timing_job("v1", step_path, tmp_path / "other")
    timed = pareto.time_against_first([job, other], 2, 1, 0, 120, allocator="arena")
    assert set(timed) == {"v0", "v1"} and timed["v1"][0] == timed["v0"][0]
    assert len(timed["v1"][1]) >= 2
