"""Dropout masks from (seed, step counter, element) (``frontend/dropout_masks.py``).

ORT's Dropout keeps its generator in the session, so a resumed run (a new session) drew other
masks than the uninterrupted run and ended with every tensor different. The rewrite draws
each mask from a hash of the node's seed, the step's carried counter and the element index;
these tests hold the ONNX generator to its numpy reference, check the masks' statistics,
the upgrade of steps built before it, and the export of the plain model. Exact resumption
itself is tested in test_trainer.py and test_train_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from benchmarks.dropout_cuda_check import ort_dropout, with_dropout
from memcc import Trainer
from memcc.backend import checkpoint as ckpt
from memcc.backend.onnx_file import save_graph
from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.dropout_masks import (
    COUNTER,
    COUNTER_NEW,
    OPERANDS_PROP,
    ORIGINAL_PROP,
    counter_dropouts,
    dropout_mask,
    threshold,
)
from memcc.frontend.load import load_graph
from memcc.frontend.random_draws import normal_values, uniform_values
from memcc.graph import attr
from memcc.step import STATE_KEY, TrainingStep
from models import mlp


def _two_dropouts(ratio: float = 0.25, train: bool = True, shape=(6, 5, 7)):
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["a", "a.mask"], name="first"),
             helper.make_node("Dropout", ["a", "r", "t"], ["y", "y.mask"], name="second")]
    g = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info(v, TensorProto.BOOL if v.endswith("mask")
                                       else TensorProto.FLOAT, list(shape))
         for v in ("a", "a.mask", "y", "y.mask")],
        [helper.make_tensor("r", TensorProto.FLOAT, [], [ratio]),
         helper.make_tensor("t", TensorProto.BOOL, [], [train])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return load_graph(m)


def test_the_onnx_generator_draws_its_numpy_reference_masks():
    graph = _two_dropouts()
    seeds = {n.name: attr(n, "seed") for n in graph.nodes}
    assert counter_dropouts(graph) == ["first", "second"]
    assert not [n for n in graph.nodes if n.op_type == "Dropout"]
    graph.inputs = [*graph.inputs, COUNTER]
    sess = ort.InferenceSession(graph.to_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).uniform(0.5, 2.0, (6, 5, 7)).astype(np.float32)
    drawn = {}
    for step in (0, 1, 7, 2 ** 32 + 3):
        a, a_mask, y, y_mask = sess.run(None, {"x": x, COUNTER: np.asarray(step, np.int64)})
        want_a = dropout_mask(seeds["first"], step, x.shape, 0.25)
        want_y = dropout_mask(seeds["second"], step, x.shape, 0.25)
        np.testing.assert_array_equal(a_mask, want_a)
        np.testing.assert_array_equal(y_mask, want_y)
        scale = np.float32(1 / 0.75)
        np.testing.assert_array_equal(a, np.where(want_a, x * scale, np.float32(0)))
        np.testing.assert_array_equal(y, np.where(want_y, a * scale, np.float32(0)))
        drawn[step] = a_mask
    assert not np.array_equal(drawn[0], drawn[1])
    assert not np.array_equal(drawn[1], drawn[7])


def _uniform_graph():
    """x * (RandomUniformLike(x, 0.5, 2.5) < 1.5), and a float16 RandomUniform of its own
    shape: the draws an exporter writes for an in-place dropout or a Bernoulli."""
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["u"], name="u", low=0.5, high=2.5),
             helper.make_node("Less", ["u", "t"], ["keep"]),
             helper.make_node("Cast", ["keep"], ["keepf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "keepf"], ["y"]),
             helper.make_node("RandomUniform", [], ["h"], name="h", shape=[3, 4],
                              dtype=TensorProto.FLOAT16, seed=5.0),
             helper.make_node("RandomNormalLike", ["x"], ["n"], name="n", mean=1.0,
                              scale=2.0)]
    g = helper.make_graph(
        nodes, "uniform", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 5, 7])],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, [6, 5, 7]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [6, 5, 7]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT16, [3, 4]),
         helper.make_tensor_value_info("n", TensorProto.FLOAT, [6, 5, 7])],
        [helper.make_tensor("t", TensorProto.FLOAT, [], [1.5])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    return load_graph(m)


def test_random_draws_give_their_numpy_reference_from_the_counter():
    """ORT seeds an unseeded RandomUniformLike or RandomNormalLike from the clock (two runs
    of a dynamo export of torchvision's MNASNet trained apart): the rewrite draws from
    (seed, step, element); the normal's transcendentals within a few ulps of numpy's."""
    graph = _uniform_graph()
    assert counter_dropouts(graph) == ["u", "h", "n"]
    assert not [n for n in graph.nodes if n.op_type.startswith("Random")]
    graph.inputs = [*graph.inputs, COUNTER]
    x = np.ones((6, 5, 7), np.float32)
    from memcc.frontend.dropout_masks import _seed
    u_seed = _seed(helper.make_node("RandomUniformLike", ["x"], ["u"], name="u"))
    runs = []
    for threads in (1, 2):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        sess = ort.InferenceSession(graph.to_model().SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        runs.append([sess.run(None, {"x": x, COUNTER: np.asarray(k, np.int64)})
                     for k in (0, 1)])
    n_seed = _seed(helper.make_node("RandomNormalLike", ["x"], ["n"], name="n"))
    for k, (u, y, h, n) in enumerate(runs[0]):
        np.testing.assert_allclose(n, normal_values(n_seed, k, (6, 5, 7), 1.0, 2.0),
                                   rtol=1e-5, atol=1e-5)
        want = uniform_values(u_seed, k, (6, 5, 7), 0.5, 2.5)
        np.testing.assert_array_equal(u, want)
        np.testing.assert_array_equal(y, x * (want < 1.5))
        np.testing.assert_array_equal(h, uniform_values(5, k, (3, 4), 0.0, 1.0, np.float16))
        assert 0.5 <= u.min() and u.max() < 2.5 and abs(float(u.mean()) - 1.5) < 0.15
    assert not np.array_equal(runs[0][0][0], runs[0][1][0])
    for a, b in zip(runs[0], runs[1], strict=True):
        assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


def test_normal_draws_have_the_normal_distribution():
    """Box-Muller on two hashes: mean, spread and the share within one and two standard
    deviations of a standard normal over 2^18 values, and no correlation between steps."""
    z = normal_values(11, 0, (256, 1024), 0.0, 1.0).astype(np.float64)
    other = normal_values(11, 1, (256, 1024), 0.0, 1.0).astype(np.float64)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    assert abs((np.abs(z) < 1).mean() - 0.6827) < 0.005
    assert abs((np.abs(z) < 2).mean() - 0.9545) < 0.003
    assert abs(np.corrcoef(z.ravel(), other.ravel())[0, 1]) < 0.01
    assert np.isfinite(z).all()


def test_masks_keep_one_minus_ratio_and_differ_across_steps_and_nodes():
    shape = (64, 128, 128)          # 1M elements: the mean is known to about 3e-4
    for ratio in (0.1, 0.5):
        p = 1 - ratio
        m0 = dropout_mask(11, 0, shape, ratio)
        m1 = dropout_mask(11, 1, shape, ratio)
        other = dropout_mask(12, 0, shape, ratio)
        for m in (m0, m1, other):
            assert abs(m.mean() - p) < 2e-3, (ratio, m.mean())
        # Independent draws agree on p^2 + (1-p)^2 of the elements; a shifted or repeated
        # mask agrees on more, a complementary one on less.
        expected = p * p + (1 - p) ** 2
        for a, b in ((m0, m1), (m0, other), (m0[:, :, 1:], m0[:, :, :-1]),
                     (m0[:, 1:], m0[:, :-1]), (m0[1:], m0[:-1])):
            assert abs((a == b).mean() - expected) < 3e-3
    assert threshold(0.1) == 429496730 and threshold(1 - 1e-12) == 2 ** 32 - 1


def test_an_identity_dropout_is_left_alone():
    """Inference mode or ratio 0: ORT's Dropout is an identity, nothing random to rewrite."""
    for graph in (_two_dropouts(train=False), _two_dropouts(ratio=0.0)):
        before = [n.op_type for n in graph.nodes]
        assert counter_dropouts(graph) == []
        assert [n.op_type for n in graph.nodes] == before and COUNTER not in graph.info


@pytest.fixture(scope="module")
def old_step(tmp_path_factory):
    """A step as memcc built it before counter-based masks: seeded Dropouts, no counter."""
    d = tmp_path_factory.mktemp("old_step")
    forward = load_graph(with_dropout(mlp.build(batch=4, in_features=8, width=16, depth=2)))
    with ort_dropout():
        step = build_training_step(forward, BuildOptions(optimizer="adamw"))
    assert [n for n in step.nodes if n.op_type == "Dropout"]
    assert COUNTER not in step.inputs
    return save_graph(step, d / "old.onnx")


def test_an_old_step_is_rewritten_when_loaded(old_step):
    graph = load_graph(old_step)
    assert not [n for n in graph.nodes if n.op_type == "Dropout"]
    assert COUNTER in graph.inputs and COUNTER_NEW in graph.outputs
    assert json.loads(graph.metadata[STATE_KEY])[COUNTER_NEW] == COUNTER
    TrainingStep.of(graph).validate(str(old_step))


def test_an_old_checkpoint_resumes_with_the_counter_at_its_step(old_step, tmp_path):
    """Its checkpoints hold no counter; the fingerprint without it matches, and the counter
    starts at the checkpoint's step."""
    trainer = Trainer(old_step, threads=1)
    feeds = synthetic_feeds(trainer.graph, seed=0)
    for _ in range(3):
        trainer.step(feeds)
    sig = trainer.signature()
    legacy = {**sig, "state": {k: v for k, v in sig["state"].items() if k != COUNTER}}
    tensors = {k: v for k, v in trainer.state_dict().items() if k != COUNTER}
    ckpt.save(tmp_path, tensors, ckpt.CheckpointInfo(step=3, sig=legacy, data_state={},
                                                     step_file=str(old_step)))
    resumed = Trainer.resume(tmp_path, threads=1)
    assert resumed.state_dict()[COUNTER] == 3
    assert np.isfinite(resumed.step(feeds))


def test_export_writes_the_plain_dropout_back(old_step, tmp_path):
    trainer = Trainer(old_step, threads=1)
    trainer.step(synthetic_feeds(trainer.graph, seed=0))
    model = onnx.load(str(trainer.export(tmp_path / "trained.onnx")))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Dropout") == 2 and "Range" not in ops and "GreaterOrEqual" not in ops
    names = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    assert COUNTER not in names
    assert not [p for n in model.graph.node for p in n.metadata_props
                if p.key == ORIGINAL_PROP]
    assert all(len(n.output) == 1 for n in model.graph.node if n.op_type == "Dropout")


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "older-step"])
def test_export_restores_the_ratio_and_mode_the_step_no_longer_holds(tmp_path, recorded):
    """A dynamo export's Dropouts read their ratio and training_mode from initializers
    (``val_24``, ``val_25``); the step drops them once the generator replaces the Dropouts,
    and ``memcc export`` of a transformers BERT failed with "forward output 'val_25' is not
    computed in the step" (first-use audit, session 36). The export writes them back."""
    w = np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]),
         helper.make_node("Dropout", ["h", "val_24", "val_25"], ["y"], name="drop")],
        "d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [onnx.numpy_helper.from_array(w, "w"),
         helper.make_tensor("val_24", TensorProto.FLOAT, [], [0.25]),
         helper.make_tensor("val_25", TensorProto.BOOL, [], [True])])
    step = build_training_step(
        load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])),
        BuildOptions(loss="mse"))
    assert "val_24" not in step.initializers and "val_25" not in step.initializers
    if not recorded:   # a step built before the operands were recorded: from the threshold
        for n in step.nodes:
            keep = [p for p in n.metadata_props if p.key != OPERANDS_PROP]
            del n.metadata_props[:]
            n.metadata_props.extend(keep)
    trainer = Trainer(save_graph(step, tmp_path / "step.onnx"), threads=1)
    trainer.step(synthetic_feeds(trainer.graph, seed=0))
    model = onnx.load(str(trainer.export(tmp_path / "trained.onnx")))
    drop = next(n for n in model.graph.node if n.op_type == "Dropout")
    assert list(drop.input) == ["h", "val_24", "val_25"]
    consts = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
              for n in model.graph.node if n.op_type == "Constant"}
    assert consts["val_24"].dtype == np.float32 and float(consts["val_24"]) == 0.25
    assert consts["val_25"].dtype == np.bool_ and bool(consts["val_25"])
    x = np.ones((3, 4), np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    assert y.shape == (3, 5)


def test_an_exported_in_place_dropout_trains_reproducibly_and_resumes_exactly(tmp_path):
    """The dynamo exporter writes ``nn.Dropout(inplace=True)`` as RandomUniformLike, Less
    and Mul (torchvision's MNASNet), and ``torch.randn_like`` as RandomNormalLike: the built
    step draws both from the counter, so runs at 1 and 2 threads agree, a resumed run equals
    the straight one, and export writes the draws back."""
    import torch

    class InPlace(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
            self.drop = torch.nn.Dropout(0.3, inplace=True)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(self.drop(h + 0.1 * torch.randn_like(h)))  # a VAE's kind of noise

    torch.manual_seed(0)
    path = tmp_path / "inplace.onnx"
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(InPlace().train(), (torch.randn(4, 8),), str(path), dynamo=True,
                          optimize=False, input_names=["x"])
    assert {"RandomUniformLike", "RandomNormalLike"} <= {
        n.op_type for n in onnx.load(str(path)).graph.node}
    step = save_graph(build_training_step(load_graph(path), BuildOptions()), tmp_path / "s.onnx")
    assert not [n for n in onnx.load(str(step)).graph.node if n.op_type.startswith("Random")]
    feeds = synthetic_feeds(load_graph(step), seed=0)

    def train(threads: int, steps: int, trainer=None) -> Trainer:
        trainer = trainer or Trainer(step, threads=threads)
        for _ in range(steps):
            trainer.step(feeds)
        return trainer

    straight = [train(t, 4).state_dict() for t in (1, 2)]
    train(2, 2).save(tmp_path / "ck")
    resumed = train(2, 2, Trainer.resume(tmp_path / "ck", threads=2)).state_dict()
    for other in (straight[1], resumed):
        assert sorted(other) == sorted(straight[0])
        assert all(np.array_equal(straight[0][k], other[k]) for k in other)
    model = onnx.load(str(Trainer(step, threads=1).export(tmp_path / "trained.onnx")))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("RandomUniformLike") == ops.count("RandomNormalLike") == 1
    assert "Range" not in ops


def test_export_writes_a_draw_whose_shape_source_the_step_dropped_as_random_uniform(tmp_path):
    """The dynamo exporter's optimizer draws dropout masks as RandomUniformLike of a
    zero-filled initializer (``self_float``, torchvision's MobileNetV3): the step no longer
    holds it once the draw reads the counter, and export failed ("neither computed nor
    stored in the step"). It writes the RandomUniform of that shape instead."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("RandomUniformLike", ["self_float"], ["u"], name="draw"),
             helper.make_node("Less", ["u", "p"], ["keep"]),
             helper.make_node("Cast", ["keep"], ["keepf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["h", "keepf"], ["d"]),
             helper.make_node("MatMul", ["d", "w2"], ["logits"])]
    g = helper.make_graph(
        nodes, "draw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 3])],
        [numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1"),
         numpy_helper.from_array(np.zeros((4, 16), np.float32), "self_float"),
         numpy_helper.from_array(np.asarray(0.7, np.float32), "p"),
         numpy_helper.from_array(rng.standard_normal((16, 3)).astype(np.float32), "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    step = save_graph(build_training_step(load_graph(m), BuildOptions()), tmp_path / "s.onnx")
    trainer = Trainer(step, threads=1)
    trainer.step(synthetic_feeds(trainer.graph, seed=0))
    model = onnx.load(str(trainer.export(tmp_path / "trained.onnx")))
    (draw,) = [n for n in model.graph.node if n.op_type.startswith("Random")]
    assert draw.op_type == "RandomUniform" and list(attr(draw, "shape")) == [4, 16]
    out = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]
                               ).run(None, {"x": np.ones((4, 8), np.float32)})[0]
    assert out.shape == (4, 3) and np.isfinite(out).all()


def test_build_warns_about_dropouts_that_never_drop_beside_ones_that_do():
    """transformers' GPT-2 in train mode: scaled_dot_product_attention's attention dropout
    is exported without training_mode (an identity in ONNX) beside Dropouts that train; the
    step trained without it in silence. A model without Dropout, or with none that
    trains, hears nothing."""
    from exports import export

    from memcc.frontend.export_signature import ExportWarning

    said = {}
    for dropout in (0.1, 0.0):
        path, _, _, dims = export("gpt2", "torchscript", training=True, dropout=dropout)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExportWarning)
            build_training_step(load_graph(path, dims), BuildOptions())
        said[dropout] = [str(w.message) for w in caught if "no training mode" in str(w.message)]
    assert len(said[0.1]) == 1 and "2 Dropout node(s)" in said[0.1][0], said
    assert "attn" in said[0.1][0]
    assert said[0.0] == []
