"""Models that compute their own loss: ONNX's ``SoftmaxCrossEntropyLoss`` and
``NegativeLogLikelihoodLoss`` (``memcc/frontend/loss_ops.py``) build with ``--loss none``.

Small torch modules whose forward returns ``F.cross_entropy`` or ``F.nll_loss`` (mean, sum
and none reductions, -100 labels ignored, class weights, a sequence's [N, C, T] scores) are
exported by both exporters; the step's loss and every parameter gradient must be torch's on
the same weights and batch within ``RTOL`` (relative to the largest of each gradient). Hand-
written graphs cover what the exporters never write: int32 labels, opset 12 (whose
LogSoftmax flattens), ``log_prob`` as an output, another ``ignore_index``. A tiny
HuggingFace GPT-2 called with ``labels=`` builds and matches torch too.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from exports import _jitter_constant_parameters
from onnx import TensorProto, helper, numpy_helper
from test_exports_grad import parameter_groups
from threads import run_at_threads
from torch import nn

from memcc.backend.verify import step_outputs
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph

RTOL = 1e-5  # float32: loss and each gradient, relative to its largest magnitude
CLASSES = 5
IGNORE = -100


class LossNet(nn.Module):
    """A Linear (and a Tanh) whose forward returns one of torch's losses of its scores."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.l1, self.l2 = nn.Linear(6, 8), nn.Linear(8, CLASSES)
        self.register_buffer("class_w", torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25]))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.l2(torch.tanh(self.l1(x)))
        k = self.kind
        if o.dim() == 3:  # [N, T, C]: torch takes the classes on axis 1
            o = o.transpose(1, 2)
        if k in ("mean", "seq"):
            return F.cross_entropy(o, y)
        if k == "sum":
            return F.cross_entropy(o, y, reduction="sum")
        if k == "none":
            return F.cross_entropy(o, y, reduction="none").sum() * 0.5
        if k == "weighted":
            return F.cross_entropy(o, y, weight=self.class_w)
        if k == "weighted_sum":
            return F.cross_entropy(o, y, weight=self.class_w, reduction="sum")
        if k == "nll":
            return F.nll_loss(F.log_softmax(o, 1), y)
        if k == "nll_weighted":
            return F.nll_loss(F.log_softmax(o, 1), y, weight=self.class_w)
        raise AssertionError(k)


def _batch(kind: str, ignored: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (3, 4) if kind == "seq" else (6,)
    x = rng.standard_normal((*shape, 6)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=shape).astype(np.int64)
    if ignored:
        y.reshape(-1)[::3] = IGNORE
    return x, y


def _export(module: nn.Module, exporter: str, batch, path: Path) -> Path:
    """``module`` exported with inputs ``x``, ``y`` and output ``loss``: TorchScript in
    training mode at opset 17, dynamo (``dynamo_noopt``: without its optimizer, which folds
    GPT-2's position embedding into a constant)."""
    args = tuple(torch.from_numpy(a) for a in batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(module, args, str(path), dynamo=False, input_names=["x", "y"],
                              output_names=["loss"], do_constant_folding=False,
                              training=torch.onnx.TrainingMode.TRAINING, opset_version=17)
        else:
            prog = torch.onnx.export(module, args, dynamo=True, input_names=["x", "y"],
                                     output_names=["loss"], verbose=False,
                                     optimize=exporter == "dynamo")
            prog.save(str(path), external_data=False)
    return path


def _step_grads(path: Path, feeds: dict[str, np.ndarray]):
    """The step built with ``--loss none`` (no update): it and one run's outputs."""
    step = build_training_step(load_graph(path), BuildOptions(loss="none", optimizer="none"))
    return step, step_outputs(step, feeds, "cpu")


def _assert_like_torch(where: str, step, out, module: nn.Module, feeds) -> None:
    """The loss and every gradient (exporters' copies of one weight summed) torch's."""
    m = copy.deepcopy(module).train()
    loss = m(*(torch.from_numpy(v) for v in feeds.values()))
    loss.backward()
    ref = loss.item()
    assert abs(float(out["loss"]) - ref) <= RTOL * max(1.0, abs(ref)), (where, out["loss"], ref)
    tparams = {n: p.detach().numpy() for n, p in m.named_parameters()}
    tgrads = {n: p.grad.numpy() for n, p in m.named_parameters()}
    oparams = {k[: -len(".grad")]: step.initializers[k[: -len(".grad")]]
               for k in out if k.endswith(".grad")}
    covered: set[str] = set()
    for onnx_members, torch_members in parameter_groups(oparams, tparams):
        got = sum((out[f"{o}.grad"].T if tr else out[f"{o}.grad"]).astype(np.float64)
                  for o, tr in onnx_members)
        want = sum(tgrads[t].astype(np.float64) for t in torch_members)
        err = float(np.abs(got - want).max()) / max(float(np.abs(want).max()), 1e-12)
        assert err <= RTOL, f"{where}: {torch_members}: relative error {err:.2e}"
        covered.update(torch_members)
    assert covered == set(tgrads), f"{where}: torch parameters unmatched: " \
        f"{sorted(set(tgrads) - covered)}"


CASES = [("mean", False), ("mean", True), ("sum", True), ("none", True),
         ("weighted", True), ("weighted_sum", False), ("nll", True), ("nll_weighted", True),
         ("seq", True)]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo", "dynamo_noopt"])
@pytest.mark.parametrize(("kind", "ignored"), CASES)
def test_exported_loss_trains_as_torch(tmp_path, exporter, kind, ignored):
    """``F.cross_entropy`` / ``F.nll_loss`` computed inside the model: the step's loss and
    gradients are torch's (-100 labels ignored where ``ignored``); the class weights stay
    constants (never a trained parameter), whichever way the exporter stored them."""
    module = LossNet(kind)
    batch = _batch(kind, ignored)
    path = _export(copy.deepcopy(module), exporter, batch, tmp_path / f"{kind}.onnx")
    ops = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert ops & {"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"}, ops
    feeds = dict(zip(("x", "y"), batch, strict=True))
    step, out = _step_grads(path, feeds)
    assert not {n.op_type for n in step.nodes} & {"SoftmaxCrossEntropyLoss",
                                                   "NegativeLogLikelihoodLoss"}
    assert "class_w.grad" not in out
    _assert_like_torch(f"{kind}/{exporter}", step, out, module, feeds)


def test_every_label_ignored_gives_nan_and_zero_gradients(tmp_path):
    """As torch's mean over no kept position: loss nan, every gradient 0."""
    module = LossNet("mean")
    x, y = _batch("mean", False)
    path = _export(module, "torchscript", (x, y), tmp_path / "all.onnx")
    _, out = _step_grads(path, {"x": x, "y": np.full_like(y, IGNORE)})
    assert np.isnan(out["loss"])
    grads = [v for k, v in out.items() if k.endswith(".grad")]
    assert grads and all(np.all(g == 0) for g in grads)


def _handwritten(op: str, opset: int, attrs: dict, weights: np.ndarray | None,
                 log_prob: bool) -> tuple[onnx.ModelProto, np.ndarray]:
    """``op(x * p, labels int32[, weights])`` over [N, C, T] scores (p the parameter), then a
    ReduceSum (a no-op on a scalar) as the loss; with ``log_prob`` the second output of
    SoftmaxCrossEntropyLoss is a graph output too. Returns the model and p."""
    p = np.random.default_rng(2).standard_normal((CLASSES, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(p, "p")]
    ins = ["scores", "labels"]
    if weights is not None:
        inits.append(numpy_helper.from_array(weights, "cw"))
        ins.append("cw")
    outs = ["per", "logp"] if log_prob else ["per"]
    nodes = [helper.make_node("Mul", ["x", "p"], ["scores"]),
             helper.make_node(op, ins, outs, name="the_loss", **attrs),
             helper.make_node("ReduceSum", ["per"], ["loss"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, CLASSES, 4]),
                     helper.make_tensor_value_info("labels", TensorProto.INT32, [3, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=8)
    return model, p


HANDWRITTEN = [  # op, opset, attributes, class weights?, log_prob output?
    ("SoftmaxCrossEntropyLoss", 13, {"ignore_index": 0}, False, True),
    ("SoftmaxCrossEntropyLoss", 15, {"reduction": "none", "ignore_index": 3}, True, False),
    ("SoftmaxCrossEntropyLoss", 17, {"reduction": "sum"}, True, True),
    ("NegativeLogLikelihoodLoss", 16, {"reduction": "mean", "ignore_index": 1}, True, False),
    ("NegativeLogLikelihoodLoss", 13, {"reduction": "none"}, False, False),
]


@pytest.mark.parametrize(("op", "opset", "attrs", "weighted", "log_prob"), HANDWRITTEN)
def test_handwritten_loss_ops_match_torch(op, opset, attrs, weighted, log_prob):
    """Int32 labels, opsets 13 to 15 (no GatherElements gradient: the label's class is
    picked by a mask), ``log_prob`` read as an output, an ``ignore_index`` among the
    classes, none at all: the loss, the log-probabilities and the gradient torch's."""
    weights = np.float32([0.5, 2.0, 1.0, 3.0, 0.25]) if weighted else None
    model, p = _handwritten(op, opset, attrs, weights, log_prob)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, CLASSES, 4)).astype(np.float32),
             "labels": rng.integers(0, CLASSES, size=(3, 4)).astype(np.int32)}
    step = build_training_step(load_graph(model),
                               BuildOptions(loss="none", optimizer="none"))
    out = step_outputs(step, feeds, "cpu", also=["logp"] if log_prob else [])
    assert "cw.grad" not in out
    tp = torch.from_numpy(p).requires_grad_()
    scores = torch.from_numpy(feeds["x"]) * tp
    logp = torch.log_softmax(scores, 1) if op == "SoftmaxCrossEntropyLoss" else scores
    loss = F.nll_loss(logp, torch.from_numpy(feeds["labels"]).long(),
                      weight=None if weights is None else torch.from_numpy(weights),
                      ignore_index=attrs.get("ignore_index", -12345),
                      reduction=attrs.get("reduction", "mean")).sum()
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= RTOL * max(1.0, abs(loss.item()))
    want = tp.grad.numpy()
    assert np.abs(out["p.grad"] - want).max() <= RTOL * np.abs(want).max()
    if log_prob:
        np.testing.assert_allclose(out["logp"], logp.detach().numpy(), rtol=RTOL, atol=1e-6)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], outs: list[str]):
    """``outs`` (made the graph's outputs) of one ORT run of ``model``."""
    import onnxruntime as ort

    model = copy.deepcopy(model)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in outs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(outs, feeds)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
def test_opset_12_forward_is_what_ort_computes(op):
    """Opset 12's LogSoftmax flattens the axes from ``axis`` on: the rewrite moves the
    classes of [N, C, T] scores last and back. The rewritten forward gives what ORT gives
    for the op itself (its ONNX function body), ``log_prob`` included (memcc builds steps
    from opset 13 on; loading alone takes opset 12)."""
    attrs = {"ignore_index": 2, "reduction": "mean"}
    model, _ = _handwritten(op, 12, attrs, np.float32([0.5, 2.0, 1.0, 3.0, 0.25]),
                            op == "SoftmaxCrossEntropyLoss")
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((3, CLASSES, 4)).astype(np.float32),
             "labels": rng.integers(0, CLASSES, size=(3, 4)).astype(np.int32)}
    outs = ["loss", "logp"] if op == "SoftmaxCrossEntropyLoss" else ["loss"]
    graph = load_graph(model)
    assert not {n.op_type for n in graph.nodes} & {op}
    got, want = _run(graph.to_model(), feeds, outs), _run(model, feeds, outs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-6)


def test_unknown_reduction_is_refused_naming_the_node():
    model, _ = _handwritten("SoftmaxCrossEntropyLoss", 17, {"reduction": "average"}, None,
                            False)
    with pytest.raises(InputError, match=r"the_loss.*reduction 'average'.*--loss cross-entropy"):
        load_graph(model)


def test_label_smoothing_the_exporter_dropped_is_refused():
    """torch 2.13 and 2.14's dynamo exporter writes ``cross_entropy(..., label_smoothing=
    0.1)`` as a plain SoftmaxCrossEntropyLoss (its loss 0.45% off torch's, its gradients
    10% off, measured); the FX call it records on the node still says 0.1."""
    model, _ = _handwritten("SoftmaxCrossEntropyLoss", 17, {}, None, False)
    node = next(n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    call = ("%cross_entropy_loss : [num_users=1] = call_function[target=torch.ops.aten."
            "cross_entropy_loss.default](args = (%linear, %y, None, 1, -100, {}), kwargs = {{}})")
    node.metadata_props.add(key="pkg.torch.onnx.fx_node", value=call.format(0.1))
    with pytest.raises(InputError, match=r"the_loss.*label_smoothing=0.1.*F\.nll_loss"):
        load_graph(model)
    node.metadata_props[0].value = call.format(0.0)
    load_graph(model)  # no smoothing: the op is the loss


class GPT2Loss(nn.Module):
    """A tiny HuggingFace GPT-2 returning its own loss (``labels=``): dropout 0."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100,
                                      n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        self.model = transformers.GPT2LMHeadModel(cfg)
        # LayerNorm's ones and zeros made unique: exporters merge equal initializers
        _jitter_constant_parameters(self.model, torch.Generator().manual_seed(0))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo_noopt"])
def test_huggingface_gpt2_with_labels_trains_as_torch(tmp_path, exporter):
    """GPT-2 called with ``labels=`` (HuggingFace's shifted ``cross_entropy``, -100 labels
    ignored: a SoftmaxCrossEntropyLoss over [tokens, vocabulary]) builds with ``--loss
    none``; loss and every gradient torch's (the tied embedding's copies summed)."""
    pytest.importorskip("transformers")
    module = GPT2Loss().train()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 100, size=(2, 8)).astype(np.int64)
    labels = rng.integers(0, 100, size=(2, 8)).astype(np.int64)
    labels[:, :3] = IGNORE
    path = _export(copy.deepcopy(module), exporter, (ids, labels), tmp_path / "gpt2.onnx")
    feeds = {"x": ids, "y": labels}  # the names _export gives the inputs
    step, _ = _step_grads(path, feeds)
    # At 1 and 2 intra-op threads, twice each (the same bits within a count), torch's.
    for n, out in run_at_threads(step, feeds, threads=(1, 2), repeats=2).items():
        _assert_like_torch(f"gpt2/{exporter}/{n} threads", step, out, module, feeds)


@pytest.mark.parametrize("opset", [13, 15, 17])
@pytest.mark.parametrize("ignore_index", [None, 2])
def test_built_cross_entropy_before_opset_16_trains_as_torch(opset, ignore_index):
    """``--loss cross-entropy`` on a model of opset 13-15 (README: opset 13 and newer are
    covered): the loss memcc adds picks the label's class by a mask there, since the
    GatherElements gradient needs opset 16's ScatterElements-add (before, build refused
    the model, naming a GatherElements node the model did not have). Loss and gradient
    torch's, with and without an ignored label."""
    p = np.random.default_rng(2).standard_normal((4, CLASSES)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "p"], ["logits"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [6, CLASSES])],
        [numpy_helper.from_array(p, "p")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              ir_version=8)
    rng = np.random.default_rng(3)
    labels = rng.integers(0, CLASSES, size=6).astype(np.int64)
    if ignore_index is not None:
        labels[:2] = ignore_index
    feeds = {"x": rng.standard_normal((6, 4)).astype(np.float32), "labels": labels}
    step = build_training_step(load_graph(model), BuildOptions(
        optimizer="none", ignore_index=ignore_index))
    if opset < 16:
        assert not any(n.op_type == "GatherElements" for n in step.nodes)
    out = step_outputs(step, feeds, "cpu")
    tp = torch.from_numpy(p).requires_grad_()
    loss = F.cross_entropy(torch.from_numpy(feeds["x"]) @ tp, torch.from_numpy(labels),
                           ignore_index=-12345 if ignore_index is None else ignore_index)
    loss.backward()
    assert abs(float(out["loss"]) - loss.item()) <= RTOL * max(1.0, abs(loss.item()))
    want = tp.grad.numpy()
    assert np.abs(out["p.grad"] - want).max() <= RTOL * np.abs(want).max()
