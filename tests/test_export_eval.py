"""``memcc export --eval``: the trained model written as PyTorch's eval mode runs it.

A model exported in train mode keeps train mode in the forward model ``memcc export``
writes (batch statistics, dropping Dropouts); the deployment a user trains for is
``module.eval()``. These tests train a step two SGD steps, export it with ``--eval`` and
hold its ONNX output against the PyTorch module in eval mode loaded with the exported
weights, for both exporters; a step rewritten for CUDA (BatchNorm as reductions) exports
the same model; a random draw outside Dropout is refused, not written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from exports import DYNAMO_NOOPT, export, make_inputs, torch_forward
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions
from memcc.passes.providers.provider_step import for_provider
from memcc.step import TrainingStep
from memcc.trainer import Trainer, forward_graph


def _trained(exporter: str, tmp_path: Path) -> tuple[Path, Path, torch.nn.Module, dict]:
    """The MobileNet block (three BatchNorms, a Dropout of 0.1) exported in train mode,
    built, trained two SGD steps and checkpointed."""
    path, module, inputs, dims = export("mobilenet_block", exporter, training=True,
                                        dropout=0.1)
    step_path = tmp_path / "s.onnx"
    api.build(path, step_path, dims=dims, options=BuildOptions(optimizer="sgd", lr=0.1))
    trainer = Trainer(step_path)
    labels = np.random.default_rng(0).integers(0, 10, size=2).astype(np.int64)
    for _ in range(2):
        trainer.step({**inputs, "labels": labels})
    trainer.save(tmp_path / "ckpt")
    return step_path, tmp_path / "ckpt", module, inputs


def _export(step: Path, ckpt: Path, out: Path, *flags: str) -> str:
    r = CliRunner().invoke(app, ["export", str(step), "--checkpoint", str(ckpt), "-o",
                                 str(out), *flags])
    assert r.exit_code == 0, r.output
    return r.output


def _run(path: Path, inputs: dict[str, np.ndarray], threads: int) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: inputs[i.name] for i in sess.get_inputs()})[0]


def _agrees_with_torch(path: Path, module: torch.nn.Module,
                       batches: list[dict[str, np.ndarray]]) -> None:
    """The exported model at 1 and 2 threads against the module in eval mode on each
    batch (other sizes than it was built at): within 1e-5 of the largest output."""
    module.eval()
    for feeds in batches:
        want = torch_forward(module, feeds)
        for threads in (1, 2):
            got = _run(path, feeds, threads)
            assert got.shape == want.shape
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _images(like: np.ndarray, seed: int) -> list[dict[str, np.ndarray]]:
    """Batches of 1 and 3 images shaped as ``like``'s."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((b, *like.shape[1:])).astype(np.float32)}
            for b in (1, 3)]


def _token_batches(seed: int) -> list[dict[str, np.ndarray]]:
    """GPT-2 inputs at 1 x 5 and 3 x 11 tokens (built at 2 x 8)."""
    return [{k: v.numpy() for k, v in make_inputs("gpt2", sizes, seed=seed).items()}
            for sizes in ({"batch": 1, "seq": 5}, {"batch": 3, "seq": 11})]


@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_eval_export_computes_what_pytorch_eval_mode_does(exporter, tmp_path):
    step, ckpt, module, inputs = _trained(exporter, tmp_path)
    said = _export(step, ckpt, tmp_path / "eval.onnx", "--eval")
    assert "eval mode: 3 BatchNorm(s)" in said and "1 Dropout(s)" in said, said
    plain = _export(step, ckpt, tmp_path / "train.onnx")
    assert "keeps train mode" in plain and "--eval" in plain, plain
    assert "the format follows the name" not in _export(step, ckpt, tmp_path / "w.safetensors")
    # A PyTorch user's habit, weights.pt, gets the ONNX model: said, not silent.
    assert "the format follows the name" in _export(step, ckpt, tmp_path / "w.pt")
    # --eval is about the ONNX graph; with safetensors it is refused, nothing written.
    r = CliRunner().invoke(app, ["export", str(step), "--checkpoint", str(ckpt), "-o",
                                 str(tmp_path / "e.safetensors"), "--eval"])
    assert r.exit_code != 0 and "--eval writes the ONNX model" in r.output, r.output
    assert not (tmp_path / "e.safetensors").exists()

    weights = safetensors.torch.load_file(tmp_path / "w.safetensors")
    missing, unexpected = module.load_state_dict(weights, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing), \
        (missing, unexpected)
    module.eval()
    with torch.no_grad():
        want = module(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()
    scale = float(np.abs(want).max())
    for threads in (1, 2):
        got = _run(tmp_path / "eval.onnx", inputs, threads)
        assert np.abs(got - want).max() <= 1e-5 * scale, (threads, got, want)
    # The train-mode file normalises by the batch: another answer (the test can fail).
    assert np.abs(_run(tmp_path / "train.onnx", inputs, 1) - want).max() > 1e-3 * scale
    fwd = onnx.load(tmp_path / "eval.onnx")
    assert not any(a.name == "training_mode" and a.i for n in fwd.graph.node
                   for a in n.attribute)


def test_a_step_rewritten_for_cuda_exports_the_same_eval_model(tmp_path):
    """On CUDA a training-mode BatchNorm is reductions feeding an inference-mode one
    (``passes/providers/batchnorm_for_cuda.py``): ``--eval`` points that node at the
    running statistics, and the reductions go."""
    path, _, inputs, dims = export("mobilenet_block", "torchscript", training=True,
                                   dropout=0.1)
    step = api.build(path, tmp_path / "s.onnx", dims=dims, options=BuildOptions())
    spec = TrainingStep.of(step)
    state = {k: np.asarray(v) for k, v in step.initializers.items()}
    on_cuda = for_provider(step, "cuda")[0]
    assert any(n.op_type == "ReduceSumSquare" for n in on_cuda.nodes)
    plain, cuda = (forward_graph(g, spec, state, eval_mode=True) for g in (step, on_cuda))
    assert not any(n.op_type == "ReduceSumSquare" for n in cuda.nodes)
    assert sorted(n.op_type for n in cuda.nodes) == sorted(n.op_type for n in plain.nodes)
    from memcc.backend.onnx_file import save_graph
    a, b = (save_graph(g, tmp_path / f"{k}.onnx") for k, g in (("a", plain), ("b", cuda)))
    assert np.array_equal(_run(a, inputs, 1), _run(b, inputs, 1))


@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_a_step_rewritten_for_cuda_exports_the_same_train_model_and_weights(exporter,
                                                                            tmp_path):
    """A step compiled for CUDA writes its BatchNorms back as training-mode nodes over the
    running statistics (``trainer/batchnorm_back.py``): the train-mode ONNX model computes
    the same bits as the CPU step's, and the weights carry the running statistics (before,
    the CUDA form's export had none, and kept the reductions)."""
    path, _, inputs, dims = export("mobilenet_block", exporter, training=True, dropout=0.0)
    step = api.build(path, tmp_path / "s.onnx", dims=dims, options=BuildOptions())
    on_cuda = for_provider(step, "cuda")[0]
    rng = np.random.default_rng(0)
    state = {k: np.asarray(v) for k, v in step.initializers.items()}
    running = [k for k in state if "running" in k]
    assert running
    for k in running:  # trained-looking statistics, not the initial ones
        state[k] = (state[k] + rng.uniform(0.1, 0.5, state[k].shape)).astype(state[k].dtype)
    fwd = {k: forward_graph(g, TrainingStep.of(g), state)
           for k, g in (("plain", step), ("cuda", on_cuda))}
    assert sorted(n.op_type for n in fwd["cuda"].nodes) == \
        sorted(n.op_type for n in fwd["plain"].nodes)
    from memcc.backend.onnx_file import save_graph
    from memcc.trainer import exported_weight_names
    files = {k: save_graph(g, tmp_path / f"{k}.onnx") for k, g in fwd.items()}
    for threads in (1, 2):
        assert np.array_equal(_run(files["plain"], inputs, threads),
                              _run(files["cuda"], inputs, threads))
    names = {k: set(exported_weight_names(g, TrainingStep.of(g), fwd[k]))
             for k, g in (("plain", step), ("cuda", on_cuda))}
    assert names["cuda"] == names["plain"] and set(running) <= names["cuda"]
    for k in running:
        assert np.array_equal(fwd["cuda"].initializers[k], state[k]), k


class _Noisy(torch.nn.Module):
    """Gaussian noise in train mode, as a noise layer (or stochastic depth) writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x + 0.1 * torch.randn_like(x)
        return self.fc(x)


def test_a_random_draw_outside_dropout_is_refused_and_nothing_written(tmp_path):
    module = _Noisy().train()
    x = torch.randn(2, 6)
    src = tmp_path / "noisy.onnx"
    torch.onnx.export(module, (x,), str(src), dynamo=False, input_names=["x"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING,
                      do_constant_folding=False)
    step = api.build(src, tmp_path / "s.onnx", options=BuildOptions())
    spec = TrainingStep.of(step)
    with pytest.raises(InputError, match="random draw.*RandomNormalLike"):
        forward_graph(step, spec, dict(step.initializers), eval_mode=True)
    Trainer(tmp_path / "s.onnx").save(tmp_path / "ckpt")
    r = CliRunner().invoke(app, ["export", str(tmp_path / "s.onnx"), "--checkpoint",
                                 str(tmp_path / "ckpt"), "-o", str(tmp_path / "e.onnx"),
                                 "--eval"])
    assert r.exit_code != 0 and "random draw" in r.output, r.output
    assert not (tmp_path / "e.onnx").exists()


def test_the_exported_model_keeps_its_named_axes_where_it_runs_at_other_sizes(tmp_path):
    """The user's model took any batch; the step was built at one. The exported model has
    the named axes back where it runs at other sizes (a TorchScript ResNet: Flatten, no
    folded reshape), checked against torch's eval mode at batch 1 and 3."""
    path, module, inputs, dims = export("convnet", "torchscript", training=True)
    api.build(path, tmp_path / "s.onnx", dims=dims, options=BuildOptions())
    Trainer(tmp_path / "s.onnx").save(tmp_path / "ck")
    said = _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "e.onnx", "--eval")
    assert "written at the sizes" not in said, said
    _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "w.safetensors")
    module.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"),
                           strict=False)
    sess = ort.InferenceSession(str(tmp_path / "e.onnx"), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape[0] == "batch"
    _agrees_with_torch(tmp_path / "e.onnx", module, _images(inputs["x"], 3))


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_a_transformer_is_exported_at_any_batch_and_sequence(tmp_path, exporter):
    """memcc folds the exporter's shape computations at the built sizes (batch 2, 8
    tokens); export puts them back, so GPT-2 runs at other batches and lengths as torch's
    eval mode does, after training and from a compiled step too (the dynamo export's
    `Concat([-1], Shape(mask)[1:2])` reads a constant that folding left unused: it is
    recorded with the folded node). A step built with row chunks is exported with every
    region computed whole again (a flat MLP's 3-D values too, which its chunks hold flat)."""
    path, module, _, dims = export("gpt2", exporter, training=True)
    api.build(path, tmp_path / "g.onnx", dims=dims, options=BuildOptions())
    api.compile_model(tmp_path / "g.onnx", api.CompileOptions(budget="min", time_limit=10),
                      output=tmp_path / "g.memcc.onnx")
    trainer = Trainer(tmp_path / "g.memcc.onnx")
    batch = {k: v.numpy() for k, v in make_inputs("gpt2", seed=1).items()}
    trainer.step(batch | {"labels": batch["input_ids"]})
    trainer.save(tmp_path / "gk")
    said = _export(tmp_path / "g.memcc.onnx", tmp_path / "gk", tmp_path / "g_e.onnx",
                   "--eval")
    assert "written at the sizes" not in said, said
    _export(tmp_path / "g.memcc.onnx", tmp_path / "gk", tmp_path / "w.safetensors")
    module.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"),
                           strict=False)
    sess = ort.InferenceSession(str(tmp_path / "g_e.onnx"), providers=["CPUExecutionProvider"])
    assert [i.shape for i in sess.get_inputs()] == [["batch", "seq"]] * 2
    _agrees_with_torch(tmp_path / "g_e.onnx", module, _token_batches(4))

    # Row chunks: chunk 0 of each region computes every row again in the exported model
    # (frontend/whole_rows.py). TorchScript's GPT-2 MLP runs on flat rows, whose chunks
    # dropped the Reshapes a shape computation reads: export puts them back.
    api.build(path, tmp_path / "c.onnx", dims=dims,
              options=BuildOptions(attention_chunks=2, mlp_chunks=3))
    Trainer(tmp_path / "c.onnx").save(tmp_path / "ck")
    said = " ".join(_export(tmp_path / "c.onnx", tmp_path / "ck", tmp_path / "c_e.onnx",
                            "--eval").split())
    assert "written at the sizes" not in said, said
    fresh = export("gpt2", exporter, training=True)[1]  # untrained, as saved
    _agrees_with_torch(tmp_path / "c_e.onnx", fresh, _token_batches(4))

    # A step built before memcc kept what it folded: the message says so.
    old = onnx.load(tmp_path / "g.onnx")
    keep = [p for p in old.metadata_props if p.key != "memcc.fold_records"]
    del old.metadata_props[:]
    old.metadata_props.extend(keep)
    for n in old.graph.node:
        kept = [p for p in n.metadata_props if p.key != "memcc.folded_from"]
        del n.metadata_props[:]
        n.metadata_props.extend(kept)
    onnx.save(old, tmp_path / "old.onnx")
    Trainer(tmp_path / "old.onnx").save(tmp_path / "ok")
    said = " ".join(_export(tmp_path / "old.onnx", tmp_path / "ok", tmp_path / "o_e.onnx",
                            "--eval").split())
    assert "this step was built before memcc kept what it folded" in said, said


class _DropPath(torch.nn.Module):
    """An in-place nn.Dropout and timm's stochastic depth (``bernoulli_`` on a [B, 1]
    tensor, divided by the keep probability): the dynamo exporter writes both as
    ``x * (RandomUniformLike < keep) / keep``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.drop = torch.nn.Dropout(0.2, inplace=True)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.fc1(x)))
        if self.training:
            keep = 0.9
            mask = y.new_empty((y.shape[0], 1)).bernoulli_(keep).div_(keep)
            y = y * mask
        return self.fc2(x + y)


@pytest.mark.parametrize("optimize", [False, True])
def test_dropout_written_as_a_random_mask_passes_through(optimize, tmp_path):
    torch.manual_seed(0)
    module = _DropPath().train()
    x = torch.randn(4, 6)
    src = tmp_path / "m.onnx"
    torch.onnx.export(module, (x,), dynamo=True, optimize=optimize, input_names=["x"],
                      output_names=["logits"]).save(str(src))
    _trained_eval_is_torch_s(module, x, src, tmp_path, passed=2)
    assert "2 Dropout(s) are in training mode" in _export(
        tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "t.onnx")


def _trained_eval_is_torch_s(module: torch.nn.Module, x: torch.Tensor, src, tmp_path,
                             passed: int) -> None:
    """Build ``src``, train a step, export: ``--eval`` passes ``passed`` random masks
    through, and runs as the module loaded with the exported weights does in eval mode."""
    api.build(src, tmp_path / "s.onnx", options=BuildOptions(lr=0.1))
    trainer = Trainer(tmp_path / "s.onnx")
    trainer.step({"x": x.numpy(), "labels": np.array([0, 1, 2, 0])})
    trainer.save(tmp_path / "ck")
    said = _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "e.onnx", "--eval")
    assert f"{passed} Dropout(s) pass their input through" in said, said
    _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "w.safetensors")
    module.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"))
    with torch.no_grad():
        want = module.eval()(x).numpy()
    got = _run(tmp_path / "e.onnx", {"x": x.numpy()}, 1)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


class _HfDropPath(torch.nn.Module):
    """HuggingFace's stochastic depth (Swin, ConvNeXt, BEiT): ``x / keep * floor(keep +
    rand)``, which both exporters write as ``Mul(Div(x, keep), Floor(Add(keep,
    RandomUniformLike)))``; ``--eval`` refused it as a random draw that is no Dropout mask
    (a walk-through, Swin TorchScript)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.fc1(x))
        if self.training:
            keep = 0.8
            mask = (keep + torch.rand((y.shape[0], 1), dtype=y.dtype)).floor()
            y = y.div(keep) * mask
        return self.fc2(x + y)


@pytest.mark.parametrize("dynamo", [False, True])
def test_huggingface_drop_path_passes_through_in_eval(dynamo, tmp_path):
    torch.manual_seed(0)
    module = _HfDropPath().train()
    x = torch.randn(4, 6)
    src = tmp_path / "m.onnx"
    if dynamo:
        torch.onnx.export(module, (x,), dynamo=True, optimize=False, input_names=["x"],
                          output_names=["logits"]).save(str(src))
    else:
        torch.onnx.export(module, (x,), str(src), dynamo=False, input_names=["x"],
                          output_names=["logits"], do_constant_folding=False,
                          training=torch.onnx.TrainingMode.TRAINING)
    _trained_eval_is_torch_s(module, x, src, tmp_path, passed=1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_model_exported_in_train_mode_builds_again_and_trains_as_its_step(tmp_path,
                                                                            threads):
    """A user trains, exports the model (train mode, as PyTorch exported it) and builds a
    step from that file again, to train on: the BatchNorms' running outputs the step
    named `stat.new` are renamed in the file (the new build gives them those names), they
    read their running statistics as stored, and the file keeps PyTorch as its producer,
    so the new step updates the running variance as PyTorch does. One more step of each
    on the same batch gives the same bits (SGD without momentum: no state to carry)."""
    path, _, inputs, dims = export("convnet", "torchscript", training=True)
    opts = BuildOptions(momentum=0.0)
    api.build(path, tmp_path / "s.onnx", dims=dims, options=opts)
    labels = np.array([0, 1, 2, 0])[: inputs["x"].shape[0]]
    first = Trainer(tmp_path / "s.onnx", threads=threads)
    first.step({"x": inputs["x"], "labels": labels})
    first.save(tmp_path / "ck")
    _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "m.onnx")
    api.build(tmp_path / "m.onnx", tmp_path / "again.onnx", dims=dims, options=opts)
    assert {p.key: p.value for p in onnx.load(tmp_path / "again.onnx").metadata_props}[
        "memcc.producer"] == "pytorch"
    batch = {"x": inputs["x"][::-1].copy(), "labels": labels[::-1].copy()}
    again = Trainer(tmp_path / "again.onnx", threads=threads)
    again.step(batch)
    first.step(batch)
    want, got = first.state_dict(), again.state_dict()
    assert set(got) <= set(want) and any("running_var" in k for k in got)
    for k, v in got.items():
        assert np.array_equal(v, want[k]), k


def test_a_row_chunked_vit_with_dropout_exports_whole_at_any_batch(tmp_path):
    """A ViT with Dropout 0.1 built over row chunks: each chunk's Dropout is put back as
    a plain node before the chunks are joined again (it records the chunk's names), and a
    value name the chunking freed and the backward reused (`mul_38`) stays the chunk's.
    The eval model keeps its batch axis and matches torch's eval mode at batch 1 and 3."""
    path, module, inputs, dims = export("vit", "dynamo", training=True, dropout=0.1)
    api.build(path, tmp_path / "s.onnx", dims=dims,
              options=BuildOptions(attention_chunks=2, mlp_chunks=3))
    Trainer(tmp_path / "s.onnx").save(tmp_path / "ck")
    said = _export(tmp_path / "s.onnx", tmp_path / "ck", tmp_path / "e.onnx", "--eval")
    assert "written at the sizes" not in said, said
    sess = ort.InferenceSession(str(tmp_path / "e.onnx"), providers=["CPUExecutionProvider"])
    assert sess.get_inputs()[0].shape[0] == "batch"
    _agrees_with_torch(tmp_path / "e.onnx", module, _images(inputs["x"], 5))
