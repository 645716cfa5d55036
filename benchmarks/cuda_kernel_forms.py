"""Which ONNX forms of BatchNorm's per-channel sums run fastest under ORT (issue 30)?

memcc writes training-mode BatchNormalization and its backward in standard ops
(``memcc/passes/providers/batchnorm_for_cuda.py`` for the forward on CUDA, the gradient rule in
``memcc/frontend/gradients/nn.py`` for the backward), and on CUDA every per-channel sum
(axes 0, 2, 3 of NCHW) becomes a Transpose to channels-first and a trailing-axis sum
(``memcc/passes/providers/deterministic_reductions.py``): ORT's CUDA reduction over leading axes
adds
with atomics. The Transpose copies a whole activation per sum. This script times the
alternatives one against another, each as a small ONNX model (opset 17) run by ORT under
memcc's execution contract (``memcc.backend.session.make_session``), so that memcc's
defaults can follow a measurement:

1. ``sum``: x [N,C,H,W] -> [C], six ways (``sum_forms``);
2. ``bn_forward``: batch statistics, normalisation and running statistics, the way
   ``batchnorm_for_cuda`` writes them (with and without its reduction rewrite), with the
   sums in the two-stage form of 1(c), and one-pass E[x], E[x^2];
3. ``bn_backward``: memcc's gradient rule exactly as emitted (the rule is called on one
   training-mode BatchNormalization), after ``for_provider(..., "cuda")``, with the sums in
   the two-stage form, with the variance as a sum of squares, and from saved statistics;
4. ``matmul``: Transpose + MatMul against com.microsoft FusedMatMul at a GPT-2
   attention-backward and a linear-layer-backward shape (on CUDA every form with a MatMul,
   the sum's ones-vector form too, also with the provider option ``use_tf32=0``: ORT lets
   cuBLAS use TF32 by default and memcc does not say otherwise);
5. ``torch`` (CUDA, when torch with CUDA imports): PyTorch's BatchNorm forward and
   forward + backward on the same data, TF32 off, cuDNN, as the target.

Every form's inputs are bound once (IOBinding; on CUDA as device OrtValues, shared by every
form of a shape) and its outputs to preallocated device buffers, so no host copy is timed;
``run_with_iobinding`` returns after ORT synchronised the stream, and
``synchronize_outputs`` is called inside the timed region too. The forms of one shape run
interleaved, in a fresh random order every round (``benchmarks.stats.interleaved_times``);
each form reports the median over rounds, the spread (10th to 90th percentile), the median
less the time ORT takes to run a one-node model on a 1-element tensor (``floor``: the fixed
cost of one run, which no form avoids), the largest relative error of any output against a
float64 reference (max |out - ref| / max |ref|, per output; computed by torch on the GPU
where it can, else numpy), and whether ``--det-runs`` more runs gave the same bits.
``fastest`` is the fastest form whose error is within ``--tol``, ``fastest_deterministic``
the fastest that also gave the same bits every run, and ``speedup_vs_default`` how much
faster that one is than the form memcc writes on CUDA today (``DEFAULT_FORM``); a summary
table lists those per case. A form ORT cannot load or run becomes a row with its error, and
``--budget-s`` stops starting new shapes (the rest are listed as skipped), so one GPU call
always returns a result; ``kernel_forms.json`` is rewritten after every case.

    python benchmarks/cuda_kernel_forms.py --out $OUT                     # GPU machine
    python benchmarks/cuda_kernel_forms.py --provider cpu --medium --rounds 15
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
import onnxruntime as ort  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from benchmarks.node_counts import statistics_by_reductions  # noqa: E402
from benchmarks.stats import interleaved_times  # noqa: E402
from memcc.backend.session import SessionSettings, cuda_available, make_session, resolve_provider  # noqa: E402
from memcc.errors import MemccError  # noqa: E402
from memcc.frontend.emit import Emitter  # noqa: E402
from memcc.frontend.gradients import batchnorm_backward, load_rules  # noqa: E402
from memcc.frontend.gradients.nn import Normalised, batchnorm_train_backward  # noqa: E402
from memcc.frontend.gradients.registry import RULES, GradContext  # noqa: E402
from memcc.graph import Graph, TensorInfo  # noqa: E402
from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm  # noqa: E402
from memcc.passes.providers.deterministic_reductions import (  # noqa: E402
    per_channel,
    reduced_axes,
    to_trailing_axes,
)

F32 = TensorProto.FLOAT
EPS = 1e-5
MOMENTUM = 0.9
GROUPS = ("sum", "bn_forward", "bn_backward", "matmul", "torch")
# ResNet-50's BatchNorm inputs at 224 px, per sample (C, H, W), most frequent kinds first
# (each stage's block outputs, then its expansion at the stem's size): the batch is --batch.
RESNET50_BN = [(256, 56, 56), (1024, 14, 14), (512, 28, 28), (2048, 7, 7), (64, 112, 112)]
PRESETS = {
    "full": {"batch": 184, "bn": RESNET50_BN, "attention": (8, 12, 1024, 64),
             "linear": (8192, 768, 3072)},
    "medium": {"batch": 16, "bn": RESNET50_BN, "attention": (2, 12, 512, 64),
               "linear": (2048, 768, 3072)},
    "quick": {"batch": 4, "bn": [(8, 12, 12), (32, 5, 5)],
              "attention": (1, 2, 32, 16), "linear": (64, 24, 48)},
}
DEVICE = {"cuda": "cuda", "cpu": "cpu"}


# ---------------------------------------------------------------------------- model building
def new_graph(inputs: dict[str, tuple[int, ...]], *, ms_domain: bool = False) -> Graph:
    """An empty opset-17 graph with float32 ``inputs`` (name -> shape)."""
    opsets = {"": 17, "com.microsoft": 1} if ms_domain else {"": 17}
    return Graph(nodes=[], inputs=list(inputs), outputs=[], initializers={},
                 info={k: TensorInfo(F32, tuple(s)) for k, s in inputs.items()},
                 opsets=opsets, name="kernel_form")


def finish(g: Graph, outputs: list[str]) -> Graph:
    g.outputs = list(outputs)
    return g


def _reduce(emit: Emitter, op: str, x: str, axis: int, out: str | None = None) -> str:
    """``op`` over one axis, keepdims=0, axes spelled as opset 17 wants them."""
    src = emit.info(x)
    info = TensorInfo(src.dtype, tuple(d for i, d in enumerate(src.shape) if i != axis))
    outputs: list[str] | int = [out] if out else 1
    if op == "ReduceSum":  # axes an input since opset 13, an attribute for the others
        return emit.op(op, [x, emit.ints([axis])], outputs=outputs, keepdims=0, info=info)
    return emit.op(op, [x], outputs=outputs, axes=[axis], keepdims=0, info=info)


def two_stage_sum(emit: Emitter, x: str, op: str = "ReduceSum", final: str = "ReduceSum",
                  out: str | None = None) -> str:
    """x [N,C,H,W] -> [C] without copying x: Reshape [N,C,HW] (free), ``op`` over the
    trailing axis -> [N,C], Transpose of that small tensor -> [C,N], ``final`` over N."""
    n, c, h, w = emit.info(x).shape
    x3 = emit.reshape(x, [n, c, h * w])
    t = emit.transpose(_reduce(emit, op, x3, 2), [1, 0])
    return _reduce(emit, final, t, 1, out)


def transpose_form(graph: Graph) -> Graph:
    """``graph``'s per-channel sums as a Transpose and a trailing-axis sum: what
    ``for_provider(.., "cuda")`` wrote until its two-stage sums (``per_channel_sums``), kept
    as the reference the other forms are timed against."""
    return to_trailing_axes(graph, only=per_channel)[0]


def sum_forms(shape: tuple[int, ...]) -> dict[str, tuple[str, Graph]]:
    """Per-channel sum of x [N,C,H,W] -> [C], each form a model from x to ``s``."""
    n, c, h, w = shape
    forms: dict[str, tuple[str, Graph]] = {}

    g = new_graph({"x": shape})
    e = Emitter(g)
    e.op("ReduceSum", ["x", e.ints([0, 2, 3])], outputs=["s"], keepdims=0,
         info=TensorInfo(F32, (c,)))
    leading = finish(g, ["s"])
    forms["a_leading"] = ("ReduceSum axes (0,2,3): ORT's CUDA fast path adds with atomics",
                          leading)
    forms["b_transpose"] = ("Transpose(1,0,2,3) + ReduceSum over trailing axes "
                            "(memcc's CUDA form until 2026-11-27: "
                            "deterministic_reductions.to_trailing_axes)",
                            transpose_form(leading))

    g = new_graph({"x": shape})
    e = Emitter(g)
    two_stage_sum(e, "x", out="s")
    forms["c_two_stage"] = ("Reshape [N,C,HW] + ReduceSum(2) -> [N,C] + Transpose -> [C,N] "
                            "+ ReduceSum(1)", finish(g, ["s"]))

    g = new_graph({"x": shape})
    e = Emitter(g)
    s = e.reduce_sum(e.reshape("x", [n, c, h * w]), [2], keepdims=False)
    e.op("ReduceSum", [s, e.ints([0])], outputs=["s"], keepdims=0,
         info=TensorInfo(F32, (c,)))
    forms["c2_two_stage_leading"] = ("Reshape [N,C,HW] + ReduceSum(2) -> [N,C] + ReduceSum(0)"
                                     " (a small leading-axis sum, no Transpose)",
                                     finish(g, ["s"]))

    g = new_graph({"x": shape})
    e = Emitter(g)
    e.op("ReduceSum", [e.reshape("x", [n, c, h * w]), e.ints([0, 2])], outputs=["s"],
         keepdims=0, info=TensorInfo(F32, (c,)))
    forms["d_reshape_02"] = ("Reshape [N,C,HW] + ReduceSum axes (0,2)", finish(g, ["s"]))

    g = new_graph({"x": shape})
    e = Emitter(g)
    rows = e.reshape("x", [n * c, h * w])
    col = e.op("MatMul", [rows, e.const(np.ones((h * w, 1), np.float32), name="ones_hw")],
               info=TensorInfo(F32, (n * c, 1)))
    per_sample = e.reshape(col, [n, c])
    row = e.op("MatMul", [e.const(np.ones((1, n), np.float32), name="ones_n"), per_sample],
               info=TensorInfo(F32, (1, c)))
    e.op("Reshape", [row, e.ints([c])], outputs=["s"], info=TensorInfo(F32, (c,)))
    forms["e_matmul"] = ("Reshape [N*C,HW] MatMul ones[HW,1] -> [N,C]; ones[1,N] MatMul "
                         "-> [C] (cuBLAS GEMV; TF32 if the provider allows it)",
                         finish(g, ["s"]))
    return forms


def bn_node() -> onnx.NodeProto:
    return helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean_in", "var_in"],
                            ["y", "running_mean", "running_var"], name="bn", epsilon=EPS,
                            momentum=MOMENTUM, training_mode=1)


def bn_stat_inputs(c: int) -> dict[str, tuple[int, ...]]:
    return {"scale": (c,), "bias": (c,), "mean_in": (c,), "var_in": (c,)}


def per_channel_reduction(graph: Graph, node: onnx.NodeProto, producers) -> bool:
    """ReduceSum/Mean/SumSquare over axes 0, 2, 3 of a 4-d tensor (BatchNorm's sums)."""
    if node.op_type not in ("ReduceSum", "ReduceMean", "ReduceSumSquare"):
        return False
    info = graph.info.get(node.input[0])
    if info is None or len(info.shape) != 4:
        return False
    return reduced_axes(graph, node, 4, producers) == [0, 2, 3]


def to_two_stage(graph: Graph, *, square_mean: bool = False) -> Graph:
    """A copy of ``graph`` with every per-channel reduction in the two-stage form of
    ``two_stage_sum`` (ReduceMean as a mean of means, ReduceSumSquare's second stage a
    ReduceSum). ``square_mean``: a ReduceMean of Mul(a, a) whose product has no other reader
    (the variance in memcc's backward rule) becomes ReduceSumSquare of ``a`` over the count,
    which drops one activation-sized Mul."""
    out = graph.copy()
    producers = out.producers()
    consumers = out.consumers()
    emit = Emitter(out, detached=True, prefix="two_stage/")
    dropped: set[str] = set()
    squared: dict[str, str] = {}  # ReduceMean output -> the value it squares
    if square_mean:
        for node in out.nodes:
            if node.op_type != "ReduceMean" or not per_channel_reduction(out, node, producers):
                continue
            mul = producers.get(node.input[0])
            if (mul is not None and mul.op_type == "Mul" and mul.input[0] == mul.input[1]
                    and len(consumers.get(mul.output[0], [])) == 1):
                squared[node.output[0]] = mul.input[0]
                dropped.add(mul.output[0])
    nodes: list[onnx.NodeProto] = []
    for node in out.nodes:
        if node.output and node.output[0] in dropped:
            continue
        if not per_channel_reduction(out, node, producers):
            nodes.append(node)
            continue
        start = len(emit.nodes)
        y_info = out.info[node.output[0]]
        if node.output[0] in squared:
            src = squared[node.output[0]]
            n, _, h, w = out.info[src].shape
            r = two_stage_sum(emit, src, "ReduceSumSquare", "ReduceSum")
            r = emit.mul(r, emit.scalar(1.0 / (n * h * w), F32))
        else:
            final = "ReduceSum" if node.op_type == "ReduceSumSquare" else node.op_type
            r = two_stage_sum(emit, node.input[0], node.op_type, final)
        emit.op("Reshape", [r, emit.ints(list(y_info.shape))], outputs=[node.output[0]],
                info=y_info)
        nodes.extend(emit.nodes[start:])
    out.set_nodes(nodes)
    return out


def bn_forward_forms(shape: tuple[int, ...]) -> dict[str, tuple[str, Graph]]:
    """Training-mode BatchNorm forward: y, running mean and running variance."""
    n, c, h, w = shape
    g = new_graph({"x": shape, **bn_stat_inputs(c)})
    g.nodes.append(bn_node())
    g.info.update(y=TensorInfo(F32, shape), running_mean=TensorInfo(F32, (c,)),
                  running_var=TensorInfo(F32, (c,)))
    original = finish(g, ["y", "running_mean", "running_var"])
    expanded, _ = expand_training_batchnorm(original)
    forms = {
        "a_leading": ("memcc's expansion (ReduceMean, Sub, ReduceSumSquare, Mul, "
                      "BatchNormalization in inference mode) with leading-axis reductions",
                      expanded),
        "b_transpose": ("the same with each statistic through a Transpose (memcc's CUDA "
                        "form until 2026-11-27)", transpose_form(expanded)),
        "c_two_stage": ("the same with the sums in the two-stage form (sum c)",
                        to_two_stage(expanded)),
    }
    # One pass: E[x] and E[x^2] from x itself (no centred copy), var = E[x^2] - E[x]^2.
    g = new_graph({"x": shape, **bn_stat_inputs(c)})
    e = Emitter(g)
    count = float(n * h * w)
    inv_count = e.scalar(1.0 / count, F32)
    mean = e.mul(two_stage_sum(e, "x"), inv_count)
    mean_sq = e.mul(two_stage_sum(e, "x", "ReduceSumSquare", "ReduceSum"), inv_count)
    var = e.sub(mean_sq, e.mul(mean, mean))
    e.op("BatchNormalization", ["x", "scale", "bias", mean, var], outputs=["y"], epsilon=EPS,
         info=TensorInfo(F32, shape))
    for out, running, batch in (("running_mean", "mean_in", mean),
                                ("running_var", "var_in", var)):
        kept = e.mul(running, e.scalar(MOMENTUM, F32))
        e.op("Add", [kept, e.mul(batch, e.scalar(1.0 - MOMENTUM, F32))], outputs=[out],
             info=TensorInfo(F32, (c,)))
    forms["d_one_pass"] = ("one pass: two-stage sums of x and of x^2, var = E[x^2] - E[x]^2 "
                           "(no centred copy; cancels when |mean| >> std)",
                           finish(g, ["y", "running_mean", "running_var"]))
    return forms


def _backward_graph(shape: tuple[int, ...], *, saved_stats: bool) -> Graph:
    """memcc's gradient rule for one training-mode BatchNormalization, called as autodiff
    calls it, with gy as an input; ``saved_stats``: the shared tail
    (``batchnorm_train_backward``) fed the batch mean and 1/std as inputs instead of
    recomputing them from x (what the forward could keep: 2 x C floats)."""
    load_rules()
    n, c, h, w = shape
    inputs = {"x": shape, "gy": shape, **bn_stat_inputs(c)}
    if saved_stats:
        inputs.update(batch_mean=(1, c, 1, 1), batch_inv_std=(1, c, 1, 1))
    g = new_graph(inputs)
    g.info.update(y=TensorInfo(F32, shape), running_mean=TensorInfo(F32, (c,)),
                  running_var=TensorInfo(F32, (c,)))
    node = bn_node()
    emit = Emitter(g, prefix="grad/")
    ctx = GradContext(graph=g, emit=emit, requires_grad={"x", "scale", "bias", "y"})
    if saved_stats:
        xhat = emit.mul(emit.sub("x", "batch_mean"), "batch_inv_std")
        grads = batchnorm_train_backward(ctx, node, "gy", Normalised(xhat, "batch_inv_std"),
                                         [0, 2, 3], float(n * h * w))
    else:
        # The statistics from reductions of x, as the CUDA rewrite writes the rule's
        # training-mode statistics node where it cannot read the forward's.
        with mock.patch.object(batchnorm_backward, "_normalised", statistics_by_reductions):
            grads = RULES["BatchNormalization"](ctx, node, ["gy", None, None])
    names = ["gx", "gscale", "gbias"]
    for value, name in zip(grads[:3], names, strict=True):  # renamed: no Identity copies
        g.info[name] = g.info[value]
        for n_ in g.nodes:
            for k, v in enumerate(n_.output):
                if v == value:
                    n_.output[k] = name
            for k, v in enumerate(n_.input):
                if v == value:
                    n_.input[k] = name
    return finish(g, names)


def bn_backward_forms(shape: tuple[int, ...]) -> dict[str, tuple[str, Graph]]:
    """BatchNorm's input, scale and bias gradients from x, gy and the scale."""
    rule = _backward_graph(shape, saved_stats=False)
    saved = _backward_graph(shape, saved_stats=True)
    return {
        "a_leading": ("memcc's rule with the statistics recomputed from x by reductions "
                      "(leading-axis reductions)", rule),
        "b_transpose": ("the same with each sum through a Transpose (memcc's CUDA form "
                        "until 2026-11-27)", transpose_form(rule)),
        "c_two_stage": ("the same with every sum in the two-stage form (sum c)",
                        to_two_stage(rule)),
        "d_two_stage_sumsq": ("c, and the variance as ReduceSumSquare(centred) / count "
                              "instead of ReduceMean(Mul(centred, centred))",
                              to_two_stage(rule, square_mean=True)),
        "e_saved_stats": ("the rule's tail fed the batch mean and 1/std as inputs (no "
                          "recomputed statistics), sums two-stage", to_two_stage(saved)),
    }


def matmul_forms(kind: str, dims: tuple[int, ...]) -> dict[str, tuple[str, Graph]]:
    """``attention``: A [B,H,S,D] x B [B,H,S,D]^T; ``linear``: A [M,K]^T x B [M,N]."""
    if kind == "attention":
        b, hh, s, d = dims
        a_shape = b_shape = (b, hh, s, d)
        out_shape = (b, hh, s, s)
        perm, trans = [0, 1, 3, 2], {"transB": 1}
        transposed = "B"
    else:
        m, k, n = dims
        a_shape, b_shape, out_shape = (m, k), (m, n), (k, n)
        perm, trans = [1, 0], {"transA": 1}
        transposed = "A"
    forms = {}
    g = new_graph({"A": a_shape, "B": b_shape})
    e = Emitter(g)
    t = e.transpose(transposed, perm)
    e.op("MatMul", [t, "B"] if transposed == "A" else ["A", t], outputs=["Y"],
         info=TensorInfo(F32, out_shape))
    forms["a_transpose_matmul"] = (f"Transpose {perm} of {transposed} + MatMul",
                                   finish(g, ["Y"]))
    g = new_graph({"A": a_shape, "B": b_shape}, ms_domain=True)
    e = Emitter(g)
    e.op("FusedMatMul", ["A", "B"], outputs=["Y"], alpha=1.0,
         info=TensorInfo(F32, out_shape), **trans)
    e.nodes[-1].domain = "com.microsoft"  # the Emitter writes the standard domain only
    forms["b_fused_matmul"] = (f"com.microsoft FusedMatMul({', '.join(f'{k}=1' for k in trans)})",
                               finish(g, ["Y"]))
    return forms


# ---------------------------------------------------------------------------- references
@dataclass
class Case:
    """One shape of one group: its inputs, the float64 reference outputs, its forms."""

    group: str
    shape: list
    inputs: dict[str, np.ndarray]
    reference: dict[str, np.ndarray]
    forms: dict[str, tuple[str, Graph]] = field(default_factory=dict)
    # CUDA provider options per form, on top of memcc's (``provider_options``)
    options: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: bool = False  # over --budget-s: no data or reference computed

    def with_tf32_twins(self, provider: str) -> Case:
        """On CUDA, each form with a MatMul once more with ``use_tf32=0``: ORT's CUDA
        provider lets cuBLAS round float32 MatMul inputs to TF32 unless told not to, and
        memcc's provider options do not say; the twin shows what full float32 costs."""
        if provider != "cuda":
            return self
        for name, (desc, graph) in list(self.forms.items()):
            if any(n.op_type in ("MatMul", "FusedMatMul") for n in graph.nodes):
                self.forms[f"{name}_tf32_off"] = (f"{desc}; CUDA option use_tf32=0", graph)
                self.options[f"{name}_tf32_off"] = {"use_tf32": "0"}
        return self


def bn_data(shape: tuple[int, ...], seed: int) -> dict[str, np.ndarray]:
    """x with per-channel means in [-2, 2] (what a convolution hands BatchNorm is not
    centred; the one-pass variance pays for that), gy, and the BatchNorm parameters."""
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = rng.standard_normal(shape, dtype=np.float32)
    x += rng.uniform(-2, 2, (1, c, 1, 1)).astype(np.float32)
    return {"x": x, "gy": rng.standard_normal(shape, dtype=np.float32),
            "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
            "bias": rng.uniform(-0.5, 0.5, c).astype(np.float32),
            "mean_in": rng.uniform(-0.1, 0.1, c).astype(np.float32),
            "var_in": rng.uniform(0.9, 1.1, c).astype(np.float32)}


def reference_backend(provider: str) -> tuple[Callable, Callable, str]:
    """(to float64, back to numpy, name): torch float64 on the GPU where the provider is
    CUDA and torch has it (the float64 reference of a [184, 256, 56, 56] step takes
    seconds in numpy on one core), else numpy."""
    if provider == "cuda" and torch_cuda_ready():
        import torch

        return (lambda a: torch.from_numpy(a).to("cuda", torch.float64),
                lambda t: t.cpu().numpy(), "torch float64 on cuda")
    return (lambda a: a.astype(np.float64)), (lambda a: a), "numpy float64"


def bn_reference(d: dict[str, np.ndarray], to64: Callable = lambda a: a.astype(np.float64),
                 back: Callable = lambda a: a) -> dict[str, np.ndarray]:
    """Forward and backward of training-mode BatchNorm in float64 (ONNX's definition: the
    biased variance, also for the running statistic, as memcc and ORT's CPU kernel do).
    Written in the operations numpy arrays and torch tensors share (``reference_backend``).
    """
    x, gy = to64(d["x"]), to64(d["gy"])
    view = (1, -1, 1, 1)
    axes = (0, 2, 3)
    gamma = to64(d["scale"]).reshape(view)
    mean = x.mean(axis=axes)
    centred = x - mean.reshape(view)
    var = (centred * centred).mean(axis=axes)
    inv = 1.0 / (var + EPS) ** 0.5
    xhat = centred * inv.reshape(view)
    del centred
    count = float(d["x"].size // d["x"].shape[1])
    gb = gy.sum(axis=axes)
    gs = (gy * xhat).sum(axis=axes)
    gx = (gamma * inv.reshape(view) / count) * (
        count * gy - gb.reshape(view) - xhat * gs.reshape(view))
    y = xhat * gamma + to64(d["bias"]).reshape(view)
    ref = {"s": x.sum(axis=axes), "y": y,
           "running_mean": to64(d["mean_in"]) * MOMENTUM + mean * (1 - MOMENTUM),
           "running_var": to64(d["var_in"]) * MOMENTUM + var * (1 - MOMENTUM),
           "gx": gx, "gscale": gs, "gbias": gb,
           "batch_mean": mean.reshape(view), "batch_inv_std": inv.reshape(view)}
    return {k: back(v) for k, v in ref.items()}


def cases(groups: list[str], preset: dict, seed: int, provider: str = "cpu",
          over_budget: Callable[[], bool] = lambda: False):
    """Yield each (group, shape) case lazily: only one shape's data lives at a time. Once
    ``over_budget()``, the remaining cases come as ``skipped`` shells."""
    batch = preset["batch"]
    to64, back, _ = reference_backend(provider)
    bn_groups = [g for g in ("sum", "bn_forward", "bn_backward") if g in groups]
    for k, (c, h, w) in enumerate(preset["bn"]):
        if not bn_groups and "torch" not in groups:
            break
        shape = (batch, c, h, w)
        if over_budget():
            for group in bn_groups + (["torch"] if "torch" in groups else []):
                yield Case(group, list(shape), {}, {}, skipped=True)
            continue
        data = bn_data(shape, seed + k)
        ref = bn_reference(data, to64, back)
        saved = {"batch_mean": ref["batch_mean"].astype(np.float32),
                 "batch_inv_std": ref["batch_inv_std"].astype(np.float32)}
        builders: dict[str, Callable] = {"sum": sum_forms, "bn_forward": bn_forward_forms,
                                         "bn_backward": bn_backward_forms}
        outputs = {"sum": ["s"], "bn_forward": ["y", "running_mean", "running_var"],
                   "bn_backward": ["gx", "gscale", "gbias"]}
        for group in bn_groups:
            yield Case(group, list(shape), {**data, **saved},
                       {o: ref[o] for o in outputs[group]}, builders[group](shape))
        if "torch" in groups:
            yield Case("torch", list(shape), data,
                       {o: ref[o] for o in ("y", "gx", "gscale", "gbias")})
    if "matmul" in groups:
        rng = np.random.default_rng(seed + 100)
        for kind in ("attention", "linear"):
            dims = preset[kind]
            if over_budget():
                yield Case("matmul", [kind, list(dims)], {}, {}, skipped=True)
                continue
            forms = matmul_forms(kind, dims)
            a_shape = dims if kind == "attention" else dims[:2]
            b_shape = dims if kind == "attention" else (dims[0], dims[2])
            a = rng.standard_normal(a_shape, dtype=np.float32)
            b = rng.standard_normal(b_shape, dtype=np.float32)
            a64, b64 = to64(a), to64(b)
            y = back(a64 @ b64.swapaxes(-1, -2) if kind == "attention" else a64.T @ b64)
            yield Case("matmul", [kind, list(a_shape), list(b_shape)], {"A": a, "B": b},
                       {"Y": y}, forms)


# ---------------------------------------------------------------------------- running
def relative_error(outputs: dict[str, np.ndarray], reference: dict[str, np.ndarray]
                   ) -> tuple[float, str]:
    """The largest max |out - ref| / max |ref| over the outputs, and which output."""
    worst, name = 0.0, ""
    for k, ref in reference.items():
        diff = np.subtract(ref, np.asarray(outputs[k]).reshape(ref.shape), dtype=np.float64)
        np.abs(diff, out=diff)
        err = float(diff.max()) / max(float(np.max(np.abs(ref))), 1e-30)
        if err > worst or not name:
            worst, name = err, k
    return worst, name


class BoundForm:
    """One form's session with its inputs bound once (device OrtValues shared with the
    other forms of the shape) and its outputs bound to preallocated buffers."""

    def __init__(self, graph: Graph, values: dict[str, ort.OrtValue], provider: str,
                 cuda_options: dict[str, str] | None = None) -> None:
        self.session = make_session(graph.to_model(), provider,
                                    SessionSettings(cuda_options=cuda_options))
        self.binding = self.session.io_binding()
        for i in self.session.get_inputs():
            self.binding.bind_ortvalue_input(i.name, values[i.name])
        self.outputs: dict[str, ort.OrtValue] = {}
        for o in self.session.get_outputs():
            info = graph.info[o.name]
            value = ort.OrtValue.ortvalue_from_shape_and_type(
                list(info.shape), info.np_dtype, DEVICE[provider], 0)
            self.binding.bind_ortvalue_output(o.name, value)
            self.outputs[o.name] = value
        self.nodes = sum(n.op_type != "Constant" for n in graph.nodes)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def fetch(self) -> dict[str, np.ndarray]:
        return {k: np.array(v.numpy(), copy=True) for k, v in self.outputs.items()}


def summarize(times_s: list[float], floor_ms: float) -> dict:
    ms = np.asarray(times_s) * 1e3
    median = float(np.median(ms))
    p10, p90 = (float(v) for v in np.percentile(ms, [10, 90]))
    return {"median_ms": round(median, 4), "spread_ms": round(p90 - p10, 4),
            "net_ms": round(median - floor_ms, 4), "rounds": len(ms)}


def run_onnx_case(case: Case, provider: str, rounds: int, det_runs: int, floor_ms: float
                  ) -> list[dict]:
    device = DEVICE[provider]
    values = {k: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v), device, 0)
              for k, v in case.inputs.items()}
    # A form that cannot load or run is reported as such; the others are still timed (the
    # GPU session has one try).
    bound: dict[str, BoundForm] = {}
    rows = []
    for name, (desc, graph) in case.forms.items():
        try:
            form = BoundForm(graph, values, provider, case.options.get(name))
            form()
            bound[name] = form
        except Exception as exc:  # ORT raises its own pybind types
            rows.append(failed_row(name, desc, exc))
    times = interleaved_times(bound, rounds=rounds, warmup=2, order="random",
                              seed=0) if bound else {}
    for name, form in bound.items():
        first = form.fetch()
        same = True
        for _ in range(det_runs):
            form()
            again = form.fetch()
            same = same and all(np.array_equal(first[k], again[k]) for k in first)
        err, worst = relative_error(first, case.reference)
        rows.append({"form": name, "description": case.forms[name][0], "nodes": form.nodes,
                     **summarize(times[name], floor_ms), "rel_error": err,
                     "worst_output": worst, "deterministic": same})
    return rows


def failed_row(form: str, description: str, exc: BaseException) -> dict:
    text = str(exc).strip().splitlines()
    return {"form": form, "description": description, "nodes": None, "median_ms": None,
            "spread_ms": None, "net_ms": None, "rounds": 0, "rel_error": None,
            "worst_output": None, "deterministic": None,
            "error": f"{type(exc).__name__}: {text[0] if text else ''}"[:300]}


def run_torch_case(case: Case, provider: str, rounds: int, det_runs: int, floor_ms: float
                   ) -> list[dict]:
    """PyTorch's BatchNorm (F.batch_norm, training=True) forward, and forward + autograd
    backward, on the same data; every call ends in a device synchronisation."""
    import torch
    import torch.nn.functional as fn

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.enabled = True
    dev = torch.device("cuda" if provider == "cuda" else "cpu")
    t = {k: torch.from_numpy(v).to(dev) for k, v in case.inputs.items()}
    x = t["x"].requires_grad_(True)
    w = t["scale"].requires_grad_(True)
    b = t["bias"].requires_grad_(True)
    gy = t["gy"]
    rm, rv = t["mean_in"].clone(), t["var_in"].clone()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def forward() -> dict:
        with torch.no_grad():
            y = fn.batch_norm(x, rm, rv, w, b, training=True, momentum=1 - MOMENTUM, eps=EPS)
        sync()
        return {"y": y}

    def forward_backward() -> dict:
        y = fn.batch_norm(x, rm, rv, w, b, training=True, momentum=1 - MOMENTUM, eps=EPS)
        gx, gs, gb = torch.autograd.grad(y, (x, w, b), gy)
        sync()
        return {"gx": gx, "gscale": gs, "gbias": gb}

    fns = {"torch_forward": forward, "torch_forward_backward": forward_backward}
    times = interleaved_times(fns, rounds=rounds, warmup=2, order="random", seed=0)
    rows = []
    for name, f in fns.items():
        first = {k: v.detach().cpu().numpy() for k, v in f().items()}
        same = all(np.array_equal(first[k], v.detach().cpu().numpy())
                   for _ in range(det_runs) for k, v in f().items())
        err, worst = relative_error(first, {k: case.reference[k] for k in first})
        rows.append({"form": name, "description": f"torch {torch.__version__} "
                     f"F.batch_norm(training=True){' + autograd' if 'backward' in name else ''}"
                     f" on {dev.type}, TF32 off", "nodes": None,
                     **summarize(times[name], floor_ms), "rel_error": err,
                     "worst_output": worst, "deterministic": same})
    return rows


def measure_floor(provider: str, rounds: int) -> float:
    """Median ms of one run of a one-node model on a 1-element tensor: what every run pays
    whatever its kernels (Python, ORT's run setup, the stream synchronisation)."""
    g = new_graph({"f": (1,)})
    Emitter(g).op("Add", ["f", "f"], outputs=["o"], info=TensorInfo(F32, (1,)))
    value = ort.OrtValue.ortvalue_from_numpy(np.ones(1, np.float32), DEVICE[provider], 0)
    form = BoundForm(finish(g, ["o"]), {"f": value}, provider)
    times = interleaved_times({"floor": form}, rounds=max(rounds, 20), warmup=3)
    return float(np.median(times["floor"])) * 1e3


def torch_cuda_ready() -> bool:
    try:
        import torch
    except Exception:
        return False
    return bool(torch.cuda.is_available())


def markdown(entry: dict) -> str:
    """One table per group and shape, and the fastest form within the tolerance."""
    lines = [f"### {entry['group']} {entry['shape']}", "",
             "| form | nodes (no Constants) | median ms | spread ms | net ms | rel. error "
             "| deterministic |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in entry["forms"]:
        if r.get("error"):
            lines.append(f"| {r['form']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(f"| {r['form']} | {r['nodes'] if r['nodes'] is not None else '-'} | "
                     f"{r['median_ms']:.3f} | {r['spread_ms']:.3f} | {r['net_ms']:.3f} | "
                     f"{r['rel_error']:.1e} ({r['worst_output']}) | "
                     f"{'yes' if r['deterministic'] else 'NO'} |")
    lines.append("")
    if entry["fastest_any"] is not None:
        lines.append(f"fastest within tolerance: **{entry['fastest']}**"
                     + (f" (fastest of all: {entry['fastest_any']})"
                        if entry["fastest_any"] != entry["fastest"] else "")
                     + (f"; fastest deterministic: **{entry.get('fastest_deterministic')}**"
                        if entry.get("fastest_deterministic") != entry["fastest"] else ""))
    return "\n".join(lines) + "\n"


# The form memcc writes today, per group, on CUDA (the CPU keeps the leading-axis form).
DEFAULT_FORM = {"sum": "b_transpose", "bn_forward": "b_transpose",
                "bn_backward": "b_transpose", "matmul": "a_transpose_matmul"}


def against_default(group: str, rows: list[dict], best: str | None) -> dict:
    """memcc's CUDA form for the group and how many times faster ``best`` (the fastest
    deterministic form within tolerance) is."""
    default = DEFAULT_FORM.get(group)
    ms = {r["form"]: r["median_ms"] for r in rows if not r.get("error")}
    if default is None or best is None or default not in ms or not ms[best]:
        return {"default_form": default, "speedup_vs_default": None}
    return {"default_form": default,
            "speedup_vs_default": round(ms[default] / ms[best], 3)}


def summary(entries: list[dict], provider: str) -> str:
    """One line per case: the fastest form and its speed-up over memcc's CUDA form."""
    lines = [f"## Fastest forms on {provider} (within tolerance)", "",
             "| group | shape | fastest | fastest deterministic | its speed-up over memcc's "
             "CUDA form |", "|---|---|---|---|---:|"]
    for e in entries:
        if e["group"] == "torch" or e["fastest"] is None:
            continue
        x = e["speedup_vs_default"]
        lines.append(f"| {e['group']} | {e['shape']} | {e['fastest']} | "
                     f"{e['fastest_deterministic']} | "
                     f"{'-' if x is None else f'{x:.2f}x'} ({e['default_form']}) |")
    return "\n".join(lines) + "\n"


def fastest(rows: list[dict], tol: float) -> tuple[str | None, str | None]:
    ran = [r for r in rows if not r.get("error")]
    ok = [r for r in ran if r["rel_error"] <= tol]
    best = min(ok, key=lambda r: r["median_ms"])["form"] if ok else None
    return best, min(ran, key=lambda r: r["median_ms"])["form"] if ran else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--provider", choices=("cuda", "cpu"),
                   default="cuda" if cuda_available() else "cpu",
                   help="ORT provider (default: cuda where this onnxruntime has it)")
    p.add_argument("--out", type=Path, help="folder for kernel_forms.json")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny shapes (tests)")
    size.add_argument("--medium", action="store_true",
                      help="batch 16 and smaller matmuls (a CPU run)")
    p.add_argument("--batch", type=int, help="BatchNorm batch (default 184; 16 --medium)")
    p.add_argument("--rounds", type=int, help="timed rounds (default 30 on cuda, 5 on cpu)")
    p.add_argument("--det-runs", type=int, default=2,
                   help="extra runs whose bits must equal the first (default 2)")
    p.add_argument("--groups", default=",".join(GROUPS),
                   help=f"comma-separated subset of {','.join(GROUPS)}")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                   help="PyTorch's BatchNorm as the target (auto: on CUDA when torch has it)")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="relative error a form may have to be called fastest (default 1e-4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget-s", type=float, default=100.0,
                   help="start no new shape after this many seconds (default 100); the JSON "
                        "names what was skipped")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    try:
        provider = resolve_provider(args.provider)
        groups = [g.strip() for g in args.groups.split(",") if g.strip()]
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"--groups {args.groups}: unknown {', '.join(unknown)}; choose "
                             f"from {', '.join(GROUPS)}")
        if args.out is not None and args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out}: exists and is not a folder; give a folder")
        for flag, v in (("--rounds", args.rounds), ("--batch", args.batch)):
            if v is not None and v < 1:
                raise ValueError(f"{flag} {v}: give 1 or more")
        if args.det_runs < 1:
            raise ValueError(f"--det-runs {args.det_runs}: give 1 or more")
    except (MemccError, ValueError) as exc:
        print(f"cuda_kernel_forms: {exc}", file=sys.stderr)
        return 2
    preset_name = "quick" if args.quick else "medium" if args.medium else "full"
    preset = dict(PRESETS[preset_name])
    if args.batch:
        preset["batch"] = args.batch
    rounds = args.rounds or (30 if provider == "cuda" else 5)
    want_torch = args.torch == "on" or (args.torch == "auto" and provider == "cuda"
                                         and torch_cuda_ready())
    if "torch" in groups and not want_torch:
        groups.remove("torch")

    floor_ms = measure_floor(provider, rounds)
    print(f"# Kernel forms on {provider} (onnxruntime {ort.__version__}, preset "
          f"{preset_name}, batch {preset['batch']}, {rounds} rounds; floor {floor_ms:.3f} ms "
          "per run)\n", flush=True)
    entries: list[dict] = []
    skipped: list[str] = []
    result = {
        "provider": provider, "onnxruntime": ort.__version__,
        "device": _device_name(provider), "preset": preset_name, "batch": preset["batch"],
        "rounds": rounds, "det_runs": args.det_runs, "tolerance": args.tol,
        "reference": reference_backend(provider)[2], "floor_ms": round(floor_ms, 4),
        "groups": entries, "torch_targets": [], "skipped": skipped, "elapsed_s": None,
    }
    def over_budget() -> bool:
        return time.perf_counter() - started > args.budget_s

    for case in cases(groups, preset, args.seed, provider, over_budget):
        if case.skipped:
            skipped.append(f"{case.group} {case.shape}")
            continue
        t0 = time.perf_counter()
        try:
            if case.group == "torch":
                rows = run_torch_case(case, provider, rounds, args.det_runs, floor_ms)
            else:
                rows = run_onnx_case(case.with_tf32_twins(provider), provider, rounds,
                                     args.det_runs, floor_ms)
        except Exception as exc:  # one try on the GPU: report it and go on
            rows = [failed_row("(whole case)", case.group, exc)]
        # torch's two rows are two different jobs (forward; forward + backward): no winner.
        best, best_any = fastest(rows, args.tol) if case.group != "torch" else (None, None)
        best_det = (fastest([r for r in rows if r.get("deterministic")], args.tol)[0]
                    if case.group != "torch" else None)
        entry = {"group": case.group, "shape": case.shape, "forms": rows, "fastest": best,
                 "fastest_any": best_any, "fastest_deterministic": best_det,
                 **against_default(case.group, rows, best_det),
                 "seconds": round(time.perf_counter() - t0, 2)}
        entries.append(entry)
        print(markdown(entry), flush=True)
        write(args.out, result, started)  # after every case: a run cut short keeps its rows
    print(summary(entries, provider))
    result["torch_targets"] = targets = torch_targets(entries)
    for t in targets:
        print(f"target {t['shape']}: torch forward+backward {t['torch_ms']:.3f} ms; ORT's "
              f"fastest forward + backward forms {t['ort_ms']:.3f} ms "
              f"({t['ort_forward']} + {t['ort_backward']}); memcc's CUDA default "
              f"(b_transpose twice) {t['ort_cuda_default_ms']:.3f} ms")
    if skipped:
        print(f"skipped (over --budget-s {args.budget_s:g}): {'; '.join(skipped)}")
    write(args.out, result, started)
    print(f"\nelapsed {result['elapsed_s']} s")
    return 0


def write(out: Path | None, result: dict, started: float) -> None:
    """kernel_forms.json in ``out`` (nothing without --out), written whole each time."""
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "kernel_forms.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out / "kernel_forms.json")


def torch_targets(entries: list[dict]) -> list[dict]:
    """Per BatchNorm shape with a torch row: torch's forward + backward against ORT's
    fastest (within tolerance) forward form plus fastest backward form, and against
    memcc's CUDA default (``b_transpose`` both ways)."""
    def ms(entry: dict | None, form: str | None) -> float | None:
        if entry is None or form is None:
            return None
        return next((r["median_ms"] for r in entry["forms"] if r["form"] == form), None)

    by = {(e["group"], str(e["shape"])): e for e in entries}
    out = []
    for e in entries:
        if e["group"] != "torch" or ms(e, "torch_forward_backward") is None:
            continue
        fwd, bwd = by.get(("bn_forward", str(e["shape"]))), by.get(("bn_backward",
                                                                     str(e["shape"])))
        parts = [ms(fwd, fwd and fwd["fastest"]), ms(bwd, bwd and bwd["fastest"])]
        default = [ms(fwd, "b_transpose"), ms(bwd, "b_transpose")]
        if None in parts or None in default:
            continue
        out.append({"shape": e["shape"], "torch_ms": ms(e, "torch_forward_backward"),
                    "ort_ms": round(sum(parts), 4), "ort_forward": fwd["fastest"],
                    "ort_backward": bwd["fastest"],
                    "ort_cuda_default_ms": round(sum(default), 4)})
    return out


def _device_name(provider: str) -> str:
    if provider == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0)
        except Exception:
            pass
        return "cuda"
    return f"{platform.processor() or platform.machine()} cpu"


if __name__ == "__main__":
    sys.exit(main())
