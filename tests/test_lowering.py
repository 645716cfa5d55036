"""The plan of actions and the lowering made of checked passes.

Old-style plans (a set of forward nodes to recompute) keep working and lower to the very
graph ``apply_recompute`` produced; the per-value actions are a view of the same plan; the
passes refuse what they cannot do (an unknown variant, an offload of a value that is
not saved) with a clear error, and their
``ensures`` catch a pass that breaks the graph.
"""

from __future__ import annotations

import pytest
from onnx import helper

from memcc.backend.runner import synthetic_feeds
from memcc.backend.verify import compare_outputs, step_outputs
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.cost_model import unit_costs
from memcc.passes.lowering.lower import (
    PASSES,
    InsertRecompute,
    LoweringError,
    copy_order_problems,
    lower,
)
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.plan import (
    KEEP,
    RECOMPUTE,
    Keep,
    Offload,
    Offloadable,
    Plan,
    PlanError,
    Recompute,
    Saveable,
    StepStructure,
    everything_saveable,
    nothing_saveable,
    save_only_these_values,
)
from memcc.passes.planning.simulate import simulate
from models import build_model


@pytest.fixture(scope="module")
def step():
    g = build_training_step(load_graph(build_model("mlp", batch=16, width=64, depth=4)),
                            BuildOptions(optimizer="sgd"))
    return g, StepStructure.of(g)


def _names(graph):
    return [(n.name, list(n.input), list(n.output)) for n in graph.nodes]


# ---------------------------------------------------------------------------- the plan
def test_old_constructor_and_field_work_as_before(step):
    g, st = step
    nodes = frozenset(sorted(st.recomputable)[:3])
    plan = Plan(nodes, "sqrtn", {"segments": 2})
    assert plan.recompute == nodes and plan.strategy == "sqrtn"
    assert Plan.from_recompute(nodes, "sqrtn", {"segments": 2}) == plan
    assert plan.to_json() == {"strategy": "sqrtn", "recompute": sorted(nodes),
                              "notes": {"segments": 2}}
    assert Plan().recompute == frozenset() and Plan().offload == {} and Plan().variants == {}


def test_actions_are_per_saved_value(step):
    g, st = step
    node = sorted(st.recomputable & set(st.producer_of.values()))[0]
    plan = Plan(frozenset({node}))
    actions = plan.actions(st)
    assert set(actions) == set(st.saved)
    for value, action in actions.items():
        want = RECOMPUTE if st.producer_of[value] == node else KEEP
        assert action == want
    assert Plan.from_actions(actions, st).recompute == plan.recompute
    assert Saveable is Keep and Offloadable is Offload and isinstance(RECOMPUTE, Recompute)


def test_from_actions_rejects_what_the_step_lacks(step):
    g, st = step
    with pytest.raises(PlanError, match="not a saved value"):
        Plan.from_actions({"no-such-value": KEEP}, st)
    value = sorted(st.saved)[0]
    plan = Plan.from_actions({value: Offload("host")}, st)
    assert plan.action(value, st) == Offload("host") and not plan.recompute
    assert plan.to_json()["offload"] == {value: {"src": "device", "dst": "host"}}
    with pytest.raises(ValueError, match="memory spaces"):
        Offload("disk")


def test_variants_default_and_validate(step):
    g, st = step
    node = sorted(st.forward)[0]
    assert Plan().variant(node) == "default"
    assert Plan(variants={node: "default"}).variant(node) == "default"
    with pytest.raises(PlanError, match="rule name"):
        Plan(variants={node: ""})


# ---------------------------------------------------------------------------- the passes
def test_passes_run_in_the_fixed_order(step):
    g, st = step
    low = lower(g, Plan(), st, check="full")
    assert [r.name for r in low.reports] == \
        ["substitute-variants", "insert-recompute", "insert-copies"]
    assert [p.name for p in PASSES] == [r.name for r in low.reports]
    assert not any(r.changed for r in low.reports)


def test_lowering_is_the_recompute_lowering_node_for_node(step):
    g, st = step
    plan = Plan(frozenset(st.recomputable))
    low = lower(g, plan, st, check="full")
    old = apply_recompute(g, plan, st)
    assert _names(low.graph) == _names(old.graph)
    assert low.cloned_nodes == old.cloned_nodes and low.cloned_nodes
    assert low.recomputed_values == old.recomputed_values
    assert dict(low.rerun_before) == old.rerun_before
    feeds = synthetic_feeds(g, seed=1)
    assert compare_outputs(step_outputs(g, feeds, "cpu"),
                           step_outputs(low.graph, feeds, "cpu"), exact=True) == []


def test_simulate_is_lowering_plus_liveness(step):
    g, st = step
    plan = Plan(frozenset(sorted(st.recomputable)[::2]))
    sim = simulate(g, plan, unit_costs(g), st)
    assert [r.name for r in sim.passes] == [p.name for p in PASSES]
    assert _names(sim.graph) == _names(lower(g, plan, st).graph)
    assert sim.cloned_nodes and sim.added_time_s > 0


def test_variants_that_do_not_exist_are_refused_clearly(step):
    g, st = step
    node = next(n.name for n in g.nodes if n.op_type == "Relu")
    with pytest.raises(LoweringError, match="has no variant 'inverted'"):
        lower(g, Plan(variants={node: "inverted"}), st)
    with pytest.raises(LoweringError, match="not forward nodes"):
        lower(g, Plan(variants={"no-such-node": "default"}), st)


def _offloadable(g, st):
    from memcc.passes.lowering.swap import offload_problems

    return [v for v in sorted(st.saved)
            if not offload_problems(g, Plan(offload={v: Offload("host")}), st)]


@pytest.mark.parametrize("name", ["mlp", "gpt2"])
def test_offloaded_values_go_out_after_the_forward_and_back_before_the_backward(name, tmp_path):
    """Issue 11 item 3/4 on CPU: the copies run there (plain copies), the outputs are bit
    for bit the original's, ORT executes the planned order, and nothing but the copy-out
    reads the device original after the forward pass."""
    from memcc.backend.onnx_file import save_graph
    from memcc.backend.runner import RunRequest, run_steps

    kw = {"mlp": dict(batch=16, width=64, depth=4), "gpt2": dict(batch=2, seq_len=32)}[name]
    g = build_training_step(load_graph(build_model(name, **kw)), BuildOptions(optimizer="sgd"))
    st = StepStructure.of(g)
    values = _offloadable(g, st)
    assert len(values) >= 3, name
    plan = Plan(frozenset(), "hand", {}, {v: Offload("host") for v in values})
    low = lower(g, plan, st, check="full")
    report = low.reports[-1]
    assert report.changed and report.summary["copies"] == 2 * len(values)
    nodes = low.graph.nodes
    where = {n.name: i for i, n in enumerate(nodes)}
    for v in values:
        out = next(n for n in nodes if n.op_type == "MemcpyToHost" and n.input[0] == v)
        back = next(n for n in nodes if n.op_type == "MemcpyFromHost"
                    and n.input[0] == out.output[0])
        readers = [n for n in nodes if v in n.input and n is not out]
        assert all(r.name in st.forward for r in readers), v
        last = max(where[r.name] for r in readers + [n for n in nodes if v in n.output])
        first = min(where[n.name] for n in nodes if back.output[0] in n.input)
        # Right after the last forward reader, right before the first backward reader (other
        # copies placed at the same point may sit in between).
        assert last < where[out.name] and where[back.name] < first, v
        between = nodes[last + 1:where[out.name]] + nodes[where[back.name] + 1:first]
        assert all(n.op_type.startswith("Memcpy") for n in between), v
    feeds = synthetic_feeds(g, seed=1)
    assert compare_outputs(step_outputs(g, feeds, "cpu"),
                           step_outputs(low.graph, feeds, "cpu"), exact=True) == []
    path = save_graph(low.graph, tmp_path / "swapped.onnx")
    run = run_steps(path, RunRequest(steps=2))
    assert run.order_matches_plan, run.executed_order_mismatch


def test_offload_refuses_what_it_cannot_copy(step):
    g, st = step
    value = _offloadable(g, st)[0]
    producer = g.def_use().producer[value].name
    with pytest.raises(LoweringError, match="both recomputed and offloaded"):
        lower(g, Plan(frozenset({producer}), "hand", {}, {value: Offload("host")}), st)
    for fixed in (g.inputs[0], sorted(g.initializers)[0]):  # stays where it is
        with pytest.raises(LoweringError, match="not saved|not computed by the forward pass"):
            lower(g, Plan(offload={fixed: Offload("host")}), st)
    with pytest.raises(LoweringError, match="not saved"):
        lower(g, Plan(offload={"no-such-value": Offload("host")}), st)


def test_recompute_of_a_backward_node_is_a_strategy_bug(step):
    g, st = step
    backward = next(n.name for n in g.nodes if n.name not in st.forward)
    with pytest.raises(LoweringError, match="not forward nodes"):
        lower(g, Plan(frozenset({backward})), st)


def test_ensures_catch_a_pass_that_breaks_the_order(step):
    g, st = step

    class Broken(InsertRecompute):
        def run(self, graph):
            out, summary = super().run(graph)
            out.set_nodes(list(reversed(out.nodes)))
            return out, summary

    plan = Plan(frozenset(st.recomputable))
    with pytest.raises(LoweringError, match="not a valid execution order"):
        lower(g, plan, st, passes=(Broken,))
    lower(g, plan, st, passes=(Broken,), check="off")  # only ensures catch it


def test_ensures_catch_a_stale_index(step):
    g, st = step

    class Sloppy(InsertRecompute):
        def run(self, graph):
            out, summary = super().run(graph)
            du = out.def_use()
            # The lowered step shares the step's nodes: one of its own to edit (the index
            # told), then an edit behind the index's back.
            node = du.own(out.nodes, len(out.nodes) - 1)
            node.input[0] = node.input[0]  # fine; now an edit behind the index's back:
            node.output[0], keep = node.output[0] + ".renamed", node.output[0]
            out.outputs = [o if o != keep else node.output[0] for o in out.outputs]
            assert du is out.def_use()
            return out, summary

    with pytest.raises(LoweringError, match="def-use index is stale"):
        lower(g, Plan(frozenset(st.recomputable)), st, passes=(Sloppy,), check="full")


def test_copy_in_must_follow_its_copy_out():
    out_node = helper.make_node("MemcpyToHost", ["a"], ["a.host"], name="out")
    in_node = helper.make_node("MemcpyFromHost", ["a.host"], ["a.dev"], name="in")

    class G:
        nodes = [in_node, out_node]

    assert copy_order_problems(G()) == ["'in' copies 'a.host' in before it was copied out"]
    G.nodes = [out_node, in_node]
    assert copy_order_problems(G()) == []


def test_policies_named_like_jax(step):
    g, st = step
    assert everything_saveable(st).recompute == frozenset()
    everything = nothing_saveable(st)
    assert all(isinstance(a, Recompute) or st.producer_of[v] not in st.recomputable
               for v, a in everything.actions(st).items())
    keep = sorted(st.saved)[:2]
    plan = save_only_these_values(st, keep)
    assert all(plan.action(v, st) == KEEP for v in keep)
    assert plan.recompute < everything.recompute
    with pytest.raises(PlanError, match="not saved values"):
        save_only_these_values(st, ["nope"])
    assert lower(g, everything, st, check="full").cloned_nodes


def test_variant_memo_gives_the_same_simulation(step):
    """A search's ``VariantMemo`` (``PlanningContext.memo``) substitutes each set of variants
    once; every plan it judges comes out as without it: peak, liveness, the lowered nodes
    in order and the passes' reports."""
    from memcc.passes.lowering.lower import VariantMemo
    from memcc.passes.lowering.variant_substitution import applicable_variants, rule_nodes

    g, st = step
    rules = rule_nodes(g)
    chosen = {n.name: vs[0].name for n in g.nodes if n.name in st.forward
              for vs in [applicable_variants(g, n, rules)] if vs}
    assert chosen
    costs, memo = unit_costs(g), VariantMemo()
    rc = sorted(st.recomputable)
    plans = [Plan(frozenset(rc[::2]), variants=chosen), Plan(frozenset(rc[1::2]), variants=chosen),
             Plan(frozenset(rc[::3]), variants=dict(list(chosen.items())[:1])), Plan(frozenset(rc))]
    for plan in plans:
        want = simulate(g, plan, costs, st)
        got = simulate(g, plan, costs, st, memo=memo)
        assert _names(got.graph) == _names(want.graph)
        assert got.liveness.live_during == want.liveness.live_during
        assert (got.peak_bytes, got.added_time_s) == (want.peak_bytes, want.added_time_s)
        assert [(r.name, r.summary, r.changed) for r in got.passes] == \
            [(r.name, r.summary, r.changed) for r in want.passes]
    assert len(memo._done) == 2  # two sets of variants asked, each substituted once
