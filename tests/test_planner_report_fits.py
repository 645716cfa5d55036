"""The report's ``strategies`` rows judge "fits" as the picker does.

Found by the first-use audit of session 36 on a transformers BERT (dynamo export) at
``--budget 3.3MB``: the ILP's plan (+3.8% time) read "fits" in ``memcc report`` next to a
polished plan at +12.4% picked as "the cheapest plan that fits". The picker counts a plan's
peak plus the heap room of the small buffers it adds (``Simulation.fit_bytes``); the rows
counted the peak alone."""

from __future__ import annotations

from types import SimpleNamespace

from memcc.passes.planning.context import StrategyResult
from memcc.passes.planning.planner import _finish
from memcc.passes.planning.request import Budget


def _sim(peak: int, heap_room: int, added: float) -> SimpleNamespace:
    return SimpleNamespace(peak_bytes=peak, fit_bytes=peak + heap_room, added_time_s=added,
                           plan=SimpleNamespace(notes={}))


def test_a_plan_over_the_budget_by_its_heap_room_is_not_reported_as_fitting():
    base = _sim(2_000, 0, 0.0)
    cheap = _sim(1_000, 200, 0.001)   # peak within 1,100, not with its heap room
    dear = _sim(1_050, 20, 0.003)     # fits with its heap room
    found = StrategyResult()
    found.add("none", [base], {"strategy": "none"})
    found.add("ilp", [cheap], {"strategy": "ilp"})
    found.add("auto", [dear], {"strategy": "polish", "from": "sqrtn"})
    out = _finish(base, found, Budget.of(1_100), "auto")
    assert out.best is dear
    rows = {r["strategy"]: r for r in out.runs}
    assert rows["ilp"]["fitting"] == 0 and not rows["ilp"]["picked"]
    assert rows["polish"]["fitting"] == 1 and rows["polish"]["picked"]


def test_the_smallest_peak_search_still_judges_by_the_peak():
    base = _sim(2_000, 0, 0.0)
    small = _sim(1_000, 500, 0.002)
    found = StrategyResult()
    found.add("none", [base], {"strategy": "none"})
    found.add("ilp", [small], {"strategy": "ilp"})
    out = _finish(base, found, Budget.of(1_000), "auto", smallest_first=True)
    assert out.best is small
    assert {r["strategy"]: r for r in out.runs}["ilp"]["fitting"] == 1
