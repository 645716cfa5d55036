"""The model zoo builds valid ONNX that ORT runs, and torch_reference agrees with ORT.

Two things are checked against each other here, neither trusted alone: the zoo's graphs (run
by ORT) and ``torch_reference`` (an independent torch interpreter that later gradient tests
use as ground truth). Single-node cases cover torch_reference's handling of ops and
attributes the zoo itself does not emit (what ``torch.onnx.export`` produces).

ORT runs with graph optimizations off, as memcc's backend does: at the default level ORT's
ConstantSharing merges identical small initializers (BN scale/bias/running stats of <= 8
channels) and the training-mode BN kernel then corrupts them (see
``test_ort_constant_sharing_breaks_small_training_batchnorm``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gradcheck import make_model
from onnx import TensorProto, helper, numpy_helper
from torch_reference import (
    torch_forward,
    torch_loss_and_grads,
    torch_sgd_losses,
    trainable_params,
)

from models import MODELS, PRESETS, build_model, make_feeds, make_labels, model_meta
from models.__main__ import main as models_main

ROOT = Path(__file__).resolve().parents[1]
F32 = TensorProto.FLOAT
I64 = TensorProto.INT64


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
            outputs: list[str] | None = None) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(outputs, feeds)


def assert_matches(ref: np.ndarray, got: np.ndarray, rtol: float = 1e-4) -> None:
    """rtol, with an absolute floor scaled to the output so near-zero entries do not fail."""
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * max(scale, 1e-6))


# ====================================================================== zoo
@pytest.fixture(scope="module", params=sorted(MODELS))
def zoo(request) -> tuple[str, onnx.ModelProto]:
    return request.param, build_model(request.param)


def test_zoo_model_is_valid_onnx(zoo):
    name, model = zoo
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    assert model.opset_import[0].version == 17
    assert [o.name for o in model.graph.output] == ["logits"]
    inputs = [i.name for i in model.graph.input]
    assert inputs[0] in ("input", "input_ids")
    # Only parameters and BN running stats are initializers; constants are Constant nodes.
    assert all(t.data_type == TensorProto.FLOAT for t in model.graph.initializer)
    assert model_meta(model)["family"] in (name, model.graph.name)


def test_zoo_ort_matches_torch_reference(zoo):
    name, model = zoo
    feeds = make_feeds(model, seed=1)
    (got,) = ort_run(model, feeds)
    outputs, params = torch_forward(model, feeds)
    ref = outputs["logits"].detach().numpy()
    assert got.shape == ref.shape
    assert np.isfinite(ref).all()
    assert_matches(ref, got)
    assert set(params) == {t.name for t in model.graph.initializer}
    assert all(p.requires_grad for p in params.values())


def test_zoo_output_shapes(zoo):
    name, model = zoo
    meta = model_meta(model)
    (logits,) = ort_run(model, make_feeds(model))
    options = meta["options"]
    if name == "unet":
        r = options["resolution"]
        expected = (options["batch"], r, r, meta["num_classes"])
    elif name == "gpt2":
        expected = (options["batch"], options["seq_len"], options["vocab_size"])
    else:
        expected = (options["batch"], meta["num_classes"])
    assert logits.shape == tuple(expected)


def test_zoo_loads_with_static_shapes(zoo):
    from memcc.frontend.load import load_graph

    _, model = zoo
    graph = load_graph(model)
    for node in graph.nodes:
        for out in node.output:
            if out:
                assert out in graph.info, f"no shape for {out}"


def test_zoo_trains_with_sgd(zoo):
    """The init is sane: a few SGD steps on one batch lower the cross-entropy."""
    name, model = zoo
    feeds, labels = make_feeds(model, seed=2), make_labels(model, seed=2)
    losses = torch_sgd_losses(model, feeds, steps=3, lr=0.01, labels=labels)
    assert all(np.isfinite(losses))
    assert losses[-1] < losses[0], f"{name}: {losses}"


def test_grads_cover_all_trainable_params(zoo):
    name, model = zoo
    feeds, labels = make_feeds(model), make_labels(model)
    loss, grads = torch_loss_and_grads(model, feeds, labels=labels)
    assert np.isfinite(loss)
    trainable = trainable_params(model)
    assert set(grads) == set(trainable)
    assert not any(n.endswith(("running_mean", "running_var")) for n in trainable)
    assert all(np.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("name", ["resnet18", "gpt2", "bert", "unet"])
def test_dynamic_batch(name):
    from memcc.frontend.load import load_graph

    model = build_model(name, dynamic_batch=True)
    onnx.checker.check_model(model, full_check=True)
    feeds = make_feeds(model, dims={"batch": 3})
    (got,) = ort_run(model, feeds)
    assert got.shape[0] == 3
    assert_matches(torch_forward(model, feeds)[0]["logits"].detach().numpy(), got)
    graph = load_graph(model, {"batch": 3})
    assert graph.info["logits"].shape[0] == 3


def test_builders_are_deterministic_and_seeded():
    a, b, c = build_model("gpt2"), build_model("gpt2"), build_model("gpt2", seed=1)
    assert a.SerializeToString() == b.SerializeToString()
    wa = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    wc = {t.name: numpy_helper.to_array(t) for t in c.graph.initializer}
    assert not np.array_equal(wa["wte.weight"], wc["wte.weight"])


def test_readable_parameter_names():
    names = {t.name for t in build_model("resnet18").graph.initializer}
    assert {"conv1.weight", "bn1.running_mean", "layer1.0.conv1.weight",
            "layer2.0.downsample.0.weight", "fc.weight", "fc.bias"} <= names
    names = {t.name for t in build_model("resnet50").graph.initializer}
    assert "layer4.2.conv3.weight" in names
    names = {t.name for t in build_model("gpt2", tie_embeddings=False).graph.initializer}
    assert {"wte.weight", "h.1.attn.c_attn.weight", "ln_f.bias", "lm_head.weight"} <= names


def test_bert_attention_mask_matters():
    model = build_model("bert")
    feeds = make_feeds(model)
    assert (feeds["attention_mask"] == 0).any()
    (masked,) = ort_run(model, feeds)
    (full,) = ort_run(model, {**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})
    assert not np.allclose(masked[1], full[1])  # the padded row changes
    np.testing.assert_allclose(masked[0], full[0], rtol=1e-6)  # the unpadded row does not


def test_gpt2_is_causal():
    model = build_model("gpt2")
    feeds = make_feeds(model)
    changed = feeds["input_ids"].copy()
    changed[:, -1] = (changed[:, -1] + 1) % 96
    (a,) = ort_run(model, feeds)
    (b,) = ort_run(model, {"input_ids": changed})
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.allclose(a[:, -1], b[:, -1])


def test_presets_and_overrides():
    model = build_model("mlp", preset="large", batch=2, in_features=8, width=8, depth=2,
                        num_classes=3)
    assert model_meta(model)["options"]["batch"] == 2
    assert all(PRESETS[name] for name in MODELS)
    with pytest.raises(KeyError):
        build_model("mlp", preset="nope")
    with pytest.raises(KeyError):
        build_model("nope")


def test_mlp_matmul_variant_and_bn_inference_mode():
    for model in (build_model("mlp", linear="matmul"),
                  build_model("resnet18", bn_training=False),
                  build_model("vgg16", batch_norm_layers=True)):
        feeds = make_feeds(model)
        (got,) = ort_run(model, feeds)
        assert_matches(torch_forward(model, feeds)[0]["logits"].detach().numpy(), got)


# ====================================================================== CLI
def test_cli_subprocess_writes_loadable_file(tmp_path):
    out = tmp_path / "gpt2.onnx"
    proc = subprocess.run(
        [sys.executable, "-m", "models", "gpt2", "-o", str(out), "--batch", "3",
         "--seq-len", "8", "--width", "16", "--depth", "1", "--heads", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [3, 8]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_cli_writes_every_model(name, tmp_path):
    out = tmp_path / f"{name}.onnx"
    assert models_main([name, "-o", str(out), "--seed", "3"]) == 0
    model = onnx.load(str(out))
    onnx.checker.check_model(model)
    assert model_meta(model)["options"]["seed"] == 3


def test_cli_options_and_errors(tmp_path, capsys):
    out = tmp_path / "r.onnx"
    assert models_main(["resnet50", "-o", str(out), "-O", "blocks=[1,1,1,1]", "--width", "8",
                        "--resolution", "32"]) == 0
    assert model_meta(onnx.load(str(out)))["options"]["blocks"] == [1, 1, 1, 1]
    assert models_main(["mlp", "-o", str(out), "--resolution", "3"]) == 2
    assert "no option resolution" in capsys.readouterr().err
    assert models_main(["--list"]) == 0


def test_list_shows_default_sizes_parameter_counts_and_presets(capsys):
    """--list says what a bare ``python -m models NAME`` builds, as built, and how big."""
    assert models_main(["--list"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100
    blocks = dict(zip(MODELS, out.split("\n\n")[1:], strict=True))
    for name, block in blocks.items():
        model = build_model(name)
        text = " ".join(block.split())  # undo the wrapping
        buffers = sum(int(np.prod(t.dims)) for t in model.graph.initializer
                      if "running_" in t.name)
        params = sum(int(np.prod(t.dims)) for t in model.graph.initializer) - buffers
        assert text.startswith(f"{name} ({params:,} parameters at the defaults)"), text
        # every option as built, in the -O KEY=VALUE form that rebuilds it
        for key, value in model_meta(model)["options"].items():
            if key != "arch":
                assert f" {key}={value!r}".replace(", ", ",") in text, (name, key)
        assert "dynamic_batch=False" in text
        for preset, opts in PRESETS.get(name, {}).items():
            assert f"--preset {preset} " + " ".join(f"{k}={v!r}" for k, v in opts.items()) in text
    assert "blocks=[3,4,6,3]" in blocks["resnet50"]  # derived defaults show as built
    assert "batch_norm" not in blocks["gpt2"]


def test_cli_external_data(tmp_path, monkeypatch):
    import models.__main__ as cli

    monkeypatch.setattr(cli, "EXTERNAL_DATA_THRESHOLD", 1000)
    out = tmp_path / "mlp.onnx"
    assert cli.main(["mlp", "-o", str(out)]) == 0
    assert (tmp_path / "mlp.onnx.data").exists()
    model = onnx.load(str(out))
    feeds = make_feeds(model)
    (got,) = ort_run(model, feeds)
    assert_matches(ort_run(build_model("mlp"), feeds)[0], got)


# ====================================================================== torch_reference
def test_loss_and_grads_match_plain_torch():
    """torch_reference's gradients equal a hand-written torch MLP's."""
    model = build_model("mlp", depth=2)
    feeds, labels = make_feeds(model), make_labels(model)
    loss, grads = torch_loss_and_grads(model, feeds, labels=labels)
    w = {t.name: torch.tensor(numpy_helper.to_array(t), requires_grad=True)
         for t in model.graph.initializer}
    h = torch.tensor(feeds["input"])
    for name in ("layers.0", "layers.1"):
        h = torch.relu(h @ w[f"{name}.weight"].T + w[f"{name}.bias"])
    logits = h @ w["head.weight"].T + w["head.bias"]
    ref = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-6)
    for name, t in w.items():
        np.testing.assert_allclose(grads[name], t.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_loss_kinds():
    model = build_model("unet")
    feeds = make_feeds(model)
    target = np.zeros((2, 32, 32, 4), np.float32)
    mse, grads = torch_loss_and_grads(model, feeds, loss="mse", target=target)
    logits = ort_run(model, feeds)[0]
    assert mse == pytest.approx(float((logits**2).mean()), rel=1e-4)
    assert "head.weight" in grads
    ce, _ = torch_loss_and_grads(model, feeds, labels=make_labels(model))
    lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lab = make_labels(model)
    ref = -np.take_along_axis(lp, lab[..., None], -1).mean()
    assert ce == pytest.approx(float(ref), rel=1e-4)


def _const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(
        np.asarray(value), name))


def _case(op: str, feeds: dict[str, np.ndarray], consts: dict[str, object] | None = None,
          n_out: int = 1, opset: int = 17, inputs: list[str] | None = None,
          **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A one-node model: float/int feeds are graph inputs, ``consts`` Constant nodes."""
    consts = consts or {}
    names = inputs if inputs is not None else list(feeds) + list(consts)
    nodes = [_const(k, v) for k, v in consts.items()]
    outs = [f"y{i}" for i in range(n_out)]
    nodes.append(helper.make_node(op, names, outs, **attrs))
    ins = [(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in feeds.items()]
    model = make_model(nodes, ins, [(o, F32, None) for o in outs], opset=opset)
    # Output element types come from inference; make_model only needs names here.
    for o in model.graph.output:
        o.type.tensor_type.ClearField("elem_type")
    model = onnx.shape_inference.infer_shapes(model)
    return model, feeds


def _x(*shape, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _i(values) -> np.ndarray:
    return np.asarray(values, np.int64)


X4 = _x(2, 4, 7, 6)
CASES = {
    "slice_neg_step": _case("Slice", {"x": _x(5, 6)}, {"s": _i([4, -100]), "e": _i([-100, 100]),
                                                        "a": _i([0, 1]), "st": _i([-2, 2])}),
    "slice_opset9": _case("Slice", {"x": _x(5, 6)}, opset=9, starts=[1], ends=[-1], axes=[1]),
    "pad_constant_neg": _case("Pad", {"x": _x(3, 4)}, {"p": _i([1, -1, 0, 2]),
                                                        "v": np.float32(1.5)}),
    "pad_reflect": _case("Pad", {"x": X4}, {"p": _i([0, 0, 1, 2, 0, 0, 2, 1])},
                         mode="reflect"),
    "pad_edge_axes": _case("Pad", {"x": X4}, {"p": _i([1, 2, 2, 1]), "v": np.float32(0),
                                              "ax": _i([-2, -1])}, mode="edge", opset=18),
    "conv_asym_dil_group": _case("Conv", {"x": X4, "w": _x(6, 2, 3, 2)}, group=2,
                                 pads=[1, 0, 2, 1], dilations=[2, 1], strides=[1, 2]),
    "conv_same_upper": _case("Conv", {"x": X4, "w": _x(3, 4, 3, 3), "b": _x(3)},
                             auto_pad="SAME_UPPER", strides=[2, 2]),
    "conv1d": _case("Conv", {"x": _x(2, 3, 9), "w": _x(4, 3, 3)}, pads=[1, 1]),
    "conv_transpose": _case("ConvTranspose", {"x": X4, "w": _x(4, 3, 3, 3), "b": _x(6)},
                            strides=[2, 2], pads=[1, 0, 0, 1], output_padding=[1, 0],
                            group=2),
    "conv_transpose_output_shape": _case("ConvTranspose", {"x": X4, "w": _x(4, 2, 3, 3)},
                                         strides=[2, 2], output_shape=[14, 12]),
    "maxpool_ceil_indices": _case("MaxPool", {"x": X4}, n_out=2, kernel_shape=[3, 3],
                                  strides=[2, 2], pads=[1, 1, 1, 1], ceil_mode=1),
    "maxpool_asym": _case("MaxPool", {"x": X4}, kernel_shape=[2, 3], pads=[0, 1, 1, 2]),
    "avgpool_pad_exclude": _case("AveragePool", {"x": X4}, kernel_shape=[3, 3],
                                 pads=[1, 1, 1, 1], strides=[2, 2]),
    "avgpool_pad_include": _case("AveragePool", {"x": X4}, kernel_shape=[3, 3],
                                 pads=[1, 1, 1, 1], count_include_pad=1),
    "avgpool_asym": _case("AveragePool", {"x": X4}, kernel_shape=[2, 2], pads=[0, 1, 1, 0]),
    "global_max_pool": _case("GlobalMaxPool", {"x": X4}),
    "split_num_outputs": _case("Split", {"x": _x(7, 3)}, n_out=3, opset=18, axis=0,
                               num_outputs=3),
    "split_sizes": _case("Split", {"x": _x(3, 7)}, {"s": _i([2, 5])}, n_out=2, axis=1,
                         opset=13),
    "split_attr": _case("Split", {"x": _x(6, 2)}, n_out=2, opset=11, split=[4, 2]),
    "reduce_mean_input": _case("ReduceMean", {"x": X4}, {"a": _i([1, -1])}, opset=18),
    "reduce_mean_attr": _case("ReduceMean", {"x": X4}, opset=13, axes=[2], keepdims=0),
    "reduce_sum_noop": _case("ReduceSum", {"x": X4}, {"a": _i([])}, noop_with_empty_axes=1),
    "reduce_sum_all": _case("ReduceSum", {"x": X4}, keepdims=0),
    "reduce_max": _case("ReduceMax", {"x": X4}, opset=13, axes=[0, 3]),
    "reduce_l2": _case("ReduceL2", {"x": X4}, opset=13, axes=[1]),
    "reduce_logsumexp": _case("ReduceLogSumExp", {"x": X4}, opset=13, axes=[3]),
    "squeeze_attr": _case("Squeeze", {"x": _x(1, 3, 1)}, opset=11, axes=[-1]),
    "unsqueeze_attr": _case("Unsqueeze", {"x": _x(3, 2)}, opset=11, axes=[0, 3]),
    "unsqueeze_input": _case("Unsqueeze", {"x": _x(3, 2)}, {"a": _i([-1, 0])}),
    "expand": _case("Expand", {"x": _x(3, 1)}, {"s": _i([2, 1, 4])}),
    "where": _case("Where", {"c": np.array([[True, False, True]]), "a": _x(2, 3),
                             "b": np.array(-1.0, np.float32)}),
    "range": _case("Range", {}, {"a": np.float32(1.0), "b": np.float32(4.5),
                                 "c": np.float32(0.5)}),
    "cast_float_int": _case("Cast", {"x": _x(4, 3) * 3}, to=I64),
    "constant_of_shape": _case("ConstantOfShape", {}, {"s": _i([2, 3])},
                               value=numpy_helper.from_array(np.array([7], np.int64))),
    "shape_slice": _case("Shape", {"x": X4}, start=1, end=-1),
    "gather_neg": _case("Gather", {"x": _x(5, 3)}, {"i": _i([[-1, 0], [2, -5]])}, axis=0),
    "gather_scalar_axis1": _case("Gather", {"x": X4}, {"i": _i(2)}, axis=1),
    "gather_elements": _case("GatherElements", {"x": _x(3, 4)}, {"i": _i([[0, 3], [1, -1],
                                                                          [2, 2]])}, axis=1),
    "gather_nd_batch": _case("GatherND", {"x": _x(2, 3, 4)}, {"i": _i([[[1], [0]], [[2], [1]]])},
                             batch_dims=1),
    "scatter_elements_add": _case("ScatterElements", {"x": _x(3, 4), "u": _x(2, 4)},
                                  {"i": _i([[0, 1, 2, 0], [0, 0, 1, 2]])}, axis=0,
                                  reduction="add", inputs=["x", "i", "u"]),
    "tile": _case("Tile", {"x": _x(2, 3)}, {"r": _i([2, 1])}),
    "trilu": _case("Trilu", {"x": _x(4, 5)}, {"k": _i(1)}, upper=0),
    "cumsum": _case("CumSum", {"x": _x(3, 4)}, {"a": _i(1)}, exclusive=1, reverse=1),
    "einsum": _case("Einsum", {"a": _x(2, 3, 4), "b": _x(2, 4, 5)}, equation="bij,bjk->bik"),
    "softmax_opset11": _case("Softmax", {"x": _x(2, 3, 4)}, opset=11, axis=1),
    "log_softmax": _case("LogSoftmax", {"x": _x(2, 3, 4)}, axis=0),
    "gemm_trans_alpha": _case("Gemm", {"a": _x(4, 3), "b": _x(5, 4), "c": _x(5)},
                              transA=1, transB=1, alpha=0.5, beta=2.0),
    "clip_min_only": _case("Clip", {"x": _x(3, 4)}, {"m": np.float32(0.1)}),
    "leaky_relu": _case("LeakyRelu", {"x": _x(3, 4)}, alpha=0.2),
    "hard_sigmoid": _case("HardSigmoid", {"x": _x(3, 4)}),
    "gelu_tanh_opset20": _case("Gelu", {"x": _x(3, 4)}, opset=20, approximate="tanh"),
    "erf": _case("Erf", {"x": _x(3, 4)}),
    "layer_norm_axis1": _case("LayerNormalization", {"x": _x(2, 3, 4), "s": _x(3, 4),
                                                     "b": _x(3, 4)}, n_out=3, axis=1),
    "batch_norm_training": _case("BatchNormalization", {
        "x": X4, "s": _x(4), "b": _x(4), "m": _x(4), "v": np.abs(_x(4)) + 0.5}, n_out=3,
        training_mode=1, momentum=0.8),
    "batch_norm_inference": _case("BatchNormalization", {
        "x": X4, "s": _x(4), "b": _x(4), "m": _x(4), "v": np.abs(_x(4)) + 0.5}),
    "instance_norm": _case("InstanceNormalization", {"x": X4, "s": _x(4), "b": _x(4)}),
    "flatten_axis0": _case("Flatten", {"x": X4}, axis=0),
    "mod_int": _case("Mod", {"a": _i([[7, -7, 5]]), "b": _i([3, 3, -2])}),
    "div_int": _case("Div", {"a": _i([7, -7, 5]), "b": _i([2, 2, -3])}),
    "pow_int_exp": _case("Pow", {"x": _x(3, 4)}, {"e": _i(2)}),
    "argmax_last": _case("ArgMax", {"x": np.array([[1, 3, 3], [2, 2, 0]], np.float32)},
                         axis=1, select_last_index=1),
    "one_hot": _case("OneHot", {"i": _i([[0, 2], [-1, 5]])}, {"d": _i(4),
                                                              "v": np.float32([0.5, 2.0])}),
    "resize_nearest": _case("Resize", {"x": X4}, {"r": np.float32([]),
                                                  "s": np.float32([1, 1, 2, 2])},
                            mode="nearest", coordinate_transformation_mode="asymmetric",
                            nearest_mode="floor"),
    "resize_linear": _case("Resize", {"x": X4}, {"r": np.float32([]),
                                                 "s": np.float32([1, 1, 2, 2])},
                           mode="linear"),
    "softmax_ce": _case("SoftmaxCrossEntropyLoss", {"x": _x(4, 5, 3)},
                        {"l": _i([[0, 4, 1], [2, 2, 3], [1, 0, 0], [4, 3, 3]])}, n_out=2,
                        ignore_index=3),
    "dropout_identity": _case("Dropout", {"x": _x(3, 4)}, {"r": np.float32(0.5)}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_reference_op_matches_ort(case):
    model, feeds = CASES[case]
    outs = [o.name for o in model.graph.output]
    got = ort_run(model, feeds, outs)
    ref, _ = torch_forward(model, feeds)
    for name, g in zip(outs, got, strict=True):
        r = ref[name].detach().numpy()
        assert r.dtype == g.dtype, (name, r.dtype, g.dtype)
        assert r.shape == g.shape, (name, r.shape, g.shape)
        assert_matches(r, g, rtol=1e-5)


def test_unsupported_op_is_named():
    model, feeds = _case("Hardmax", {"x": _x(2, 3)})
    with pytest.raises(NotImplementedError, match="Hardmax"):
        torch_forward(model, feeds)


def test_ort_constant_sharing_breaks_small_training_batchnorm():
    """Pins an ORT 1.31 fact the zoo tests work around: at the default optimization level
    ConstantSharing merges identical initializers of <= 8 elements (BN scale/bias and running
    stats all start as ones/zeros), and the training-mode BN kernel updates running stats in
    place, so a second run sees a changed scale. With optimizations off, runs agree."""
    model = build_model("unet")  # first stage has 8 channels
    feeds = make_feeds(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    first, second = sess.run(None, feeds)[0], sess.run(None, feeds)[0]
    ref = torch_forward(model, feeds)[0]["logits"].detach().numpy()
    assert not np.allclose(first, second) or not np.allclose(first, ref, rtol=1e-3)
    np.testing.assert_array_equal(ort_run(model, feeds)[0], ort_run(model, feeds)[0])


def test_double_mode_promotes_every_float():
    """double=True runs float32 graphs in float64 (constants and casts included)."""
    for name in ("bert", "mobilenetv2"):
        model = build_model(name)
        feeds = make_feeds(model)
        out64, params = torch_forward(model, feeds, double=True)
        assert out64["logits"].dtype == torch.float64
        assert all(p.dtype == torch.float64 for p in params.values())
        out32, _ = torch_forward(model, feeds)
        assert_matches(out64["logits"].detach().numpy(), out32["logits"].detach().numpy())
    loss, grads = torch_loss_and_grads(build_model("mlp"), make_feeds(build_model("mlp")),
                                       labels=make_labels(build_model("mlp")), double=True)
    assert all(g.dtype == np.float64 for g in grads.values())
