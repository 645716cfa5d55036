"""``memcc build --attention-chunks K`` and ``--mlp-chunks K``: every attention's scores and
probabilities over query chunks, every MLP's hidden activations over token chunks
(``frontend/row_chunks.py``).

Against whole regions of the same model: loss, parameter gradients and updated weights
within ``ROW_CHUNKS_TOLERANCE`` at 1, 2 and 4 threads, each run twice, on the zoo's GPT-2
(a chunk count that does not divide the tokens, and one above them) and on torch.onnx
exports of transformers models with both exporters (their masks, NaN guards, Dropout and
gated MLPs); no Softmax over all the queries left; a lower smallest budget where the
chunked tensors dominate, verified by running the plan; and clear refusals.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from threads import assert_step_matches

from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import synthetic_feeds
from memcc.compiler import CompileOptions, compile_model
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.row_chunks import ROW_CHUNKS_TOLERANCE, find_attentions, find_mlps
from memcc.graph import Graph
from memcc.step import ROW_CHUNKS_KEY
from models import build_model


def compare(whole: Graph, chunked: Graph) -> None:
    assert_step_matches(whole, chunked, ROW_CHUNKS_TOLERANCE)


def softmax_rows(step: Graph) -> list[int]:
    """The query rows of each Softmax of the step's forward pass."""
    return [step.info[n.output[0]].shape[-2] for n in step.nodes
            if n.op_type == "Softmax" and not n.name.startswith("grad/")]


@pytest.mark.parametrize("chunks", [3, 16])
def test_zoo_gpt2_matches_whole_attention(chunks):
    model = build_model("gpt2", batch=3, seq_len=10, width=32, depth=2, heads=2,
                        vocab_size=96)
    whole = build_training_step(load_graph(model), BuildOptions())
    chunked = build_training_step(load_graph(model), BuildOptions(attention_chunks=chunks))
    assert softmax_rows(whole) == [10, 10]
    used = min(chunks, 10)   # at most one query per chunk
    rows = softmax_rows(chunked)
    assert len(rows) == 2 * used and sum(rows) == 20 and max(rows) <= -(-10 // used)
    assert chunked.metadata[ROW_CHUNKS_KEY] == \
        f'{{"attention": {{"chunks": {chunks}, "regions": 2}}}}'
    compare(whole, chunked)


def test_zoo_gpt2_mlps_match_whole_mlps_with_attentions_and_the_loss_chunked_too():
    model = build_model("gpt2", batch=3, seq_len=10, width=32, depth=2, heads=2,
                        vocab_size=96)
    whole = build_training_step(load_graph(model), BuildOptions())
    assert len(find_mlps(load_graph(model))) == 2
    chunked = build_training_step(load_graph(model), BuildOptions(
        mlp_chunks=3, attention_chunks=4, loss_chunks=3))
    hidden = [chunked.info[n.output[0]].shape for n in chunked.nodes
              if n.op_type == "Tanh" and not n.name.startswith("grad/")]
    assert len(hidden) == 2 * 3 and all(s[-2] <= 4 for s in hidden), hidden
    assert chunked.metadata[ROW_CHUNKS_KEY] == ('{"attention": {"chunks": 4, "regions": 2}, '
                                                '"mlp": {"chunks": 3, "regions": 2}}')
    compare(whole, chunked)


@pytest.mark.parametrize("family,exporter", [
    ("gpt2", "torchscript"), ("gpt2", "dynamo"), ("gpt2", "dynamo_noopt"),
    ("bert", "torchscript"), ("llama", "dynamo"), ("vit", "torchscript"),
])
def test_real_exports_match_whole_attention(family, exporter):
    """transformers models through torch.onnx: GPT-2's and BERT's additive masks and NaN
    guards (``Where(IsNaN(p), 0, p)``), Llama's grouped-query keys, ViT's Dropout (p=0 in
    training mode, as TorchScript writes it)."""
    from exports import export

    path, _, _, dims = export(family, exporter, training=True)
    whole = build_training_step(load_graph(path, dims), BuildOptions())
    chunked = build_training_step(load_graph(path, dims), BuildOptions(attention_chunks=3))
    assert '"attention": {"chunks": 3, "regions": 2}' in chunked.metadata[ROW_CHUNKS_KEY]
    assert max(softmax_rows(chunked)) < max(softmax_rows(whole))
    compare(whole, chunked)


def test_every_chunk_of_a_dropout_draws_its_own_masks():
    """memcc seeds every Dropout at load (``canonicalize.seed_dropouts``); a chunk copies its
    whole node, so without a seed of its own every chunk would draw the same mask. The
    step draws each mask from its Dropout's seed (``frontend.dropout_masks``), and records
    the Dropout it replaced."""
    from exports import export

    from memcc.frontend.dropout_masks import ORIGINAL_PROP

    path, _, _, dims = export("vit", "torchscript", training=True, dropout=0.1)
    step = build_training_step(load_graph(path, dims),
                               BuildOptions(attention_chunks=3, mlp_chunks=2))
    # Left: only those exported without training_mode, which ORT runs as an identity.
    assert all(len(n.input) < 3 for n in step.nodes if n.op_type == "Dropout")
    originals = []
    for n in step.nodes:
        for p in n.metadata_props:
            if p.key == ORIGINAL_PROP:
                originals.append(onnx.NodeProto.FromString(bytes.fromhex(p.value)))
    seeds = {n.name: [a.i for a in n.attribute if a.name == "seed"] for n in originals}
    assert sum("/r" in name for name in seeds) >= 6, sorted(seeds)
    assert all(len(s) == 1 for s in seeds.values())
    assert len({s[0] for s in seeds.values()}) == len(seeds)


@pytest.mark.parametrize("family,exporter", [
    ("bert", "dynamo"), ("llama", "torchscript"), ("vit", "dynamo_noopt"),
    ("gpt2", "torchscript"), ("gpt2", "dynamo"),
])
def test_real_exports_mlps_match_whole_mlps(family, exporter):
    """BERT's erf GELU, Llama's gated SiLU MLP (two products of one input), ViT's GELU, and
    transformers' GPT-2, whose Conv1D layers are Gemms on flattened [tokens, width] rows
    with Reshapes around the activation (its chunks stay flat, without the Reshapes)."""
    from exports import export

    path, _, _, dims = export(family, exporter, training=True)
    forward = load_graph(path, dims)
    mlps = find_mlps(forward)
    assert len(mlps) >= 2
    if family == "gpt2":
        assert all(m.flat and m.last.op_type == "Gemm" for m in mlps)
    whole = build_training_step(load_graph(path, dims), BuildOptions())
    chunked = build_training_step(load_graph(path, dims), BuildOptions(mlp_chunks=3))
    assert f'"mlp": {{"chunks": 3, "regions": {len(mlps)}}}' in chunked.metadata[ROW_CHUNKS_KEY]
    compare(whole, chunked)


def test_long_sequences_get_a_lower_smallest_budget_that_holds_when_run(tmp_path):
    """At 256 tokens and width 32 the scores are the largest tensors: the smallest plan of
    the chunked step is far below the whole step's, and ``--verify`` runs it within its
    budget with the same outputs (the MLPs are chunked too)."""
    model = build_model("gpt2", batch=1, seq_len=256, width=32, depth=2, heads=4,
                        vocab_size=64)
    plans = {}
    for chunks in (1, 8):
        step = build_training_step(load_graph(model), BuildOptions(attention_chunks=chunks,
                                                                   mlp_chunks=chunks))
        path = tmp_path / f"step{chunks}.onnx"
        save_graph(step, path)
        result = compile_model(path, CompileOptions(budget="min", cost="analytic",
                                                    verify=chunks > 1, time_limit=10),
                               output=tmp_path / f"min{chunks}.onnx")
        plans[chunks] = result.report
    whole, chunked = plans[1]["plan"]["peak_bytes"], plans[8]["plan"]["peak_bytes"]
    assert chunked < 0.6 * whole, (whole, chunked)
    check = plans[8]["verification"]
    assert check["ok"] and check["measured_peak_bytes"] <= plans[8]["budget_bytes"]
    loads = {k: next(p["summary"] for p in r["passes"] if p["name"] == "load")
             for k, r in plans.items()}
    assert "row_chunks" not in loads[1]
    assert loads[8]["row_chunks"] == {"attention": {"chunks": 8, "regions": 2},
                                      "mlp": {"chunks": 8, "regions": 2}}


def test_the_trained_forward_model_is_exported_in_chunks(tmp_path):
    """``memcc export`` writes the forward pass the step holds, chunked, after a training
    step: plain ORT loads it and computes logits of the step's shape."""
    import onnxruntime as ort

    from memcc import Trainer
    from memcc.step import TrainingStep

    model = build_model("gpt2", batch=2, seq_len=8, width=32, depth=1, heads=2, vocab_size=64)
    step = build_training_step(load_graph(model), BuildOptions(attention_chunks=2,
                                                               mlp_chunks=2))
    path = tmp_path / "step.onnx"
    save_graph(step, path)
    trainer = Trainer(path, threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    trainer.step(feeds)
    exported = onnx.load(str(trainer.export(tmp_path / "trained.onnx")))
    assert sum(n.op_type == "Softmax" for n in exported.graph.node) == 2
    data = {i.name: feeds[i.name] for i in exported.graph.input}
    logits = ort.InferenceSession(exported.SerializeToString()).run(None, data)[0]
    forward = TrainingStep(step).forward_outputs[0]
    assert logits.shape == step.info[forward].shape and np.isfinite(logits).all()


def test_a_budget_nothing_fits_names_the_flags_that_would_split(tmp_path):
    """Compiling a forward model whose smallest budget is above the one asked, with the
    row chunks set by flags (compile does not choose them then): the error names the
    attentions and MLPs left whole and the flags that split them, and only those. (No
    slack: with the default 1 MiB, 400 KB is below what the inputs, parameters and state
    alone need with it, which is refused before any search, without the hint.)"""
    from memcc.passes.planning.planner import BudgetError

    model = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=1, seq_len=64, width=32, depth=2, heads=2,
                          vocab_size=64), str(model))
    with pytest.raises(BudgetError) as whole:
        compile_model(model, CompileOptions(budget=400_000, slack_bytes=0, cost="analytic",
                                            time_limit=3, build=BuildOptions(
                                                loss_chunks=1, attention_chunks=1,
                                                mlp_chunks=1)),
                      output=tmp_path / "out.onnx")
    assert "2 attentions (--attention-chunks K) and 2 MLPs (--mlp-chunks K)" in str(whole.value)
    with pytest.raises(BudgetError) as half:
        compile_model(model, CompileOptions(budget=400_000, slack_bytes=0, cost="analytic",
                                            time_limit=3,
                                            build=BuildOptions(loss_chunks=1, attention_chunks=2,
                                                               mlp_chunks=1)),
                      output=tmp_path / "out.onnx")
    assert "2 MLPs (--mlp-chunks K)" in str(half.value)
    assert "attentions (" not in str(half.value)


def _attention_model(probs_is_output: bool) -> onnx.ModelProto:
    """softmax(q k^T / 4 + bias) v with a learned [T, T] bias, by hand."""
    t, d = 6, 4
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, rng.standard_normal(s).ravel())
             for n, s in (("wq", [d, d]), ("wk", [d, d]), ("bias", [t, t]))]
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"]),
        helper.make_node("MatMul", ["x", "wk"], ["k"]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Div", ["s", "four"], ["s4"]),
        helper.make_node("Add", ["s4", "bias"], ["sb"]),
        helper.make_node("Softmax", ["sb"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "x"], ["y"]),
    ]
    inits.append(helper.make_tensor("four", TensorProto.FLOAT, [], [4.0]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, t, d])]
    if probs_is_output:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [2, t, t]))
    graph = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, t, d])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_split_side_input_gets_its_gradient_and_shared_values_are_left_whole():
    """A learned bias spanning the queries is split with them (its gradient is the Concat of
    the chunks'); probabilities that the model also returns are not chunked."""
    free = load_graph(_attention_model(False))
    assert len(find_attentions(free)) == 1
    whole = build_training_step(free, BuildOptions(loss="mse"))
    chunked = build_training_step(load_graph(_attention_model(False)),
                                  BuildOptions(loss="mse", attention_chunks=4))
    assert any(n.op_type == "Split" and n.input[0] == "bias" for n in chunked.nodes)
    compare(whole, chunked)
    assert find_attentions(load_graph(_attention_model(True))) == []


def test_a_fused_gate_and_up_product_split_by_columns():
    """Phi-3's MLP: one product makes gate and up side by side, a Split along the last axis
    takes them apart, silu(gate) * up goes down: one MLP, chunked, the same gradients."""
    t, c, h = 6, 4, 8
    rng = np.random.default_rng(1)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, sh, rng.standard_normal(sh).ravel())
             for n, sh in (("w_gate_up", [c, 2 * h]), ("w_down", [h, c]))]
    inits.append(helper.make_tensor("halves", TensorProto.INT64, [2], [h, h]))
    nodes = [
        helper.make_node("MatMul", ["x", "w_gate_up"], ["gu"]),
        helper.make_node("Split", ["gu", "halves"], ["gate", "up"], axis=-1),
        helper.make_node("Sigmoid", ["gate"], ["sg"]),
        helper.make_node("Mul", ["gate", "sg"], ["silu"]),
        helper.make_node("Mul", ["silu", "up"], ["hidden"]),
        helper.make_node("MatMul", ["hidden", "w_down"], ["y"]),
    ]
    model = helper.make_model(helper.make_graph(
        nodes, "gated", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, t, c])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, t, c])], inits),
        opset_imports=[helper.make_opsetid("", 17)])
    mlps = find_mlps(load_graph(model))
    assert len(mlps) == 1 and any(n.op_type == "Split" for n in mlps[0].nodes)
    whole = build_training_step(load_graph(model), BuildOptions(loss="mse"))
    chunked = build_training_step(load_graph(model), BuildOptions(loss="mse", mlp_chunks=3))
    assert sum(n.op_type == "Split" and n.input[0] == "x" for n in chunked.nodes) == 1
    compare(whole, chunked)


def test_what_it_cannot_take_is_refused_clearly():
    with pytest.raises(InputError, match="--attention-chunks 0: give 1"):
        BuildOptions(attention_chunks=0)
    with pytest.raises(InputError, match="--mlp-chunks 0: give 1"):
        BuildOptions(mlp_chunks=0)
    resnet = build_model("resnet18", batch=2, resolution=32)
    with pytest.raises(InputError, match="--attention-chunks found no attention"):
        build_training_step(load_graph(resnet), BuildOptions(attention_chunks=2))
    with pytest.raises(InputError, match="--mlp-chunks found no mlp"):
        build_training_step(load_graph(resnet), BuildOptions(mlp_chunks=2))
    with pytest.raises(InputError, match="found no attention"):
        build_training_step(load_graph(_attention_model(True)),
                            BuildOptions(loss="mse", attention_chunks=2))


def test_the_command_line_builds_it(tmp_path):
    from typer.testing import CliRunner

    from memcc.cli import app

    model = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=2, seq_len=8, width=32, depth=1, heads=2,
                          vocab_size=64), str(model))
    out = tmp_path / "step.onnx"
    res = CliRunner().invoke(app, ["build", str(model), "-o", str(out),
                                   "--attention-chunks", "4", "--mlp-chunks", "2"])
    assert res.exit_code == 0, res.output
    step = onnx.load(str(out))
    assert sum(n.op_type == "Softmax" for n in step.graph.node
               if not n.name.startswith("grad/")) == 4
    assert sum(n.op_type == "Tanh" for n in step.graph.node
               if not n.name.startswith("grad/")) == 2
    assert any(p.key == ROW_CHUNKS_KEY for p in step.metadata_props)
    bad = CliRunner().invoke(app, ["build", str(model), "-o", str(out),
                                   "--attention-chunks", "0"])
    assert bad.exit_code != 0
