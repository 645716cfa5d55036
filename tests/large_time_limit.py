"""``--time-limit`` holds on a large step, under whatever solver release is installed.

MONeT's ResNet-50 step (the zoo's ``resnet50 --preset imagenet --batch 184``) at 8.01 GB,
``--cost analytic``: with highspy 1.16.0 a compile of it was reported still inside HiGHS
after 15 minutes under the default 60 s limit. Here it is planned with a short limit, once
with the installed HiGHS and once with a HiGHS that never returns in time, and the planner
must be done within the limit plus 10%, plus a fixed allowance for what it does before
its clock starts (building the model, the sqrt(n) segmentations) and after (simulating
the answers).

Not collected by a plain ``pytest`` (the file name does not start with ``test_``): it
costs about 40 s on two cores, so CI runs it by path in its second pass (``.ci/run``),
under the newest releases, where a solver that stops honouring its limit would show up.
"""

from __future__ import annotations

import threading
import time

import pytest

from memcc.compiler import CompileOptions, compile_model
from models import build_model

LIMIT_S = 5.0
# The planner's work outside its clock on this step: 2.0 s to build the model and the
# segmentations, under 1 s to simulate the answers, on the two-core machine that measured
# it (BENCHMARKS.md, "The time limit under the newest highspy"); four times that here.
SETUP_S = 12.0


@pytest.fixture(scope="module")
def resnet50_184():
    return build_model("resnet50", preset="imagenet", batch=184)


def _plan(model) -> tuple[float, dict]:
    opts = CompileOptions(budget="8.01GB", cost="analytic", time_limit=LIMIT_S)
    start = time.perf_counter()
    report = compile_model(model, opts).report
    wall = time.perf_counter() - start
    plan_s = next(p["time_s"] for p in report["passes"] if p["name"] == "plan")
    assert plan_s <= wall
    return plan_s, report


def test_the_time_limit_holds_with_the_installed_solver(resnet50_184):
    plan_s, report = _plan(resnet50_184)
    assert plan_s <= LIMIT_S * 1.1 + SETUP_S, report["strategies"]
    assert report["plan"]["fits"]


def test_the_time_limit_holds_when_the_solver_never_returns(resnet50_184, monkeypatch):
    """Every HiGHS solve blocks past its deadline: each is left behind, the plan comes
    from sqrt(n), and the report says the ILP stopped at the time limit."""
    import highspy

    release = threading.Event()

    def stuck(self):
        release.wait(60)   # before the fix, each solve waited this out
        return highspy.HighsStatus.kOk

    monkeypatch.setattr(highspy.Highs, "run", stuck)
    try:
        plan_s, report = _plan(resnet50_184)
    finally:
        release.set()
    assert plan_s <= LIMIT_S * 1.1 + SETUP_S, report["strategies"]
    assert report["solver"]["limit_hit"] == "time"
    assert report["plan"]["fits"]
