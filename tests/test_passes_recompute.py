"""The recompute lowering: where clones go, what they compute, what the original keeps."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import FLOAT, make_model
from onnx import helper, numpy_helper

from memcc.backend.runner import synthetic_feeds
from memcc.backend.verify import compare_outputs, step_outputs
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.plan import Plan, StepStructure
from models import build_model


@pytest.fixture(scope="module")
def mlp_step():
    return build_training_step(load_graph(build_model("mlp", batch=64, width=256, depth=6)),
                               BuildOptions(optimizer="sgd"))


def test_empty_plan_changes_nothing(mlp_step):
    res = apply_recompute(mlp_step, Plan())
    assert [n.name for n in res.graph.nodes] == [n.name for n in mlp_step.nodes]
    assert res.cloned_nodes == ()


def test_clones_run_just_before_their_first_backward_reader(mlp_step):
    st = StepStructure.of(mlp_step)
    relus = [n.name for n in mlp_step.nodes if n.name in st.recomputable and n.op_type == "Relu"]
    res = apply_recompute(mlp_step, Plan(frozenset(relus[:2])), st)
    order = [n.name for n in res.graph.nodes]
    last_forward = max(i for i, n in enumerate(res.graph.nodes) if n.name in st.forward)
    for name in relus[:2]:
        assert name in res.cloned_nodes
        clone = next(i for i, n in enumerate(res.graph.nodes) if n.name.startswith(name + ".rc"))
        assert clone > last_forward
        reader = res.rerun_before[name]
        assert order.index(reader) == clone + 1 or order.index(reader) > clone
    # Forward originals no longer feed the backward pass.
    backward_inputs = {i for n in res.graph.nodes if n.name not in st.forward for i in n.input}
    for v in res.recomputed_values:
        assert v not in backward_inputs


def test_rewritten_step_is_bit_identical(mlp_step):
    st = StepStructure.of(mlp_step)
    res = apply_recompute(mlp_step, Plan(frozenset(st.recomputable)), st)
    feeds = synthetic_feeds(mlp_step, seed=3)
    a = step_outputs(mlp_step, feeds, "cpu")
    b = step_outputs(res.graph, feeds, "cpu")
    assert compare_outputs(a, b, exact=True) == []
    assert len(res.graph.nodes) > len(mlp_step.nodes)


def test_unread_forward_outputs_are_dropped_not_pinned():
    """MaxPool's Indices output is read only by the backward pass: once the backward reads
    the clone's, the original output must go (ORT never frees an unconsumed output)."""
    step = build_training_step(load_graph(build_model("resnet18", batch=2, resolution=64)),
                               BuildOptions(optimizer="none"))
    st = StepStructure.of(step)
    pool = next(n.name for n in step.nodes if n.op_type == "MaxPool")
    res = apply_recompute(step, Plan(frozenset({pool})), st)
    consumed = {i for n in res.graph.nodes for i in n.input} | set(res.graph.outputs)
    for n in res.graph.nodes:
        for o in n.output:
            if o:
                assert o in consumed or n.name not in st.forward, (n.name, o)
    feeds = synthetic_feeds(step, seed=0)
    assert compare_outputs(step_outputs(step, feeds, "cpu"),
                           step_outputs(res.graph, feeds, "cpu"), exact=True) == []


def dropout_model():
    """MatMul -> Dropout (training) -> Relu -> MatMul: a step whose Dropout mask is random."""
    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((16, 32)) * 0.3).astype(np.float32)
    w2 = (rng.standard_normal((32, 4)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(
            np.asarray(0.5, np.float32), "ratio")),
        helper.make_node("Constant", [], ["train"], value=numpy_helper.from_array(
            np.asarray(True), "train")),
        helper.make_node("Dropout", ["h", "ratio", "train"], ["d"], name="drop"),
        helper.make_node("Relu", ["d"], ["r"]),
        helper.make_node("MatMul", ["r", "w2"], ["logits"]),
    ]
    return make_model(nodes, [("x", FLOAT, [8, 16])], [("logits", FLOAT, [8, 4])],
                      {"w1": w1, "w2": w2})


def test_ort_dropout_is_never_recomputed_and_the_rest_stays_bit_identical():
    """ORT's Dropout (a step built before counter-based masks) draws a new mask per run."""
    from benchmarks.dropout_cuda_check import ort_dropout

    with ort_dropout():
        step = build_training_step(load_graph(dropout_model()), BuildOptions())
    st = StepStructure.of(step)
    assert "drop" in st.forward and "drop" not in st.recomputable
    res = apply_recompute(step, Plan(frozenset(st.forward)), st)
    assert "drop" not in res.cloned_nodes and res.cloned_nodes
    # A recomputed Dropout would draw a second, different mask: there must be exactly one.
    assert sum(n.op_type == "Dropout" for n in res.graph.nodes) == 1
    assert all(n.op_type != "Constant" for n in step.nodes if n.name in st.recomputable)


def test_a_counter_based_dropout_mask_is_recomputed_bit_for_bit():
    """memcc's Dropout masks are a function of (seed, step counter, element): ordinary ops
    the planner may recompute, and the recomputed mask is the forward's."""
    from threads import mismatches, run_once

    step = build_training_step(load_graph(dropout_model()), BuildOptions())
    st = StepStructure.of(step)
    assert "drop" in st.forward and "drop" in st.recomputable   # the generator's Where
    res = apply_recompute(step, Plan(frozenset(st.recomputable)), st)
    before = {n.name for n in step.nodes}
    added = [n.op_type for n in res.graph.nodes if n.name not in before]
    assert "GreaterOrEqual" in added and "Where" in added, added   # the mask, recomputed
    values = synthetic_feeds(step, 0)
    feeds = {i: values[i] for i in step.inputs if i not in step.initializers}
    assert not mismatches(run_once(step, feeds, 1), run_once(res.graph, feeds, 1))


# ---------------------------------------------------------------------------- rebuilt again
def test_recompute_again_rebuilds_chain_clones_for_each_later_reader():
    """Every recomputable node recomputed, once with clones kept (one chain from the inputs,
    every clone live until its own backward reader) and once rebuilt again: each layer's
    backward rebuilds what it reads from the inputs, so early layers run once per later
    layer, the step's numbers are still the original's bit for bit (at 1 thread, and at 2
    and 4 threads twice each), and less is live at the peak (activations outweigh the
    weights at this batch)."""
    from threads import run_at_threads, run_once

    from memcc.passes.analysis.liveness import analyze_liveness

    mlp_step = build_training_step(
        load_graph(build_model("mlp", batch=1024, width=64, depth=6)),
        BuildOptions(optimizer="sgd"))
    st = StepStructure.of(mlp_step)
    every = frozenset(st.recomputable)
    kept = apply_recompute(mlp_step, Plan(every), st)
    again = apply_recompute(mlp_step, Plan(every, recompute_again=every), st)
    clones = [n.name for n in again.graph.nodes if ".rc" in n.name]
    first_relu = next(n.name for n in mlp_step.nodes if n.op_type == "Relu")
    assert sum(c.startswith(first_relu + ".rc") for c in clones) > 1
    assert len(again.graph.nodes) > len(kept.graph.nodes)
    assert set(again.recomputed_values) == set(kept.recomputed_values)
    assert analyze_liveness(again.graph).peak_bytes < analyze_liveness(kept.graph).peak_bytes
    feeds = synthetic_feeds(mlp_step, seed=3)
    assert compare_outputs(run_once(mlp_step, feeds, 1), run_once(again.graph, feeds, 1),
                           exact=True) == []
    ref, new = run_at_threads(mlp_step, feeds), run_at_threads(again.graph, feeds)
    for threads in ref:
        assert compare_outputs(ref[threads], new[threads], exact=True) == [], threads


def test_recompute_again_must_name_recomputed_nodes():
    from memcc.passes.plan import PlanError

    with pytest.raises(PlanError, match="recompute_again"):
        Plan(frozenset({"a"}), recompute_again=frozenset({"a", "b"}))


def test_a_split_with_unread_pieces_is_recomputed_as_slices():
    """A Split whose middle piece nothing reads (the dynamo exporter writes such Splits for
    timm's MixNet): its clone dropped the unread piece, which left a Split with fewer
    outputs than sizes, and the plan did not load. The clone is one Slice per piece it
    needs, bit for bit."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"]),
        helper.make_node("Split", ["h", "sizes"], ["a", "b", "c"], name="split", axis=1),
        helper.make_node("Mul", ["a", "a"], ["a2"]),
        helper.make_node("Mul", ["c", "c"], ["c2"]),
        helper.make_node("Concat", ["a2", "c2"], ["ac"], axis=1),
        helper.make_node("MatMul", ["ac", "w2"], ["logits"]),
    ]
    model = make_model(nodes, [("x", FLOAT, [8, 16])], [("logits", FLOAT, [8, 4])],
                       {"w1": rng.standard_normal((16, 32)).astype(np.float32),
                        "sizes": np.asarray([8, 10, 14], np.int64),
                        "w2": rng.standard_normal((22, 4)).astype(np.float32)})
    step = build_training_step(load_graph(model), BuildOptions(optimizer="none"))
    st = StepStructure.of(step)
    res = apply_recompute(step, Plan(frozenset({"split"})), st)
    clones = [n for n in res.graph.nodes if n.name.startswith("split.rc")]
    assert [n.op_type for n in clones] == ["Slice", "Slice"]
    assert [int(res.graph.initializers[n.input[1]][0]) for n in clones] == [0, 18]
    assert [int(res.graph.initializers[n.input[2]][0]) for n in clones] == [8, 32]
    feeds = synthetic_feeds(step, seed=0)
    assert compare_outputs(step_outputs(step, feeds, "cpu"),
                           step_outputs(res.graph, feeds, "cpu"), exact=True) == []


def test_a_recomputed_training_batchnorm_leaves_the_fed_running_statistics_alone():
    """A clone of a training-mode BatchNorm reads copies of the running statistics: ORT's
    CPU kernel wrote into the fed buffer otherwise (tests/test_ort_facts.py), so a second
    run on the same feeds gave other running statistics (a SegFormer plan at --budget
    min). The plan recomputing each saved Relu of a BatchNorm, and the BatchNorm: same
    bits as the step as built, at 1 and 2 threads, each run twice on one feeds dict, which
    stays as it was."""
    from threads import mismatches, run_at_threads

    step = build_training_step(load_graph(build_model("resnet18", batch=4, resolution=32,
                                                      width=8, blocks=[1, 1])),
                               BuildOptions())
    st = StepStructure.of(step)
    producer = step.def_use().producer
    relus = [producer[v] for v in st.saved if producer[v].op_type == "Relu"
             and producer[producer[v].input[0]].op_type == "BatchNormalization"]
    chains = frozenset(n.name for r in relus for n in (r, producer[r.input[0]]))
    planned = apply_recompute(step, Plan(chains, "test"), st).graph
    assert sum(n.op_type == "BatchNormalization" for n in planned.nodes) > \
        sum(n.op_type == "BatchNormalization" for n in step.nodes)
    feeds = synthetic_feeds(step, 0)
    kept = {k: v.copy() for k, v in feeds.items()}
    ours = run_at_threads(planned, feeds, threads=(1, 2), repeats=2)
    theirs = run_at_threads(step, feeds, threads=(1, 2), repeats=1)
    assert all(np.array_equal(feeds[k], kept[k]) for k in feeds)
    assert not mismatches(theirs[1], ours[1]) and not mismatches(theirs[2], ours[2])


def test_the_lowered_step_shares_the_nodes_it_keeps_and_edits_copies_of_its_own():
    """The lowering keeps the step's nodes as they are (no deep copy per plan judged):
    the step planned is left byte for byte as it was, a kept node is the step's own object,
    every node it edited (a backward reader given a clone, MaxPool losing its Indices) is a
    copy, and the index it hands on is right. Liveness reads the shared nodes' rows once
    per step, and gets the table it would have read node by node."""
    from memcc.passes.analysis.liveness import analyze_liveness
    from memcc.passes.analysis.node_table import NodeTable, rows_of

    step = build_training_step(load_graph(build_model("resnet18", batch=2, resolution=64)),
                               BuildOptions(optimizer="none"))
    st = StepStructure.of(step)
    before = [n.SerializeToString() for n in step.nodes]
    pool = next(n for n in step.nodes if n.op_type == "MaxPool")
    relus = [n.name for n in step.nodes if n.name in st.recomputable and n.op_type == "Relu"]
    res = apply_recompute(step, Plan(frozenset({pool.name, *relus[:3]})), st)
    assert [n.SerializeToString() for n in step.nodes] == before
    g = res.graph
    assert g.shares is step and g.def_use().check(g.nodes) == []
    mine = {id(n): n for n in step.nodes}
    kept = [n for n in g.nodes if id(n) in mine]
    edited = [n for n in g.nodes if id(n) not in mine and n.name in {m.name for m in step.nodes}]
    assert len(kept) > len(step.nodes) // 2 and edited
    assert all(n.SerializeToString() != mine_n.SerializeToString()
               for n in edited for mine_n in step.nodes if mine_n.name == n.name)
    new_pool = next(n for n in g.nodes if n.name == pool.name)
    assert new_pool is not pool and len(new_pool.output) < len(pool.output)
    plain, known = NodeTable.of(g.nodes), NodeTable.of(g.nodes, rows_of(step))
    assert (known.ops, known.ins, known.outs) == (plain.ops, plain.ins, plain.outs)
    assert analyze_liveness(g).live_during == analyze_liveness(g.copy()).live_during
