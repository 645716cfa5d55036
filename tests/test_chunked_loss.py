"""``memcc build --loss-chunks K``: cross-entropy and the vocabulary projection over row
chunks, each chunk's gradient taken at once (``frontend/chunked_loss.py``).

Against the plain loss of the same model: loss, parameter gradients and updated weights
within ``LOSS_CHUNKS_TOLERANCE`` at 1, 2 and 4 threads, each run twice (a chunk count that
does not divide the rows included), the logits never formed, a lower simulated peak where
the logits are large, the step still planned and verified by ``memcc compile``, and the
trained forward model exported with its logits.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from threads import assert_step_matches

from memcc import Trainer
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import synthetic_feeds
from memcc.compiler import CompileOptions, compile_model
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.chunked_loss import LOSS_CHUNKS_TOLERANCE
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
from memcc.passes.analysis.liveness import heap_allowance_bytes
from memcc.passes.plan import Plan
from memcc.passes.planning.simulate import simulate
from memcc.step import TrainingStep
from models import build_model


def compare(plain: Graph, chunked: Graph) -> None:
    assert_step_matches(plain, chunked, LOSS_CHUNKS_TOLERANCE)


@pytest.mark.parametrize("chunks", [3, 8])
def test_zoo_gpt2_matches_the_plain_loss(chunks):
    model = build_model("gpt2", batch=3, seq_len=10, width=32, depth=2, heads=2,
                        vocab_size=96)
    plain = build_training_step(load_graph(model), BuildOptions())
    chunked = build_training_step(load_graph(model), BuildOptions(loss_chunks=chunks))
    assert not [n for n in chunked.nodes if "logits" in n.output]
    assert sum(n.op_type == "LogSoftmax" for n in chunked.nodes) == chunks
    compare(plain, chunked)


def test_large_logits_lower_the_peak_and_compile_verifies(tmp_path):
    """At a vocabulary of 2,048 the logits are the step's largest tensors: the simulated
    peak goes down, and ``memcc compile --verify`` plans and checks the chunked step."""
    model = build_model("gpt2", batch=4, seq_len=64, width=32, depth=2, heads=2,
                        vocab_size=2048)
    plain = build_training_step(load_graph(model), BuildOptions())
    chunked = build_training_step(load_graph(model), BuildOptions(loss_chunks=8))
    peaks = [simulate(g, Plan(), analytic_costs(g, NOMINAL_CPU)).peak_bytes
             for g in (plain, chunked)]
    assert peaks[1] < 0.75 * peaks[0], peaks
    path = tmp_path / "chunked.onnx"
    save_graph(chunked, path)
    # 80% of the peak as built, plus the heap room compile keeps for the small buffers
    budget = int(peaks[1] * 0.8) + heap_allowance_bytes(chunked)
    result = compile_model(path, CompileOptions(budget=budget, cost="analytic",
                                                verify=True, time_limit=20),
                           output=tmp_path / "out.onnx")
    assert result.report["verification"]["ok"]


def test_real_export_matches_and_the_trained_forward_model_has_its_logits(tmp_path):
    """A transformers GPT-2 exported by torch.onnx (dynamo): the chunked step matches the
    plain one, and the forward model exported after training computes the logits again,
    with the trained weights."""
    from exports import export

    path, _, _, dims = export("gpt2", "dynamo", training=True)
    plain = build_training_step(load_graph(path, dims), BuildOptions())
    chunked_step = build_training_step(load_graph(path, dims), BuildOptions(loss_chunks=4))
    compare(plain, chunked_step)
    out, logits = _trained_forward(chunked_step, tmp_path / "chunked")
    forward_outputs = list(TrainingStep(chunked_step).forward_outputs)
    assert [o.name for o in onnx.load(str(out)).graph.output] == forward_outputs
    assert logits.shape == chunked_step.info[forward_outputs[0]].shape
    assert np.isfinite(logits).all()


class _WordLM:
    """A word-level LSTM language model whose vocabulary projection is an ``nn.Linear``
    with a bias, which both exporters write as a MatMul and an Add over rank-3 states."""

    @staticmethod
    def export(path, exporter: str):
        import torch

        class WordLM(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.emb = torch.nn.Embedding(300, 16)
                self.rnn = torch.nn.LSTM(16, 16, batch_first=True)
                self.out = torch.nn.Linear(16, 300)

            def forward(self, input_ids):
                return self.out(self.rnn(self.emb(input_ids))[0])

        torch.manual_seed(0)
        model = WordLM()
        with torch.no_grad():
            model.out.bias.normal_()
        ids = torch.randint(0, 300, (3, 7))
        kw = {"dynamo": False, "do_constant_folding": False, "opset_version": 17} \
            if exporter == "torchscript" else {"dynamo": True, "optimize": False}
        torch.onnx.export(model, (ids,), str(path), input_names=["input_ids"],
                          output_names=["logits"], **kw)
        return path


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_projection_with_a_bias_is_chunked_and_exported_with_it(tmp_path, exporter):
    """``nn.Linear(width, vocab)`` with its bias: the chunks add the bias and take its
    gradient (the column sums of each chunk's logits gradient); loss and every gradient
    match the plain loss's, and the exported forward model adds the trained bias again."""
    path = _WordLM.export(tmp_path / "lm.onnx", exporter)
    plain = build_training_step(load_graph(path), BuildOptions())
    chunked_step = build_training_step(load_graph(path), BuildOptions(loss_chunks=3))
    assert sum(n.op_type == "LogSoftmax" for n in chunked_step.nodes) == 3
    assert TrainingStep(chunked_step).loss_projection["bias"] == "out.bias"
    compare(plain, chunked_step)
    _, logits = _trained_forward(chunked_step, tmp_path / "chunked")
    # The trained forward model's logits, against the plain step's forward after the same
    # step: both read the same trained weights (within the chunks' rounding).
    _, ref = _trained_forward(plain, tmp_path / "plain")
    np.testing.assert_allclose(logits, ref, rtol=1e-4, atol=1e-5)
    assert np.abs(ref).max() > 0.5


def _trained_forward(step: Graph, folder) -> tuple:
    """One training step on synthetic batch 0, then the exported forward model's path and
    its first output on that batch."""
    folder.mkdir()
    step_path = folder / "step.onnx"
    save_graph(step, step_path)
    trainer = Trainer(step_path, threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    trainer.step(feeds)
    out = trainer.export(folder / "trained.onnx")
    data = {i.name: feeds[i.name] for i in onnx.load(str(out)).graph.input}
    return out, ort.InferenceSession(str(out)).run(None, data)[0]


def test_what_it_cannot_take_is_refused_clearly():
    with pytest.raises(InputError, match="--loss-chunks applies to --loss cross-entropy"):
        BuildOptions(loss="mse", loss_chunks=4)
    with pytest.raises(InputError, match="give 1"):
        BuildOptions(loss_chunks=0)
    resnet = build_model("resnet18", batch=2, resolution=32)   # logits from a Gemm
    with pytest.raises(InputError, match="--loss-chunks needs the logits"):
        build_training_step(load_graph(resnet), BuildOptions(loss_chunks=2))


def test_the_command_line_builds_it(tmp_path):
    from typer.testing import CliRunner

    from memcc.cli import app

    model = tmp_path / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=2, seq_len=8, width=32, depth=1, heads=2,
                          vocab_size=64), str(model))
    out = tmp_path / "step.onnx"
    res = CliRunner().invoke(app, ["build", str(model), "-o", str(out), "--loss-chunks", "4"])
    assert res.exit_code == 0, res.output
    step = onnx.load(str(out))
    assert sum(n.op_type == "LogSoftmax" for n in step.graph.node) == 4
    assert any(p.key == "memcc.loss_projection" for p in step.metadata_props)
    bad = CliRunner().invoke(app, ["build", str(model), "-o", str(out), "--loss", "mse",
                                   "--loss-chunks", "4"])
    assert bad.exit_code != 0 and "--loss-chunks applies to --loss cross-entropy" in bad.output
