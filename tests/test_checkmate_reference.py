"""memcc's planner against the exact optimum of its own search space (issue 9's target:
"at most 2% more than the optimum at the same budget" on steps of up to about 60 nodes).

The reference (``tests/checkmate_reference.py``) enumerates every distinct recompute plan
of a small training step and judges each with memcc's own simulator, so the budget means
the same bytes on both sides. Each case asks ``choose_plan(strategy="ilp")`` for a plan at
a budget between the smallest peak memcc's space reaches and the baseline, and checks that
it fits and costs at most 2% more than the optimum (and never less: the reference is exact).
"""

from __future__ import annotations

import functools
import math
import random

import pytest
from checkmate_reference import (
    Point,
    Simulated,
    StageGraph,
    checkmate_frontier,
    checkmate_milp,
    checkmate_peak,
    closed_recompute_sets,
    frontier,
    optimum,
    schedule_of_plan,
    simulate_all,
)

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import DeviceRates, analytic_costs, unit_costs
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import BudgetError, choose_plan
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import simulate
from models import build_model
from models._builder import GraphBuilder, float_input, logits_output, metadata
from models._layers import linear

RATES = DeviceRates(5e10, 1e10, 5e-6, "fixed test rates")
TOLERANCE = 0.02  # issue 9: at most 2% more than the optimum
# Budgets: the smallest peak memcc's space reaches plus this fraction of the way up to the
# baseline peak.
FRACTIONS = (0.0, 0.25, 0.5, 0.75)


# ------------------------------------------------------------------ small steps
def mlp_chain() -> Graph:
    """Four Gemm+Relu layers, activations (batch 512) larger than the weights."""
    return _step(build_model("mlp", batch=512, in_features=32, width=64, depth=4))


def residual_net(batch: int = 512, width: int = 48, blocks: int = 2) -> Graph:
    """Two residual blocks: x + fc2(relu(fc1(x))), then a ReLU."""
    b = GraphBuilder("residual", 0)
    x = float_input(b, [batch, width])
    for k in range(blocks):
        h = b.op("Relu", [linear(b, x, f"block{k}.fc1", width, 2 * width)],
                 name=f"block{k}.relu1")
        h = linear(b, h, f"block{k}.fc2", 2 * width, width)
        x = b.op("Relu", [b.op("Add", [x, h], name=f"block{k}.add")], name=f"block{k}.out")
    logits_output(b, linear(b, x, "head", width, 10), [batch, 10])
    return _step(b.model("", metadata("residual", {}, num_classes=10)))


def attention_block(batch: int = 8, seq: int = 64, width: int = 16) -> Graph:
    """One single-head self-attention with a residual: the scores [seq x seq] dominate."""
    b = GraphBuilder("attention", 0)
    x = float_input(b, [batch, seq, width])
    std = 1.0 / math.sqrt(width)
    q = b.op("MatMul", [x, b.normal("wq", [width, width], std * std)], name="q")
    k = b.op("MatMul", [x, b.normal("wk", [width, width], std)], name="k")
    v = b.op("MatMul", [x, b.normal("wv", [width, width], std)], name="v")
    kt = b.op("Transpose", [k], name="k_t", perm=[0, 2, 1])
    p = b.op("Softmax", [b.op("MatMul", [q, kt], name="scores")], name="probs", axis=-1)
    x = b.op("Add", [x, b.op("MatMul", [p, v], name="context")], name="res")
    logits = b.op("MatMul", [x, b.normal("head", [width, 10], std)], name="head")
    logits_output(b, logits, [batch, seq, 10])
    return _step(b.model("", metadata("attention", {}, num_classes=10)))


def _step(model) -> Graph:
    # Plain SGD: the momentum's nodes would only add update work no plan touches.
    return build_training_step(load_graph(model), BuildOptions(momentum=0.0))


STEPS = {"mlp": mlp_chain, "residual": residual_net, "attention": attention_block}
COSTS = {"analytic": lambda g: analytic_costs(g, RATES), "unit": unit_costs}

# A miss is a failed assertion or a plan-less pytest.fail, never another exception.
MISS = (AssertionError, pytest.fail.Exception)
# Cases the planner misses, with what was measured (strict: a fix turns them into failures
# that say "remove the mark"). Empty since the recompute model places each clone's birth
# explicitly (chains of any depth); before, 8 cases here found no plan at the two lowest
# budgets of the residual and attention steps.
MISSED: dict[tuple[str, str, float], str] = {}


@functools.cache
def reference(name: str) -> tuple[Graph, StepStructure, list[Simulated]]:
    """A step, its structure and every distinct plan simulated (once per test session:
    enumerating is most of this file's run time)."""
    g = STEPS[name]()
    st = StepStructure.of(g)
    return g, st, simulate_all(g, st)


def _cases():
    for name in sorted(STEPS):
        for cost in sorted(COSTS):
            for f in FRACTIONS:
                reason = MISSED.get((name, cost, f))
                marks = [pytest.mark.xfail(strict=True, reason=reason, raises=MISS)
                         ] if reason else []
                yield pytest.param(name, cost, f, marks=marks, id=f"{name}-{cost}-{f}")


@pytest.mark.parametrize("name", sorted(STEPS))
def test_steps_are_small_and_their_plans_enumerable(name):
    g, st, plans = reference(name)
    assert len(st.forward) <= 60, name
    assert 2 < len(plans) <= 5_000, name
    # Recomputing saves something on every step, or the comparison says nothing.
    base = next(p.peak_bytes for p in plans if not p.recompute)
    assert min(p.peak_bytes for p in plans) < 0.95 * base, name


@pytest.mark.parametrize("name", sorted(STEPS))
def test_plans_outside_the_closed_sets_add_nothing_new(name):
    """Any subset of recomputable nodes lowers to the same step as its closed part, so the
    enumeration covers memcc's whole space: random subsets land on enumerated peaks."""
    g, st, plans = reference(name)
    seen = {p.recompute: p.peak_bytes for p in plans}
    rng = random.Random(0)
    nodes = sorted(st.recomputable)
    unit = unit_costs(g)
    for _ in range(12):
        subset = frozenset(n for n in nodes if rng.random() < 0.5)
        sim = simulate(g, Plan(subset), unit, st)
        closed = frozenset(sim.cloned_nodes)
        assert closed in seen, (name, sorted(subset))
        assert sim.peak_bytes == seen[closed]
    assert len(seen) == len(closed_recompute_sets(g, st))


@pytest.mark.parametrize(("name", "cost", "fraction"), list(_cases()))
def test_ilp_is_within_two_percent_of_the_exact_optimum(name, cost, fraction):
    g, st, plans = reference(name)
    costs = COSTS[cost](g)
    front = frontier(plans, costs, g)
    smallest, base = front[0].peak_bytes, front[-1].peak_bytes
    budget = int(smallest + fraction * (base - smallest))
    best: Point | None = optimum(front, budget)
    assert best is not None
    try:
        # The reference enumerates recompute sets only, so the ILP plans without variants.
        out = choose_plan(g, costs, PlanRequest(Budget.of(budget), strategy="ilp", time_limit=20,
                                                kinds=DecisionKinds(variants=False)), structure=st)
    except BudgetError as exc:
        pytest.fail(f"{name}/{cost}: ilp found no plan within {budget:,} B "
                    f"({budget / base:.3f} of the baseline); the optimum fits at "
                    f"+{best.added_time_s:.6g} recomputing {sorted(best.recompute)} "
                    f"(smallest ilp reached: {exc.smallest:,} B)")
    got = out.best
    assert got.peak_bytes <= budget
    assert simulate(g, got.plan, costs, st).peak_bytes == got.peak_bytes
    eps = 1e-12 + 1e-9 * best.added_time_s
    assert got.added_time_s >= best.added_time_s - eps, "the reference is not the optimum"
    assert got.added_time_s <= (1 + TOLERANCE) * best.added_time_s + eps, (
        f"{name}/{cost} at {budget:,} B: ilp +{got.added_time_s:.6g} "
        f"({sorted(got.plan.recompute)}), optimum +{best.added_time_s:.6g} "
        f"({sorted(best.recompute)})")


# ------------------------------------------------------------------ Checkmate's MILP
@pytest.mark.parametrize("name", sorted(STEPS))
def test_checkmate_milp_is_never_dearer_than_memccs_space(name):
    """Checkmate's stage x node MILP, in its own memory model, at the smallest peak memcc's
    space reaches in that model: solved to optimality by HiGHS, its schedule fits when
    replayed, its modelled peak is the replayed one, and it costs no more than memcc's best
    plan there (its space contains memcc's, so anything else is a modelling error)."""
    g, st, plans = reference(name)
    sg = StageGraph.of(g, unit_costs(g), st)
    front = checkmate_frontier(sg, plans)
    budget = front[0].peak_bytes
    res = checkmate_milp(sg, budget, time_limit=30)
    assert res.status == "optimal", name
    replayed = checkmate_peak(sg, res.runs)
    assert replayed <= budget
    assert res.modelled_peak == pytest.approx(replayed)
    assert all(t in runs for t, runs in enumerate(res.runs))  # every node runs in its stage
    assert res.added_time_s <= front[0].added_time_s + 1e-9


def test_memccs_baseline_is_checkmates_schedule_without_recompute():
    """The replay agrees with the MILP on the schedule that recomputes nothing."""
    g, st, _ = reference("mlp")
    sg = StageGraph.of(g, unit_costs(g), st)
    plain = schedule_of_plan(sg, ())
    res = checkmate_milp(sg, checkmate_peak(sg, plain), time_limit=30)
    assert res.status == "optimal" and res.added_time_s == 0.0
    assert res.modelled_peak == pytest.approx(checkmate_peak(sg, plain))
