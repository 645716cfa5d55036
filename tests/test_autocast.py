"""Autocast (``memcc build --precision``): the policy op by op on hand-built graphs, the
backward's own Casts, and the CPU provider's float32 computing between 16-bit casts
(``passes/providers/sixteen_bit.py``). Numerics against PyTorch's autocast on the zoo and on
real exports: tests/test_autocast_numerics.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gradcheck import make_model
from onnx import TensorProto, helper
from threads import run_once

from memcc.frontend.autocast import autocast
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.providers.provider_step import for_provider
from memcc.passes.providers.sixteen_bit import for_provider as sixteen_bit
from memcc.step import PRECISION_KEY
from models import build_model, make_feeds, make_labels

F, BF, H = TensorProto.FLOAT, TensorProto.BFLOAT16, TensorProto.FLOAT16


def _block():
    """x -> MatMul(W) + b -> Div by a scalar -> Softmax -> MatMul(W2) -> LayerNorm -> y,
    with x also read by a second MatMul (one Cast for both) and a Dropout whose ratio
    must keep its type."""
    rng = np.random.default_rng(0)
    inits = {n: rng.standard_normal(s).astype(np.float32)
             for n, s in (("W", [8, 8]), ("b", [8]), ("W2", [8, 8]), ("W3", [8, 8]),
                          ("g", [8]), ("beta", [8]))}
    inits |= {"s": np.float32(2.0), "r": np.float32(0.0)}
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["mm"]),
        helper.make_node("Add", ["mm", "b"], ["biased"]),
        helper.make_node("Div", ["biased", "s"], ["scaled"]),
        helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
        helper.make_node("Dropout", ["p", "r"], ["pd"]),
        helper.make_node("MatMul", ["pd", "W2"], ["h"]),
        helper.make_node("MatMul", ["x", "W3"], ["side"]),
        helper.make_node("Add", ["h", "side"], ["sum"]),
        helper.make_node("LayerNormalization", ["sum", "g", "beta"], ["y"], axis=-1),
    ]
    return make_model(nodes, [("x", F, [4, 8])], [("y", F, [4, 8])], inits)


def _types(graph):
    return {v: graph.info[v].dtype for v in graph.info}


def test_the_policy_op_by_op():
    g, summary = autocast(load_graph(_block()), "bf16")
    t = _types(g)
    # Matrix products in bfloat16, the bias added to a product cast to it (torch.addmm).
    assert t["mm"] == BF and t["biased"] == BF and t["h"] == BF and t["side"] == BF
    # A Div by a constant scalar stays in the activation's type; Softmax is float32, and
    # what follows it promotes to float32 until the next product.
    assert t["scaled"] == BF and t["p"] == F and t["pd"] == F
    # h + side: both 16-bit, stays 16-bit; LayerNormalization computes in float32.
    assert t["sum"] == BF and t["y"] == F
    # The Dropout's ratio keeps its own type (its schema's T1).
    drop = next(n for n in g.nodes if n.op_type == "Dropout")
    assert t[drop.input[1]] == F
    # One Cast per value and type: x is read by two MatMuls, cast once.
    casts = [n for n in g.nodes if n.op_type == "Cast"]
    assert sum(1 for n in casts if n.input[0] == "x") == 1
    assert summary.casts == len(casts)
    # Every node still reads values of one type per constraint: ORT loads it.
    for n in g.nodes:
        if n.op_type in ("MatMul", "Add"):
            assert len({t[i] for i in n.input}) == 1, n


def test_fp32_builds_the_step_as_before():
    model = build_model("mlp")
    a = build_training_step(load_graph(model), BuildOptions())
    b = build_training_step(load_graph(model), BuildOptions(precision="fp32"))
    assert a.to_model().SerializeToString() == b.to_model().SerializeToString()
    assert PRECISION_KEY not in a.metadata


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_step_keeps_fp32_parameters_state_and_gradients(precision):
    step = build_training_step(load_graph(build_model("gpt2")), BuildOptions(
        precision=precision, optimizer="adamw"))
    params = json.loads(step.metadata["memcc.parameters"])
    state = json.loads(step.metadata["memcc.state"])
    grads = json.loads(step.metadata["memcc.gradients"])
    assert all(step.info[p].dtype == F for p in params)
    assert all(step.info[s].dtype == F for s in state.values())
    assert all(step.info[g].dtype == F for g in grads.values())
    assert step.info[step.metadata["memcc.loss"]].dtype == F
    record = json.loads(step.metadata[PRECISION_KEY])
    assert record["precision"] == precision and record["casts_added"] > 0
    low = BF if precision == "bf16" else H
    matmuls = [n for n in step.nodes if n.op_type == "MatMul"]
    assert matmuls and all(step.info[n.output[0]].dtype == low for n in matmuls)


def test_the_backward_reads_16_bit_values_not_their_float32_copies():
    """A LayerNorm's float32 input copy and the weights' 16-bit copies are cast again in the
    backward, so that neither is held from the forward to the backward."""
    step = build_training_step(load_graph(build_model("gpt2")), BuildOptions(precision="bf16"))
    from memcc.step import Role, TrainingStep

    roles = TrainingStep(step).roles
    forward_casts = {n.output[0] for n in step.nodes
                     if n.op_type == "Cast" and roles[n.name] is Role.FORWARD
                     and (step.info[n.output[0]].dtype == F
                          or n.input[0] in step.inputs)}
    assert forward_casts
    read_later = {i for n in step.nodes if roles[n.name] is not Role.FORWARD
                  for i in n.input}
    assert not (forward_casts & read_later), sorted(forward_casts & read_later)[:5]
    assert json.loads(step.metadata[PRECISION_KEY])["recast_in_backward"] > 0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_the_cpu_provider_runs_a_16_bit_step_it_has_no_kernels_for(precision):
    """ORT's CPU provider has no bfloat16 MatMul (the step would not load) and no float16
    one (ORT would insert its own Casts): memcc computes those ops in float32 between casts,
    and says which."""
    model = build_model("resnet18", batch=2, resolution=32)
    step = build_training_step(load_graph(model), BuildOptions(precision=precision))
    ran, report = for_provider(step, "cpu")
    emulated = report["sixteen_bit_emulated"]
    assert emulated.get("Conv", 0) > 0
    low = BF if precision == "bf16" else H
    # Values between ops stay 16-bit: every emulated node's results are cast back down.
    for n in ran.nodes:
        if n.op_type == "Conv":
            assert ran.info[n.output[0]].dtype == F
    feeds = {**make_feeds(model, seed=0), "labels": make_labels(model, seed=0)}
    out = run_once(ran, feeds, 2)
    assert np.isfinite(float(out[step.metadata["memcc.loss"]]))
    assert any(ran.info[v].dtype == low for v in ran.info)


def test_a_reducing_scatter_is_computed_in_float32_on_the_cpu():
    """onnxruntime 1.31's CPU ScatterElements lists float16 but refuses it with
    reduction='add' when it runs; the MaxPool gradient is such a scatter."""
    model = build_model("resnet18", batch=2, resolution=32)
    step = build_training_step(load_graph(model), BuildOptions(precision="fp16"))
    scatters = [n for n in step.nodes if n.op_type == "ScatterElements"
                and step.info[n.output[0]].dtype == H]
    assert scatters and all(n.attribute[0].s == b"add" for n in scatters
                            if n.attribute and n.attribute[0].name == "reduction")
    ran, report = sixteen_bit(step, "cpu")
    assert report["sixteen_bit_emulated"].get("ScatterElements", 0) == len(scatters)


def test_an_fp32_step_is_left_alone_by_the_provider_pass():
    step = build_training_step(load_graph(build_model("mlp")), BuildOptions())
    ran, report = sixteen_bit(step, "cpu")
    assert ran is step and report == {}


def test_trained_weights_export_as_the_float32_forward_model(tmp_path):
    """memcc.Trainer trains a bfloat16 step on the CPU; the forward model it exports is the
    model as it came (no autocast Casts, float32 values) with the trained master weights,
    and plain ONNX Runtime runs it."""
    import onnx
    import onnxruntime as ort

    from memcc import Trainer

    model = build_model("gpt2")
    path = tmp_path / "step.onnx"
    onnx.save(build_training_step(load_graph(model), BuildOptions(precision="bf16"))
              .to_model(), str(path))
    feeds = make_feeds(model, seed=0)
    batch = {**feeds, "labels": make_labels(model, seed=0)}
    trainer = Trainer(path)
    losses = [trainer.step(batch) for _ in range(3)]
    assert losses[-1] < losses[0]
    out = trainer.export(tmp_path / "trained.onnx")
    exported = onnx.load(str(out))
    types = {i.data_type for i in exported.graph.initializer}
    assert TensorProto.FLOAT in types and types <= {TensorProto.FLOAT, TensorProto.INT64}
    assert not [n for n in exported.graph.node if n.op_type == "Cast"
                and any(a.name == "to" and a.i in (BF, H) for a in n.attribute)]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    logits = sess.run(None, feeds)[0]
    assert logits.dtype == np.float32 and np.isfinite(logits).all()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_step_compiled_for_the_cpu_exports_a_forward_model_ort_loads(tmp_path, precision):
    """compile writes the CPU provider's float32 computing into a 16-bit step (``f32/``
    Casts around each node without a 16-bit kernel). The exported forward model kept them:
    a Cast down to 16-bit whose output the float32 model types float32, which ONNX Runtime
    refused ("Type (tensor(float)) of output arg ... of node (f32/Cast_N) does not match
    expected type (tensor(float16))"). Now it is the model the step as built exports, bit
    for bit, and its loss is the step's within 16-bit rounding."""
    import onnx
    import onnxruntime as ort

    from memcc import Trainer
    from memcc.step import TrainingStep
    from memcc.trainer.export import ExportRequest, export_weights

    model = build_model("gpt2")
    built = build_training_step(load_graph(model), BuildOptions(precision=precision))
    compiled, report = for_provider(built, "cpu")
    assert report["sixteen_bit_emulated"]
    path = tmp_path / "step.onnx"
    onnx.save(compiled.to_model(), str(path))
    feeds = make_feeds(model, seed=0)
    labels = make_labels(model, seed=0)
    trainer = Trainer(path)
    for _ in range(2):
        trainer.step({**feeds, "labels": labels})
    state = trainer.state_dict()
    out = trainer.export(tmp_path / "trained.onnx")
    assert not [n for n in onnx.load(str(out)).graph.node if n.op_type == "Cast"
                and (n.name.startswith("f32/") or any(a.name == "to" and a.i in (BF, H)
                                                      for a in n.attribute))]
    logits = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    as_built = export_weights(built, TrainingStep.of(built), state,
                              ExportRequest(tmp_path / "built.onnx"))
    theirs = ort.InferenceSession(str(as_built), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    np.testing.assert_array_equal(logits, theirs)
    # The step's forward at these weights (its loss, before its update) computes in 16-bit.
    loss = trainer.step({**feeds, "labels": labels})
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ours = -np.take_along_axis(logp, labels[..., None], -1).mean()
    assert abs(ours - loss) <= 2e-2 * abs(loss), (ours, loss)


def test_16_bit_products_are_priced_at_the_tensor_core_rate_on_cuda_only():
    """The CUDA rates price a 16-bit MatMul at twice the float32 rate (the datasheets'
    ratio, not measured); on the CPU the provider pass has made it a float32 MatMul."""
    from memcc.passes.analysis.cost_model import CUDA_NOMINAL, NOMINAL_CPU, analytic_estimate
    from memcc.passes.analysis.cuda_node_times import node_features

    model = build_model("gpt2", batch=8, seq_len=128)
    a = build_training_step(load_graph(model), BuildOptions())
    b = build_training_step(load_graph(model), BuildOptions(precision="bf16"))
    big = max((n for n in a.nodes if n.op_type == "MatMul"),
              key=lambda n: a.info[n.output[0]].numel)
    twin = next(n for n in b.nodes if n.name == big.name)
    assert b.info[twin.output[0]].dtype == BF
    flops32, flops16 = node_features(a, big)[1], node_features(b, twin)[1]
    assert flops16 == flops32 / CUDA_NOMINAL.sixteen_bit_flops
    assert analytic_estimate(b, twin, CUDA_NOMINAL) < analytic_estimate(a, big, CUDA_NOMINAL)
    assert NOMINAL_CPU.sixteen_bit_flops == 1.0


def test_compile_plans_a_16_bit_step_and_says_what_the_cpu_computes_in_float32(tmp_path):
    """compile plans a bfloat16 step (built from the forward model with --precision),
    verifies it bit for bit against the step as built, reports what autocast did and which
    ops the CPU provider computes in float32 between casts, and warns about the speed."""
    from memcc.compiler import CompileOptions, compile_model

    path = tmp_path / "gpt2.onnx"
    import onnx

    onnx.save(build_model("gpt2", batch=4, seq_len=64), str(path))
    result = compile_model(path, CompileOptions(
        budget="min", strategy="sqrtn", cost="analytic", time_limit=20, verify=True,
        build=BuildOptions(precision="bf16", loss_chunks=1, attention_chunks=1,
                           mlp_chunks=1)), output=tmp_path / "out.onnx")
    report = result.report
    load = report["passes"][0]["summary"]
    assert load["precision"]["precision"] == "bf16"
    assert load["sixteen_bit_emulated"].get("MatMul", 0) > 0
    assert report["verification"]["ok"] and report["plan"]["fits"]
    assert any("float32 between 16-bit casts" in w for w in report["warnings"])


def test_bf16_on_cuda_points_at_fp16_where_only_fp16_has_convolution_kernels(tmp_path):
    """ORT's CUDA provider registers no bfloat16 Conv (memcc's table, read from its source):
    a bf16 convnet planned for CUDA computes its convolutions in float32, and compile's
    warning says that --precision fp16 has kernels for them."""
    import onnx

    from memcc.compiler import CompileOptions, compile_model

    path = tmp_path / "r.onnx"
    onnx.save(build_model("resnet18", batch=2, resolution=32, width=8), str(path))
    report = compile_model(path, CompileOptions(
        budget="1TB", provider="cuda", cost="analytic",
        build=BuildOptions(precision="bf16"))).report
    warning = next(w for w in report["warnings"] if "float32 between 16-bit casts" in w)
    assert "the cuda provider" in warning and "Conv " in warning
    assert "With --precision fp16 the provider has kernels for" in warning
    assert "Conv, ConvTranspose" in warning


def test_a_model_with_nothing_to_compute_in_16_bit_is_refused_with_a_message():
    """--precision on a model without matrix products or convolutions would build the float32
    step under another name: refused, saying why and what to do."""
    from memcc.errors import InputError

    rng = np.random.default_rng(0)
    model = make_model([helper.make_node("Mul", ["x", "w"], ["y"])],
                       [("x", F, [4, 8])], [("y", F, [4, 8])],
                       {"w": rng.standard_normal([8]).astype(np.float32)})
    with pytest.raises(InputError, match="no float32 matrix product or convolution"):
        build_training_step(load_graph(model), BuildOptions(precision="bf16", loss="mse"))


def test_a_budget_a_16_bit_step_cannot_reach_is_refused_naming_one_it_can(tmp_path):
    """Below what the bfloat16 step can reach, compile refuses, writes nothing and names a
    budget; that budget compiles and fits."""
    import onnx

    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.planning.planner import BudgetError

    path = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=4, seq_len=64), str(path))
    whole = {"loss_chunks": 1, "attention_chunks": 1, "mlp_chunks": 1}
    opts = {"strategy": "sqrtn", "cost": "analytic", "time_limit": 20}
    least = compile_model(path, CompileOptions(
        budget="min", build=BuildOptions(precision="bf16", **whole), **opts)
        ).report["budget_bytes"]
    out = tmp_path / "out.onnx"
    with pytest.raises(BudgetError) as refused:
        compile_model(path, CompileOptions(budget=int(least * 0.9),
                                           build=BuildOptions(precision="bf16", **whole),
                                           **opts), output=out)
    assert not out.exists()
    named = int(__import__("re").search(r"--budget (\d+)", str(refused.value)).group(1))
    fits = compile_model(path, CompileOptions(budget=named, build=BuildOptions(
        precision="bf16", **whole), **opts), output=out).report
    assert fits["plan"]["fits"] and out.exists()


def test_the_autocast_comparison_benchmark_prints_both_sides():
    """benchmarks/autocast_vs_torch.py, whose figures README and BENCHMARKS.md quote."""
    from benchmarks.autocast_vs_torch import compare

    row = compare("mlp", "bf16", {})
    assert row["median_error_torch"] > 0 and row["median_error_memcc"] > 0
    assert np.isfinite([row["loss_torch"], row["loss_memcc"], row["loss_float64"]]).all()
    assert row["max_error_memcc"] >= row["median_error_memcc"]
