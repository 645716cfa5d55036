"""``activation_from_input``: a decomposed GELU or SiLU differentiated from its input alone.

The chain is recognised by what it computes (``variant_activations.match_activation``), so
each spelling exporters use is tried, and chains that compute something else, or whose
values someone else reads, must not be. The variant replaces the default rules of every
node of the chain; its results are checked against those rules within its stated
tolerance at 1 and 2 threads, and against torch autograd.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch.nn.functional as F
from gradcheck import FLOAT, grad_graph, make_model, torch_grads
from onnx import helper
from test_variants import check_variant, forward_nodes, lowered, rel_err, zoo_step
from threads import run_at_threads, run_once

from memcc.frontend.gradients.variant_activations import ACTIVATION_TOLERANCE, match_activation
from memcc.frontend.gradients.variants import lookup
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
from memcc.passes.lowering.lower import lower
from memcc.passes.lowering.variant_substitution import (
    apply_variants,
    region_variants,
    variant_problems,
)
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.model.variant_rule import peak_working_set
from memcc.passes.planning.planner import BudgetError, choose_plan
from memcc.passes.planning.request import Budget, PlanRequest
from memcc.passes.planning.simulate import simulate
from memcc.step import GRAD_OF_PROP, node_props
from models import build_model

VARIANT = "activation_from_input"
C = math.sqrt(2.0 / math.pi)
SHAPE = (4, 6, 10)

Chain = list[tuple[str, list[str], str]]   # (op, inputs, output); "k:<v>" is a constant

CHAINS: dict[str, tuple[Chain, object]] = {
    # GPT-2 as transformers writes it, with Pow for the cube.
    "gelu_tanh_pow": ([("Pow", ["x", "k:3.0"], "cube"), ("Mul", ["k:0.044715", "cube"], "ac"),
                       ("Add", ["x", "ac"], "inner"), ("Mul", ["inner", f"k:{C}"], "u"),
                       ("Tanh", ["u"], "t"), ("Add", ["k:1.0", "t"], "one_t"),
                       ("Mul", ["x", "k:0.5"], "half"), ("Mul", ["half", "one_t"], "y")],
                      lambda x: F.gelu(x, approximate="tanh")),
    # The cube as x*x*x and the 0.5 applied last.
    "gelu_tanh_mul": ([("Mul", ["x", "x"], "sq"), ("Mul", ["sq", "x"], "cube"),
                       ("Mul", ["cube", "k:0.044715"], "ac"), ("Add", ["ac", "x"], "inner"),
                       ("Mul", [f"k:{C}", "inner"], "u"), ("Tanh", ["u"], "t"),
                       ("Add", ["t", "k:1.0"], "one_t"), ("Mul", ["x", "one_t"], "xt"),
                       ("Mul", ["xt", "k:0.5"], "y")],
                      lambda x: F.gelu(x, approximate="tanh")),
    # BERT / torch's exact GELU.
    "gelu_erf": ([("Div", ["x", f"k:{math.sqrt(2.0)}"], "z"), ("Erf", ["z"], "e"),
                  ("Add", ["e", "k:1.0"], "one_e"), ("Mul", ["x", "one_e"], "xe"),
                  ("Mul", ["xe", "k:0.5"], "y")], lambda x: F.gelu(x)),
    "silu": ([("Sigmoid", ["x"], "s"), ("Mul", ["x", "s"], "y")], lambda x: F.silu(x)),
}


def chain_graph(chain: Chain, after: list | None = None) -> Graph:
    """x -> Identity -> the chain -> y, differentiated with loss sum(y * w)."""
    consts: dict[str, np.ndarray] = {}
    nodes = [helper.make_node("Identity", ["x"], ["xa"], name="x.act")]
    for k, (op, ins, out) in enumerate(chain):
        names = []
        for i in ins:
            if i.startswith("k:"):
                name = f"c{len(consts)}"
                consts[name] = np.array(float(i[2:]), np.float32)
                names.append(name)
            else:
                names.append("xa" if i == "x" else i)
        nodes.append(helper.make_node(op, names, [out], name=f"n{k}.{op}"))
    nodes += after or []
    outs = [("y" if not after else after[-1].output[0], FLOAT, list(SHAPE))]
    return grad_graph(make_model(nodes, [("x", FLOAT, list(SHAPE))], outs, consts), ["x"])


def anchor_of(g: Graph, chain: Chain):
    return next(n for n in g.nodes if n.output and n.output[0] == chain[-1][2])


@pytest.mark.parametrize("name", list(CHAINS))
def test_each_spelling_is_recognised_and_matches_default_and_torch(name):
    chain, fn = CHAINS[name]
    g = chain_graph(chain)
    found = match_activation(g, anchor_of(g, chain))
    assert found is not None, name
    assert found.activation.name == name.removesuffix("_pow").removesuffix("_mul")
    assert found.input == "xa"
    assert len(found.region.nodes) == len(chain)
    # What the chain's default rules keep for the backward (docs/VARIANTS.md): x and
    # intermediates, four for the tanh GELU, three for the erf GELU, two for SiLU.
    kept = {i for n in g.nodes if node_props(n).get(GRAD_OF_PROP) in found.region.nodes
            for i in n.input if i == "xa" or i in {out for _, _, out in chain}}
    assert len(kept) == {"gelu_tanh": 4, "gelu_erf": 3, "silu": 2}[found.activation.name]
    var = apply_variants(g, Plan(variants={anchor_of(g, chain).name: VARIANT})).graph
    # Only the chain's input is read by the new backward; the intermediates are not.
    intermediates = {out for _, _, out in chain[:-1]}
    back = [n for n in var.nodes if f"/{VARIANT}/" in n.name]
    assert back and not intermediates & {i for n in back for i in n.input}
    # Its own buffers at once, as the planner walks them (ORT's in-place rules): at most
    # four activation-sized ones, its result included.
    assert peak_working_set(back, var.info, var.opset) <= 4 * var.info["xa"].nbytes
    variant = lookup(anchor_of(g, chain).op_type, VARIANT)
    assert variant is not None
    feeds = {"x": np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32) * 3}
    outs = check_variant(g, var, feeds, list(g.outputs), variant)
    torch_loss, torch_g = torch_grads(fn, feeds, ["x"])
    for out in outs.values():
        assert abs(float(out[var.outputs[0]]) - torch_loss) <= 1e-4 * max(1.0, abs(torch_loss))
        assert rel_err(out[var.outputs[1]], torch_g["x"]) <= 1e-4


def test_a_chain_computing_something_else_is_not_taken():
    chain = [(op, ins if ins != ["k:0.044715", "cube"] else ["k:0.05", "cube"], out)
             for op, ins, out in CHAINS["gelu_tanh_pow"][0]]
    g = chain_graph(chain)
    assert match_activation(g, anchor_of(g, chain)) is None


def test_a_chain_whose_values_others_read_is_not_taken():
    chain = CHAINS["gelu_tanh_pow"][0]
    # tanh(.) read after the chain too, and then a graph output as well.
    g = chain_graph(chain, after=[helper.make_node("Add", ["y", "t"], ["r"], name="r")])
    assert match_activation(g, anchor_of(g, chain)) is None
    g = chain_graph(chain)
    g.outputs = [*g.outputs, "t"]
    assert match_activation(g, anchor_of(g, chain)) is None
    # x read after the chain too (a residual): its gradient is not the chain's alone.
    after = [helper.make_node("Add", ["y", "xa"], ["r"], name="residual")]
    g = chain_graph(chain, after=after)
    assert match_activation(g, anchor_of(g, chain)) is None


@pytest.fixture(scope="module")
def gpt2():
    return zoo_step(build_model("gpt2", batch=2, seq_len=32, width=64, depth=2, heads=2,
                                vocab_size=96))


def test_on_gpt2_and_bert_every_gelu_within_tolerance(gpt2):
    """The zoo's GPT-2 (tanh GELU with Pow) and BERT (erf GELU): each GELU is found, the
    other variants of its nodes are excluded, and loss and gradients stay within the
    stated tolerance of the default rules."""
    bert = zoo_step(build_model("bert", batch=2, seq_len=16, width=32, depth=2, heads=2))
    for (g, feeds, grads), op in ((gpt2, "Tanh"), (bert, "Erf")):
        st = StepStructure.of(g)
        chosen = region_variants(g, st)
        assert len(chosen) == 2 and set(chosen.values()) == {VARIANT}
        # A plan that also asks for a variant of a node inside a chain is refused.
        inner = forward_nodes(g, "Tanh")[-1] if op == "Tanh" else None
        if inner is not None and any(inner.startswith(a) for a in chosen):
            assert variant_problems(g, Plan(variants={**chosen, inner: "from_input"}))
        low = lowered(g, chosen)
        variant = lookup("Mul", VARIANT)
        assert variant is not None and variant.tolerance == ACTIVATION_TOLERANCE
        names = ["loss", *grads.values()]
        ref = run_once(g, feeds, 1)
        top = max(float(np.abs(ref[k]).max()) for k in names)
        # 1, 2 and 4 intra-op threads, each run twice in fresh sessions (the same bits).
        for threads, new in run_at_threads(low, feeds, threads=(1, 2, 4)).items():
            for k in names:
                # Gradients that are zero up to rounding (a key bias under Softmax) are
                # noise over noise: left out, as benchmarks/variant_checks.py does.
                if float(np.abs(ref[k]).max()) >= 1e-5 * top:
                    assert rel_err(new[k], ref[k]) <= ACTIVATION_TOLERANCE, (threads, k)


def test_budget_min_plans_over_the_gelus_in_place_where_that_is_lower():
    """``--budget min`` also plans over the step with every GELU on the variant (the ILP
    cannot recompute a chain it differentiates from its input); the lower of the two wins,
    and its plan, run through the lowering over the step as built, is what was simulated.
    (sqrt(n) plans keep this test fast; ``auto`` takes the same path.)"""
    g, _, _ = zoo_step(build_model("gpt2", batch=8, seq_len=64, width=32, depth=2, heads=2,
                                   vocab_size=64))
    costs = analytic_costs(g, NOMINAL_CPU)
    st = StepStructure.of(g)
    without = choose_plan(g, costs, PlanRequest(Budget.MIN, strategy="sqrtn", regions=False),
                          structure=st)
    best = choose_plan(g, costs, PlanRequest(Budget.MIN, strategy="sqrtn"), structure=st)
    assert best.best.peak_bytes < without.best.peak_bytes
    assert best.picked.endswith("over region variants")
    assert best.baseline.peak_bytes == without.baseline.peak_bytes
    # The report keeps both searches' runs; the second's say so.
    assert any(r.get("region_variants") == 2 for r in best.runs)
    assert any(not r.get("region_variants") for r in best.runs)
    assert all(r.get("region_variants") for r in best.runs if r.get("picked"))
    over = {n: v for n, v in best.best.plan.variants.items() if v == VARIANT}
    assert len(over) == 2
    again = simulate(g, best.best.plan, costs, st)
    assert again.peak_bytes == best.best.peak_bytes
    lower(g, best.best.plan, st, check="full")
    # A budget between the two floors fits; one below both is refused naming this floor.
    between = (best.best.peak_bytes + without.best.peak_bytes) // 2
    fit = choose_plan(g, costs, PlanRequest(Budget.of(between), strategy="sqrtn"), structure=st)
    assert fit.best.peak_bytes <= between
    with pytest.raises(BudgetError) as exc:
        choose_plan(g, costs, PlanRequest(Budget.of(best.best.peak_bytes - 1), strategy="sqrtn"),
                    structure=st)
    assert exc.value.smallest == best.best.peak_bytes
