"""MaxPool variants (``memcc/frontend/gradients/variant_pool.py``): numbers and planning.

``MaxPool:recompute`` is exact: its backward runs the same MaxPool again on X, so the
indices and therefore the gradients are the default rule's bit for bit, at 1 and 2 intra-op
threads. Once the default rule is gone the forward MaxPool no longer computes its Indices
output. The planner sees the saving (the int32 indices, kept from the forward pass to the
backward by the default rule) and takes the variant where it is the cheapest way to a budget.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from gradcheck import FLOAT, grad_graph, make_model
from onnx import TensorProto, helper, numpy_helper
from test_variants import (
    assert_matches_torch,
    check_hand_built,
    check_variant,
    forward_nodes,
    hand_built,
    lowered,
    rand,
    zoo_step,
)
from torch_reference import torch_loss_and_grads

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.gradients.variants import EXACT, lookup
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
from memcc.passes.lowering.variant_substitution import (
    applicable_variants,
    apply_variants,
    rule_nodes,
    variant_context,
)
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import build_problem, choose_plan
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import simulate
from models import build_model

RECOMPUTE = "recompute"


def _variant():
    v = lookup("MaxPool", RECOMPUTE)
    assert v is not None and v.tier == EXACT
    return v


def _pool_node(g: Graph, name: str = "op") -> onnx.NodeProto:
    return next(n for n in g.nodes if n.name == name)


# ---------------------------------------------------------------------------- hand-built
# name: (x shape, attributes, opset)
POOL_CASES = {
    "3x3-stride2-pad1": ((2, 3, 9, 9), dict(kernel_shape=[3, 3], strides=[2, 2],
                                            pads=[1, 1, 1, 1]), 17),
    "2x2-disjoint": ((2, 4, 8, 6), dict(kernel_shape=[2, 2], strides=[2, 2]), 17),
    "2x2-disjoint-opset11": ((2, 4, 8, 6), dict(kernel_shape=[2, 2], strides=[2, 2]), 11),
    "1d-asymmetric-pads": ((3, 2, 11), dict(kernel_shape=[3], strides=[2], pads=[1, 0]), 17),
    "ceil-mode": ((2, 3, 8, 8), dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1), 17),
    "dilated": ((2, 2, 9, 10), dict(kernel_shape=[2, 3], strides=[1, 2], dilations=[2, 1],
                                    pads=[1, 1, 0, 1]), 17),
    "same-upper": ((2, 2, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2],
                                      auto_pad="SAME_UPPER"), 17),
}


@pytest.mark.parametrize("case", list(POOL_CASES))
def test_recompute_equals_the_default_bit_for_bit(case):
    """Also with many ties (values rounded to a few levels): the recomputed MaxPool picks
    the same first maximum as the forward one, so ties land on the same element."""
    shape, attrs, opset = POOL_CASES[case]
    rng = np.random.default_rng(0)
    for x in (rand(rng, *shape), np.round(rand(rng, *shape)).clip(-1, 1)):
        feeds = {"x": x.astype(np.float32)}
        ref = hand_built("MaxPool", feeds, ["x"], opset, **attrs)
        res = apply_variants(ref, Plan(variants={"op": RECOMPUTE}))
        assert list(_pool_node(res.graph).output) == ["y"]  # no Indices computed any more
        assert not [n for n in res.graph.nodes if n.op_type == "Cast"]  # nor cast to int32
        again = [n for n in res.backward_added if n.startswith(f"op/{RECOMPUTE}/MaxPool")]
        assert len(again) == 1
        check_variant(ref, res.graph, feeds, list(ref.outputs), _variant())


def test_recompute_matches_torch():
    feeds = {"x": rand(np.random.default_rng(1), 2, 3, 9, 9)}

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, 3, 2, 1)

    check_hand_built("MaxPool", RECOMPUTE, feeds, ["x"], fn, kernel_shape=[3, 3],
                     strides=[2, 2], pads=[1, 1, 1, 1])


def test_recomputed_pooled_output_is_read_so_ort_frees_it():
    """ORT never frees an output nobody reads (tests/test_ort_facts.py): the backward's
    pooled output must have a reader, or it would be held to the end of the step."""
    feeds = {"x": rand(np.random.default_rng(2), 2, 3, 8, 8)}
    ref = hand_built("MaxPool", feeds, ["x"], kernel_shape=[2, 2], strides=[2, 2])
    g = apply_variants(ref, Plan(variants={"op": RECOMPUTE})).graph
    again = next(n for n in g.nodes if n.name.startswith(f"op/{RECOMPUTE}/MaxPool"))
    readers = {i for n in g.nodes for i in n.input}
    assert all(o in readers for o in again.output)


def test_an_indices_output_the_step_returns_stays_on_the_forward_node():
    """Only optional outputs that nothing but the removed rule read are dropped."""
    feeds = {"x": rand(np.random.default_rng(3), 2, 3, 8, 8)}
    node = helper.make_node("MaxPool", ["x"], ["y", "ind"], name="op", kernel_shape=[2, 2],
                            strides=[2, 2])
    model = make_model([node], [("x", FLOAT, [2, 3, 8, 8])],
                       [("y", FLOAT, [2, 3, 4, 4]), ("ind", TensorProto.INT64, [2, 3, 4, 4])])
    ref = grad_graph(model, ["x"])
    ref.outputs = [*ref.outputs, "ind"]
    var = apply_variants(ref, Plan(variants={"op": RECOMPUTE})).graph
    assert list(_pool_node(var).output) == ["y", "ind"]
    check_variant(ref, var, feeds, list(ref.outputs), _variant())


def test_offered_for_row_major_indices_only():
    """Column-major indices (storage_order 1) are not the default rule's either."""
    feeds = {"x": rand(np.random.default_rng(4), 1, 2, 6, 6)}
    g = hand_built("MaxPool", feeds, ["x"], kernel_shape=[2, 2])
    pool = _pool_node(g)
    offered = {v.name for v in applicable_variants(g, pool, rule_nodes(g))}
    assert RECOMPUTE in offered
    column_major = onnx.NodeProto()
    column_major.CopyFrom(pool)
    column_major.attribute.append(helper.make_attribute("storage_order", 1))
    ctx = variant_context(g, pool, "probe/", taken=())
    assert _variant().applies(ctx, pool) and not _variant().applies(ctx, column_major)


# ---------------------------------------------------------------------------- ResNet
@pytest.fixture(scope="module")
def resnet():
    model = build_model("resnet18", batch=8, resolution=32, width=8)
    return model, *zoo_step(model)


def test_recompute_on_resnet_is_exact_and_matches_torch(resnet):
    """ResNet's stem MaxPool 3x3/2 after a Relu: many ties at zero. Lowered with the full
    check; the loss and every gradient equal the default's at 1 and 2 threads."""
    model, g, feeds, grads = resnet
    pools = forward_nodes(g, "MaxPool")
    assert len(pools) == 1 and len(_pool_node(g, pools[0]).output) == 2
    low = lowered(g, {pools[0]: RECOMPUTE})
    assert list(_pool_node(low, pools[0]).output) == [_pool_node(g, pools[0]).output[0]]
    assert not any(n.op_type == "Cast" and n.name.startswith("grad/") and
                   low.info[n.output[0]].dtype == TensorProto.INT32 for n in low.nodes)
    outs = check_variant(g, low, feeds, ["loss", *grads.values()], _variant())
    data = {n: v for n, v in feeds.items() if n != "labels"}
    ref_loss, ref = torch_loss_and_grads(model, data, labels=feeds["labels"], double=True)
    for threads, out in outs.items():
        assert_matches_torch(f"MaxPool recompute at {threads} threads", out, grads,
                             ref_loss, ref)


# ---------------------------------------------------------------------------- planning
def _pool_model(shortcut: bool, c: int = 8, c2: int = 32, n: int = 4,
                hw: int = 32) -> onnx.ModelProto:
    """x -> Conv -> Relu -> MaxPool 3x3/2 -> Conv (MSE loss). The Relu's default rule keeps
    its output, the MaxPool's input, for the backward anyway. With ``shortcut`` a strided
    1x1 Conv also reads it (as a ResNet downsample does) and its sum with the second Conv
    is the output: then no variant of the Relu can free the MaxPool's input either."""
    rng = np.random.default_rng(0)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32),
                                       name)

    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["h"], name="conv1", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[3, 3],
                         strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p", "w2"], ["y2" if shortcut else "y"], name="conv2",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
    ]
    weights = [weight("w1", (c, 3, 3, 3)), weight("w2", (c2, c, 3, 3))]
    if shortcut:
        nodes += [helper.make_node("Conv", ["r", "w3"], ["y3"], name="conv3",
                                   kernel_shape=[1, 1], strides=[2, 2]),
                  helper.make_node("Add", ["y2", "y3"], ["y"], name="add")]
        weights.append(weight("w3", (c2, c, 1, 1)))
    g = helper.make_graph(
        nodes, "pool", [helper.make_tensor_value_info("x", FLOAT, [n, 3, hw, hw])],
        [helper.make_tensor_value_info("y", FLOAT, [n, c2, hw // 2, hw // 2])], weights)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _step(shortcut: bool):
    g = build_training_step(load_graph(_pool_model(shortcut)),
                            BuildOptions(optimizer="sgd", loss="mse"))
    st = StepStructure.of(g)
    costs = analytic_costs(g, NOMINAL_CPU)
    return g, st, costs, simulate(g, Plan(), costs, st)


def _saved_indices(g: Graph) -> str:
    """The int32 indices the default rule keeps from the forward pass to the backward."""
    cast = next(n for n in rule_nodes(g)["pool"] if n.op_type == "Cast")
    assert g.info[cast.output[0]].dtype == TensorProto.INT32
    return cast.output[0]


@pytest.mark.parametrize("shortcut", [False, True])
def test_the_simulator_and_the_ilp_model_see_the_indices_freed(shortcut):
    """The peak (inside the second Conv's backward, where the indices are live) drops by
    at least their bytes; the ILP's terms for the variant alone give the simulator's peak
    (within 0.1%: the variant's constants are counted as resident for the whole step)."""
    g, st, costs, base = _step(shortcut)
    var = simulate(g, Plan(variants={"pool": RECOMPUTE}), costs, st)
    assert base.peak_bytes - var.peak_bytes >= g.info[_saved_indices(g)].nbytes
    pp = build_problem(g, st, base.liveness, costs)
    x = np.zeros(pp.problem.n_vars)
    x[{v: k for k, v in pp.variants.choice_of.items()}[("pool", RECOMPUTE)]] = 1.0
    assert abs(pp.problem.peak(x) - var.peak_bytes) <= 1e-3 * base.peak_bytes


def test_the_planner_takes_recompute_where_it_is_the_cheapest_way_to_the_budget():
    """With the shortcut, no Relu variant frees the MaxPool's input, and at a budget
    halfway between the baseline and the variant's peak the ILP takes MaxPool:recompute
    alone: recompute alone also reaches that budget (since the 1x1 shortcut's weight
    gradient is a MatMul, which holds less), but only by running conv1 and its Relu again,
    which costs more."""
    g, st, costs, base = _step(shortcut=True)
    var = simulate(g, Plan(variants={"pool": RECOMPUTE}), costs, st)
    budget = (base.peak_bytes + var.peak_bytes) // 2
    res = choose_plan(g, costs, PlanRequest(Budget.of(budget), strategy="ilp"), structure=st,
                      baseline=base)
    assert res.best.plan.variants == {"pool": RECOMPUTE}
    assert not res.best.plan.recompute and res.best.peak_bytes <= budget
    alone = choose_plan(g, costs, PlanRequest(Budget.of(budget), strategy="ilp",
                                              kinds=DecisionKinds(variants=False)),
                        structure=st, baseline=base)
    assert alone.best.plan.recompute and alone.best.peak_bytes <= budget
    assert alone.best.added_time_s > res.best.added_time_s
