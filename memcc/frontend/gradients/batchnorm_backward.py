"""Training-mode BatchNormalization's backward in the fewest nodes (issue 30).

The backward as memcc first wrote it spends 21 nodes per BatchNorm: eight to
rebuild the batch statistics and ``xhat``, three reductions, eight more for
``dx = gamma * inv * (gy - sum(gy) / n - xhat * sum(gy * xhat) / n)`` and three Reshapes
between ``[C]`` and ``[1, C, 1, ...]``. Most of those are per-channel scalars or views, each
still a node (a kernel launch on CUDA, where ResNet-50's step is launch-bound).

ONNX already has a node that applies a per-channel affine map to an activation and takes
its per-channel operands as ``[C]`` vectors: BatchNormalization in inference mode,
``y = (x - mean) * scale / sqrt(var + eps) + bias``. Fed the batch variance, it gives
``1 / sqrt(var + eps)`` without the Add, Sqrt and Reciprocal, and needs no Reshape. So:

- ``xhat`` and the batch variance ``var`` (``[C]``) from one more training-mode
  BatchNormalization of ``x``, with scale 1, bias 0 and momentum 0 (``_normalised``): its
  running-statistics outputs are then the batch's own statistics, and its output is ``x``
  normalised by them, as the forward's node normalised it. Where it took ReduceMean, Sub,
  Mul, ReduceMean and an inference-mode BatchNormalization of the centred input, it is one
  node that reads ``x`` three times and writes ``xhat`` once, and no centred input or its
  square is ever alive (the floors ``--budget min`` reached on three convnets did not
  drop: the backward's later nodes set them; BENCHMARKS.md, session 43). It reads two
  buffers of its own, made by one Split of a constant (ORT writes the running outputs
  into them);
- the scale and bias gradients ``sum(gy * xhat)`` and ``sum(gy)`` reduced straight to
  ``[C]`` (same bits as before, without the Reshapes);
- ``z = gy - BN(xhat; scale sum(gy * xhat), bias 0, mean 0, var n * n, epsilon 0)``: the
  kernel's factor ``sum(gy * xhat) * (1 / sqrt(n * n))`` is the float32 product of the old
  ``sum(gy * xhat) * (-1 / n)`` up to its sign, so ``z`` is the same bits as the old
  ``gy + xhat * view(sum(gy * xhat) * (-1 / n))`` without the Mul on ``[C]`` and the view
  to ``[1, C, 1, ...]`` (``_less_projection``; an affine of the centred input would save
  more but keep the centred input alive next to ``xhat``, one activation more in the
  working set that sets ``--budget min``'s floor);
- ``dx = BN(z; scale gamma, bias 0, mean sum(gy) / n, var)``, that is
  ``gamma * inv * (z - sum(gy) / n)``.

9 nodes (12 with the statistics from reductions, 14 before the projection above). ORT's
kernel folds the per-channel operands first (``z * (inv * gamma) + (0 - mean * inv *
gamma)``), so ``dx`` is rounded differently from the old ``(z - sum(gy) / n) * (gamma *
inv)``, and the training kernel takes ``1 / sqrt`` as ``sqrt(1 / (var + eps))`` and sums in
its own order: ``tests/test_batchnorm_backward.py`` bounds the difference. Only float32
activations and statistics take this form (the kernel's types); anything else keeps the
general rule in ``gradients/nn.py``.
"""

from __future__ import annotations

import itertools
import weakref

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.registry import GradContext
from memcc.graph import TensorInfo

Grads = list[str | None]
# The name of the constants the statistics nodes' own buffers are split from.
BUFFERS = "statistics_buffers"
# Per emitter, the largest value such a constant it wrote holds (``_own_buffers``).
_largest_held: weakref.WeakKeyDictionary[Emitter, int] = weakref.WeakKeyDictionary()


def applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
    """float32 activation and scale, rank 3 or more: what the kernel computes in."""
    x, scale = node.input[:2]
    x_info = ctx.info(x)
    return (len(x_info.shape) >= 3 and x_info.dtype == TensorProto.FLOAT
            and ctx.info(scale).dtype == TensorProto.FLOAT)


def batchnorm_train_grad_affine(ctx: GradContext, node: onnx.NodeProto, gy: str,
                                axes: list[int], eps: float) -> Grads:
    """The input, scale and bias gradients in the form of the module docstring."""
    emit = ctx.emit
    x, scale, bias = node.input[:3]
    x_info = ctx.info(x)
    dtype = x_info.dtype
    channels = int(x_info.shape[1])
    n = float(np.prod([x_info.shape[a] for a in axes]))
    zeros = emit.const(np.zeros(channels), dtype, name="zeros")
    xhat, var = _normalised(ctx, x, zeros, eps)
    sum_gy = emit.reduce_sum(gy, axes, keepdims=False)
    sum_gy_xhat = emit.reduce_sum(emit.mul(gy, xhat), axes, keepdims=False)
    gx = None
    if ctx.needs_grad(x):
        z = _less_projection(emit, gy, xhat, sum_gy_xhat, n, zeros)
        # gamma * (z - sum(gy) / n) / sqrt(var + eps), one node
        mean_gy = emit.mul(sum_gy, emit.scalar(1.0 / n, dtype))
        gx = emit.op("BatchNormalization", [z, scale, zeros, mean_gy, var], epsilon=eps,
                     info=x_info)
    gs = sum_gy_xhat if ctx.needs_grad(scale) else None
    gb = emit.cast(sum_gy, ctx.info(bias).dtype) if ctx.needs_grad(bias) else None
    return [gx, gs, gb] + [None] * (len(node.input) - 3)


def _normalised(ctx: GradContext, x: str, zeros: str, eps: float) -> tuple[str, str]:
    """``xhat`` and the batch variance ``[C]`` from one training-mode BatchNormalization
    of ``x`` with scale 1, bias 0, momentum 0 and running statistics 0: its running
    outputs are then the batch's own (``0 * 0 + batch * 1``), and its output is ``x``
    normalised by them, as the forward's node normalised it. On the CPU provider
    (``onnxruntime/core/providers/cpu/nn/batch_norm.h``) the variance is the population
    one, the sum of squared deviations over the count; the mean output is not read.
    Where the CUDA provider runs the step, ``passes/providers/batchnorm_for_cuda.py``
    replaces this node by an inference-mode one fed the forward's statistics.

    ORT's CPU kernel writes its running outputs into its running inputs' buffers (the
    kernel is registered with ``Alias(3, 1)``, ``Alias(4, 2)``), whoever else reads them:
    fed a shared constant it would overwrite the zeros every other node reads. So each such
    node reads two buffers of its own, made each step by one Split of a constant
    (``_own_buffers``; ``zeros``, the ``[C]`` constant, is read by the other nodes of the
    rule)."""
    emit = ctx.emit
    info = ctx.info(x)
    channels = int(info.shape[1])
    stat = TensorInfo(info.dtype, (channels,))
    ones = emit.const(np.ones(channels), info.dtype, name="ones")
    xhat, _, var = emit.op("BatchNormalization",
                           [x, ones, zeros, *_own_buffers(emit, channels, info.dtype)],
                           outputs=3, info=[info, stat, stat], epsilon=eps, momentum=0.0,
                           training_mode=1)
    return xhat, var


def _own_buffers(emit: Emitter, channels: int, dtype: int) -> list[str]:
    """Two ``[C]`` buffers made by one Split, for one statistics node to write into.

    What they hold does not matter (momentum 0: ``held * 0 + batch``), as long as it is
    finite, but it must differ from every other such Split's constant: with its graph
    optimizations on (the defaults of a plain ``InferenceSession``), ONNX Runtime's
    common-subexpression elimination merges Splits of equal constants, and two statistics
    nodes then write into one buffer (measured: outputs 0.53 relative off on the zoo
    ResNet-18 with zeros for all). Each node takes the next two integers after the largest
    any such constant of the graph holds, one per half (equal halves were not seen to be
    merged; distinct, no merge of equal values could give the two statistics one buffer).
    The graph is read for that once per emitter (``_largest_held``), not once per node."""
    first = _largest_held.get(emit)
    if first is None:
        first = max((int(numpy_helper.to_array(n.attribute[0].t).max())
                     for n in itertools.chain(emit.graph.nodes, () if emit.nodes is
                                              emit.graph.nodes else emit.nodes)
                     if n.op_type == "Constant" and BUFFERS in n.output[0]), default=0)
    first += 1
    _largest_held[emit] = first + 1
    values = np.concatenate([np.full(channels, first), np.full(channels, first + 1)])
    stat = TensorInfo(dtype, (channels,))
    return emit.op("Split", [emit.const(values, dtype, name=BUFFERS)], outputs=2, axis=0,
                   info=[stat, stat], num_outputs=2 if emit.opset >= 18 else None)


def _count_root_is_exact(n: float) -> bool:
    """Whether float32 ``1 / sqrt(n * n)`` is float32 ``1 / n``, as the kernel computes
    it from a variance of ``n * n`` and no epsilon (true of every count tried, the checks
    of ``tests/test_batchnorm_backward.py``; kept as a guard, the count is known here)."""
    square = np.float32(n) * np.float32(n)
    return bool(np.isfinite(square) and np.float32(1.0) / np.sqrt(square) == np.float32(1.0 / n))


def _less_projection(emit: Emitter, gy: str, xhat: str, sum_gy_xhat: str, n: float,
                     zeros: str) -> str:
    """``z = gy - xhat * (sum(gy * xhat) / n)`` in two nodes where it took four.

    The per-channel factor ``sum(gy * xhat) / n`` is applied by an inference-mode
    BatchNormalization fed a variance of ``n * n`` and no epsilon: its kernel folds
    ``sum * (1 / sqrt(n * n))`` per channel, which is the same float32 product as the old
    ``sum * (-1 / n)`` up to its sign, and multiplies ``xhat`` by it plus 0. So ``gy - that``
    is the same bits as the old ``gy + xhat * view(sum * (-1 / n))``, without the Mul on
    ``[C]`` and the Reshape to ``[1, C, 1, ...]`` (issue 30). Where the count's root is not
    exact in float32 (the guard above) the old form is written."""
    info = emit.info(xhat)
    channels = int(info.shape[1])
    if not _count_root_is_exact(n):
        coef = emit.reshape(emit.mul(sum_gy_xhat, emit.scalar(-1.0 / n, info.dtype)),
                            [1, channels] + [1] * (len(info.shape) - 2))
        return emit.add(gy, emit.mul(xhat, coef))
    squared = emit.const(np.full(channels, float(np.float32(n) * np.float32(n))), info.dtype,
                         name="count_squared")
    projected = emit.op("BatchNormalization", [xhat, sum_gy_xhat, zeros, zeros, squared],
                        epsilon=0.0, info=info)
    return emit.sub(gy, projected)
