"""Issue 35 (items 2 and 7): trained weights go back to every PyTorch name they stand for.

The dynamo exporter's optimizer (``optimize=True``, its default) merges parameters that hold
equal values at export (a fresh GPT-2's LayerNorm weights and biases) into one initializer
and folds others into constants (the zero biases of its Conv1D layers); torch ties GPT-2's
``lm_head.weight`` to ``transformer.wte.weight`` and traces one of them. ``memcc build``
must name what was merged and folded (from the exporter's records), and ``memcc export
--format safetensors`` must write each trained value under every PyTorch name it stands for,
so that README's ``module.load_state_dict(safetensors.torch.load_file(OUT))`` loads strictly
(``optimize=False``) and loads what there is (``optimize=True``, ``strict=False``).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import safetensors.torch
import torch
from exports import DYNAMO_NOOPT, export
from gradcheck import FLOAT, check_against_torch, make_model
from onnx import helper
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_map import ExportMap, read_export_map
from memcc.frontend.export_signature import ExportWarning
from memcc.frontend.folded_copies import recompute_folded_copies
from memcc.frontend.load import load_graph
from memcc.step import TrainingStep
from memcc.trainer import Trainer

README = Path(__file__).resolve().parents[1] / "README.md"
LN = "model.transformer.h.{}.ln_{}.{}"
MERGED_WEIGHTS = [LN.format(0, 2, "weight"), LN.format(1, 1, "weight"),
                  LN.format(1, 2, "weight"), "model.transformer.ln_f.weight"]
FOLDED = sorted(f"model.transformer.h.{i}.{m}.bias" for i in (0, 1)
                for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))


def _readme_snippet() -> str:
    """The weight-loading line README gives for `memcc export --format safetensors`."""
    m = re.search(r"`(module\.load_state_dict\(safetensors\.torch\.load_file\(OUT\)\))`",
                  README.read_text())
    assert m, "README lost its weight-loading snippet"
    return m.group(1)


def _build(path: Path, out: Path, dims: dict[str, int]) -> tuple[TrainingStep, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        graph = api.build(path, out, dims=dims,
                          options=BuildOptions(optimizer="sgd", lr=0.5, momentum=0.0))
    return TrainingStep.of(graph), [str(w.message) for w in caught
                                    if issubclass(w.category, ExportWarning)]


def _train_and_export(step_path: Path, inputs: dict[str, np.ndarray], tmp_path: Path
                      ) -> tuple[Path, Path, str]:
    """Two SGD steps, a checkpoint, then `memcc export` to safetensors and to ONNX."""
    labels = np.random.default_rng(0).integers(0, 100, size=inputs["input_ids"].shape)
    trainer = Trainer(step_path)
    for _ in range(2):
        trainer.step({**inputs, "labels": labels.astype(np.int64)})
    trainer.save(tmp_path / "ckpt")
    weights, fwd = tmp_path / "w.safetensors", tmp_path / "fwd.onnx"
    runner = CliRunner()
    r = runner.invoke(app, ["export", str(step_path), "--checkpoint", str(tmp_path / "ckpt"),
                            "-o", str(weights)])
    assert r.exit_code == 0, r.output
    r2 = runner.invoke(app, ["export", str(step_path), "--checkpoint", str(tmp_path / "ckpt"),
                             "-o", str(fwd)])
    assert r2.exit_code == 0, r2.output
    return weights, fwd, r.output


def _onnx_logits(model: onnx.ModelProto, inputs: dict[str, np.ndarray]) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in inputs.items() if k in names})[0]


def _torch_logits(module: torch.nn.Module, inputs: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return module(**{k: torch.from_numpy(v) for k, v in inputs.items()}).numpy()


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_optimized_export_names_merged_and_folded_parameters(tmp_path):
    path, module, inputs, dims = export("gpt2", "dynamo", training=True, fresh=True)
    step, msgs = _build(path, tmp_path / "step.onnx", dims)
    merged = [m for m in msgs if "merged" in m]
    assert merged, msgs
    assert "-> model.transformer.h.0.ln_1.weight" in merged[0]
    assert all(n in merged[0] for n in MERGED_WEIGHTS), merged[0]
    assert "one tied parameter" in merged[0] and "optimize=False" in merged[0]
    folded = [m for m in msgs if "folded them into constants" in m]
    assert folded and FOLDED[0] in folded[0] and "optimize=False" in folded[0], msgs

    # The record accounts for every PyTorch parameter: held by a step parameter or folded.
    names = step.state_dict_names()
    assert sorted(step.folded_parameters()) == FOLDED
    assert set(names) | set(step.folded_parameters()) == set(module.state_dict())
    assert all(names[n] == LN.format(0, 1, "weight") for n in MERGED_WEIGHTS)
    assert names["model.transformer.wte.weight"] == "model.lm_head.weight"  # torch's tie
    src = step.parameter_sources()[LN.format(0, 1, "weight")]
    assert src["merged"] == sorted(MERGED_WEIGHTS)

    args = ["build", str(path), "-o", str(tmp_path / "cli.onnx")]
    for k, v in dims.items():
        args += ["--dim", f"{k}={v}"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "they hold 21 PyTorch parameters, 8 of them merged into others by the exporter, " \
        "and 8 more have no trained value" in " ".join(r.output.split()), r.output
    assert "note: " in r.output and "0 under names the exporter made up" in r.output
    assert "val_303 was a transposed copy" in " ".join(r.output.split()), r.output


def test_optimized_export_weights_go_back_to_every_name(tmp_path):
    path, module, inputs, dims = export("gpt2", "dynamo", training=True, fresh=True)
    assert read_export_map(onnx.load(str(path))).copies == {"val_303": ("model.lm_head.weight",)}
    step, msgs = _build(path, tmp_path / "step.onnx", dims)
    # The output layer's pre-transposed copy is computed from lm_head.weight again.
    assert any("val_303 was a transposed copy of model.lm_head.weight: now computed from "
               "it (Transpose(perm=[1, 0])), trained as one" in m for m in msgs), msgs
    assert not any("made up" in m for m in msgs), msgs
    sources = step.parameter_sources()
    assert all(s["named"] for s in sources.values()) and "val_303" not in sources
    assert sources["model.lm_head.weight"]["folded_copies"] == {
        "val_303": "Transpose(perm=[1, 0])"}
    weights, fwd, output = _train_and_export(tmp_path / "step.onnx", inputs, tmp_path)
    assert "trained as one tied parameter" in output and "strict=False" in output
    saved = safetensors.torch.load_file(str(weights))
    state = set(module.state_dict())
    assert set(saved) == state - set(FOLDED)
    shared = saved[LN.format(0, 1, "weight")]
    assert not torch.equal(shared, torch.ones_like(shared))  # trained
    assert all(torch.equal(saved[n], shared) for n in MERGED_WEIGHTS)

    # README: load with strict=False; the folded biases keep their values at export.
    before = _torch_logits(module, inputs)
    result = module.load_state_dict(saved, strict=False)
    assert sorted(result.missing_keys) == FOLDED and not result.unexpected_keys
    # PyTorch with the exported weights computes what memcc's exported ONNX computes.
    theirs = _torch_logits(module, inputs)
    assert _rel(theirs, before) > 1e-3  # the trained weights, not the exported ones
    assert _rel(_onnx_logits(onnx.load(str(fwd)), inputs), theirs) <= 1e-5


def test_pre_transposed_linear_weights_go_back_under_their_names(tmp_path):
    """The dynamo exporter's optimizer folds `Transpose(W)` for every `nn.Linear` it writes
    as a MatMul, and with no other reader of W the parameter is gone from the file: a
    transformers Llama's 14 projection weights (and its output layer) are trained under
    `val_N` names. Its records say each copy feeds an `aten.linear` as the weight, so the
    copy is W transposed: export writes it back under W's name, transposed, and PyTorch
    loads every weight strictly and computes memcc's exported ONNX model."""
    path, module, inputs, dims = export("llama", "dynamo", training=True, fresh=True)
    emap = read_export_map(onnx.load(str(path)))
    assert emap.copies and set(emap.copy_ops) == set(emap.copies)
    assert set(emap.copy_ops.values()) == {"Transpose(perm=[1, 0])"}
    step, msgs = _build(path, tmp_path / "step.onnx", dims)
    assert not any("made up" in m for m in msgs), msgs
    copies = {p: s for p, s in step.parameter_sources().items() if s.get("copy_of")}
    assert len(copies) == len(emap.copies)
    weights, fwd, output = _train_and_export(tmp_path / "step.onnx", inputs, tmp_path)
    assert "made up" not in output, output
    before = _torch_logits(module, inputs)
    module.load_state_dict(safetensors.torch.load_file(str(weights)), strict=True)
    theirs = _torch_logits(module, inputs)
    assert _rel(theirs, before) > 1e-3  # the trained weights, not the exported ones
    assert _rel(_onnx_logits(onnx.load(str(fwd)), inputs), theirs) <= 1e-5


def test_optimized_export_step_gradients_match_torch():
    """The recomputed copy's gradient flows into its parameter: lm_head.weight (which torch
    ties to wte.weight) gets the gradient of both its uses, the embedding lookup and the
    output layer, as torch autograd computes it."""
    path, module, inputs, dims = export("gpt2", "dynamo", training=True)
    assert read_export_map(onnx.load(str(path))).copies  # the file has the folded copy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        step = build_training_step(load_graph(path, dims), BuildOptions(optimizer="none"))
    params = TrainingStep.of(step).parameters
    assert "val_303" not in params and "model.lm_head.weight" in params
    labels = np.random.default_rng(0).integers(0, 100, size=inputs["input_ids"].shape)
    feeds = {**inputs, "labels": labels.astype(np.int64)}
    sess = ort.InferenceSession(step.to_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    out = dict(zip(names, sess.run(None, {i.name: feeds.get(i.name, step.initializers.get(
        i.name)) for i in sess.get_inputs()}), strict=True))
    logits = module(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 100),
                                             torch.from_numpy(labels).reshape(-1))
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= 1e-4 * max(1.0, loss.item())
    record = TrainingStep.of(step)
    grads, holder = record.gradients(), record.state_dict_names()
    for name, p in module.named_parameters():  # torch lists the tied weight once
        ref = p.grad.numpy()
        got = out[grads[holder[name]]]
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        assert err <= 1e-3, f"{name}: relative error {err:.2e}"


def _copy_model(w: np.ndarray, copy: np.ndarray) -> onnx.ModelProto:
    """y = (x @ C) @ W: C the exporter's folded copy of W, W read as itself too."""
    return make_model(
        [helper.make_node("MatMul", ["x", "C"], ["m"]),
         helper.make_node("MatMul", ["m", "W"], ["y"])],
        [("x", FLOAT, (2, copy.shape[0]))], [("y", FLOAT, (2, w.shape[1]))],
        {"W": w, "C": copy})


@pytest.mark.parametrize("op", ["Transpose", "Reshape", "Identity"])
def test_folded_copy_becomes_its_op_on_the_parameter(op):
    """Each value-preserving op the values prove is written back, and the gradient of W
    sums both uses (torch autograd on the same function)."""
    # Square for Identity: its transposition fits the shape too, and the values rule it out.
    w = np.random.default_rng(1).standard_normal((4, 4) if op == "Identity" else
                                                 (6, 4)).astype(np.float32)
    copy = w.T if op == "Transpose" else w.reshape(4, 6) if op == "Reshape" else w
    model = _copy_model(w, np.ascontiguousarray(copy))
    emap = recompute_folded_copies(model, ExportMap({"W": ("p.w",)}, copies={"C": ("p.w",)}))
    assert not emap.copies and emap.computed["C"][:2] == ("p.w", "W")
    assert emap.computed["C"][2].startswith(op)
    assert [t.name for t in model.graph.initializer if t.name != "C.shape"] == ["W"]
    assert model.graph.node[0].op_type == op and list(model.graph.node[0].output) == ["C"]
    # W as a graph input, so that the gradient check feeds it.
    del model.graph.initializer[[t.name for t in model.graph.initializer].index("W")]
    model.graph.input.append(helper.make_tensor_value_info("W", FLOAT, w.shape))
    x = np.random.default_rng(2).standard_normal((2, copy.shape[0])).astype(np.float32)
    view = {"Transpose": lambda t: t.T, "Reshape": lambda t: t.reshape(4, 6),
            "Identity": lambda t: t}[op]
    check_against_torch(model, {"x": x, "W": w}, lambda x, W: x @ view(W) @ W, ["W"])


@pytest.mark.parametrize("case", ["differs", "ambiguous", "two sources"])
def test_folded_copy_the_values_do_not_prove_stays_a_copy(case):
    """The record alone is not trusted: a copy whose values are no op of its parameter, or
    fit several ops that move elements differently (a constant-filled tensor), or that was
    folded from two parameters, stays as it was (trained under its made-up name)."""
    w = np.random.default_rng(1).standard_normal((6, 4)).astype(np.float32)
    copy = np.ascontiguousarray(w.T)
    sources = ("p.w",)
    if case == "differs":
        copy[0, 0] += 1e-6
    elif case == "ambiguous":
        w, copy = np.ones((6, 4), np.float32), np.ones((4, 6), np.float32)
    else:
        sources = ("p.w", "p.v")
    model = _copy_model(w, copy)
    before = model.SerializeToString()
    emap = ExportMap({"W": ("p.w",)}, copies={"C": sources})
    assert recompute_folded_copies(model, emap) == emap
    assert model.SerializeToString() == before


@pytest.mark.parametrize("exporter", [DYNAMO_NOOPT, "torchscript"])
def test_export_keeping_names_loads_strictly_and_matches(tmp_path, exporter):
    """Item 7: GPT-2's tied lm_head/wte: README's snippet loads strictly, and PyTorch with
    the trained weights computes what memcc's exported ONNX model computes. Both forms that
    keep PyTorch's names: dynamo without its optimizer (torch.export traces the tie through
    lm_head.weight) and a TorchScript training export (it stores wte.weight, and lm_head's
    Transpose reads it)."""
    path, module, inputs, dims = export("gpt2", exporter, training=True)
    step, msgs = _build(path, tmp_path / "step.onnx", dims)
    assert not any("merged" in m or "folded them" in m for m in msgs), msgs
    weights, fwd, _ = _train_and_export(tmp_path / "step.onnx", inputs, tmp_path)
    saved = safetensors.torch.load_file(str(weights))
    assert torch.equal(saved["model.transformer.wte.weight"], saved["model.lm_head.weight"])
    exec(_readme_snippet(), {"module": module, "safetensors": safetensors, "OUT": str(weights)})
    got = _torch_logits(module, inputs)
    assert _rel(_onnx_logits(onnx.load(str(fwd)), inputs), got) <= 1e-5
    before = _torch_logits(export("gpt2", exporter, training=True)[1], inputs)
    assert _rel(got, before) > 1e-3  # the trained weights, not the exported ones


def test_export_map_tells_merges_from_batchnorm_folds_and_copies():
    """No false merges: a BatchNorm folded into its Conv leaves the Conv node carrying the
    BatchNorm's FX node (its weights are folded, not merged); a pre-transposed Linear
    weight is a copy trained under its made-up name."""
    path, *_ = export("conv_bn", "dynamo", training=True)
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None and not emap.merged
    assert emap.folded == ("bn.bias", "bn.weight")
    path, module, _, _ = export("gpt2", "dynamo", training=True)
    emap = read_export_map(onnx.load(str(path)))
    assert not emap.merged and not emap.folded and not emap.unused
    assert list(emap.copies.values()) == [("model.lm_head.weight",)]
    assert emap.stands_for["model.lm_head.weight"] == ("model.lm_head.weight",
                                                       "model.transformer.wte.weight")
    held = {n for names in emap.stands_for.values() for n in names}
    assert held == set(module.state_dict())
    # TorchScript records no signature: only the tie is read, from the node that reads
    # wte.weight in module lm_head (/model/lm_head/Transpose).
    path, *_ = export("gpt2", "torchscript", training=True)
    emap = read_export_map(onnx.load(str(path)))
    assert emap is not None and not emap.merged and not emap.folded and not emap.copies
    assert {k: v for k, v in emap.stands_for.items() if len(v) > 1} == {
        "model.transformer.wte.weight": ("model.transformer.wte.weight", "model.lm_head.weight")}


class _TwoNorms(torch.nn.Module):
    """Two LayerNorms and a BatchNorm of one width, fresh (weights ones, biases zeros), and
    two linear layers that share storage (distinct parameters, one tensor in memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)
        self.b.weight = torch.nn.Parameter(self.a.weight.data)  # storage shared
        self.n1, self.n2 = torch.nn.LayerNorm(6), torch.nn.LayerNorm(6)
        self.bn, self.head = torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(self.n2(self.b(torch.relu(self.n1(self.a(x)))))))


def test_torchscript_eval_export_trains_fresh_equal_parameters_apart(tmp_path):
    """TorchScript's export in eval mode (its default) stores parameters equal at export
    once: n2's weight and bias, and the BatchNorm's, are Identity copies of n1's. torch
    trains each apart, so memcc does (each its own gradient, torch's); the linear layers
    that share storage (not constant-filled) stay one tensor, as torch's optimizer updates
    them, with the gradient of both uses."""
    torch.manual_seed(0)
    module, x = _TwoNorms().eval(), torch.randn(4, 6)
    path = tmp_path / "norms.onnx"
    torch.onnx.export(module, (x,), str(path), dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["logits"])
    aliases = {n.output[0] for n in onnx.load(str(path)).graph.node if n.op_type == "Identity"}
    assert {"n2.weight", "n2.bias", "bn.weight", "bn.bias", "b.weight"} <= aliases
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = build_training_step(load_graph(path), BuildOptions(optimizer="none"))
    assert any("6 parameter(s) and buffer(s)" in str(w.message) for w in caught)
    params = TrainingStep.of(step).parameters
    assert {"n2.weight", "n2.bias", "bn.weight", "bn.bias"} <= set(params)
    assert "b.weight" not in params and "a.weight" in params
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    sess = ort.InferenceSession(step.to_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    out = dict(zip([o.name for o in sess.get_outputs()],
                   sess.run(None, {"x": x.numpy(), "labels": labels}), strict=True))
    torch.nn.functional.cross_entropy(module(x), torch.from_numpy(labels)).backward()
    grads = {name: p.grad.numpy() for name, p in module.named_parameters()}
    grads["a.weight"] = grads["a.weight"] + grads.pop("b.weight")  # one tensor in memory
    for name, ref in grads.items():
        got = out[f"{name}.grad"]
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-6))
        assert err <= 1e-5, f"{name}: relative error {err:.2e}"


def test_nested_sequentials_keep_their_state_dict_names(tmp_path):
    """TorchScript names a Sequential's child after its parent as it spelt it
    (``/features/features.0/features.0.0/Conv``): the scope was read as
    ``features.0.features.0.0``, each convolution looked read by a module without
    parameters of its own, and its made-up second name broke a strict load (torchvision's
    MobileNetV3 and timm's EfficientNet: 102 and 205 unexpected keys)."""
    import torch.nn as nn

    def block(i: int, o: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())

    module = nn.Sequential()
    module.add_module("features", nn.Sequential(nn.Sequential(block(3, 4)),
                                                nn.Sequential(block(4, 6), block(6, 6))))
    module.add_module("pool", nn.AdaptiveAvgPool2d(1))
    module.add_module("flat", nn.Flatten())
    module.add_module("fc", nn.Linear(6, 3))
    x = torch.randn(2, 3, 8, 8)
    path = tmp_path / "nested.onnx"
    torch.onnx.export(module.train(), (x,), str(path), dynamo=False, input_names=["x"],
                      output_names=["logits"], training=torch.onnx.TrainingMode.TRAINING)
    step, _ = _build(path, tmp_path / "s.onnx", {})
    names = {n for src in step.parameter_sources().values()
             for n in src.get("pytorch_names") or ()}
    assert names and names <= set(module.state_dict()), sorted(names - set(module.state_dict()))
    Trainer(tmp_path / "s.onnx").save(tmp_path / "ck")
    r = CliRunner().invoke(app, ["export", str(tmp_path / "s.onnx"), "--checkpoint",
                                 str(tmp_path / "ck"), "-o", str(tmp_path / "w.safetensors")])
    assert r.exit_code == 0, r.output
    module.load_state_dict(safetensors.torch.load_file(tmp_path / "w.safetensors"),
                           strict=True)


def test_a_folded_batchnorm_gets_a_warning_of_its_own(tmp_path):
    """A TorchScript eval-mode export folds each BatchNorm into its convolution
    (``onnx::Conv_N``): the step trains another model. That was one clause inside the long
    made-up-names warning; it is now a short warning of its own, first."""
    path, _, _, dims = export("convnet", "torchscript")
    _, said = _build(path, tmp_path / "s.onnx", dims)
    first = next(i for i, m in enumerate(said) if "folded into the convolutions" in m)
    names = next(i for i, m in enumerate(said) if "names the exporter made up" in m)
    assert first < names and "12 parameters named onnx::Conv_N" in said[first], said
    assert "training=torch.onnx.TrainingMode.TRAINING" in said[first]


def test_weights_holding_a_folded_batchnorm_are_said_at_export(tmp_path):
    """The dynamo exporter's optimizer folds a train-mode BatchNorm into the convolution
    before it and keeps the convolution's PyTorch name; build warns that the step trains
    another model, and `memcc export` to safetensors says again that those weights, loaded
    into the module that runs its own BatchNorm, apply it twice."""
    path, _, inputs, dims = export("convnet", "dynamo", training=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        api.build(path, tmp_path / "s.onnx", dims=dims, options=BuildOptions())
    Trainer(tmp_path / "s.onnx").save(tmp_path / "ck")
    r = CliRunner().invoke(app, ["export", str(tmp_path / "s.onnx"), "--checkpoint",
                                 str(tmp_path / "ck"), "-o", str(tmp_path / "w.safetensors")])
    said = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert "the exporter folded 6 BatchNorm(s) into the convolutions" in said, said
    assert "applies it twice" in said


@pytest.mark.parametrize("exporter", ["dynamo", DYNAMO_NOOPT])
def test_a_dynamo_export_in_eval_mode_is_told_to_call_train(exporter):
    """A convnet exported with `module.eval()`: the program updates no running statistic,
    which the signature shows. Build says the module was in eval mode and to call
    `module.train()` (before, with `optimize=False` it advised exporting with
    `optimize=False`, what the user had done)."""
    path, _, _, dims = export("convnet", exporter, training=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        build_training_step(load_graph(path, dims), BuildOptions())
    said = [str(w.message) for w in caught if issubclass(w.category, ExportWarning)]
    eval_mode = [m for m in said if "exported with the module in eval mode" in m]
    assert eval_mode and "module.train()" in eval_mode[0], said
    assert not any("inference form" in m for m in said), said


def test_a_folded_attention_scale_is_a_constant_not_a_parameter(tmp_path):
    """The dynamo exporter's optimizer folds `scaled_dot_product_attention`'s scale into a
    one-element initializer under a made-up name, folded from constants alone; it was
    trained as a parameter PyTorch does not have (the module then computed something else
    after training: 2.6e-3 on this ViT). It is a constant now: the safetensors load
    strictly and PyTorch computes memcc's exported ONNX model."""
    path, module, inputs, dims = export("vit", "dynamo", training=True)
    emap = read_export_map(onnx.load(str(path)))
    assert emap.constants
    labels = np.array([0, 1] * inputs["x"].shape[0])[: inputs["x"].shape[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExportWarning)
        graph = api.build(path, tmp_path / "s.onnx", dims=dims,
                          options=BuildOptions(optimizer="sgd", lr=0.5, momentum=0.0))
    assert not set(emap.constants) & set(TrainingStep.of(graph).parameters)
    trainer = Trainer(tmp_path / "s.onnx")
    for _ in range(2):
        trainer.step({**inputs, "labels": labels.astype(np.int64)})
    trainer.save(tmp_path / "ck")
    runner = CliRunner()
    for out in ("w.safetensors", "fwd.onnx"):
        r = runner.invoke(app, ["export", str(tmp_path / "s.onnx"), "--checkpoint",
                                str(tmp_path / "ck"), "-o", str(tmp_path / out)])
        assert r.exit_code == 0, r.output
    before = _torch_logits(module, inputs)
    module.load_state_dict(safetensors.torch.load_file(str(tmp_path / "w.safetensors")),
                           strict=True)
    theirs = _torch_logits(module, inputs)
    assert _rel(theirs, before) > 1e-3
    assert _rel(_onnx_logits(onnx.load(str(tmp_path / "fwd.onnx")), inputs), theirs) <= 1e-5
