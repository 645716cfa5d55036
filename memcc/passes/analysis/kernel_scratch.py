"""Kernel scratch: the bytes an ORT kernel allocates and frees inside itself while it runs.

Enters: one node and the tensor infos of its inputs and outputs (and, for the arena, the CPU
intra-op threads). Leaves: the scratch requests, one per buffer (``scratch_buffers``), or
their sum (``scratch_bytes``). Kept apart from ``liveness`` because two analyses read it:
liveness adds the sum to a node's live bytes, ``arena`` replays each buffer as its own
request. Which kernels are modelled, and why, is told in ``liveness``'s module docstring.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from memcc.graph import TensorInfo, attr

VARIADIC_OPS = frozenset({"Sum", "Max", "Min", "Mean"})
# CPU kernels whose scratch is a ``std::vector`` (operator new, so glibc's heap), not a
# request to the kernel's allocator: ScatterElements copies its indices into one
# (onnxruntime/core/providers/cpu/tensor/scatter.cc, ``CopyScatterData``). With the CPU
# arena on, that buffer lies outside the arena (measured: a 4 MiB copy beside the arena's
# regions at a zoo GPT-2's peak, 8 x 256 tokens, width 256).
HEAP_SCRATCH_OPS = frozenset({"ScatterElements"})

# The ops ``scratch_buffers`` gives scratch without ``cpu_threads`` (every other op: none).
SCRATCH_OPS = frozenset({"Where", *VARIADIC_OPS, "Dropout", "ConvTranspose",
                         "ScatterElements", "Softmax", "LogSoftmax"})


def scratch_bytes(node: onnx.NodeProto, info: Mapping[str, TensorInfo], opset: int = 17) -> int:
    """Bytes a kernel allocates and frees inside itself (see the module docstring)."""
    if node.op_type not in SCRATCH_OPS:  # asked of every node of every plan judged
        return 0
    return sum(scratch_buffers(node, info, opset))


def scratch_buffers(node: onnx.NodeProto, info: Mapping[str, TensorInfo],
                    opset: int = 17, *, cpu_threads: int | None = None) -> tuple[int, ...]:
    """The buffers behind ``scratch_bytes``, one request each (the arena serves them
    separately: ``passes.analysis.arena``); with ``cpu_threads``, also Conv's MLAS working buffer
    (module docstring)."""
    op = node.op_type
    if op == "Conv" and cpu_threads is not None:
        work = _mlas_conv_working_bytes(node, info, cpu_threads)
        return (work,) if work else ()
    if op == "Where" and len(node.input) == 3 and node.output[0] in info:
        cond, x, y = (info.get(i) for i in node.input)
        out = info[node.output[0]]
        if cond is None or x is None or y is None:
            return ()
        sel_x = _broadcast_numel(cond.shape, x.shape)
        sel_y = _broadcast_numel(cond.shape, y.shape)
        return (sel_x * out.itemsize, sel_y * out.itemsize)
    if op in VARIADIC_OPS and len([i for i in node.input if i]) > 2:
        out = info.get(node.output[0])
        return (out.nbytes,) if out is not None else ()
    if op == "Dropout" and (len(node.output) < 2 or not node.output[1]):
        out = info.get(node.output[0])
        return (out.numel,) if out is not None else ()  # bool mask, one byte per element
    if op == "ConvTranspose" and len(node.input) >= 2:
        return (_conv_transpose_columns(node, info),)
    if op == "ScatterElements" and len(node.input) >= 2:
        idx = info.get(node.input[1])
        return (idx.numel * 8,) if idx is not None else ()
    if op in ("Softmax", "LogSoftmax") and opset >= 13:
        x = info.get(node.input[0])
        if x is None or len(x.shape) < 2:
            return ()
        axis = attr(node, "axis", -1)
        axis = axis + len(x.shape) if axis < 0 else axis
        return (x.nbytes, x.nbytes) if axis != len(x.shape) - 1 else ()
    return ()


# MLAS's convolution (onnxruntime/core/mlas/lib/convolve.cpp, MlasConvPrepare): per-thread
# working buffers of STRIDEN x STRIDEK floats, threads by multiplies per thread.
MLAS_CONV_BUFFER_PER_THREAD = 128 * 128
MLAS_THREAD_COMPLEXITY = 64 * 1024
MLAS_MAXIMUM_THREADS = 16
MLAS_STRIDEN_ALIGN = 16


def _mlas_conv_working_bytes(node: onnx.NodeProto, info: Mapping[str, TensorInfo],
                             threads: int) -> int:
    """The working buffer ORT's CPU Conv takes from its allocator (float Conv through MLAS):
    none for a pointwise convolution; the whole im2col matrix when there are more filters
    than output positions; else a 64 KiB block per thread it uses."""
    if len(node.input) < 2:
        return 0
    x, w, y = (info.get(n) for n in (node.input[0], node.input[1], node.output[0]))
    if x is None or w is None or y is None or not 3 <= len(w.shape) <= 5 or x.itemsize != 4:
        return 0
    dims = len(w.shape) - 2
    filters = int(w.shape[0]) // max(int(attr(node, "group", 1)), 1)
    k = int(np.prod(w.shape[1:]))           # input channels per group x kernel size
    out_size = int(np.prod(y.shape[2:]))
    strides = list(attr(node, "strides", [1] * dims))
    pads = list(attr(node, "pads", [0] * 2 * dims))
    auto_pad = attr(node, "auto_pad", b"NOTSET")
    padded = any(pads) or auto_pad not in (b"NOTSET", "NOTSET", b"VALID", "VALID")
    if all(s == 1 for s in strides) and not padded and k == int(w.shape[1]):
        return 0  # pointwise: a GEMM straight on the input
    if filters > out_size:
        return out_size * k * 4
    complexity = filters * out_size * k
    target = (complexity // MLAS_THREAD_COMPLEXITY + 1
              if complexity < MLAS_THREAD_COMPLEXITY * MLAS_MAXIMUM_THREADS
              else MLAS_MAXIMUM_THREADS)
    target = max(1, min(target, threads))
    stride_n = -(-out_size // target)
    if target > 1:
        stride_n = -(-stride_n // MLAS_STRIDEN_ALIGN) * MLAS_STRIDEN_ALIGN
        if stride_n >= out_size:
            target = 1
        elif stride_n * (target - 1) >= out_size:
            target -= 1
    return target * MLAS_CONV_BUFFER_PER_THREAD * 4


def _conv_transpose_columns(node: onnx.NodeProto, info: Mapping[str, TensorInfo]) -> int:
    """ORT's ConvTranspose expands one image into a column buffer before col2im:
    (output channels per group x kernel size) x input image size elements."""
    x, w = info.get(node.input[0]), info.get(node.input[1])
    if x is None or w is None or len(w.shape) < 3:
        return 0
    kernel = math.prod(w.shape[2:])
    image = math.prod(x.shape[2:])
    return w.shape[1] * kernel * image * x.itemsize  # w: [C_in, C_out / group, *kernel]


def scratch_on_heap(node: onnx.NodeProto) -> bool:
    """Whether the CPU kernel of ``node`` takes its scratch from glibc's heap rather than
    from its allocator (``HEAP_SCRATCH_OPS``): with the CPU arena on, it is not an arena
    request. CUDA kernels are not covered: their scratch stays an arena request."""
    return node.op_type in HEAP_SCRATCH_OPS


def _broadcast_numel(a: Sequence[int], b: Sequence[int]) -> int:
    """Elements of ``a`` and ``b`` broadcast together (0: they do not broadcast), as
    ``np.broadcast_shapes`` has it, in plain ints (asked for every plan judged)."""
    n = max(len(a), len(b))
    total = 1
    for x, y in zip((1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b),
                    strict=True):
        if x != y and x != 1 and y != 1:
            return 0
        total *= y if x == 1 else x
    return total
