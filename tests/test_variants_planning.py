"""Variants in the planner: the ILP chooses them with recompute, the lowering realises
them, the report describes them, and ``--verify`` holds them to their tier.

(The numerics of each variant against the default rule and PyTorch: tests/test_variants.py.)
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memcc.backend.runner import synthetic_feeds
from memcc.backend.verify import compare_outputs, step_outputs
from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
from memcc.passes.lowering.lower import LoweringError, lower
from memcc.passes.lowering.variant_substitution import apply_variants
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import build_problem, choose_plan
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import simulate
from models import build_model


def _relu_then_scale(batch: int = 2048, width: int = 64) -> onnx.ModelProto:
    """x @ W1 -> Relu -> * 2 -> @ W2 -> Tanh -> @ W3: the Relu's output is saved only for
    the Relu's own backward (Mul by a constant needs none), so a 1-byte mask frees it for
    the whole rest of the step, while recomputing it means re-running the MatMul in front
    (its input h dies after the Relu)."""
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, int]) -> onnx.TensorProto:
        return numpy_helper.from_array(
            (rng.standard_normal(shape) * 0.05).astype(np.float32), name)

    two = numpy_helper.from_array(np.asarray(2.0, np.float32), "two")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "two"], ["m"], name="scale"),
        helper.make_node("MatMul", ["m", "w2"], ["h2"], name="mm2"),
        helper.make_node("Tanh", ["h2"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "w3"], ["y"], name="mm3"),
    ]
    g = helper.make_graph(
        nodes, "relu_scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 10])],
        [weight("w1", (width, width)), weight("w2", (width, width)),
         weight("w3", (width, 10)), two])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def relu_step():
    g = build_training_step(load_graph(_relu_then_scale()), BuildOptions(optimizer="sgd"))
    return g, StepStructure.of(g), analytic_costs(g, NOMINAL_CPU)


def test_the_ilp_prefers_a_mask_to_recomputing_a_matmul(relu_step):
    g, st, costs = relu_step
    base = simulate(g, Plan(), costs, st)
    r_bytes = g.info["r"].nbytes
    budget = base.peak_bytes - r_bytes // 2
    with_variants = choose_plan(g, costs, PlanRequest(Budget.of(budget), strategy="ilp"),
                                structure=st, baseline=base)
    assert with_variants.best.peak_bytes <= budget
    assert with_variants.best.plan.variants == {"relu": "mask"}
    assert "mm1" not in with_variants.best.plan.recompute
    # Without variants the same budget needs the MatMul re-run: dearer.
    without = choose_plan(g, costs, PlanRequest(Budget.of(budget), strategy="ilp",
                                                kinds=DecisionKinds(variants=False)),
                          structure=st, baseline=base)
    assert without.best.peak_bytes <= budget and not without.best.plan.variants
    assert without.best.added_time_s > with_variants.best.added_time_s


def test_a_variant_plan_lowers_to_the_same_numbers_and_keeps_the_forward(relu_step):
    g, st, _ = relu_step
    plan = Plan(variants={"relu": "mask"})
    low = lower(g, plan, st, check="full")
    after = StepStructure.of(low.graph)
    assert "r" not in after.saved                 # the float output is no longer handed on
    assert any(g2.op_type == "Greater" for g2 in low.graph.nodes
               if g2.name in after.forward)       # the mask is taken in the forward pass
    assert st.forward <= after.forward
    feeds = synthetic_feeds(g, seed=0)
    assert compare_outputs(step_outputs(g, feeds, "cpu"), step_outputs(low.graph, feeds, "cpu"),
                           exact=True) == []
    # The input graph is untouched.
    assert [n.name for n in g.nodes] == [n.name for n in simulate(
        g, Plan(), analytic_costs(g, NOMINAL_CPU), st).graph.nodes]


def test_recompute_after_a_variant_uses_the_step_with_the_variant(relu_step):
    g, st, costs = relu_step
    sim = simulate(g, Plan(frozenset({"scale"}), variants={"relu": "mask"}), costs, st)
    feeds = synthetic_feeds(g, seed=0)
    assert compare_outputs(step_outputs(g, feeds, "cpu"), step_outputs(sim.graph, feeds, "cpu"),
                           exact=True) == []


def test_bad_variant_requests_are_refused_by_name(relu_step):
    g, st, _ = relu_step
    with pytest.raises(LoweringError, match="has no variant 'nope'"):
        lower(g, Plan(variants={"relu": "nope"}), st)
    with pytest.raises(LoweringError, match="not forward nodes"):
        lower(g, Plan(variants={"no-such-node": "mask"}), st)
    # A step built before rule records existed cannot take variants, and says why.
    old = g.copy()
    for n in old.nodes:
        keep = [p for p in n.metadata_props if p.key not in ("memcc.grad_in",
                                                             "memcc.grad_out")]
        del n.metadata_props[:]
        n.metadata_props.extend(keep)
    with pytest.raises(LoweringError, match="rebuild it with memcc build"):
        lower(old, Plan(variants={"relu": "mask"}), StepStructure.of(old))


def _resnet_problem(batch: int, resolution: int):
    """A ResNet-18 SGD step, its structure, costs, baseline and ILP problem."""
    g = build_training_step(load_graph(build_model("resnet18", batch=batch,
                                                   resolution=resolution)),
                            BuildOptions(optimizer="sgd"))
    st = StepStructure.of(g)
    costs = analytic_costs(g, NOMINAL_CPU)
    base = simulate(g, Plan(), costs, st)
    return g, st, costs, base, build_problem(g, st, base.liveness, costs)


def test_one_variant_per_node_and_only_where_it_applies():
    g, st, costs, base, pp = _resnet_problem(4, 32)
    chosen = pp.variants.choice_of
    assert chosen, "resnet18 offers variants (Relu masks at least)"
    ops = {n.name: n.op_type for n in g.nodes}
    assert {ops[node] for node, _ in chosen.values()} >= {"Relu"}
    # Each node's variants form one choice group (at most one is picked).
    groups = [set(grp.tolist()) for grp in pp.problem.choice_groups]
    by_node: dict[str, set[int]] = {}
    for var, (node, _) in chosen.items():
        by_node.setdefault(node, set()).add(var)
    for node, vars_ in by_node.items():
        if len(vars_) > 1:
            assert vars_ in groups, node
    # Every candidate lowers and simulates (so the planner can judge it).
    for node, name in list(chosen.values())[:12]:
        res = apply_variants(g, Plan(variants={node: name}))
        assert res.substituted == ((node, f"{ops[node]}:{name}"),)
        sim = simulate(g, Plan(variants={node: name}), costs, st)
        assert sim.peak_bytes > 0


def test_compile_reports_variants_and_verifies_within_their_tier(tmp_path, relu_step):
    g, st, costs = relu_step
    budget = simulate(g, Plan(), costs, st).peak_bytes - g.info["r"].nbytes // 2
    path = tmp_path / "m.onnx"
    onnx.save(_relu_then_scale(), path)
    opts = CompileOptions(budget=budget, cost="analytic", verify=True, margin=0.0,
                          slack_bytes=0)
    res = compile_model(path, opts, output=tmp_path / "out.onnx",
                        report_path=tmp_path / "r.json")
    report = json.loads((tmp_path / "r.json").read_text())
    v = report["plan"]["variants"]
    assert v["chosen"] == {"relu": "mask"}
    kind = v["by_kind"]["Relu:mask"]
    assert kind["nodes"] == 1 and kind["bytes_saved"] > 0 and kind["tier"] == "exact"
    assert v["exactness"] == "exact"
    assert report["verification"]["ok"]
    assert report["verification"]["comparison"] == "bit-identical"
    assert any(n.name.startswith("relu/mask/") for n in res.graph.nodes)
    # --no-variants: the same compile chooses none.
    res2 = compile_model(path, CompileOptions(budget=budget, cost="analytic", margin=0.0,
                                              slack_bytes=0, variants=False))
    assert res2.report["plan"]["variants"]["chosen"] == {}


def test_equivalent_outputs_are_checked_against_the_stated_tolerance():
    a = {"g": np.array([1.0, 2.0, 4.0], np.float32)}
    close = {"g": np.array([1.0, 2.0, 4.0 + 4e-6], np.float32)}
    far = {"g": np.array([1.0, 2.0, 4.01], np.float32)}
    assert compare_outputs(a, close, exact=True)            # not bit-identical
    assert compare_outputs(a, close, exact=False, tolerance=1e-5) == []
    assert "beyond the plan's stated tolerance" in compare_outputs(
        a, far, exact=False, tolerance=1e-5)[0]
    # An output that is zero up to rounding is compared relative to a tenth of the largest
    # output of its kind, not to its own noise; one that is small but real still is.
    a["noise"], a["small"] = (np.array([2e-14], np.float32), np.array([3e-3], np.float32))
    b = {**a, "noise": np.array([-1e-14], np.float32), "small": np.array([3.1e-3], np.float32)}
    assert compare_outputs(a, {**b, "small": a["small"]}, exact=False, tolerance=1e-5) == []
    assert "'small'" in compare_outputs(a, b, exact=False, tolerance=1e-5)[0]
    # Kinds: a small output is judged against the largest of its own kind. Alone in its
    # kind, "small" is its own scale: 3% relative is beyond 1e-5.
    kinds = {"g": "parameters", "noise": "gradients", "small": "gradients"}
    tiny = {**b, "small": np.array([3e-3 * (1 + 5e-6)], np.float32)}
    assert compare_outputs(a, tiny, exact=False, tolerance=1e-5, kinds=kinds) == []
    assert "'small'" in compare_outputs(a, b, exact=False, tolerance=1e-5, kinds=kinds)[0]


@pytest.mark.parametrize("family,exporter", [("convnet", "torchscript"), ("gpt2", "dynamo"),
                                             ("mobilenet_block", "dynamo")])
def test_variants_on_real_exports_match_the_default_rules(family, exporter):
    """Every variant the planner is offered on a torch.onnx export, all at once, gives the
    default rules' loss and gradients within the largest tolerance they state (bit for bit
    when all are exact); the lossy ones (``--allow-lossy``) are checked the same way, on
    their own, once with each node's last lossy variant and once with its first (BatchNorm
    has two: ``inverted`` and ``bf16_saved``)."""
    from exports import export
    from threads import run_at_threads

    from memcc.frontend.gradients.variants import EXACT, LOSSY
    from memcc.passes.lowering.variant_substitution import (
        applicable_variants,
        overlapping,
        rule_nodes,
    )

    path, _, _, dims = export(family, exporter, training=True)
    g = build_training_step(load_graph(path, dims), BuildOptions(optimizer="sgd"))
    rules = rule_nodes(g)
    feeds = synthetic_feeds(g, seed=0)
    # At 2 and 4 intra-op threads, each run twice (run_at_threads fails if they differ).
    ref = run_at_threads(g, feeds)
    checked: list[dict] = []
    for lossy, pick in ((False, -1), (True, -1), (True, 0)):
        offered = {n.name: [v for v in applicable_variants(g, n, rules)
                            if (v.tier == LOSSY) == lossy] for n in g.nodes}
        offered = {k: v for k, v in offered.items() if v}
        assert offered, f"{family}/{exporter}: no {'lossy ' if lossy else ''}variant offered"
        # The last variant of each node (chunks8 for a Conv: the most chunks), or the first.
        chosen = {k: v[pick] for k, v in offered.items()}
        # A variant covering a whole decomposed GELU excludes its nodes' own variants.
        regions = {k for k, v in offered.items() if any(x.region for x in v)}
        chosen = {k: next((x for x in offered[k] if x.region), v) if k in regions else v
                  for k, v in chosen.items()}
        clash = overlapping(g, {k: v.name for k, v in chosen.items()}, keep=regions)
        chosen = {k: v for k, v in chosen.items() if k not in clash}
        if chosen in checked:
            continue
        checked.append(chosen)
        low = lower(g, Plan(variants={k: v.name for k, v in chosen.items()}),
                    StepStructure.of(g), check="full")
        inexact = [v.tolerance for v in chosen.values() if v.tier != EXACT]
        new = run_at_threads(low.graph, feeds)
        for threads in ref:
            assert compare_outputs(ref[threads], new[threads], exact=not inexact,
                                   tolerance=max(inexact) if inexact else None) == [], \
                (threads, lossy, pick)


@pytest.mark.parametrize("variant", ["mask", "product", "mask_product"])
def test_relu_variants_give_the_default_values(variant):
    """Every Relu of a ResNet step on one variant: the loss, gradients and updated weights
    equal the default's (``np.array_equal``: a product may give -0.0 where Where gives
    +0.0, equal values), and the product forms hold less at the Relu backward."""
    g = build_training_step(load_graph(build_model("resnet18", batch=4, resolution=32)),
                            BuildOptions(optimizer="sgd"))
    st = StepStructure.of(g)
    relus = [n.name for n in g.nodes if n.op_type == "Relu"]
    low = lower(g, Plan(variants=dict.fromkeys(relus, variant)), st, check="full")
    feeds = synthetic_feeds(g, seed=0)
    ref, new = step_outputs(g, feeds, "cpu"), step_outputs(low.graph, feeds, "cpu")
    assert ref.keys() == new.keys()
    for k in ref:
        assert np.array_equal(ref[k], new[k]), k
    if variant != "mask":
        assert not [n for n in low.graph.nodes if n.op_type == "Where"
                    and n.name.startswith(tuple(relus))]


def test_clip_product_variants_give_the_default_values():
    """Every ReLU6 (Clip 0..6) of the zoo's MobileNetV2 step on a product variant (in turn
    ``product`` and ``mask_product``), at 1 and 2 threads, twice each: the loss, gradients and
    updated weights equal the default's (``np.array_equal``, as for Relu above), and no
    Where is left in their backward (its two activation-sized selections set the smallest
    plan of a train-mode MobileNetV2)."""
    g = build_training_step(load_graph(build_model("mobilenetv2", batch=2, resolution=32)),
                            BuildOptions(optimizer="sgd"))
    clips = [n.name for n in g.nodes if n.op_type == "Clip"]
    assert clips
    variants = {c: ("product", "mask_product")[k % 2] for k, c in enumerate(clips)}
    low = lower(g, Plan(variants=variants), StepStructure.of(g), check="full")
    from threads import run_at_threads

    feeds = synthetic_feeds(g, seed=0)
    ref = run_at_threads(g, feeds, threads=(1, 2), repeats=2)
    new = run_at_threads(low.graph, feeds, threads=(1, 2), repeats=2)
    for threads in ref:
        assert ref[threads].keys() == new[threads].keys()
        for k in ref[threads]:
            assert np.array_equal(ref[threads][k], new[threads][k]), (threads, k)
    assert not [n for n in low.graph.nodes if n.op_type == "Where"
                and n.name.startswith(tuple(clips))]


def test_variant_model_matches_the_simulator_one_variant_at_a_time():
    """The ILP's terms for a variant, alone, give the peak the simulator finds (within 1%:
    the model ignores allocator-level effects the simulator also ignores, so the two agree
    closely or the model is wrong)."""
    g, st, costs, base, pp = _resnet_problem(8, 64)
    prob = pp.problem
    checked = 0
    for var, (node, name) in sorted(pp.variants.choice_of.items())[::7]:
        x = np.zeros(prob.n_vars)
        x[var] = 1.0
        sim = simulate(g, Plan(variants={node: name}), costs, st)
        assert abs(prob.peak(x) - sim.peak_bytes) <= 0.01 * base.peak_bytes, (node, name)
        checked += 1
    assert checked >= 5


def test_lossy_variants_only_with_allow_lossy_and_verified_within_their_tolerance(
        tmp_path, relu_step):
    """bfloat16 storage of the saved MatMul inputs is offered to the ILP only with
    ``allow_lossy``; a compile that uses it says ``lossy`` and verifies within the stated
    tolerance, not bit for bit."""
    g, st, costs = relu_step
    live = simulate(g, Plan(), costs, st).liveness

    def offered(allow: bool) -> set[str]:
        pp = build_problem(g, st, live, costs, DecisionKinds(lossy=allow))
        return {v.key for v in pp.variants.variant_of.values()}

    assert not any(k.endswith(":bf16_saved") for k in offered(False))
    assert "MatMul:bf16_saved" in offered(True)
    # Whole steps: over row chunks (which compile now searches) the MLP's floor is one
    # that lossy storage does not lower, and this is about lossy storage.
    whole = BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1)
    path = tmp_path / "m.onnx"
    onnx.save(_relu_then_scale(), path)
    smallest = compile_model(path, CompileOptions(budget="min", cost="analytic", margin=0.0,
                                                  slack_bytes=0, allow_lossy=True, build=whole))
    default = compile_model(path, CompileOptions(budget="min", cost="analytic", margin=0.0,
                                                 slack_bytes=0, build=whole))
    assert smallest.report["plan"]["peak_bytes"] < default.report["plan"]["peak_bytes"]
    # Below the smallest lossless peak, with a margin for the allocator's small buffers.
    budget = default.report["plan"]["peak_bytes"] - 1
    res = compile_model(path, CompileOptions(budget=budget, cost="analytic", margin=0.05,
                                             slack_bytes=0, allow_lossy=True, verify=True,
                                             build=whole))
    v = res.report["plan"]["variants"]
    assert any(k.endswith(":bf16_saved") for k in v["by_kind"])
    assert v["exactness"] == "lossy" and v["tolerance"] == pytest.approx(2e-2)
    assert res.report["verification"]["ok"]
    assert res.report["verification"]["comparison"].startswith("within relative 0.02")


def _relu_into_matmul(batch: int = 2048, width: int = 64) -> onnx.ModelProto:
    """x @ W1 -> Relu -> @ W2 -> Tanh -> @ W3: the Relu's output r is read by two backward
    rules, the Relu's own and the second MatMul's weight gradient."""
    model = _relu_then_scale(batch, width)
    g = model.graph
    keep = [n for n in g.node if n.name != "scale"]
    for n in keep:
        if n.name == "mm2":
            n.input[0] = "r"
    del g.node[:]
    g.node.extend(keep)
    return model


def test_a_buffer_two_rules_read_is_freed_only_by_both_variants_together():
    """r is freed early only when the Relu backward reads a mask and the MatMul keeps a
    bfloat16 copy: the joint binary models that, matches the simulator, and the ILP takes
    the pair where neither alone would save a byte."""
    g = build_training_step(load_graph(_relu_into_matmul()), BuildOptions(optimizer="sgd"))
    st = StepStructure.of(g)
    costs = analytic_costs(g, NOMINAL_CPU)
    base = simulate(g, Plan(), costs, st)
    pp = build_problem(g, st, base.liveness, costs, DecisionKinds(lossy=True))
    prob = pp.problem
    # The Relu writes r over h in place: the buffer is h's.
    joint = [i for i, n in enumerate(prob.names) if n == "joint free h"]
    assert len(joint) == 1
    var = {v: k for k, v in pp.variants.choice_of.items()}
    pair = {"relu": "mask_product", "mm2": "bf16_saved"}
    x = np.zeros(prob.n_vars)
    for node, name in pair.items():
        x[var[(node, name)]] = 1.0
    alone = simulate(g, Plan(variants={"relu": "mask_product"}), costs, st)
    both = simulate(g, Plan(variants=pair), costs, st)
    assert both.peak_bytes < alone.peak_bytes
    x[joint[0]] = 1.0
    assert prob.feasible(x)
    assert abs(prob.peak(x) - both.peak_bytes) <= 0.01 * base.peak_bytes
    # The joint binary cannot be set with only one of the two.
    x[var[("mm2", "bf16_saved")]] = 0.0
    assert not prob.feasible(x)
    # At a budget only the pair reaches, the ILP picks it.
    plan = choose_plan(g, costs, PlanRequest(Budget.of(both.peak_bytes), strategy="ilp",
                                             kinds=DecisionKinds(lossy=True)),
                       structure=st, baseline=base)
    assert plan.best.peak_bytes <= both.peak_bytes
    assert plan.best.plan.variants.get("mm2") == "bf16_saved"
