"""Reductions over leading axes written as reductions over trailing axes, for CUDA.

ORT's CUDA ReduceSum, ReduceMean, ReduceSumSquare and ReduceLogSum have a fast path, taken
unless ``use_deterministic_compute`` is set. Read from ORT's sources (docs/DETERMINISM.md,
"What ORT's sources say about the CUDA kernels"): when the reduced axes lead (a bias
gradient: ReduceSum over the batch and sequence axes), each block adds its partial sums into
the output with atomics, whose order changes from run to run; when they trail (LayerNorm
and softmax statistics), the last block combines the partials in a fixed order. With the
setting on, every reduction goes to cuDNN instead, and the setting cost the GPT-2 step of
issue 29 a third of its time on an H200 (which ops pay is what
``benchmarks/cuda_determinism.py`` measures).

``to_trailing_axes`` rewrites each such reduction whose reduced axes do not already trail
into ``Transpose`` (kept axes first, reduced axes last, in order) and the same reduction over
the trailing axes, then ``Reshape`` to the original output shape. That costs one extra pass
over the input (the transpose) and, if ORT's column form is deterministic as its source
reads, gives the same bits on every run without the setting. Whether that holds, and
whether it is cheaper than the setting, is for the GPU benchmark to say; until then the pass
is not on any runtime path.

Sums change order, so results match the original within a tolerance
(``tests/test_deterministic_reductions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np
import onnx

from memcc.frontend.constants import constant_value
from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo, attr, node_label
from memcc.passes.providers.deterministic_scatter import _COPIED_PROPS, Report

# The reductions with ORT's CUDA fast path (reduction_ops.h: fast_reduction_).
FAST_PATH_REDUCTIONS = ("ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceLogSum")
# Opset from which each takes its axes as an input instead of an attribute.
_AXES_INPUT_SINCE = {"ReduceSum": 13, "ReduceMean": 18, "ReduceSumSquare": 18,
                     "ReduceLogSum": 18}


def reduced_axes(graph: Graph, node: onnx.NodeProto, rank: int, producers) -> list[int] | None:
    """The reduced axes, sorted and non-negative; None when not known at compile time."""
    if graph.opset >= _AXES_INPUT_SINCE[node.op_type]:
        if len(node.input) < 2 or not node.input[1]:
            if int(attr(node, "noop_with_empty_axes", 0)):
                return []
            return list(range(rank))
        value = constant_value(graph, node.input[1], producers)
        if value is None:
            return None
        axes = [int(a) for a in np.ravel(value)]
        if not axes and int(attr(node, "noop_with_empty_axes", 0)):
            return []
        if not axes:
            return list(range(rank))
    else:
        axes = attr(node, "axes")
        if axes is None:
            return list(range(rank))
        axes = [int(a) for a in axes]
    return sorted({a % rank for a in axes})


def rewrite_each(graph: Graph, targets: Collection[int], prefix: str,
                 emit_one: Callable[[Emitter, onnx.NodeProto, int], None]) -> Graph:
    """A copy of ``graph`` with each node at a position in ``targets`` replaced by what
    ``emit_one(emit, node, position)`` emits (its output under the node's own name), the
    new nodes carrying the node's provenance (role, gradient of, rule) and the last one its
    name: the skeleton the reduction rewrites here and in ``per_channel_sums`` share."""
    out = graph.copy()
    emit = Emitter(out, detached=True, prefix=prefix)
    nodes: list[onnx.NodeProto] = []
    for i, node in enumerate(out.nodes):
        if i not in targets:
            nodes.append(node)
            continue
        start = len(emit.nodes)
        emit_one(emit, node, i)
        if node.name:
            emit.nodes[-1].name = node.name
        props = {p.key: p.value for p in node.metadata_props if p.key in _COPIED_PROPS}
        for made in emit.nodes[start:]:
            for key, value in props.items():
                made.metadata_props.add(key=key, value=value)
        nodes.extend(emit.nodes[start:])
    out.set_nodes(nodes)
    return out


def per_channel(reduced: list[int], kept: list[int]) -> bool:
    """A sum over every axis but the channels of an [N, C, ...] tensor of any rank
    (BatchNorm's statistics and the gradients of its scale and bias, BatchNorm1d and 3d
    included): the form ``passes.providers.batchnorm_for_cuda`` rewrites on CUDA by default,
    because ORT's atomic path for it was slow (below). Axes of size 1 are in neither list,
    so the channels alone kept and the batch among the reduced is the whole test (it was
    axes 0, 2 and 3 only until session 42: a BatchNorm3d's sums over axis 4 kept ORT's
    atomic path on CUDA, 80 of them in torchvision's r3d_18 step)."""
    return kept == [1] and 0 in reduced


# Per-channel sums that ``per_channel_by_matmul`` writes as two MatMuls by ones.
MATMUL_SUMS = ("ReduceSum", "ReduceMean")


def per_channel_by_matmul(graph: Graph) -> tuple[Graph, Report]:
    """A copy of ``graph`` with each per-channel ``ReduceSum``/``ReduceMean`` of a float32
    NCHW tensor (``per_channel``) written as cuBLAS matrix-vector products by ones: x viewed
    as [N*C, H*W] times ones[H*W, 1], viewed as [N, C], and ones[1, N] times that (a mean
    then scaled by 1 / (N*H*W)). Reshapes alias the input, so nothing the size of x is
    written: on an H200 this form summed [184, 256, 56, 56] in 0.21 ms, against 0.58 ms
    for the transpose + trailing sum and 2.6 ms for ORT's own leading-axis sum, the same
    bits on every run (BENCHMARKS.md, "Issue 30 on an H200"). The sums change order:
    results match within a tolerance (``tests/test_deterministic_reductions.py``).
    ``ReduceSumSquare`` and the rest are left to ``to_trailing_axes``. Not on the CUDA path
    yet: in the whole ResNet-50 step on an H200 it ran 2% faster than the transpose form and
    predicted 82 MB less, but moved the first loss by 1.6e-4 relative (3.1800 against
    3.1795), which an isolated sum (2.8e-7 against float64) does not explain; a float64
    check of the step decides."""
    report = Report()
    producers = graph.producers()
    targets: set[int] = set()
    for i, node in enumerate(graph.nodes):
        if node.domain not in ("", "ai.onnx") or node.op_type not in MATMUL_SUMS:
            continue
        x_info, y_info = graph.info.get(node.input[0]), graph.info.get(node.output[0])
        if x_info is None or y_info is None or len(x_info.shape) != 4 or x_info.itemsize != 4 \
                or x_info.np_dtype != np.float32:
            continue
        axes = reduced_axes(graph, node, 4, producers)
        if axes is None:
            continue
        reduced = [a for a in axes if x_info.shape[a] > 1]
        kept = [a for a in range(4) if a not in axes and x_info.shape[a] > 1]
        if sorted(axes) == [0, 2, 3] and per_channel(reduced, kept):
            targets.add(i)
    if not targets:
        return graph, report

    def by_ones(emit: Emitter, node: onnx.NodeProto, _: int) -> None:
        x_info, y_info = emit.info(node.input[0]), emit.info(node.output[0])
        n, c, h, w = (int(d) for d in x_info.shape)
        f32 = x_info.dtype
        rows = node.input[0]
        if h * w > 1:
            flat = emit.reshape(node.input[0], [n * c, h * w])
            rows = emit.op("MatMul", [flat, emit.const(np.ones((h * w, 1), np.float32))],
                           info=TensorInfo(f32, (n * c, 1)))
        rows = emit.reshape(rows, [n, c])
        total = emit.op("MatMul", [emit.const(np.ones((1, n), np.float32)), rows],
                        info=TensorInfo(f32, (1, c)))
        if node.op_type == "ReduceMean":
            total = emit.op("Mul", [total, emit.scalar(1.0 / (n * h * w), f32)],
                            info=TensorInfo(f32, (1, c)))
        emit.op("Reshape", [total, emit.ints(list(y_info.shape))], outputs=[node.output[0]],
                info=y_info)
        report.rewritten.append(f"{node_label(node)}: axes [0, 2, 3] of {[n, c, h, w]} -> "
                                "MatMul by ones over H*W, then over N")

    return rewrite_each(graph, targets, "det/", by_ones), report


def to_trailing_axes(graph: Graph, *, only: Callable[[list[int], list[int]], bool] | None
                     = None) -> tuple[Graph, Report]:
    """A copy of ``graph`` with each leading-axis fast-path reduction rewritten as above
    (``graph`` itself when there is none), and a report naming every node. ``only``: rewrite
    just the reductions for which ``only(reduced_axes, kept_axes)`` holds (axes of size 1
    left out), e.g. ``per_channel``."""
    report = Report()
    producers = graph.producers()
    targets: dict[int, tuple[list[int], list[int]]] = {}
    for i, node in enumerate(graph.nodes):
        if node.domain not in ("", "ai.onnx") or node.op_type not in FAST_PATH_REDUCTIONS:
            continue
        x_info = graph.info.get(node.input[0])
        y_info = graph.info.get(node.output[0])
        if x_info is None or y_info is None:
            report.left.append(f"{node_label(node)}: no static shape")
            continue
        rank = len(x_info.shape)
        axes = reduced_axes(graph, node, rank, producers)
        if axes is None:
            report.left.append(f"{node_label(node)}: axes computed at run time")
            continue
        # Size-1 axes do not change the memory layout: ignore them on both sides.
        reduced = [a for a in axes if x_info.shape[a] > 1]
        kept = [a for a in range(rank) if a not in axes and x_info.shape[a] > 1]
        if not reduced or not kept or max(kept) < min(reduced):
            report.already.append(f"{node_label(node)}: reduces trailing axes {axes} of "
                                  f"{list(x_info.shape)}")
            continue
        if only is not None and not only(reduced, kept):
            continue
        targets[i] = (kept, reduced)
    if not targets:
        return graph, report

    def trailing_form(emit: Emitter, node: onnx.NodeProto, i: int) -> None:
        kept, reduced = targets[i]
        x_info, y_info = emit.info(node.input[0]), emit.info(node.output[0])
        x = emit.reshape(node.input[0], [d for d in x_info.shape if d > 1])
        # Positions in the squeezed tensor.
        big = [a for a in range(len(x_info.shape)) if x_info.shape[a] > 1]
        perm = [big.index(a) for a in kept] + [big.index(a) for a in reduced]
        xt = emit.transpose(x, perm)
        trailing = list(range(len(kept), len(perm)))
        shape = tuple(x_info.shape[a] for a in kept)
        # A sum that already has the reduced shape (keepdims=0) is written under its own
        # name: a Reshape to the same shape would be one more node (issue 30).
        direct = tuple(shape) == tuple(y_info.shape)
        named = {"outputs": [node.output[0]]} if direct else {}
        if emit.opset >= _AXES_INPUT_SINCE[node.op_type]:
            r = emit.op(node.op_type, [xt, emit.ints(trailing)], keepdims=0,
                        info=TensorInfo(y_info.dtype, shape), **named)
        else:
            r = emit.op(node.op_type, [xt], axes=trailing, keepdims=0,
                        info=TensorInfo(y_info.dtype, shape), **named)
        if not direct:
            emit.op("Reshape", [r, emit.ints(list(y_info.shape))], outputs=[node.output[0]],
                    info=y_info)
        report.rewritten.append(
            f"{node_label(node)}: axes {[a for a in range(len(x_info.shape)) if a in reduced]}"
            f" of {list(x_info.shape)} -> Transpose {perm}, {node.op_type} over the last "
            f"{len(trailing)}")

    return rewrite_each(graph, targets, "det/", trailing_form), report
