"""Training steps built from real torch.onnx exports match the torch module's autograd.

Both exporters, eval and training mode, vision and text families (tests/exports.py). The
torch side runs the very module that was exported, on the same batch, with the same
cross-entropy loss. Exporters rename or copy weights (pre-transposed ``onnx::MatMul_*``,
dynamo's ``val_*``, GPT-2's tied embedding split in two), so each ONNX parameter is matched
to a torch parameter by name, else by value (as is or transposed, only when unique); a torch
parameter reached by several ONNX copies must get the sum of their gradients. The ONNX step
runs twice at 2 and at 4 intra-op threads: runs of one count must agree bit for bit, and every
count must match torch (tests/threads.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from exports import DYNAMO_NOOPT, DYNAMO_TRAIN_BN_DIVERGES, EXPORTERS, FAMILIES, export
from threads import run_at_threads

from memcc.backend.verify import compare_outputs, step_outputs
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.export_signature import ExportNote
from memcc.frontend.load import load_graph
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.plan import Plan, StepStructure

# Exports that torch.onnx gets wrong itself (tests/test_exports_load.py pins them).
BROKEN = {("gpt2_nomask", "torchscript", False), ("gpt2_nomask", "torchscript", True)} | {
    (f, "dynamo", True) for f in DYNAMO_TRAIN_BN_DIVERGES}
# Eval exports fold BatchNorm into the convolutions: those weights are not torch's.
BN_FOLDED = {"convnet", "mobilenet_block", "hf_resnet"}

CASES = [(f, e, t) for f in sorted(FAMILIES) for e in EXPORTERS for t in (False, True)
         if (f, e, t) not in BROKEN]


def parameter_groups(onnx_params: dict[str, np.ndarray], torch_params: dict[str, np.ndarray]
                     ) -> list[tuple[list[tuple[str, bool]], list[str]]]:
    """Connected groups of (ONNX parameter, transposed?) and torch parameters that hold the
    same values. Exporters split one torch weight into copies (tied embeddings) and may merge
    equal initializers into one, so the check is per group: the ONNX gradients summed equal
    the torch gradients summed. (The fixtures make every parameter's values unique.)
    """
    def same(t: np.ndarray, v: np.ndarray) -> bool | None:
        if t.shape == v.shape and np.array_equal(t, v):
            return False
        if t.ndim == 2 and t.T.shape == v.shape and np.array_equal(t.T, v):
            return True
        return None

    # Same name and same values: the exporter kept the parameter (dynamo keeps the name of a
    # BN-folded weight whose values changed: that is no match).
    by_name = {n for n, v in onnx_params.items()
               if n in torch_params and same(torch_params[n], v) is False}
    edges: dict[str, list[tuple[str, bool]]] = {n: [(n, False)] for n in by_name}
    for name, value in onnx_params.items():
        if name in by_name:
            continue
        for tname, t in torch_params.items():
            tr = same(t, value)
            if tr is not None:
                edges.setdefault(name, [])
                if (tname, tr) not in edges[name]:
                    edges[name].append((tname, tr))
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        parent.setdefault(a, a)
        while parent[a] != a:
            a = parent[a]
        return a

    for oname, hits in edges.items():
        for tname, _ in hits:
            parent[find("o:" + oname)] = find("t:" + tname)
    groups: dict[str, tuple[list, list]] = {}
    for oname, hits in edges.items():
        g = groups.setdefault(find("o:" + oname), ([], []))
        g[0].append((oname, hits[0][1]))
        for tname, _ in hits:
            if tname not in g[1]:
                g[1].append(tname)
    return list(groups.values())


@pytest.mark.parametrize("family,exporter,training", CASES)
def test_export_step_gradients_match_torch(family, exporter, training):
    path, module, inputs, dims = export(family, exporter, training=training)
    step = build_training_step(load_graph(path, dims), BuildOptions(optimizer="none"))
    classes = step.info[step.metadata.get("memcc.loss") and "labels"].shape
    logits_shape = step.info["labels"].shape
    n_classes = int(step.info[_logits_name(step)].shape[-1])
    labels = np.random.default_rng(0).integers(0, n_classes, size=logits_shape)
    runs = run_at_threads(step, {**inputs, "labels": labels.astype(np.int64)})
    assert classes == logits_shape

    m = copy.deepcopy(module)
    m.train(training)
    logits = m(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, n_classes),
                                             torch.from_numpy(labels).reshape(-1))
    loss.backward()
    for threads, out in runs.items():
        _assert_matches(f"{family}/{exporter} at {threads} threads", out, step, m, loss.item(),
                        bn_folded=family in BN_FOLDED and not training)


def test_weight_standardised_convolution_trains_by_batch_statistics():
    """timm's NF-ResNets standardise convolution weights with ``F.batch_norm(w, None, None,
    training=True)``: TorchScript writes a training-mode BatchNormalization whose running
    inputs are computed and whose running outputs nothing reads. The build refused every
    such model ("running statistics must be initializers"); it carries nothing for them
    now, carries the real BatchNorm's statistics, and the gradients are torch's."""
    path, module, inputs, dims = export("std_conv", "torchscript", training=True)
    graph = load_graph(path, dims)
    trained_bn = [n for n in graph.nodes if n.op_type == "BatchNormalization"
                  and any(a.name == "training_mode" and a.i for a in n.attribute)]
    assert len(trained_bn) == 2
    step = build_training_step(graph, BuildOptions(optimizer="none"))
    carried = [o for o in step.outputs if o.endswith(".new")]
    assert sorted(carried) == ["bn.running_mean.new", "bn.running_var.new"], carried
    feeds = _matches_torch("std_conv", step, module, inputs)
    # A plan keeps the standardising BatchNorm's three outputs (ORT refuses a training-mode
    # BatchNormalization without them), though nothing reads two: same bits.
    st = StepStructure.of(step)
    planned = _recompute_everything_gives_the_same_bits(step, feeds)
    assert all(len([o for o in n.output if o]) == 3 for n in planned.nodes
               if n.op_type == "BatchNormalization" and n.name in st.forward)


@pytest.mark.parametrize("family", ["lstm", "gru", "moe"])
@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_token_model_gradients_match_torch(family, exporter):
    """nn.LSTM and a two-layer bidirectional nn.GRU, exported as ONNX LSTM / GRU nodes and
    unrolled at load (memcc/frontend/recurrent.py), and a mixture of experts routed by
    torch.topk (TopK's gradient rule): loss and every gradient are torch's
    (backpropagation through time; through the top-k values to the router), at 2 and 4
    threads; a plan that recomputes every forward value it may gives the same bits as the
    step. (The dynamo exporter's optimizer folds torch's LSTM weights into gate-reordered
    W, R and B initializers: those train, but under no PyTorch name, so they cannot be
    matched to torch's here.)"""
    path, module, inputs, dims = export(family, exporter, training=True)
    graph = load_graph(path, dims)
    assert not any(n.op_type in ("LSTM", "GRU") for n in graph.nodes)
    assert family != "moe" or any(n.op_type == "TopK" for n in graph.nodes)
    step = build_training_step(graph, BuildOptions(optimizer="none"))
    feeds = _matches_torch(f"{family}/{exporter}", step, module, inputs)
    _recompute_everything_gives_the_same_bits(step, feeds)


@pytest.mark.parametrize("exporter", [DYNAMO_NOOPT, "dynamo"])
def test_spatial_transformer_gradients_match_torch(exporter):
    """F.affine_grid and F.grid_sample (GridSample's rule, memcc/frontend/gradients/
    grid_sample.py): the localisation net learns through the sampling grid, every gradient
    torch's at 2 and 4 threads. (TorchScript writes affine_grid only at opset 20.)"""
    path, module, inputs, dims = export("stn", exporter, training=True)
    graph = load_graph(path, dims)
    assert any(n.op_type == "GridSample" for n in graph.nodes)
    step = build_training_step(graph, BuildOptions(optimizer="none"))
    _matches_torch(f"stn/{exporter}", step, module, inputs)


@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_segmenter_trains_over_the_class_axis_torch_uses(exporter):
    """A segmenter's logits [N, C, H, W] have their classes on axis 1, where torch's
    cross_entropy takes them: with --class-axis 1 the loss is torch's per-pixel
    cross-entropy and every gradient torch's, at 2 and 4 threads (labels [N, H, W]).
    Without the flag the build says which axis it took for the classes."""
    path, module, inputs, dims = export("segmenter", exporter, training=True)
    graph = load_graph(path, dims)
    with pytest.warns(ExportNote, match="--class-axis 1"):
        plain = build_training_step(graph, BuildOptions(optimizer="none"))
    assert list(plain.info["labels"].shape) == [2, 4, 8]   # classes: the width, 8
    step = build_training_step(load_graph(path, dims),
                               BuildOptions(optimizer="none", class_axis=1))
    assert list(step.info["labels"].shape) == [2, 8, 8]
    feeds = _matches_torch(f"segmenter/{exporter}", step, module, inputs, labels=(2, 8, 8))
    _recompute_everything_gives_the_same_bits(step, feeds)


@pytest.mark.parametrize("exporter", ["torchscript", DYNAMO_NOOPT])
def test_segmenter_ignores_void_pixels_as_torch_does(exporter):
    """--ignore-index 255 (Pascal VOC's void pixels) with --class-axis 1: the loss is torch's
    ``cross_entropy(..., ignore_index=255)``, the mean over the other pixels, and every
    gradient torch's at 2 and 4 threads; the step records 255 for the data check. With
    every pixel void the loss is torch's nan and every gradient 0, as torch's are."""
    path, module, inputs, dims = export("segmenter", exporter, training=True)
    step = build_training_step(load_graph(path, dims),
                               BuildOptions(optimizer="none", class_axis=1, ignore_index=255))
    assert step.metadata["memcc.ignored_values"] == '{"labels": 255}'
    feeds = _matches_torch(f"segmenter/{exporter}", step, module, inputs, labels=(2, 8, 8),
                           ignore_index=255)
    assert (feeds["labels"] == 255).any() and (feeds["labels"] != 255).any()
    void = step_outputs(step, {**feeds, "labels": np.full((2, 8, 8), 255)}, "cpu")
    assert np.isnan(void["loss"])
    assert all(not np.any(v) for k, v in void.items() if k.endswith(".grad"))


def test_language_model_ignores_padded_labels_as_torch_does():
    """--ignore-index -100 (HuggingFace's padded labels) on GPT-2's logits [B, T, V]: loss
    and every gradient torch's ``cross_entropy`` over the flattened tokens with
    ``ignore_index=-100``, at 2 and 4 threads."""
    path, module, inputs, dims = export("gpt2", "torchscript", training=True)
    step = build_training_step(load_graph(path, dims),
                               BuildOptions(optimizer="none", ignore_index=-100))
    feeds = _matches_torch("gpt2/torchscript", step, module, inputs, labels=(2, 8),
                           ignore_index=-100)
    assert (feeds["labels"] == -100).sum() == 6


def _matches_torch(where: str, step, module: torch.nn.Module,
                   inputs: dict[str, np.ndarray],
                   labels: tuple[int, ...] = (2,), ignore_index: int | None = None
                   ) -> dict[str, np.ndarray]:
    """The step (one input and labels of 4 classes, batch 2; ``labels`` their shape)
    against the module in train mode at 2 and 4 threads, each run twice; returns the
    feeds. With ``ignore_index`` every third label is that value, and torch's loss ignores
    it; logits with their classes last ([B, T, V]) are flattened as torch's language models
    do, others keep their classes on axis 1."""
    labels = np.random.default_rng(0).integers(0, 4, size=labels).astype(np.int64)
    if ignore_index is not None:
        labels.reshape(-1)[::3] = ignore_index
    feeds = {**inputs, "labels": labels}
    runs = run_at_threads(step, feeds)
    m = copy.deepcopy(module)
    m.train(True)
    logits = m(**{k: torch.from_numpy(v) for k, v in inputs.items()})
    target = torch.from_numpy(labels)
    if logits.dim() > 2 and tuple(logits.shape[:-1]) == labels.shape:
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss = torch.nn.functional.cross_entropy(
        logits, target, ignore_index=-100 if ignore_index is None else ignore_index)
    loss.backward()
    for threads, out in runs.items():
        _assert_matches(f"{where} at {threads} threads", out, step, m, loss.item(),
                        bn_folded=False)
    return feeds


def _recompute_everything_gives_the_same_bits(step, feeds: dict[str, np.ndarray]):
    """The plan that recomputes every forward value it may: the step's bits; returns it."""
    st = StepStructure.of(step)
    planned = apply_recompute(step, Plan(frozenset(st.recomputable)), st).graph
    assert compare_outputs(step_outputs(step, feeds, "cpu"),
                           step_outputs(planned, feeds, "cpu"), exact=True) == []
    return planned


def _assert_matches(where: str, out: dict[str, np.ndarray], step, m: torch.nn.Module,
                    ref_loss: float, *, bn_folded: bool) -> None:
    assert abs(float(out["loss"]) - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss)), where
    tparams = {n: p.detach().numpy() for n, p in m.named_parameters() if p.grad is not None}
    tgrads = {n: p.grad.numpy() for n, p in m.named_parameters() if p.grad is not None}
    oparams = {k[: -len(".grad")]: step.initializers[k[: -len(".grad")]]
               for k in out if k.endswith(".grad")}
    groups = parameter_groups(oparams, tparams)
    floor = 1e-3 * max(float(np.abs(g).max()) for g in tgrads.values())
    covered: set[str] = set()
    for onnx_members, torch_members in groups:
        got = sum((out[f"{o}.grad"].T if tr else out[f"{o}.grad"]).astype(np.float64)
                  for o, tr in onnx_members)
        ref = sum(tgrads[t].astype(np.float64) for t in torch_members)
        err = float(np.abs(got - ref).max()) / max(float(np.abs(ref).max()), floor)
        assert err <= 1e-3, (f"{where}: grads of {[o for o, _ in onnx_members]} vs "
                             f"torch {torch_members}: relative error {err:.2e}")
        covered.update(torch_members)
    unmatched = set(tgrads) - covered
    if bn_folded:
        assert covered, f"{where}: no parameter of a BN-folded export could be matched"
    else:
        assert not unmatched, f"{where}: torch parameters without an ONNX gradient: " \
            f"{sorted(unmatched)}"


def _logits_name(step) -> str:
    for node in step.nodes:
        if node.op_type == "LogSoftmax" and node.output[0] == "logsoftmax":
            return node.input[0]
    raise AssertionError("no loss LogSoftmax found")
