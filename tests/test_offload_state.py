"""passes.lowering.offload_state: optimizer state in host memory, checked on the CPU.

The rewrite only adds ``MemcpyFromHost`` / ``MemcpyToHost`` around each state's update; the
CPU provider runs both as plain copies, so the rewritten step must train bit for bit as the
step as built, through ``DeviceStep``'s device layout with the state bound in host buffers.
The device prediction must leave the state off the device, and compile must pick it where
the budget is out of reach without it. The CUDA binding itself needs a GPU (BENCHMARKS.md).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from memcc.backend.device_step import DEVICE, DeviceSettings, DeviceStep, StepRoles
from memcc.backend.runner import synthetic_feeds
from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.update_groups import update_units
from memcc.graph import Graph
from memcc.passes.analysis.arrange import arrange_step
from memcc.passes.analysis.device_memory import bound_infos, predict_step
from memcc.passes.lowering.offload_state import (
    COPY_IN,
    COPY_OUT,
    HOST_STATE_KEY,
    host_resident,
    offload_state,
    optimizer_state,
)
from memcc.step import TrainingStep
from models import build_model

DIMS = dict(batch=2, seq_len=16, vocab_size=96, width=32, depth=1, heads=4)


def _step(opt: str, **dims) -> Graph:
    return build_training_step(load_graph(build_model("gpt2", **(DIMS | dims))),
                               BuildOptions(optimizer=opt))


def _run(graph: Graph, steps: int = 3) -> tuple[list[float], dict[str, np.ndarray], DeviceStep]:
    spec = TrainingStep.of(graph)
    a = arrange_step(graph, spec)
    step = DeviceStep(a.graph, StepRoles(spec.loss, spec.state, a.in_place.aliased),
                      DeviceSettings(provider="cpu", threads=1, layout=DEVICE))
    feeds = synthetic_feeds(graph, seed=0)
    losses = [step.run(feeds).loss for _ in range(steps)]
    return losses, step.state_dict(), step


@pytest.mark.parametrize("opt, kinds", [("sgd", {"momentum"}),
                                        ("adamw", {"exp_avg", "exp_avg_sq"})])
def test_the_state_offloaded_trains_bit_for_bit(opt, kinds):
    graph = _step(opt)
    state = optimizer_state(graph, min_bytes=0)
    params = TrainingStep.of(graph).trainable()
    assert {n.rsplit(".", 1)[1] for n, _ in state} == kinds
    # one (SGD) or two (AdamW) per parameter, or per group of vectors updated together
    units = update_units(graph, TrainingStep.of(graph).state, params)
    assert len(units) < len(params)
    assert len(state) == len(kinds) * len(units)
    moved = offload_state(graph, [n for n, _ in state])
    g = moved.graph
    assert host_resident(g) == {n for n, _ in state}
    assert json.loads(g.metadata[HOST_STATE_KEY]) == sorted(n for n, _ in state)
    ops = [n.op_type for n in g.nodes]
    assert ops.count(COPY_IN) == ops.count(COPY_OUT) == len(state)
    # every reader of a host-resident value is its copy-in; its update comes from a copy-out
    du = g.def_use()
    for n, _ in state:
        assert [r.op_type for r in du.readers[n]] == [COPY_IN]
    ref_losses, ref_state, _ = _run(graph)
    losses, got, step = _run(g)
    assert step.host_resident == {n for n, _ in state}
    assert losses == ref_losses
    assert got.keys() == ref_state.keys()
    for n in got:
        np.testing.assert_array_equal(got[n], ref_state[n], err_msg=n, strict=True)


def test_the_prediction_leaves_the_state_off_the_device():
    """Bound bytes drop by the whole state; the steady peak by the state less what one
    update holds on the device while it runs."""
    graph = _step("adamw", vocab_size=16384, width=64)
    state = optimizer_state(graph)
    total = sum(b for _, b in state)
    assert total > 2 << 20 and state[0][0] == "wte.weight.exp_avg"
    _, before = predict_step(graph)
    moved = offload_state(graph, [n for n, _ in state])
    a, after = predict_step(moved.graph)
    assert before.bound_bytes - after.bound_bytes == total
    bound = bound_infos(moved.graph, a.in_place.aliased, TrainingStep.of(moved.graph).state)
    assert sum(ti.nbytes for ti in bound) == after.bound_bytes
    drop = before.steady_bytes - after.steady_bytes
    # AdamW's largest update (the embedding's) holds its two state tensors and their new
    # values on the device at once: the state less that window leaves the peak
    assert 0 < total - 2 * state[0][1] <= drop <= total


def test_compile_offloads_the_state_where_the_budget_is_out_of_reach(tmp_path):
    """CUDA (estimated costs here): below the smallest budget without offload, compile
    plans with the optimizer state in host memory, and says so in the report."""
    path = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", **(DIMS | dict(vocab_size=16384, width=64))), path)

    def options(budget, offload: bool) -> CompileOptions:
        return CompileOptions(budget=budget, provider="cuda", offload=offload,
                              strategy="none", build=BuildOptions(
                                  optimizer="adamw", loss_chunks=1, attention_chunks=1,
                                  mlp_chunks=1))  # whole: this is about offload

    plain = compile_model(path, options("min", False))
    need = plain.report["budget_bytes"]
    assert plain.report["offloaded_state"] is None
    below = need - (1 << 20)
    off = compile_model(path, options(below, True))
    rep = off.report["offloaded_state"]
    # the plan without offload was refused there, naming the smallest budget it reaches
    assert rep["used"] and rep["smallest_budget_without_bytes"] == need
    # the largest tensors that cover the deficit went, the rest stays on the device
    assert [t["name"] for t in rep["tensors"]] == ["wte.weight.exp_avg", "wte.weight.exp_avg_sq"]
    assert rep["bytes"] == sum(t["bytes"] for t in rep["tensors"]) == 8 << 20
    assert rep["added_time_s"] > 0 and rep["copies_per_step"] == 2 * len(rep["tensors"])
    assert off.report["plan"]["peak_bytes"] <= below
    assert host_resident(off.graph) == {t["name"] for t in rep["tensors"]}
    # the plan's "at peak" counts the state on the device only (it counted the baseline's)
    at_peak = off.report["plan"]["breakdown_at_peak"]["optimizer_state"]
    assert at_peak <= off.report["baseline"]["breakdown_at_peak"]["optimizer_state"] - (8 << 20)
    # --budget min: all of it, and the report says how far that extends the reach
    smallest = compile_model(path, options("min", True))
    rep = smallest.report["offloaded_state"]
    assert rep["used"] and len(rep["tensors"]) == len(optimizer_state(plain.graph))
    assert rep["smallest_budget_without_bytes"] == need
    assert rep["smallest_budget_bytes"] == smallest.report["budget_bytes"] < below
    # the baseline is the step as built, whatever the state's place in the plan (it was
    # the step with the state moved: below what the step as built needs, budget to budget)
    assert off.report["baseline"]["peak_bytes"] == smallest.report["baseline"]["peak_bytes"] \
        == plain.report["baseline"]["peak_bytes"] > smallest.report["plan"]["peak_bytes"]


def test_the_cpu_provider_never_offloads_state(tmp_path):
    path = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", **DIMS), path)
    r = compile_model(path, CompileOptions(budget="min", provider="cpu", strategy="none",
                                           build=BuildOptions(optimizer="sgd")))
    assert r.report["offloaded_state"] is None and not host_resident(r.graph)
