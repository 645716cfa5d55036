"""Per-channel sums of NCHW tensors in two stages, for CUDA: no activation-sized Transpose.
(NCHW here stands for any [N, C, ...] of rank 3 to 5: the spatial axes are one axis of
H*W or D*H*W values in the first stage.)

BatchNorm's statistics and the gradients of its scale and bias reduce every axis but the
channels of an NCHW tensor. ORT's CUDA kernel adds such leading-axis sums with atomics: slow
and different from run to run (``deterministic_reductions``). memcc wrote them as a Transpose
of the whole tensor to [C, N, H, W] and a sum over the trailing axes, which reads and writes
the tensor once more than the sum itself. Here each is written in two stages instead:

- x viewed as [N, C, H*W] (a Reshape: no copy), the reduction over its last axis: [N, C];
- that [N, C] transposed to [C, N] (N*C values), and summed over its last axis: [C].

Both stages reduce trailing axes (ORT's deterministic form), and only the small [N, C]
partials are transposed. Measured on an H200 (onnxruntime-gpu 1.31.1, batch 184,
``benchmarks/cuda_kernel_forms.py``; BENCHMARKS.md, "Issue 30 on an H200"), ms per sum:
[184, 256, 56, 56] 0.458 against 0.582 for the Transpose form (2.62 for ORT's atomic one),
[184, 1024, 14, 14] 0.096 against 0.199, [184, 64, 112, 112] 0.393 against 0.720, the same
bits on every run. (The MatMul by ones was faster still, but cuBLAS rounds its inputs to
TF32 under ORT's default, which is the likeliest reason it moved ResNet-50's first loss by
1.6e-4: ``per_channel_by_matmul`` stays off.)

ReduceSum and ReduceSumSquare take their own op in the first stage and ReduceSum in the
second; ReduceMean takes ReduceMean in both (every [N, C] partial is a mean over the same
count, so the mean of the means is the mean). The sums change order, so results match the
one-stage reduction within a tolerance (``tests/test_per_channel_sums.py``: 1e-5 of the
largest magnitude in float32, at 1 and 2 threads). Other leading-axis reductions are left to
``to_trailing_axes``, and so are 16-bit ones (below).
"""

from __future__ import annotations

import math

import onnx
from onnx import TensorProto

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo, node_label
from memcc.passes.providers.deterministic_reductions import (
    _AXES_INPUT_SINCE,
    per_channel,
    reduced_axes,
    rewrite_each,
)
from memcc.passes.providers.deterministic_scatter import Report

# Partials are rounded to the input's type between the stages: 16-bit sums keep the one-stage
# (Transpose) form, whose single reduction accumulates wide and rounds once.
_WIDE_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)
TWO_STAGE = {"ReduceSum": ("ReduceSum", "ReduceSum"),
             "ReduceMean": ("ReduceMean", "ReduceMean"),
             "ReduceSumSquare": ("ReduceSumSquare", "ReduceSum")}


def _is_per_channel(graph: Graph, node: onnx.NodeProto, producers) -> bool:
    """A float32/64 per-channel ReduceSum, ReduceMean or ReduceSumSquare of an [N, C, ...]
    tensor of rank 3 to 5 (``deterministic_reductions.per_channel``): BatchNorm1d over a
    sequence, BatchNorm2d, BatchNorm3d. Rank 2 ([N, C]: the Transpose form is already
    this form's second stage) is left to ``to_trailing_axes``."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in TWO_STAGE:
        return False
    x, y = graph.info.get(node.input[0]), graph.info.get(node.output[0])
    if x is None or y is None or len(x.shape) < 3 or x.dtype not in _WIDE_FLOATS:
        return False
    rank = len(x.shape)
    axes = reduced_axes(graph, node, rank, producers)
    if axes is None:
        return False
    # Unit axes left out, as ``to_trailing_axes`` judges (``deterministic_reductions``).
    return per_channel([a for a in axes if x.shape[a] > 1],
                       [a for a in range(rank) if a not in axes and x.shape[a] > 1])


def per_channel_two_stage(graph: Graph) -> tuple[Graph, Report]:
    """A copy of ``graph`` with each per-channel reduction written in two stages (``graph``
    itself when there is none), and a report naming every node rewritten."""
    report = Report()
    producers = graph.producers()
    targets = {i for i, n in enumerate(graph.nodes) if _is_per_channel(graph, n, producers)}
    if not targets:
        return graph, report

    def two_stage(emit: Emitter, node: onnx.NodeProto, _: int) -> None:
        _emit_two_stage(emit, node)
        report.rewritten.append(f"{node_label(node)}: per-channel {node.op_type} of "
                                f"{list(emit.info(node.input[0]).shape)} -> over H*W, then "
                                "over N")

    return rewrite_each(graph, targets, "sum2/", two_stage), report


def _emit_two_stage(emit: Emitter, node: onnx.NodeProto) -> None:
    """The two stages of ``node`` (module docstring), its output under its own name (the
    name is ``rewrite_each``'s to give)."""
    x_info, y_info = emit.info(node.input[0]), emit.info(node.output[0])
    n, c, *spatial = (int(d) for d in x_info.shape)
    pixels = math.prod(spatial)
    first, second = TWO_STAGE[node.op_type]
    if pixels > 1:
        rows = _reduce(emit, first, emit.reshape(node.input[0], [n, c, pixels]), 2,
                       TensorInfo(y_info.dtype, (n, c)))
    else:  # nothing to reduce in the first stage: the square goes to the second
        rows, second = emit.reshape(node.input[0], [n, c]), first
    per_channel = emit.transpose(rows, [1, 0])  # [C, N]: N*C values, not N*C*H*W
    direct = tuple(y_info.shape) == (c,)
    total = _reduce(emit, second, per_channel, 1, TensorInfo(y_info.dtype, (c,)),
                    outputs=[node.output[0]] if direct else None)
    if not direct:
        emit.op("Reshape", [total, emit.ints(list(y_info.shape))], outputs=[node.output[0]],
                info=y_info)


def _reduce(emit: Emitter, op: str, x: str, axis: int, info: TensorInfo,
            outputs: list[str] | None = None) -> str:
    """``op`` over ``axis`` without keeping it, in the form the graph's opset takes."""
    named = {"outputs": outputs} if outputs else {}
    if emit.opset >= _AXES_INPUT_SINCE[op]:
        return emit.op(op, [x, emit.ints([axis])], keepdims=0, info=info, **named)
    return emit.op(op, [x], axes=[axis], keepdims=0, info=info, **named)
