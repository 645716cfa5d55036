"""Convolution weight gradients on CUDA as one MatMul over patches where that is faster.

memcc's rule writes the weight gradient of a k x k convolution as a Conv over batch-swapped
tensors (``_conv_weight_grad`` in ``frontend/gradients/nn.py``): x as [C, N, H, W] convolved
with gy as [M, N, Ho, Wo]. On ORT's CUDA provider that Conv is slow where x has few channels
and many pixels. Measured on an NVIDIA H200 (onnxruntime-gpu 1.31.1, TF32 on both sides,
batch 64, ResNet-50's layers at 224 px; ``benchmarks/conv_weight_grad.py --provider cuda``),
ms per weight gradient, median of 10:

======================  ==========  ===========  ======  ==================
x (C@HxW), kernel        Conv form   patches      cuDNN   this pass
======================  ==========  ===========  ======  ==================
3@224x224 7x7 s2 p3      23.9        1.29         --      patches
64@56x56 3x3             6.02        0.83         0.32    patches
128@56x56 3x3 s2         1.18        0.64         --      patches
128@28x28 3x3            1.04        0.47         --      patches
256@28x28 3x3 s2         0.37        0.42         --      Conv
256@14x14 3x3            0.33        0.32         --      Conv
512@14x14 3x3 s2         0.22        0.29         --      Conv
512@7x7 3x3              0.21        0.29         --      Conv
======================  ==========  ===========  ======  ==================

Whole network's weight gradients: Conv forms 54.6 ms, the fastest form per shape 13.4 ms,
cuDNN's backward-filter 10.9 ms. The rule (``use_patches``): input channels <= 128 and
input pixels H*W >= 784; it picks the faster form on every measured shape. 1x1 convolutions
already take a MatMul in the rule itself and are left alone, as are grouped (depthwise)
convolutions and 1-D / 3-D ones (not measured).

The patches form is the benchmark's ``patches-flat``: x batch-swapped to [C, n, H, W],
zero-padded, its k*k strided views (one per kernel tap) concatenated into patches
[k*k*C, n*Ho*Wo], one MatMul with gy as [n*Ho*Wo, M]. The patches tensor is k*k times the
(strided) input: 9x for a 3x3 convolution, 1.3 GB for 64@56x56 at batch 184. memcc is a
memory compiler, so the batch is cut into chunks (a Slice of x and gy each, one patches
tensor and MatMul per chunk, the partial [k*k*C, M] gradients added by one Sum) so that one
chunk's patches hold at most ``max(bytes of x, 64 MiB)``; the largest is reported as
``patch_bytes_max`` (while Concat runs, its views are live too: twice that). Chunks only
change how the batch sum is split, not the form measured; chunked timings are not measured.

The sums run in another order than the Conv's, so the result matches the step as built
within a tolerance, not bit for bit (``tests/test_conv_weight_grad_cuda.py`` states it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from memcc.def_use import DefUse
from memcc.errors import InputError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.shape_ops import slice_axis, slice_values
from memcc.graph import Graph, TensorInfo, attr
from memcc.step import PLAN_KEY

WEIGHT_GRAD_PROP = "memcc.conv_weight_grad"  # written by _conv_weight_grad on its Conv
MAX_CHANNELS = 128
MIN_PIXELS = 784
CHUNK_FLOOR_BYTES = 64 << 20
FORM_ENV = "MEMCC_CONV_WEIGHT_GRAD"
CHUNK_ENV = "MEMCC_PATCH_CHUNK_BYTES"


def patches_wanted() -> bool:
    """Whether CUDA steps take the patches form (``MEMCC_CONV_WEIGHT_GRAD``: ``patches``, the
    default, or ``conv``, memcc's Conv form everywhere). The rule was measured per layer on
    one GPU (an H200) and not yet as a whole step: the switch lets a user (and
    ``benchmarks/cuda_runtime.py --forms conv-grad-as-conv``) run the step without it.
    compile, run and train must see the same setting, or a compiled plan meets another
    step (a planned step is left alone, so only an unplanned one differs)."""
    value = os.environ.get(FORM_ENV, "patches").strip().lower()
    if value not in ("patches", "conv"):
        raise InputError(f"{FORM_ENV}={value}: choose patches (the default) or conv")
    return value == "patches"
def chunk_floor() -> int:
    """The least bytes one chunk's patches may hold (``CHUNK_FLOOR_BYTES``, or
    ``MEMCC_PATCH_CHUNK_BYTES``). On an H200 the patches' batch chunks of ResNet-50 at batch
    184 ran as 1,359 Slice nodes, 33 ms of 257 ms of blocking kernels
    (BENCHMARKS.md, "Twenty-second session on an H200"): the switch lets
    ``benchmarks/cuda_runtime.py --forms patches-unchunked`` time fewer, larger chunks
    before the default moves. Like ``MEMCC_CONV_WEIGHT_GRAD``, compile, run and train must
    see the same value."""
    value = os.environ.get(CHUNK_ENV, "").strip()
    if not value:
        return CHUNK_FLOOR_BYTES
    try:
        floor = int(value)
    except ValueError:
        floor = -1
    if floor < 1:
        raise InputError(f"{CHUNK_ENV}={value}: give the bytes one chunk's patches may hold "
                         f"(a positive integer; default {CHUNK_FLOOR_BYTES})")
    return floor


_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


@dataclass(frozen=True)
class WeightGrad:
    """One tagged weight gradient: dW swapped ([C, M, kh, kw]) from x and gy."""

    conv: onnx.NodeProto
    x: str
    gy: str
    dw: str
    group: int
    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begins: tuple[int, ...]


def use_patches(channels: int, pixels: int, *, max_channels: int = MAX_CHANNELS,
                min_pixels: int = MIN_PIXELS) -> bool:
    """The measured rule (module docstring): few input channels, many input pixels."""
    return channels <= max_channels and pixels >= min_pixels


def _tagged(node: onnx.NodeProto) -> WeightGrad | None:
    if node.op_type != "Conv" or not node.metadata_props:
        return None
    raw = next((p.value for p in node.metadata_props if p.key == WEIGHT_GRAD_PROP), None)
    if raw is None:
        return None
    try:
        t = json.loads(raw)
        return WeightGrad(node, t["x"], t["gy"], t["dw"], int(t["group"]),
                          *(tuple(int(v) for v in t[k])
                            for k in ("kernel", "strides", "dilations", "begins")))
    except (ValueError, KeyError, TypeError):
        return None


def _defined_in_order(graph: Graph, wg: WeightGrad, position: dict[int, int]) -> bool:
    """x and gy exist before the tagged Conv, and dw is made after it: the tag still
    describes the graph (a pass that renamed or removed its values makes it stale)."""
    producer = graph.def_use().producer
    at = position[id(wg.conv)]
    given = set(graph.inputs) | set(graph.initializers)
    before = all(v in given or (v in producer and position[id(producer[v])] < at)
                 for v in (wg.x, wg.gy))
    return before and wg.dw in producer and position[id(producer[wg.dw])] >= at


def _why_not(graph: Graph, wg: WeightGrad, max_channels: int, min_pixels: int,
             position: dict[int, int]) -> str | None:
    """None when ``wg`` is rewritten; otherwise why it keeps the Conv form."""
    xi, gi, di = (graph.info.get(v) for v in (wg.x, wg.gy, wg.dw))
    if xi is None or gi is None or di is None or not _defined_in_order(graph, wg, position):
        return "stale tag"
    if wg.group != 1 or len(xi.shape) != 4 or len(wg.kernel) != 2:
        return "grouped or not 2-D"
    n, c, h, w = xi.shape
    if (tuple(di.shape) != (c, gi.shape[1], *wg.kernel) or gi.shape[0] != n
            or xi.dtype not in _FLOATS or gi.dtype != xi.dtype or di.dtype != xi.dtype):
        return "stale tag"
    if not use_patches(c, h * w, max_channels=max_channels, min_pixels=min_pixels):
        return "rule"
    return None


def chunk_sizes(batch: int, sample_patch_bytes: int, x_bytes: int,
                floor: int = CHUNK_FLOOR_BYTES) -> list[int]:
    """Batch sizes of the chunks, as even as possible, whose patches each hold at most
    ``max(x_bytes, floor)`` (one sample per chunk when even one is larger)."""
    cap = max(x_bytes, floor)
    per = max(1, cap // max(1, sample_patch_bytes))
    chunks = math.ceil(batch / per)
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def conv_weight_grads_as_patches(graph: Graph, *, max_channels: int = MAX_CHANNELS,
                                 min_pixels: int = MIN_PIXELS,
                                 chunk_floor: int = CHUNK_FLOOR_BYTES) -> tuple[Graph, dict]:
    """A copy of ``graph`` with every weight gradient the rule picks in the patches form
    (``graph`` itself when none is), and the summary: how many were rewritten, how many
    kept their Conv (by reason), and the largest chunk's patches in bytes.

    A step ``memcc compile`` planned (``memcc.plan``) is left as it is: its plan holds for
    the forms it was planned with (compile for CUDA rewrites before planning; a plan's
    variants may re-emit the Conv form, and the patches are larger than that)."""
    planned = PLAN_KEY in graph.metadata
    position = {id(n): i for i, n in enumerate(graph.nodes)}
    found = [(wg, "planned step" if planned
              else _why_not(graph, wg, max_channels, min_pixels, position))
             for wg in map(_tagged, graph.nodes) if wg is not None]
    kept: dict[str, int] = {}
    for _, why in found:
        if why is not None:
            kept[why] = kept.get(why, 0) + 1
    todo = {wg.conv.name for wg, why in found if why is None}
    summary = {"conv_weight_grads_as_patches": len(todo), "conv_weight_grads_kept": kept,
               "patch_bytes_max": 0}
    if not todo:
        return graph, summary
    out = graph.copy(with_index=False)
    emit = Emitter(out, detached=True)
    du = DefUse.build(out.nodes)
    nodes: list[onnx.NodeProto] = []
    drop: set[int] = set()
    for node in out.nodes:
        wg = _tagged(node) if node.name in todo else None
        if wg is None:
            nodes.append(node)
            continue
        start = len(emit.nodes)
        target = _fold_target(du, wg.dw, out.outputs)
        patch_bytes = _emit_patches_grad(emit, wg, target, chunk_floor)
        summary["patch_bytes_max"] = max(summary["patch_bytes_max"], patch_bytes)
        made = emit.nodes[start:]
        provenance = [p for p in node.metadata_props if p.key != WEIGHT_GRAD_PROP]
        for n in made:
            n.metadata_props.extend(provenance)
        nodes.extend(made)
        nodes.append(node)  # the Conv: dead once dw's producer goes, removed below
        drop.add(id(du.producer[wg.dw]))
        if target is not None:
            drop.add(id(target))
    _remove_dead(nodes, drop, set(out.outputs))
    out.set_nodes(nodes)
    return out, summary


def _fold_target(du: DefUse, dw: str, outputs: list[str]) -> onnx.NodeProto | None:
    """dw's one reader when it is the rule's final swap back to [M, C, kh, kw]: the rewrite
    then writes that swap's output directly (one weight-sized Transpose fewer)."""
    readers = du.readers.get(dw, [])
    if dw in outputs or len(readers) != 1:
        return None
    r = readers[0]
    if r.op_type == "Transpose" and list(attr(r, "perm", [])) == [1, 0, 2, 3]:
        return r
    return None


def _emit_patches_grad(emit: Emitter, wg: WeightGrad, fold: onnx.NodeProto | None,
                       chunk_floor: int) -> int:
    """Emit dW from x and gy in the patches form, written to ``wg.dw`` (or to ``fold``'s
    output in the weight's layout); return the largest chunk's patches in bytes."""
    xi, gi = emit.info(wg.x), emit.info(wg.gy)
    n, c = xi.shape[:2]
    m, (oh, ow) = gi.shape[1], gi.shape[2:]
    (kh, kw), kk = wg.kernel, wg.kernel[0] * wg.kernel[1]
    sample = kk * c * oh * ow * xi.itemsize
    sizes = chunk_sizes(n, sample, xi.nbytes, chunk_floor)
    parts, lo = [], 0
    for size in sizes:
        hi = lo + size
        xc = slice_axis(emit, wg.x, 0, lo, hi) if len(sizes) > 1 else wg.x
        gc = slice_axis(emit, wg.gy, 0, lo, hi) if len(sizes) > 1 else wg.gy
        pf = _patches(emit, wg, xc, (oh, ow))  # [k*k*C, size*P], tap-major rows
        gf = emit.reshape(emit.transpose(gc, [0, 2, 3, 1]), [size * oh * ow, m])
        parts.append(emit.op("MatMul", [pf, gf], info=TensorInfo(xi.dtype, (kk * c, m))))
        lo = hi
    total = parts[0] if len(parts) == 1 else emit.op(
        "Sum", parts, info=TensorInfo(xi.dtype, (kk * c, m)))
    taps = emit.reshape(total, [kh, kw, c, m])
    if fold is not None:
        emit.op("Transpose", [taps], outputs=[fold.output[0]], perm=[3, 2, 0, 1],
                info=TensorInfo(xi.dtype, (m, c, kh, kw)))
    else:
        emit.op("Transpose", [taps], outputs=[wg.dw], perm=[2, 3, 0, 1],
                info=TensorInfo(xi.dtype, (c, m, kh, kw)))
    return max(sizes) * sample


def _patches(emit: Emitter, wg: WeightGrad, x: str, out_sp: tuple[int, int]) -> str:
    """im2col in standard ops: [k*k*C, n*Ho*Wo], row t*C + c for tap t, channel c."""
    n, c, *in_sp = emit.info(x).shape
    xt = emit.transpose(x, [1, 0, 2, 3])  # [C, n, H, W]: the views come out batch-swapped
    ends = [max(0, (o - 1) * s + (k - 1) * d + 1 - i - b) for o, s, k, d, i, b in zip(
        out_sp, wg.strides, wg.kernel, wg.dilations, in_sp, wg.begins, strict=True)]
    if any(wg.begins) or any(ends):
        pads = [0, 0, *wg.begins, 0, 0, *ends]
        padded = tuple(i + b + e for i, b, e in zip(in_sp, wg.begins, ends, strict=True))
        xt = emit.op("Pad", [xt, emit.ints(pads)], mode="constant",
                     info=TensorInfo(emit.info(x).dtype, (c, n, *padded)))
    (kh, kw), (dh, dw), (sh, sw), (oh, ow) = wg.kernel, wg.dilations, wg.strides, out_sp
    views = [slice_values(emit, xt, [i * dh, j * dw],
                          [i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1],
                          [2, 3], [sh, sw])
             for i in range(kh) for j in range(kw)]
    dtype = emit.info(x).dtype
    cat = views[0] if len(views) == 1 else emit.op(
        "Concat", views, axis=0, info=TensorInfo(dtype, (len(views) * c, n, oh, ow)))
    return emit.reshape(cat, [len(views) * c, n * oh * ow])


def _remove_dead(nodes: list[onnx.NodeProto], drop: set[int], outputs: set[str]) -> None:
    """Remove the nodes in ``drop`` (by id), then, in place, every node that only fed them:
    the rule's batch swaps, its Conv and slice, their constants."""
    du = DefUse.build([n for n in nodes if id(n) not in drop])
    work = [v for n in nodes if id(n) in drop for v in n.input if v]
    dead = set(drop)
    while work:
        v = work.pop()
        p = du.producer.get(v)
        if p is None or id(p) in dead or any(
                o in outputs or du.reader_count(o) for o in p.output if o):
            continue
        dead.add(id(p))
        du.remove(p)
        work.extend(i for i in p.input if i)
    nodes[:] = [n for n in nodes if id(n) not in dead]
