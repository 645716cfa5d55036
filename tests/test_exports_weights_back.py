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
from onnx import numpy_helper
from typer.testing import CliRunner

from memcc import api
from memcc.cli import app
from memcc.frontend.build import BuildOptions
from memcc.frontend.exported import ExportWarning, read_export_map
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


def test_optimized_export_weights_go_back_to_every_name(tmp_path):
    path, module, inputs, dims = export("gpt2", "dynamo", training=True, fresh=True)
    step, _ = _build(path, tmp_path / "step.onnx", dims)
    weights, fwd, output = _train_and_export(tmp_path / "step.onnx", inputs, tmp_path)
    assert "trained as one tied parameter" in output and "strict=False" in output
    saved = safetensors.torch.load_file(str(weights))
    state = set(module.state_dict())
    copies = [p for p, s in step.parameter_sources().items() if not s["named"]]
    assert copies and set(saved) == (state - set(FOLDED)) | set(copies)
    shared = saved[LN.format(0, 1, "weight")]
    assert not torch.equal(shared, torch.ones_like(shared))  # trained
    assert all(torch.equal(saved[n], shared) for n in MERGED_WEIGHTS)

    # README: load with strict=False; the folded biases keep their values at export.
    result = module.load_state_dict({k: v for k, v in saved.items() if k in state},
                                    strict=False)
    assert sorted(result.missing_keys) == FOLDED and not result.unexpected_keys
    # The made-up copy (lm_head transposed, trained apart) is the only difference left.
    model = onnx.load(str(fwd))
    ours, theirs = _onnx_logits(model, inputs), _torch_logits(module, inputs)
    assert _rel(ours, theirs) > 1e-3
    for t in model.graph.initializer:
        if t.name in copies:
            t.CopyFrom(numpy_helper.from_array(saved["model.lm_head.weight"].numpy().T,
                                               t.name))
    assert _rel(_onnx_logits(model, inputs), theirs) <= 1e-5


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
