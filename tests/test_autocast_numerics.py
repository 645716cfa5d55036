"""memcc's 16-bit steps (``build --precision bf16|fp16``) are as accurate as PyTorch autocast.

A 16-bit step cannot match an exact gradient to float32 tolerances; what it must do is lose
no more than PyTorch's own mixed precision loses. So every check here has three sides on
the same weights and batch: the exact reference (float64), PyTorch autocast, and memcc's
step (ORT CPU, with ``passes.providers.sixteen_bit`` computing in float32 between 16-bit
casts what ORT has no 16-bit kernel for). Per gradient, the error of each 16-bit side is
``rms(g - g64) / rms(g64)`` (``errors``); memcc must be within ``FACTOR`` of torch's
(``assert_as_accurate``):

    err_memcc <= FACTOR * err_torch + median over the model's tensors of err_torch

and the loss within ``FACTOR`` of torch's loss error plus one unit roundoff of the 16-bit
type. The median floor is at least two unit roundoffs of the 16-bit type: memcc rounds
every op of a decomposed elementwise chain (BERT's erf GELU: Div, Erf, Add, Mul, Mul) to
16-bit, where torch_reference, adding each bias in float32, carries that chain in float32
and torch itself runs GELU as one op that rounds once (zoo bert fp16: the first
intermediate bias 9.8e-4 in memcc, 2.2e-4 in torch_reference, with the fp16 roundoff
4.9e-4). Why this form, from the measurements (the sizes below, at 2 threads): the median
errors of memcc and torch agree within 1.6x on every family (gpt2 bf16 5.0e-3 vs 4.1e-3,
resnet18 bf16 0.47 vs 0.47: BatchNorm nets at init are ill-conditioned in 16-bit), and the
per-tensor ratio is at most 2.0 (mlp bf16 head.bias), but for two effects of rounding, not
of policy, that put single tensors further out:

- a 2x2 MaxPool window whose two largest inputs round in a different order in 16-bit sends
  the gradient to another element. vgg16 bf16 (seed 0): memcc's rounding reorders one of
  447 windows before the classifier that torch's does not, and that window carries the
  largest gradient element, so memcc's error on the last conv's weight is 0.28 where
  torch's is 0.15, and the difference propagates to every conv below it (median 2.5e-2 vs
  1.6e-2); the same conv's bias (the sum of the gradient, wherever it goes) has the same
  error, 0.17, on both sides. In fp16 the same happens in 1 of 400 windows at batch 2;
  batch 8 is used for vgg16 so that one window weighs less;
- torch_reference's Gemm adds the bias after a 16-bit product in float32 (promotion),
  where memcc casts the bias to 16-bit as ``torch.addmm`` and ``nn.Linear`` under autocast
  do: the classifier bias gradient of bert/vgg16 has error ~1e-6..1e-5 in torch_reference
  and ~2e-3 (one bf16 rounding) in memcc. Against a real ``nn.Linear`` (the exports) the
  ratio is 1.75 at most (BERT's pooler bias).

The median floor admits both (each is within the model's typical error) while a policy bug
that rounds more than torch does moves the median and most tensors at once: building the
fp16 steps with bfloat16 fails 7 of the 8 fp16 families. What this cannot see on ORT CPU:
whether a softmax or a norm computes in 16-bit or float32, since ORT CPU has no 16-bit
kernel for them and ``sixteen_bit`` computes them in float32 either way; the policy only
decides whether the output is rounded once more, within torch's noise (removing Softmax,
LayerNormalization, ReduceMean and Pow from ``autocast.FLOAT32`` passes here). The CUDA
provider, with 16-bit kernels, is where that shows.

The loss uses at most 0.5 of its allowance (mobilenetv2, resnet50), a tensor at most 0.69
(bert fp16, the GELU chain above), with ``FACTOR`` 2.

Torch's CPU autocast lists differ from CUDA's, which memcc follows: on CPU, softmax,
log_softmax, layer_norm, exp, sum, mean and pow run in the input's 16-bit type (torch 2.13,
``test_torch_cpu_autocast_keeps_softmax_in_16_bit`` pins it), where CUDA's autocast and
memcc compute them in float32. In the zoo models the difference rarely shows: the
interpreter's float32 bias add after each product brings values back to float32 first.

Every memcc step runs twice at 1 and at 2 intra-op threads (``threads.run_at_threads``):
the runs of one count must agree bit for bit, and each count must pass the criterion.
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import onnx
import pytest
import torch
from exports import export
from test_exports_grad import parameter_groups
from threads import run_at_threads
from torch_reference import torch_loss_and_grads

import memcc
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.providers.provider_step import for_provider
from models import MODELS, build_model, make_feeds, make_labels

TORCH_TYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Unit roundoff of each 16-bit type: the loss floor.
ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
FACTOR = 2.0


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """torch at one thread: on a loaded 2-core machine its two OpenMP threads spin against
    ORT's, and the tiny torch models of this file run 20x slower (0.2 s per BERT step)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def errors(got: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> dict[str, float]:
    """Per tensor ``rms(got - ref) / rms(ref)``, the scale floored at 1e-3 of the largest
    rms of the model: a bias before a BatchNorm or a LayerNorm-free attention's key bias has
    an exact gradient of 0, where any rounding would be an infinite relative error."""
    rms = {k: float(np.sqrt(np.mean(np.square(r, dtype=np.float64)))) for k, r in ref.items()}
    floor = 1e-3 * max(rms.values())
    return {k: float(np.sqrt(np.mean(np.square(got[k].astype(np.float64) - ref[k]))))
            / max(rms[k], floor) for k in ref}


def assert_as_accurate(where: str, precision: str, memcc_side: tuple[float, dict],
                       torch_side: tuple[float, dict], exact: tuple[float, dict]) -> None:
    """memcc's (loss, grads) within the module docstring's criterion of torch's, both
    measured against ``exact``."""
    (lm, gm), (lt, gt), (lx, gx) = memcc_side, torch_side, exact
    assert set(gm) == set(gx), (where, sorted(set(gm) ^ set(gx)))
    loss_floor = ROUNDOFF[precision] * max(1.0, abs(lx))
    assert abs(lm - lx) <= FACTOR * abs(lt - lx) + loss_floor, (
        f"{where}: loss {lm:.6g}, torch autocast {lt:.6g}, exact {lx:.6g}")
    em, et = errors(gm, gx), errors(gt, gx)
    typical = max(float(np.median(list(et.values()))), 2 * ROUNDOFF[precision])
    bad = {k: f"{em[k]:.2e} vs torch {et[k]:.2e}" for k in gx
           if not em[k] <= FACTOR * et[k] + typical}
    assert not bad, f"{where}: gradients less accurate than torch autocast " \
        f"(median torch error {typical:.2e}): {bad}"
    assert np.median(list(em.values())) <= FACTOR * typical, where


def _autocast(precision: str | None) -> torch.autocast:
    """``torch.autocast("cpu", ...)`` to ``precision``; disabled for None."""
    if precision is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=TORCH_TYPES[precision])


def sixteen_bit_step(model: onnx.ModelProto | str, precision: str,
                     dims: dict[str, int] | None = None, **options) -> Graph:
    """The step as ``memcc run`` runs it on the CPU provider. Without loss scaling: the
    gradients of one step are compared with torch autocast's, which has none (a float16
    step scales by default, and its first scale of 65536 overflows some gradients, which
    the scaled step would skip: tests/test_loss_scaling.py)."""
    options = {"loss_scale": "none", **options}
    step = build_training_step(load_graph(model, dims) if dims else load_graph(model),
                               BuildOptions(precision=precision, **options))
    return for_provider(step, "cpu")[0]


# --------------------------------------------------------------------------- (a) the zoo
# Smaller images where the default is slow in torch's CPU 16-bit convolutions.
ZOO_OPTIONS = {"resnet50": {"width": 8}, "mobilenetv2": {"resolution": 32}, "vgg16": {"batch": 8}}


@functools.cache
def _zoo(family: str) -> tuple[onnx.ModelProto, dict, np.ndarray, tuple[float, dict]]:
    model = build_model(family, **ZOO_OPTIONS.get(family, {}))
    feeds, labels = make_feeds(model, seed=0), make_labels(model, seed=0)
    exact = torch_loss_and_grads(model, feeds, labels=labels, double=True)
    return model, feeds, labels, exact


@pytest.mark.parametrize("precision", sorted(TORCH_TYPES))
@pytest.mark.parametrize("family", sorted(MODELS))
def test_zoo_step_as_accurate_as_torch_autocast(family, precision):
    model, feeds, labels, exact = _zoo(family)
    with torch.autocast("cpu", dtype=TORCH_TYPES[precision]):
        torch_side = torch_loss_and_grads(model, feeds, labels=labels)
    step = sixteen_bit_step(model, precision, optimizer="none")
    for threads, out in run_at_threads(step, {**feeds, "labels": labels},
                                       threads=(1, 2)).items():
        grads = {k[: -len(".grad")]: v for k, v in out.items() if k.endswith(".grad")}
        assert_as_accurate(f"{family} {precision} at {threads} threads", precision,
                           (float(out["loss"]), grads), torch_side, exact)


def test_torch_cpu_autocast_keeps_softmax_in_16_bit():
    """The fact the module docstring states about torch's CPU lists (CUDA's differ)."""
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ x.T
        assert h.dtype == torch.bfloat16
        assert torch.softmax(h, -1).dtype == torch.bfloat16
        assert torch.nn.functional.layer_norm(h, (4,)).dtype == torch.bfloat16
        assert torch.exp(h).dtype == torch.bfloat16


# --------------------------------------------------------------------------- (b) exports
EXPORTS = [("gpt2", "dynamo", False), ("bert", "torchscript", False),
           ("convnet", "torchscript", True)]


def _module_grads(module: torch.nn.Module, inputs: dict[str, np.ndarray], labels: np.ndarray,
                  n_classes: int, *, double: bool = False, precision: str | None = None
                  ) -> tuple[float, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The torch module's own loss and parameter gradients: in float64 (``double``), or
    under ``torch.autocast("cpu", precision)``; and the float32 parameter values."""
    m = copy.deepcopy(module)
    values = {n: p.detach().numpy().copy() for n, p in m.named_parameters()}
    if double:
        m = m.double()
    feeds = {k: torch.from_numpy(v) for k, v in inputs.items()}
    if double:
        feeds = {k: v.double() if v.is_floating_point() else v for k, v in feeds.items()}
    with _autocast(precision):
        logits = m(**feeds).reshape(-1, n_classes)
        loss = torch.nn.functional.cross_entropy(logits if double else logits.float(),
                                                 torch.from_numpy(labels).reshape(-1))
    loss.backward()
    grads = {n: p.grad.double().numpy() for n, p in m.named_parameters() if p.grad is not None}
    return float(loss), grads, {n: values[n] for n in grads}


@pytest.mark.parametrize("family,exporter,training", EXPORTS)
def test_export_bf16_step_as_accurate_as_torch_autocast(family, exporter, training):
    path, module, inputs, dims = export(family, exporter, training=training)
    step = sixteen_bit_step(str(path), "bf16", dims, optimizer="none")
    n_classes = int(step.info[_logits_name(step)].shape[-1])
    labels = np.random.default_rng(0).integers(0, n_classes, size=step.info["labels"].shape)
    exact_loss, exact, tvalues = _module_grads(module, inputs, labels, n_classes, double=True)
    torch_loss, tgrads, _ = _module_grads(module, inputs, labels, n_classes, precision="bf16")
    groups = parameter_groups(
        {k: step.initializers[k] for k in (n[: -len(".grad")] for n in step.outputs
                                           if n.endswith(".grad"))}, tvalues)
    runs = run_at_threads(step, {**inputs, "labels": labels}, threads=(1, 2))
    for threads, out in runs.items():
        # Per group of ONNX copies of one torch parameter: the sum of their gradients.
        got = {"+".join(t): sum((out[f"{o}.grad"].T if tr else out[f"{o}.grad"])
                                for o, tr in onnx_members)
               for onnx_members, t in groups}
        assert len(got) >= 0.9 * len(exact), (family, len(got), len(exact))
        assert_as_accurate(f"{family}/{exporter} bf16 at {threads} threads", "bf16",
                           (float(out["loss"]), got),
                           (torch_loss, _by_group(tgrads, groups)),
                           (exact_loss, _by_group(exact, groups)))


def _by_group(grads: dict[str, np.ndarray], groups: list) -> dict[str, np.ndarray]:
    """Torch gradients summed per group of ``parameter_groups``, keyed as the test keys
    the ONNX side."""
    return {"+".join(t): sum(grads[n] for n in t) for _, t in groups}


def _logits_name(step: Graph) -> str:
    for node in step.nodes:
        if node.op_type == "LogSoftmax" and node.output[0] == "logsoftmax":
            return node.input[0]
    raise AssertionError("no loss LogSoftmax found")


# --------------------------------------------------------------------------- (c) training
def torch_sgd_curve(module: torch.nn.Module, batches: list[dict[str, np.ndarray]],
                    n_classes: int, lr: float, precision: str | None) -> list[float]:
    """Losses of one SGD step (momentum 0.9, as memcc's ``sgd``) per batch of the torch
    module, under ``torch.autocast("cpu", precision)`` when given."""
    m = copy.deepcopy(module)
    opt = torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9)
    losses = []
    for batch in batches:
        feeds = {k: torch.from_numpy(v) for k, v in batch.items() if k != "labels"}
        with _autocast(precision):
            loss = torch.nn.functional.cross_entropy(
                m(**feeds).reshape(-1, n_classes).float(),
                torch.from_numpy(batch["labels"]).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def memcc_sgd_curve(path: str, dims: dict[str, int], batches: list[dict[str, np.ndarray]],
                    lr: float, precision: str, tmp_path) -> list[float]:
    """Losses of the same steps through ``memcc.Trainer`` on the step built from ``path``."""
    step = build_training_step(load_graph(path, dims), BuildOptions(
        precision=precision, optimizer="sgd", lr=lr, momentum=0.9, weight_decay=0.0))
    out = tmp_path / f"step-{precision}.onnx"
    onnx.save(step.to_model(), str(out))
    trainer = memcc.Trainer(out, threads=2)
    return [trainer.step(batch) for batch in batches]


def curve_gap(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two loss curves, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


TRAIN_STEPS = 20


def test_bf16_training_curve_tracks_torch_autocast(tmp_path):
    """20 SGD steps of the BERT export on one batch (the loss falls from 1.09 to 0.006):
    memcc's bf16 curve stays within ``FACTOR`` of torch autocast's distance from its own
    float32 curve (largest relative difference per step, measured: memcc bf16 vs torch
    bf16 7.2e-3, torch bf16 vs torch fp32 1.5e-2), and memcc's float32 curve matches
    torch's (1.4e-5). Longer runs (benchmarks/precision_steps.py, 200 steps over 8
    batches) are chaotic once batches are memorised: which 16-bit curve stays nearer
    float32 changes with the seed (seed 0: torch; 1 and 2: memcc), so this test stays
    short."""
    path, module, inputs, dims = export("bert", "torchscript")
    n_classes = 3
    labels = np.random.default_rng(0).integers(0, n_classes, size=(2,))
    batches = [{**inputs, "labels": labels.astype(np.int64)}] * TRAIN_STEPS
    lr = 0.03
    torch32 = torch_sgd_curve(module, batches, n_classes, lr, None)
    torch16 = torch_sgd_curve(module, batches, n_classes, lr, "bf16")
    memcc32 = memcc_sgd_curve(str(path), dims, batches, lr, "fp32", tmp_path)
    memcc16 = memcc_sgd_curve(str(path), dims, batches, lr, "bf16", tmp_path)
    assert curve_gap(memcc32, torch32) <= 1e-4, (memcc32, torch32)
    assert torch16[-1] < 0.1 * torch16[0], torch16  # the curve moves
    context = curve_gap(torch16, torch32)
    assert curve_gap(memcc16, torch16) <= FACTOR * context + ROUNDOFF["bf16"], (
        memcc16, torch16, torch32)


def test_constant_node_scalars_do_not_vote():
    """A Div by a scalar from a ``Constant`` node (the zoo GPT-2's attention scale) and a
    Where with a constant fill stay 16-bit, as a Div by an initializer does (autocast's
    policy: constants follow the activations). They were float32, which held GPT-2's
    attention scores in float32 at the bf16 step's peak."""
    step = build_training_step(load_graph(build_model("gpt2")),
                               BuildOptions(precision="bf16", optimizer="none"))
    produced = {o: n for n in step.nodes for o in n.output}
    for name, op in (("h.0.attn.scaled", "Div"), ("h.0.attn.masked", "Where")):
        assert produced[name].op_type == op
        assert step.info[name].dtype == onnx.TensorProto.BFLOAT16, name
