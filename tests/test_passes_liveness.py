"""Liveness: hand-made graphs with known lifetimes, and prediction against measurement."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import RunRequest, run_steps
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.liveness import analyze_liveness, categorize, scratch_bytes

H = helper.make_node
F = TensorProto.FLOAT
E = 1000  # elements per tensor: 4000 bytes as float
B = 4 * E


def graph(nodes, outputs, *, inputs=(("x", [E]),), inits=(), opset=17):
    g = helper.make_graph(
        nodes, "t",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_tensor_value_info(o, F, None) for o in outputs],
        list(inits),
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return load_graph(m)


def neg(src, out):
    return H("Neg", [src], [out], name=out)


def total(src, out):
    return H("ReduceSum", [src], [out], keepdims=0, name=out)


def ints(name, values):
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def test_chain_frees_each_value_after_its_last_consumer():
    g = graph([neg("x", "a"), neg("a", "b"), neg("b", "c"), total("c", "s")], ["s"])
    r = analyze_liveness(g)
    assert r.start_bytes == B  # the input
    assert r.live_during == (2 * B, 3 * B, 3 * B, 2 * B + 4)
    assert r.live_after == (2 * B, 2 * B, 2 * B, B + 4)
    assert (r.values["a"].birth, r.values["a"].death) == (0, 1)
    assert (r.values["c"].birth, r.values["c"].death) == (2, 3)
    assert r.values["s"].death is None and r.values["x"].birth == -1
    assert (r.peak_bytes, r.peak_step, r.peak_node) == (3 * B, 1, "b")
    assert set(r.live_at_peak) == {"x", "a", "b"}


def test_fan_out_lives_until_the_last_consumer():
    g = graph([neg("x", "a"), neg("a", "b"), neg("b", "c"),
               H("Add", ["a", "c"], ["d"], name="d")], ["d"])
    r = analyze_liveness(g)
    assert r.values["a"].death == 3
    assert r.peak_bytes == 4 * B  # x, a, c, d while the Add runs


def test_unconsumed_output_and_graph_output_stay_to_the_end():
    g = graph([neg("x", "dead"), neg("x", "y"), neg("y", "z")], ["y", "z"])
    r = analyze_liveness(g)
    assert r.values["dead"].death is None
    assert r.values["y"].death is None  # a graph output, though z consumed it
    assert r.live_after[-1] == 4 * B


def test_reshape_family_aliases_and_extends_the_buffer():
    g = graph([
        neg("x", "a"), H("Reshape", ["a", "shp"], ["r"], name="r"),
        H("Unsqueeze", ["r", "ax"], ["u"], name="u"), H("Flatten", ["u"], ["f"], name="f"),
        H("Identity", ["f"], ["i"], name="i"), total("i", "s"),
    ], ["s"], inits=[ints("shp", [10, 100]), ints("ax", [0])])
    r = analyze_liveness(g)
    for v in ("r", "u", "f", "i"):
        assert r.values[v].buffer == "a" and not r.values[v].owns_buffer
    assert r.values["a"].death == 5  # freed after the last reader of any alias
    assert max(r.live_during) == r.start_bytes + B + 4


def test_alias_of_an_input_is_pinned_and_a_graph_output_alias_gets_its_own_buffer():
    g = graph([H("Reshape", ["x", "shp"], ["r"], name="r"), neg("r", "n"),
               H("Identity", ["n"], ["out"], name="out")], ["out"], inits=[ints("shp", [10, 100])])
    r = analyze_liveness(g)
    assert r.values["r"].buffer == "x" and r.values["r"].death is None
    assert r.values["out"].owns_buffer


def test_in_place_only_on_the_last_use_of_a_node_output():
    last_use = graph([neg("x", "a"), H("Relu", ["a"], ["r"], name="r"), total("r", "s")], ["s"])
    assert analyze_liveness(last_use).values["r"].buffer == "a"
    used_again = graph([neg("x", "a"), H("Relu", ["a"], ["r"], name="r"),
                        H("Add", ["r", "a"], ["s"], name="s")], ["s"])
    assert analyze_liveness(used_again).values["r"].owns_buffer
    on_input = graph([H("Relu", ["x"], ["r"], name="r"), total("r", "s")], ["s"])
    assert analyze_liveness(on_input).values["r"].owns_buffer


def test_cast_in_place_needs_the_same_element_size():
    # (a Neg between the last two Casts: ORT would remove a Cast read only by Casts)
    g = graph([neg("x", "a"), H("Cast", ["a"], ["i"], to=TensorProto.INT32, name="i"),
               H("Cast", ["i"], ["d"], to=TensorProto.DOUBLE, name="d"),
               H("Neg", ["d"], ["n"], name="n"),
               H("Cast", ["n"], ["f"], to=TensorProto.FLOAT, name="f")], ["f"])
    r = analyze_liveness(g)
    assert r.values["i"].buffer == "a"
    assert r.values["d"].owns_buffer


def test_constant_node_values_exist_before_the_first_node():
    k = helper.make_tensor("kv", F, [E], np.ones(E, np.float32))
    g = graph([H("Constant", [], ["k"], value=k, name="k"), H("Mul", ["x", "k"], ["y"], name="y")],
              ["y"])
    r = analyze_liveness(g)
    assert r.start_bytes == 2 * B
    assert r.values["k"].birth == -1 and r.values["k"].death is None


def test_where_scratch_is_both_broadcast_selections():
    g = graph([neg("x", "a"), H("Greater", ["a", "x"], ["m"], name="m"),
               H("Where", ["m", "a", "z"], ["w"], name="w")], ["w"],
              inits=[helper.make_tensor("z", F, [], [0.0])])
    node = g.nodes[2]
    assert scratch_bytes(node, g.info) == 2 * B
    r = analyze_liveness(g)
    assert r.scratch[2] == 2 * B
    assert r.live_during[2] == 3 * B + E + 2 * B + 4  # x, a, m (bool), w, scratch; z
    assert r.breakdown["scratch"] == 2 * B


def test_order_changes_the_peak_and_is_validated():
    nodes = [neg("x", "a"), total("a", "sa"), neg("x", "b"), total("b", "sb"),
             H("Add", ["sa", "sb"], ["y"], name="y")]
    g = graph(nodes, ["y"])
    assert analyze_liveness(g).peak_bytes == 2 * B + 8  # x, one of a and b, two scalars
    both = analyze_liveness(g, ["a", "b", "sa", "sb", "y"])
    assert both.peak_bytes == 3 * B + 4 and both.order == ("a", "b", "sa", "sb", "y")
    with pytest.raises(ValueError, match="before its input"):
        analyze_liveness(g, ["sa", "a", "b", "sb", "y"])
    with pytest.raises(ValueError, match="does not have"):
        analyze_liveness(g, ["a", "sa", "b", "sb", "nope"])


def tiny_mlp(batch=4, d_in=8, hidden=16, classes=3) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = onnx.numpy_helper.from_array(rng.standard_normal((d_in, hidden)).astype(np.float32), "w1")
    w2 = onnx.numpy_helper.from_array(rng.standard_normal((hidden, classes)).astype(np.float32),
                                      "w2")
    g = helper.make_graph(
        [H("MatMul", ["input", "w1"], ["h"], name="fc1"), H("Relu", ["h"], ["r"], name="relu"),
         H("MatMul", ["r", "w2"], ["logits"], name="fc2")], "mlp",
        [helper.make_tensor_value_info("input", F, [batch, d_in])],
        [helper.make_tensor_value_info("logits", F, [batch, classes])], [w1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("optimizer", ["none", "adamw"])
def test_categories_follow_the_training_step_metadata(optimizer):
    step = build_training_step(load_graph(tiny_mlp()), BuildOptions(optimizer=optimizer))
    cat = categorize(step)
    params = json.loads(step.metadata["memcc.parameters"])
    assert params and all(cat[p] == "parameters" for p in params)
    state = json.loads(step.metadata["memcc.state"])
    for out, inp in state.items():
        assert cat[out] == cat[inp]
    if optimizer == "none":
        assert all(cat[f"{p}.grad"] == "gradients" for p in params)
    else:
        assert any(v == "optimizer_state" for v in cat.values())
    # Each parameter's whole gradient, also where the update reads it directly (no P.grad).
    grads = json.loads(step.metadata["memcc.gradients"])
    assert sorted(grads) == sorted(params)
    assert all(cat[g] == "gradients" for g in grads.values())
    assert cat["input"] == "other" and cat["h"] == "activations"
    r = analyze_liveness(step)
    assert sum(r.breakdown.values()) == r.peak_bytes
    assert r.category_bytes["parameters"] >= sum(step.info[p].nbytes for p in params)


def test_mlp_step_measured_within_5_percent_of_predicted(tmp_path):
    """A step whose peak holds ~44 MB of activations and a Where scratch (Relu backward)."""
    from models import mlp

    forward = mlp.build(batch=4096, in_features=512, width=512, depth=4, num_classes=10)
    step = build_training_step(load_graph(forward), BuildOptions(optimizer="sgd", lr=0.01))
    path = save_graph(step, tmp_path / "mlp_step.onnx")
    report = analyze_liveness(step)
    assert report.breakdown["activations"] > 20e6
    # the copying runner: this liveness
    result = run_steps(path, RunRequest(steps=2, in_place=False))
    assert result.order_matches_plan
    assert result.predicted_peak_bytes == report.peak_bytes
    ratio = result.measured_peak_bytes / result.predicted_peak_bytes
    assert 0.95 <= ratio <= 1.05, result.to_json()
