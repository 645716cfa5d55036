"""The planning request: a budget with an explicit ``MIN`` and one request built from the
compile options (``memcc/passes/planning/request.py``, ``CompileOptions.plan_request``)."""

import pytest

from memcc.compiler import CompileOptions
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest


def test_min_is_a_budget_of_its_own_with_no_bytes():
    assert CompileOptions(budget="min").requested_budget is Budget.MIN
    assert CompileOptions(budget=" MIN ").requested_budget.is_min
    ten = CompileOptions(budget="10MB").requested_budget
    assert not ten.is_min and ten.bytes == 10_000_000 and ten == Budget.of(10_000_000)
    with pytest.raises(ValueError, match="MIN"):
        _ = Budget.MIN.bytes
    # MIN holds nothing in advance; a budget of bytes holds what is at most its bytes.
    assert not Budget.MIN.holds(0)
    assert ten.holds(10_000_000) and not ten.holds(10_000_001)


def test_the_request_carries_what_compile_was_asked():
    options = CompileOptions(budget="min", strategy="ilp", time_limit=7.0, variants=False,
                             allow_lossy=True, provider="cuda")
    request = options.plan_request(Budget.of(123))
    assert request == PlanRequest(
        budget=Budget.of(123), strategy="ilp", time_limit=7.0,
        kinds=DecisionKinds(variants=False, lossy=True, offload=True), device="cuda",
        heap_room=False)
    assert request.at(Budget.MIN).budget is Budget.MIN and request.at(Budget.MIN).strategy == "ilp"
    cpu = CompileOptions(budget="min").plan_request(Budget.MIN)
    assert cpu.kinds == DecisionKinds() and cpu.device == "cpu" and cpu.heap_room


def test_the_segment_counts_simulated_follow_the_work_the_limit_buys():
    """A count from the limit and the step's size (never the clock): a long limit keeps
    every sqrt(n) count, a short one on a large step thins them to the floor, and a count
    given in the request (the region search's, its caller's) is kept."""
    from memcc.passes.planning.planner import MIN_SEGMENT_COUNTS, segment_counts

    at_min = PlanRequest(Budget.MIN, time_limit=60.0)
    assert segment_counts(at_min, 1_000) >= 24
    short = PlanRequest(Budget.MIN, time_limit=2.0)
    assert segment_counts(short, 20_000) == MIN_SEGMENT_COUNTS
    # A budget simulates each count about half as often as the smallest-peak search does.
    middle = PlanRequest(Budget.MIN, time_limit=10.0)
    assert segment_counts(middle.at(Budget.of(1)), 1_650) > segment_counts(middle, 1_650)
    from dataclasses import replace
    assert segment_counts(replace(short, segment_counts=9), 20_000) == 9
