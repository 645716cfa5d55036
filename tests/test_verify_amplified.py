"""``--verify`` on a plan with inexact variants under AdamW: a parameter whose gradient is
rounding noise gets an update whose size and sign that noise decides, so the two steps'
updated values differ by far more than the plan's tolerance although every gradient agrees.
Such parameters pass by their gradients; a wrong gradient or a wrong update still fails."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from memcc.backend import verify
from memcc.backend.runner import synthetic_feeds
from memcc.backend.verify import VerifyRun, differing_outputs, step_outputs, verify_rewrite
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph, TensorInfo
from memcc.step import TrainingStep


def _softmax_bias_model() -> onnx.ModelProto:
    """x @ W + b -> Softmax -> @ W2: a scalar ``b`` added along the softmax's axis changes
    nothing, so its gradient is zero in exact arithmetic and rounding noise in float32 (a
    transformer's key bias, in one node)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in (("w", (16, 32)), ("w2", (32, 4)))]
    inits.append(numpy_helper.from_array(np.asarray([0.3], np.float32), "b"))
    nodes = [helper.make_node("MatMul", ["x", "w"], ["z"], name="mm"),
             helper.make_node("Add", ["z", "b"], ["zb"], name="bias"),
             helper.make_node("Softmax", ["zb"], ["p"], name="softmax", axis=-1),
             helper.make_node("MatMul", ["p", "w2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "softmax_bias",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 4])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def adamw_step() -> Graph:
    return build_training_step(load_graph(_softmax_bias_model()),
                               BuildOptions(optimizer="adamw", lr=1e-3))


def _scaled(graph: Graph, value: str, factor: float) -> Graph:
    """``graph`` with ``value`` replaced for its readers by ``value * factor``."""
    out = graph.copy()
    scaled, k = f"{value}.scaled", f"{value}.factor"
    info = out.info[value]
    out.initializers[k] = np.asarray(factor, info.np_dtype)
    out.info[k] = TensorInfo(info.dtype, ())
    out.info[scaled] = info
    nodes = []
    for n in out.nodes:
        inputs = [scaled if i == value else i for i in n.input]
        del n.input[:]
        n.input.extend(inputs)
        nodes.append(n)
        if value in n.output:
            nodes.append(helper.make_node("Mul", [value, k], [scaled], name=f"{value}.mul"))
    out.set_nodes(nodes)
    return out


def _update_times(graph: Graph, param: str, factor: float) -> Graph:
    """``graph`` whose update of ``param`` moves it ``factor`` times as far."""
    out = graph.copy()
    new = next(o for o, src in TrainingStep.of(graph).state.items() if src == param)
    raw = f"{new}.raw"
    for n in out.nodes:
        outputs = [raw if o == new else o for o in n.output]
        del n.output[:]
        n.output.extend(outputs)
    info = out.info[new]
    out.info[raw] = out.info[f"{new}.step"] = out.info[f"{new}.far"] = info
    out.initializers[f"{new}.factor"] = np.asarray(factor, info.np_dtype)
    out.info[f"{new}.factor"] = TensorInfo(info.dtype, ())
    out.set_nodes([*out.nodes,
                   helper.make_node("Sub", [raw, param], [f"{new}.step"], name="step"),
                   helper.make_node("Mul", [f"{new}.step", f"{new}.factor"], [f"{new}.far"],
                                    name="far"),
                   helper.make_node("Add", [param, f"{new}.far"], [new], name="again")])
    return out


def _verify(original: Graph, rewritten: Graph) -> dict:
    return verify_rewrite(original, rewritten, budget=1 << 40,
                          how=VerifyRun(tolerance=1e-5, numbers_only="a test"))


def test_a_noise_gradient_amplified_by_adamw_passes_by_its_gradient(adamw_step, monkeypatch):
    # Rounding the logits differently (by one part in 2^22) leaves every gradient within
    # the tolerance and redraws the bias's noise gradient.
    rewritten = _scaled(adamw_step, "z", 1.0 + 2.0 ** -22)
    v = _verify(adamw_step, rewritten)
    assert v["ok"], v["problems"]
    # One ulp of the batch redraws that noise in the step as built too (its update moves by
    # 4e-4, the plan's by 2e-4), so the bias passes by the step's own sensitivity first.
    assert v["input_sensitive_outputs"] == 1 and v["outputs_judged_by_gradient"] == []
    # Without that measure, it passes by its gradient.
    monkeypatch.setattr(verify, "input_sensitivity", lambda *args: {})
    v = _verify(adamw_step, rewritten)
    assert v["ok"], v["problems"]
    assert v["outputs_judged_by_gradient"] == ["b.new"] and v["input_sensitive_outputs"] == 0
    # Compared as outputs alone, the bias fails, and nothing else does.
    feeds = synthetic_feeds(adamw_step, 0)
    a, b = step_outputs(adamw_step, feeds, "cpu"), step_outputs(rewritten, feeds, "cpu")
    assert list(differing_outputs(a, b, exact=False, tolerance=1e-5)) == ["b.new"]


def test_a_wrong_gradient_still_fails(adamw_step):
    grad = TrainingStep.of(adamw_step).gradients()["w"]
    v = _verify(adamw_step, _scaled(adamw_step, grad, 1.001))
    assert not v["ok"]
    assert not v["outputs_judged_by_gradient"]


def test_an_update_ten_times_too_far_still_fails(adamw_step):
    rewritten = _update_times(_scaled(adamw_step, "z", 1.0 + 2.0 ** -22), "b", 10.0)
    v = _verify(adamw_step, rewritten)
    assert not v["ok"]
    assert any("'b.new'" in p for p in v["problems"])
