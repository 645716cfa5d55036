"""Heap room for small buffers: what compile keeps free beyond the plan's predicted peak.

On the CPU with malloc, glibc's heap costs a step more than the bytes of its buffers under
the mmap threshold; ``passes.analysis.liveness.heap_allowance_bytes`` sizes that room and compile
adds
it to the slack, counted on the plan it returns (BENCHMARKS.md, "Heap allowance for small
buffers", measures it on torchvision and timm exports).
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from memcc.compiler import BASE_SLACK_BYTES, CompileOptions, compile_model, user_budget
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.liveness import (
    CPU_MMAP_THRESHOLD,
    HEAP_BYTES_PER_SMALL_BUFFER,
    heap_allowance_bytes,
    small_buffers,
)
from memcc.passes.planning.planner import BudgetError
from memcc.passes.planning.request import Budget, PlanRequest
from models import build_model


def test_small_buffers_counts_inputs_stored_values_and_node_outputs_under_the_threshold():
    small, large = [8], [CPU_MMAP_THRESHOLD // 4]  # 32 bytes; exactly the threshold
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["a"]),          # small
         helper.make_node("Reshape", ["a", "shape"], ["r"]),  # small alias: still counted
         helper.make_node("Add", ["big", "big"], ["b"])],     # at the threshold: an mmap
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, small),
         helper.make_tensor_value_info("big", TensorProto.FLOAT, large)],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, small),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, large)],
        [helper.make_tensor("w", TensorProto.FLOAT, small, [0.0] * 8),
         helper.make_tensor("shape", TensorProto.INT64, [1], [8])])
    m = onnx.shape_inference.infer_shapes(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    graph = Graph.from_model(m)
    # x, w, shape, a, r; not big (input) nor b (output), 4,096 bytes each
    assert small_buffers(graph) == 5
    assert heap_allowance_bytes(graph) == 5 * HEAP_BYTES_PER_SMALL_BUFFER


# Whole steps: these are about heap room, and compile's row-chunk search (a smallest-peak
# search per setting; the MLP's layers are row-chunk sites) tripled them.
WHOLE = BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1)


def _mlp(tmp_path, **dims):
    path = tmp_path / "mlp.onnx"
    onnx.save(build_model("mlp", in_features=16, **dims), str(path))
    return path


def test_slack_has_heap_room_only_where_the_step_allocates_from_malloc(tmp_path):
    step = build_training_step(load_graph(_mlp(tmp_path, batch=4, width=24, depth=3)),
                               BuildOptions())
    heap = heap_allowance_bytes(step)
    assert heap > 0
    assert CompileOptions().slack_for(step) == BASE_SLACK_BYTES + heap
    # an arena rounds small buffers itself (its model does); CUDA's memory is not glibc's
    assert CompileOptions(arena=True).slack_for(step) == BASE_SLACK_BYTES
    assert CompileOptions(provider="cuda").slack_for(step) == BASE_SLACK_BYTES
    assert CompileOptions(slack_bytes=0).slack_for(step) == 0
    with pytest.raises(Exception, match="slack"):
        CompileOptions(slack_bytes=-1)


def test_budget_min_keeps_room_for_the_plans_own_small_buffers(tmp_path):
    result = compile_model(_mlp(tmp_path, batch=60, width=15, depth=16),
                           CompileOptions(budget="min", cost="analytic", build=WHOLE))
    report = result.report
    heap = HEAP_BYTES_PER_SMALL_BUFFER * small_buffers(result.graph)
    assert report["heap_allowance_bytes"] == heap
    assert report["slack_bytes"] == BASE_SLACK_BYTES + heap
    assert report["budget_bytes"] == user_budget(report["plan"]["peak_bytes"],
                                                  CompileOptions(), BASE_SLACK_BYTES + heap)
    exact = compile_model(_mlp(tmp_path, batch=60, width=15, depth=16),
                          CompileOptions(budget="min", cost="analytic", slack_bytes=0,
                                                          build=WHOLE))
    assert exact.report["heap_allowance_bytes"] == 0 and exact.report["slack_bytes"] == 0


def test_a_budget_without_room_for_recomputed_small_buffers_is_refused_as_min_would(tmp_path):
    """The smallest plan recomputes small values, which the step as built does not have: a
    budget that leaves room only for the built step's small buffers does not fit, the
    refusal names the budget --budget min gives, and that budget fits."""
    path = _mlp(tmp_path, batch=60, width=15, depth=16)
    smallest = compile_model(path, CompileOptions(budget="min", cost="analytic", build=WHOLE))
    built = build_training_step(load_graph(path), BuildOptions())
    assert small_buffers(smallest.graph) > small_buffers(built)
    options = CompileOptions(cost="analytic")
    tight = user_budget(smallest.report["plan"]["peak_bytes"], options,
                         options.slack_for(built))
    with pytest.raises(BudgetError) as refused:
        compile_model(path, CompileOptions(budget=tight, cost="analytic", build=WHOLE))
    named = refused.value.smallest
    assert named == smallest.report["budget_bytes"]
    fits = compile_model(path, CompileOptions(budget=named, cost="analytic", build=WHOLE))
    report = fits.report
    assert report["plan"]["peak_bytes"] <= report["planning_budget_bytes"]
    assert report["planning_budget_bytes"] == int(
        report["budget_bytes"] * (1 - report["margin"])) - report["slack_bytes"]
    assert report["slack_bytes"] >= (BASE_SLACK_BYTES + HEAP_BYTES_PER_SMALL_BUFFER
                                     * small_buffers(fits.graph))


def test_a_plan_fits_a_budget_with_the_heap_room_of_the_small_buffers_it_adds(tmp_path):
    from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
    from memcc.passes.planning.planner import choose_plan

    step = build_training_step(load_graph(_mlp(tmp_path, batch=60, width=15, depth=16)),
                               BuildOptions())
    costs = analytic_costs(step, NOMINAL_CPU)
    smallest = choose_plan(step, costs, PlanRequest(Budget.MIN, heap_room=True)).best
    added = small_buffers(smallest.graph) - small_buffers(step)
    assert added > 0 and smallest.heap_room == HEAP_BYTES_PER_SMALL_BUFFER * added
    assert smallest.fit_bytes == smallest.peak_bytes + smallest.heap_room
    # a budget that holds the smallest peak but not its added buffers' room: with the room
    # weighed, that plan does not fit it
    tight = smallest.peak_bytes + smallest.heap_room // 2
    loose = choose_plan(step, costs, PlanRequest(Budget.of(tight)))
    assert loose.best.peak_bytes <= tight
    try:
        weighed = choose_plan(step, costs, PlanRequest(Budget.of(tight), heap_room=True)).best
    except BudgetError:
        return
    assert weighed.fit_bytes <= tight


def _two_plans(tmp_path):
    """The MLP step's baseline and two plans of it: one with the smaller peak but more heap
    room for the small buffers it adds, one with a larger peak and none."""
    from dataclasses import replace

    from memcc.passes.analysis.cost_model import unit_costs
    from memcc.passes.plan import Plan
    from memcc.passes.planning.context import StrategyResult
    from memcc.passes.planning.simulate import simulate

    graph = build_training_step(load_graph(_mlp(tmp_path, batch=4, width=8, depth=2)), WHOLE)
    base = simulate(graph, Plan(), unit_costs(graph))
    low = replace(base, peak_bytes=base.peak_bytes - 300, heap_room=500)
    high = replace(base, peak_bytes=base.peak_bytes - 100, heap_room=0)
    found = StrategyResult()
    found.add("none", [base], {"strategy": "none"})
    found.add("sqrtn", [low, high], {"strategy": "sqrtn"})
    return base, low, high, found


def test_budget_min_picks_the_plan_of_the_smallest_budget_not_of_the_smallest_peak(tmp_path):
    """--budget min names the smallest budget: the plan whose peak and added heap room are
    least (the zoo's SegFormer: 6.80 MB, where the smallest peak's plan needed 7.48)."""
    from memcc.passes.planning.planner import _finish

    _, low, high, found = _two_plans(tmp_path)
    outcome = _finish(found.plans[0][1], found, Budget.MIN, "sqrtn", smallest_first=True)
    assert outcome.best is high and high.fit_bytes < low.fit_bytes


def test_a_refusal_without_the_search_names_the_least_budget_of_the_plans_found(tmp_path):
    """A screen's refusal (no smallest-peak search) names what its plans need with their
    own heap room, not the smallest peak with the step's: that figure was refused when
    given back as a budget."""
    from memcc.passes.planning.planner import _finish

    base, low, high, found = _two_plans(tmp_path)
    with pytest.raises(BudgetError) as info:
        _finish(base, found, Budget.of(1000), "sqrtn")
    assert info.value.smallest == low.peak_bytes
    assert info.value.smallest_fit == high.fit_bytes < low.fit_bytes
