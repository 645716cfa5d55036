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
