"""Convolution weight gradients on ORT's CPU or CUDA provider: each standard-ONNX formulation
against PyTorch's own weight gradient on the same device.

Issue 30 asks for the fastest standard-ONNX spelling of a convolution's weight gradient on
each provider, and whether any comes within 2x of the framework's own backward-filter
kernel. ORT's released packages have no gradient kernels, so memcc writes dW with forward
ops (``memcc/frontend/gradients/nn.py``): a Conv over batch-swapped activations, or a MatMul
over pixels for 1x1 convolutions. Many other spellings compute the same numbers; which is
fastest depends on the shape. This script measures them one layer at a time:

    python benchmarks/conv_weight_grad.py [--provider cpu|cuda] [--tf32 on|off]
        [--batch 8] [--resolution 64] [--threads 2] [--rounds 10]
        [--models resnet50 mobilenetv2] [--shape SPEC ...] [--budget-s S] [--slow-ms MS]
        [--out FILE.json]

Shapes: every distinct Conv of the zoo's ResNet-50 (torchvision's layers, ``models/resnet``)
and every depthwise Conv (group = channels) of its MobileNetV2, at ``--batch`` and
``--resolution`` (224 is ImageNet's; the default 64 keeps a run to a few minutes on 2
cores). ``--shape NxCxHxW:MxCgxKHxKW[:sS][:pP][:dD][:gG]`` (repeatable) measures the given
layers instead, e.g. ``8x64x16x16:64x64x3x3:s1:p1``.

For each shape every formulation that applies is a small ONNX model from (x, gy) to dW:

``memcc``        what memcc's autodiff emits today for this Conv (its own rule, run through
                 ``memcc.frontend.autodiff.differentiate`` with gy as the seed).
``tconv``        the Conv over batch-swapped tensors (memcc's rule for every non-1x1 layer;
                 listed separately only for 1x1 layers, where memcc uses a MatMul).
``chunks2``      ``tconv`` over each half of the batch, the two results added.
``per-sample``   one Conv per sample, summed: a sample's x [1, C, H, W] *is* a batch of C
                 one-channel images and its gy [1, M, oh, ow] a set of M one-channel
                 filters once reshaped, so no transposes at all (grouped by channel for
                 depthwise layers).
``mm-bmm``       1x1: x as [N, C, P], gy as [N, M, P], the smaller transposed, a batched
                 MatMul and a ReduceSum over the batch.
``mm-flat``      1x1: both transposed to [C, N*P] and [N*P, M], one MatMul.
``einsum``       one Einsum over x (1x1) or its patches (k x k).
``patches-bmm``  k x k: the k*k shifted, strided views of x concatenated into patches
                 [N, k*k*C, P] (im2col with Slice and Concat), a batched MatMul with gy as
                 [N, P, M], ReduceSum over the batch.
``patches-flat`` k x k: patches of the batch-swapped x as [k*k*C, N*P], one MatMul.
``grouped-nc``   depthwise: one Conv with group = N*C over x as [1, N*C, H, W] and gy as
                 [N*C, 1, oh, ow] (both plain reshapes), a ReduceSum over the batch.
``patches-mul``  depthwise: patches [N, C, k*k, P] times gy [N, C, 1, P], a ReduceSum.
``taps``         depthwise: per kernel tap a Slice, a Mul by gy and a ReduceSum, concatenated.
``taps-t``       ``taps`` on batch-swapped x and gy ([C, N, ...]: each sum over trailing axes).
``patches-bmv``  depthwise: patches of the batch-swapped x as [C, k*k, N*P] times gy as
                 [C, N*P, 1]: one batched matrix-vector MatMul.

Every form is checked against float64 ``torch.nn.grad.conv2d_weight`` (largest difference
relative to the largest reference value) and timed under memcc's execution contract
(``memcc.backend.session.make_session``: ORT_DISABLE_ALL, ``--threads`` intra-op threads)
in interleaved rounds (``benchmarks/stats.interleaved_times``) together with PyTorch's own
weight gradient for the same layer (``aten.convolution_backward`` with output_mask [False,
True, False], ``torch.set_num_threads(--threads)``), twice: as torch dispatches it (oneDNN
on this CPU) and with oneDNN off (``torch.backends.mkldnn.enabled = False``: ATen's own
kernel); fastest/torch is against the faster of the two. Both matter on a loaded machine:
on the project's 2 shared cores, a 1x1 64->64 layer at 16x16, batch 8, took torch 3-36 ms
through oneDNN at 2 threads, 0.2 ms through ATen's kernel and 0.15 ms through oneDNN on 1
thread (oneDNN's OpenMP regions wait for a descheduled worker). Torch's OpenMP workers wait
passively (``OMP_WAIT_POLICY=PASSIVE``, set before torch loads, as
``benchmarks/torch_peer.py`` does; ``--omp-wait-policy inherit`` keeps the environment's).
The tables give each form's median ms, the fastest, torch's ms and fastest/torch; the
summary says for how many shapes the fastest standard form is within 2x of torch, and the
whole networks' sums (each shape weighted by the number of layers it stands for).

Every form runs through IOBinding (``BoundForm``) on both providers: x and gy bound once
as OrtValues on the provider's device, dW bound to a preallocated buffer there, and every
timed call synchronised, so no host copy is timed (as ``benchmarks/cuda_kernel_forms.py``).
``--provider cuda`` times the same forms on ORT's CUDA provider (memcc's contract: cuDNN's
HEURISTIC algorithm choice, ``memcc.backend.session.cudnn_conv_algo_search``) against
torch on the GPU through cuDNN twice, with its heuristic choice (torch's default) and with
``cudnn.benchmark``; the float64 reference is computed on the GPU. ``--tf32 on`` (the
default) allows TF32 on both sides (ORT's ``use_tf32=1``, its default, said explicitly;
torch's ``cudnn.allow_tf32`` and ``cuda.matmul.allow_tf32``), and the error tolerance is
then 1e-2 instead of 1e-4; ``--tf32 off`` forbids it on both. The fastest form is the
fastest within the tolerance. A form whose session cannot load or run (out of memory
included) is an error row, a shape that fails as a whole (torch's tensors) an error row
of the run; ``--slow-ms`` (default 250 on CUDA) times a form slower than that on one call,
outside the rounds. Network shapes run most network time (FLOPs x layers) first;
``--budget-s`` starts no new shape after that many seconds and lists the rest as skipped;
``--out`` is rewritten after every shape (``complete`` false and ``pending`` until the
end), so a run killed by a time limit keeps its rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402

OPSET = 17
WITHIN = 2.0  # the bar: fastest standard form within this factor of torch
FORMS = {
    "pointwise": ["memcc", "tconv", "chunks2", "per-sample", "mm-bmm", "mm-flat", "einsum"],
    "spatial": ["memcc", "chunks2", "per-sample", "patches-bmm", "patches-flat", "einsum"],
    "depthwise": ["memcc", "chunks2", "per-sample", "grouped-nc", "patches-mul", "taps",
                  "taps-t", "patches-bmv"],
    "grouped": ["memcc", "chunks2"],
}


# ---------------------------------------------------------------------------- shapes
@dataclass(frozen=True)
class ConvShape:
    """One 2-D convolution layer: input, weight and window, symmetric pads."""

    x: tuple[int, int, int, int]
    w: tuple[int, int, int, int]
    stride: tuple[int, int] = (1, 1)
    pads: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    group: int = 1
    family: str = "custom"
    name: str = ""
    count: int = 1  # how many layers of the network have this shape

    @property
    def out(self) -> tuple[int, int]:
        return tuple((i + 2 * p - ((k - 1) * d + 1)) // s + 1 for i, p, k, d, s in zip(
            self.x[2:], self.pads, self.w[2:], self.dilation, self.stride, strict=True))

    @property
    def kind(self) -> str:
        """Which formulations apply: pointwise (1x1, no pads, group 1), spatial (group 1),
        depthwise (group = input = output channels) or grouped (anything else)."""
        if self.group == 1:
            if self.w[2:] == (1, 1) and self.pads == (0, 0):
                return "pointwise"
            return "spatial"
        if self.group == self.x[1] == self.w[0] and self.w[1] == 1:
            return "depthwise"
        return "grouped"

    @property
    def flops(self) -> int:
        """Multiply-adds of the weight gradient, times two (as of the forward Conv)."""
        n, c = self.x[:2]
        return 2 * n * self.w[0] * (c // self.group) * self.w[2] * self.w[3] * int(
            np.prod(self.out))

    @property
    def label(self) -> str:
        text = ("x" + "x".join(map(str, self.x)) + " w" + "x".join(map(str, self.w))
                + f" s{self.stride[0]}")
        if any(self.pads):
            text += f" p{self.pads[0]}"
        if self.dilation != (1, 1):
            text += f" d{self.dilation[0]}"
        if self.group != 1:
            text += f" g{self.group}"
        return text

    def to_json(self) -> dict:
        return {"label": self.label, "family": self.family, "name": self.name,
                "count": self.count, "kind": self.kind, "gflops": self.flops / 1e9,
                "x": list(self.x), "w": list(self.w),
                "stride": list(self.stride), "pads": list(self.pads),
                "dilation": list(self.dilation), "group": self.group, "out": list(self.out)}


_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)x(\d+):(\d+)x(\d+)x(\d+)x(\d+)((?::[spdg]\d+)*)$")


def parse_shape(text: str) -> ConvShape:
    """``NxCxHxW:MxCgxKHxKW[:sS][:pP][:dD][:gG]`` (argparse type: its errors exit 2)."""
    m = _SPEC.match(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(
            f"--shape {text!r}: write NxCxHxW:MxCgxKHxKW[:sS][:pP][:dD][:gG], e.g. "
            "8x64x16x16:64x64x3x3:s1:p1")
    dims = [int(v) for v in m.groups()[:8]]
    opts = {t[0]: int(t[1:]) for t in m.group(9).split(":") if t}
    s, p, d, g = opts.get("s", 1), opts.get("p", 0), opts.get("d", 1), opts.get("g", 1)
    shape = ConvShape(tuple(dims[:4]), tuple(dims[4:]), (s, s), (p, p), (d, d), g,
                      family="custom", name=text.strip())
    problem = None
    if min(dims) < 1 or s < 1 or d < 1 or g < 1:
        problem = "every size, stride, dilation and group must be at least 1"
    elif shape.x[1] % g or shape.w[0] % g or shape.x[1] // g != shape.w[1]:
        problem = (f"the weight's second dimension must be channels / group "
                   f"({shape.x[1]} / {g}) and its first a multiple of the group")
    elif min(shape.out) < 1:
        problem = f"the output would be empty ({shape.out})"
    if problem:
        raise argparse.ArgumentTypeError(f"--shape {text!r}: {problem}")
    return shape


def network_shapes(models: Sequence[str], batch: int, resolution: int) -> list[ConvShape]:
    """Distinct Conv layers of the zoo's ResNet-50 (all) and MobileNetV2 (depthwise only),
    in network order, each with the number of layers it stands for."""
    from memcc.frontend.load import load_graph
    from memcc.graph import attr
    from models import build_model

    options = {"resnet50": dict(width=64), "mobilenetv2": dict(width_mult=1.0)}
    shapes: dict[tuple, ConvShape] = {}
    for family in models:
        g = load_graph(build_model(family, batch=batch, resolution=resolution,
                                   num_classes=1000, **options[family]))
        for node in g.nodes:
            if node.op_type != "Conv":
                continue
            pads = tuple(attr(node, "pads", [0, 0, 0, 0]))
            shape = ConvShape(tuple(g.info[node.input[0]].shape),
                              tuple(g.info[node.input[1]].shape),
                              tuple(attr(node, "strides", [1, 1])), pads[:2],
                              tuple(attr(node, "dilations", [1, 1])),
                              int(attr(node, "group", 1)), family, node.name)
            if family == "mobilenetv2" and shape.kind != "depthwise":
                continue
            key = (family, shape.label)
            if key in shapes:
                old = shapes[key]
                shapes[key] = ConvShape(old.x, old.w, old.stride, old.pads, old.dilation,
                                        old.group, family, old.name, old.count + 1)
            else:
                shapes[key] = shape
    return list(shapes.values())


# ---------------------------------------------------------------------------- forms
class _Net:
    """The nodes of one form's model, from inputs ``x`` and ``gy`` to output ``dw``."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []

    def op(self, op_type: str, inputs: Sequence[str], **attrs) -> str:
        out = f"v{len(self.nodes)}_{op_type.lower()}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out],
                                           name=f"n{len(self.nodes)}", **attrs))
        return out

    def ops(self, op_type: str, inputs: Sequence[str], n: int, **attrs) -> list[str]:
        outs = [f"v{len(self.nodes)}_{op_type.lower()}{i}" for i in range(n)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=f"n{len(self.nodes)}", **attrs))
        return outs

    def ints(self, values: Sequence[int]) -> str:
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(list(values), np.int64), name))
        return name

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        return self.op("Reshape", [x, self.ints(shape)])

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        return self.op("Transpose", [x], perm=list(perm))

    def slice(self, x: str, starts, ends, axes, steps=None) -> str:
        inputs = [x, self.ints(starts), self.ints(ends), self.ints(axes)]
        if steps is not None and any(k != 1 for k in steps):
            inputs.append(self.ints(steps))
        return self.op("Slice", inputs)

    def reduce_sum(self, x: str, axes: Sequence[int]) -> str:
        return self.op("ReduceSum", [x, self.ints(axes)], keepdims=0)

    def split(self, x: str, sizes: Sequence[int]) -> list[str]:
        return self.ops("Split", [x, self.ints(sizes)], len(sizes), axis=0)

    def model(self, out: str, s: ConvShape) -> onnx.ModelProto:
        for node in self.nodes:  # the last value is the model's output, named dw
            for i, o in enumerate(node.output):
                if o == out:
                    node.output[i] = "dw"
        graph = helper.make_graph(self.nodes, "dw", _io_inputs(s), [
            helper.make_tensor_value_info("dw", TensorProto.FLOAT, list(s.w))], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
        model.ir_version = 8
        return model


def _io_inputs(s: ConvShape) -> list[onnx.ValueInfoProto]:
    return [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(s.x)),
            helper.make_tensor_value_info("gy", TensorProto.FLOAT, [s.x[0], s.w[0], *s.out])]


def _tconv_ends(s: ConvShape, in_sp: Sequence[int]) -> tuple[list[int], list[int]]:
    """End pads of the batch-swapped Conv just large enough to compute the last kernel tap,
    and the taps it then computes (memcc's rule: never negative, sliced when too many)."""
    ends = [max(0, (k - 1) * d + (o - 1) * st + 1 - i - b) for k, d, o, st, i, b in
            zip(s.w[2:], s.dilation, s.out, s.stride, in_sp, s.pads, strict=True)]
    got = [(i + b + e - (o - 1) * st - 1) // d + 1 for i, b, e, o, st, d in
           zip(in_sp, s.pads, ends, s.out, s.stride, s.dilation, strict=True)]
    return ends, got


def _tconv_raw(net: _Net, s: ConvShape, x: str, gy: str, n: int) -> tuple[str, list[int]]:
    """The Conv over batch-swapped tensors on a batch of ``n``: [Cg, M, *got] (not yet
    cropped to the kernel nor transposed), as memcc's ``_conv_weight_grad`` spells it."""
    c, h, w = s.x[1], s.x[2], s.x[3]
    cg = c // s.group
    if s.group == 1:
        xt = net.transpose(x, [1, 0, 2, 3])
    else:
        xr = net.transpose(net.reshape(x, [n, s.group, cg, h, w]), [2, 1, 0, 3, 4])
        xt = net.reshape(xr, [cg, s.group * n, h, w])
    gt = net.transpose(gy, [1, 0, 2, 3])
    ends, got = _tconv_ends(s, (h, w))
    dw = net.op("Conv", [xt, gt], kernel_shape=list(s.out), strides=list(s.dilation),
                dilations=list(s.stride), pads=list(s.pads) + ends, group=s.group)
    return dw, got


def _crop(net: _Net, s: ConvShape, dw: str, got: Sequence[int], axes=(2, 3)) -> str:
    if list(got) != list(s.w[2:]):
        dw = net.slice(dw, [0, 0], list(s.w[2:]), list(axes))
    return dw


def _form_tconv(s: ConvShape) -> tuple[_Net, str]:
    net = _Net()
    dw, got = _tconv_raw(net, s, "x", "gy", s.x[0])
    return net, net.transpose(_crop(net, s, dw, got), [1, 0, 2, 3])


def _form_chunks2(s: ConvShape) -> tuple[_Net, str]:
    n = s.x[0]
    if n < 2:
        raise ValueError("a batch of 1 has no halves")
    net = _Net()
    sizes = [n // 2, n - n // 2]
    parts = []
    for xi, gi, ni in zip(net.split("x", sizes), net.split("gy", sizes), sizes, strict=True):
        dw, got = _tconv_raw(net, s, xi, gi, ni)
        parts.append(dw)
    total = net.op("Add", parts)
    return net, net.transpose(_crop(net, s, total, got), [1, 0, 2, 3])


def _form_per_sample(s: ConvShape) -> tuple[_Net, str]:
    n, c, h, w = s.x
    m, (oh, ow) = s.w[0], s.out
    net = _Net()
    ends, got = _tconv_ends(s, (h, w))
    xs = net.split("x", [1] * n) if n > 1 else ["x"]
    gs = net.split("gy", [1] * n) if n > 1 else ["gy"]
    parts = []
    depthwise = s.kind == "depthwise"
    for xi, gi in zip(xs, gs, strict=True):
        # group 1: C one-channel images, M one-channel filters: out [C, M, *got].
        # depthwise: one C-channel image, C filters of one channel each: out [1, C, *got].
        img = xi if depthwise else net.reshape(xi, [c, 1, h, w])
        filt = net.reshape(gi, [m, 1, oh, ow])
        parts.append(net.op("Conv", [img, filt], kernel_shape=[oh, ow],
                            strides=list(s.dilation), dilations=list(s.stride),
                            pads=list(s.pads) + ends, group=c if depthwise else 1))
    total = net.op("Sum", parts) if len(parts) > 1 else parts[0]
    total = _crop(net, s, total, got)
    if depthwise:
        return net, net.reshape(total, list(s.w))
    return net, net.transpose(total, [1, 0, 2, 3])


def _strided_x(net: _Net, s: ConvShape) -> str:
    """x at the pixels a 1x1 convolution reads (every stride-th)."""
    if s.stride == (1, 1):
        return "x"
    return net.slice("x", [0, 0], list(s.x[2:]), [2, 3], list(s.stride))


def _form_mm_bmm(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    m, p = s.w[0], s.out[0] * s.out[1]
    net = _Net()
    xr = net.reshape(_strided_x(net, s), [n, c, p])
    gr = net.reshape("gy", [n, m, p])
    if c <= m:  # transpose the smaller operand
        dw = net.reduce_sum(net.op("MatMul", [gr, net.transpose(xr, [0, 2, 1])]), [0])
    else:
        dw = net.transpose(net.reduce_sum(
            net.op("MatMul", [xr, net.transpose(gr, [0, 2, 1])]), [0]), [1, 0])
    return net, net.reshape(dw, list(s.w))


def _form_mm_flat(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    m, p = s.w[0], s.out[0] * s.out[1]
    net = _Net()
    xr = net.reshape(_strided_x(net, s), [n, c, p])
    gr = net.reshape("gy", [n, m, p])
    gf = net.reshape(net.transpose(gr, [1, 0, 2]), [m, n * p])
    xf = net.reshape(net.transpose(xr, [0, 2, 1]), [n * p, c])
    return net, net.reshape(net.op("MatMul", [gf, xf]), list(s.w))


def _padded(net: _Net, s: ConvShape, x: str, spatial_axes: Sequence[int], rank: int) -> str:
    """``x`` zero-padded so that every kernel tap's strided view lies inside it."""
    begins, ends = [0] * rank, [0] * rank
    for a, i, b, k, d, o, st in zip(spatial_axes, s.x[2:], s.pads, s.w[2:], s.dilation,
                                    s.out, s.stride, strict=True):
        begins[a] = b
        ends[a] = max(0, (o - 1) * st + (k - 1) * d + 1 - i - b)
    if not any(begins) and not any(ends):
        return x
    return net.op("Pad", [x, net.ints(begins + ends)], mode="constant")


def _tap_views(net: _Net, s: ConvShape, xp: str, axes: Sequence[int]) -> list[str]:
    """The k*k strided views of padded ``xp`` (row-major taps), each shaped like gy's
    pixels on ``axes``."""
    (kh, kw), (dh, dw), (sh, sw), (oh, ow) = s.w[2:], s.dilation, s.stride, s.out
    views = []
    for i in range(kh):
        for j in range(kw):
            starts = [i * dh, j * dw]
            ends = [i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1]
            views.append(net.slice(xp, starts, ends, list(axes), [sh, sw]))
    return views


def _patches(net: _Net, s: ConvShape) -> str:
    """im2col with standard ops: [N, k*k*C, P], tap-major (tap t, channel c at t*C + c)."""
    n, c = s.x[:2]
    kk, p = s.w[2] * s.w[3], s.out[0] * s.out[1]
    views = _tap_views(net, s, _padded(net, s, "x", (2, 3), 4), (2, 3))
    cat = net.op("Concat", views, axis=1) if len(views) > 1 else views[0]
    return net.reshape(cat, [n, kk * c, p])


def _from_tap_major(net: _Net, s: ConvShape, dw: str) -> str:
    """[k*k*C, M] (tap-major rows) to the weight layout [M, C, kh, kw]."""
    m, c, kh, kw = s.w
    return net.transpose(net.reshape(dw, [kh, kw, c, m]), [3, 2, 0, 1])


def _form_patches_bmm(s: ConvShape) -> tuple[_Net, str]:
    n, m, p = s.x[0], s.w[0], s.out[0] * s.out[1]
    net = _Net()
    pt = _patches(net, s)
    gt = net.reshape(net.transpose("gy", [0, 2, 3, 1]), [n, p, m])
    dw = net.reduce_sum(net.op("MatMul", [pt, gt]), [0])  # [k*k*C, M]
    return net, _from_tap_major(net, s, dw)


def _form_patches_flat(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    m, kk, p = s.w[0], s.w[2] * s.w[3], s.out[0] * s.out[1]
    net = _Net()
    xt = net.transpose("x", [1, 0, 2, 3])  # [C, N, H, W]: the views come out batch-swapped
    views = _tap_views(net, s, _padded(net, s, xt, (2, 3), 4), (2, 3))
    cat = net.op("Concat", views, axis=0) if len(views) > 1 else views[0]
    pf = net.reshape(cat, [kk * c, n * p])
    gf = net.reshape(net.transpose("gy", [0, 2, 3, 1]), [n * p, m])
    return net, _from_tap_major(net, s, net.op("MatMul", [pf, gf]))


def _form_einsum(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    m, p = s.w[0], s.out[0] * s.out[1]
    net = _Net()
    gr = net.reshape("gy", [n, m, p])
    if s.kind == "pointwise":
        xr = net.reshape(_strided_x(net, s), [n, c, p])
        return net, net.reshape(net.op("Einsum", [gr, xr], equation="nmp,ncp->mc"),
                                list(s.w))
    dw = net.op("Einsum", [_patches(net, s), gr], equation="nkp,nmp->km")
    return net, _from_tap_major(net, s, dw)


def _form_grouped_nc(s: ConvShape) -> tuple[_Net, str]:
    n, c, h, w = s.x
    oh, ow = s.out
    net = _Net()
    ends, got = _tconv_ends(s, (h, w))
    xr = net.reshape("x", [1, n * c, h, w])
    gr = net.reshape("gy", [n * c, 1, oh, ow])
    dw = net.op("Conv", [xr, gr], kernel_shape=[oh, ow], strides=list(s.dilation),
                dilations=list(s.stride), pads=list(s.pads) + ends, group=n * c)
    dw = net.reduce_sum(net.reshape(dw, [n, c, *got]), [0])  # [C, *got]
    return net, net.reshape(_crop(net, s, dw, got, axes=(1, 2)), list(s.w))


def _form_patches_mul(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    p = s.out[0] * s.out[1]
    net = _Net()
    views = [net.reshape(v, [n, c, 1, p])
             for v in _tap_views(net, s, _padded(net, s, "x", (2, 3), 4), (2, 3))]
    cat = net.op("Concat", views, axis=2) if len(views) > 1 else views[0]
    prod = net.op("Mul", [cat, net.reshape("gy", [n, c, 1, p])])
    return net, net.reshape(net.reduce_sum(prod, [0, 3]), list(s.w))  # [C, k*k]


def _form_taps(s: ConvShape) -> tuple[_Net, str]:
    c = s.x[1]
    net = _Net()
    sums = [net.reshape(net.reduce_sum(net.op("Mul", [v, "gy"]), [0, 2, 3]), [c, 1])
            for v in _tap_views(net, s, _padded(net, s, "x", (2, 3), 4), (2, 3))]
    cat = net.op("Concat", sums, axis=1) if len(sums) > 1 else sums[0]
    return net, net.reshape(cat, list(s.w))


def _form_patches_bmv(s: ConvShape) -> tuple[_Net, str]:
    n, c = s.x[:2]
    p = s.out[0] * s.out[1]
    net = _Net()
    xt = net.transpose("x", [1, 0, 2, 3])  # [C, N, H, W]
    views = [net.reshape(v, [c, 1, n * p])
             for v in _tap_views(net, s, _padded(net, s, xt, (2, 3), 4), (2, 3))]
    cat = net.op("Concat", views, axis=1) if len(views) > 1 else views[0]  # [C, k*k, N*P]
    gt = net.reshape(net.transpose("gy", [1, 0, 2, 3]), [c, n * p, 1])
    return net, net.reshape(net.op("MatMul", [cat, gt]), list(s.w))  # [C, k*k, 1]


def _form_taps_t(s: ConvShape) -> tuple[_Net, str]:
    c = s.x[1]
    net = _Net()
    xt = net.transpose("x", [1, 0, 2, 3])  # [C, N, H, W]: each tap's sum over trailing axes
    gt = net.transpose("gy", [1, 0, 2, 3])
    sums = [net.reshape(net.reduce_sum(net.op("Mul", [v, gt]), [1, 2, 3]), [c, 1])
            for v in _tap_views(net, s, _padded(net, s, xt, (2, 3), 4), (2, 3))]
    cat = net.op("Concat", sums, axis=1) if len(sums) > 1 else sums[0]
    return net, net.reshape(cat, list(s.w))


def memcc_form(s: ConvShape) -> onnx.ModelProto:
    """What memcc's autodiff emits for this Conv's weight gradient, alone: a forward model
    y = Conv(x, w), loss = ReduceSum(y), differentiated for w with gy seeded as y's
    gradient (the loss's own rule skipped), then cut down to the nodes dW depends on."""
    from memcc.frontend.autodiff import differentiate
    from memcc.frontend.load import load_graph
    from memcc.graph import ancestors

    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", kernel_shape=list(s.w[2:]),
                            strides=list(s.stride), pads=list(s.pads) * 2,
                            dilations=list(s.dilation), group=s.group)
    loss = helper.make_node("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0)
    inputs = _io_inputs(s) + [helper.make_tensor_value_info("w", TensorProto.FLOAT, list(s.w))]
    model = helper.make_model(helper.make_graph(
        [conv, loss], "layer", inputs,
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]),
        opset_imports=[helper.make_opsetid("", OPSET)])
    graph = load_graph(model)
    dw = differentiate(graph, "loss", ["w"], seeds={"y": "gy"}, skip=["loss"])["w"]
    producer = {o: n for n in graph.nodes for o in n.output}
    needed, _ = ancestors([dw], producer)
    keep = {id(n) for n in needed}
    graph.nodes = [n for n in graph.nodes if id(n) in keep]
    graph.inputs = ["x", "gy"]
    graph.outputs = [dw]
    used = {i for n in graph.nodes for i in n.input}
    graph.initializers = {k: v for k, v in graph.initializers.items() if k in used}
    return graph.to_model()


BUILDERS: dict[str, Callable[[ConvShape], tuple[_Net, str]]] = {
    "tconv": _form_tconv,
    "chunks2": _form_chunks2,
    "per-sample": _form_per_sample,
    "mm-bmm": _form_mm_bmm,
    "mm-flat": _form_mm_flat,
    "einsum": _form_einsum,
    "patches-bmm": _form_patches_bmm,
    "patches-flat": _form_patches_flat,
    "grouped-nc": _form_grouped_nc,
    "patches-mul": _form_patches_mul,
    "taps": _form_taps,
    "taps-t": _form_taps_t,
    "patches-bmv": _form_patches_bmv,
}


def form_model(s: ConvShape, form: str) -> onnx.ModelProto:
    """The ONNX model of ``form`` for layer ``s``: inputs x and gy, output dW."""
    if form == "memcc":
        return memcc_form(s)
    net, out = BUILDERS[form](s)
    return net.model(out, s)


# ---------------------------------------------------------------------------- measuring
FP32_TOL = 1e-4  # float32 accumulation against the float64 reference
TF32_TOL = 1e-2  # TF32 rounds every product's inputs to 10 mantissa bits (about 1e-3 seen)
DEFAULT_SLOW_MS = {"cuda": 250.0, "cpu": None}
# PyTorch's two kernels per provider: the name the timing uses -> the JSON key and column.
TORCH_KERNELS = {
    "cpu": {"torch": ("onednn", "torch (oneDNN)"), "torch-native": ("native", "torch (native)")},
    "cuda": {"torch": ("cudnn", "torch (cuDNN)"),
             "torch-benchmark": ("cudnn_benchmark", "torch (cuDNN benchmark)")},
}


@dataclass(frozen=True)
class RunConfig:
    """How a run measures. ``provider``: ORT's provider and torch's device. ``tf32`` (CUDA
    only): TF32 allowed on both sides or on neither (ORT's ``use_tf32`` provider option;
    torch's cuDNN and matmul flags). ``slow_ms``: a form whose warm call takes longer is
    timed on that call alone, not in the rounds, so one pathological form cannot spend a
    GPU call's time (None: every form goes into the rounds, the CPU default)."""

    provider: str = "cpu"
    threads: int = 2
    rounds: int = 10
    tf32: bool = True
    slow_ms: float | None = None
    seed: int = 0

    @property
    def tolerance(self) -> float:
        """The largest error relative to the float64 reference that is still dW."""
        return TF32_TOL if self.provider == "cuda" and self.tf32 else FP32_TOL

    def session_settings(self):
        """memcc's execution contract (``make_session``) with the threads and, on CUDA, the
        TF32 choice said explicitly (ORT's default is use_tf32=1)."""
        from memcc.backend.session import SessionSettings

        cuda = {"use_tf32": "1" if self.tf32 else "0"} if self.provider == "cuda" else None
        return SessionSettings(intra_op_threads=self.threads, cuda_options=cuda)


def _data(s: ConvShape, cfg: RunConfig) -> tuple[np.ndarray, np.ndarray]:
    """Random float32 x and gy. On CUDA drawn by torch on the GPU and copied to the host
    once (numpy takes seconds per batch-184 activation on one core)."""
    gy_shape = (s.x[0], s.w[0], *s.out)
    if cfg.provider == "cuda":
        import torch

        gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
        x, gy = (torch.randn(shape, generator=gen, device="cuda").cpu().numpy()
                 for shape in (s.x, gy_shape))
        return x, gy
    rng = np.random.default_rng(cfg.seed)
    return (rng.standard_normal(s.x).astype(np.float32),
            rng.standard_normal(gy_shape).astype(np.float32))


def _torch_fns(s: ConvShape, x: np.ndarray, gy: np.ndarray, provider: str = "cpu"):
    """PyTorch's weight gradient for the layer on ``provider``'s device, two ways, both
    timed: on the CPU as torch picks its kernel (oneDNN where enabled) and with oneDNN off
    (ATen's own kernels); on CUDA through cuDNN with its heuristic choice (torch's default)
    and with ``cudnn.benchmark`` (cuDNN times its algorithms). Each call synchronises the
    device. Also the float64 reference dW, computed on the same device (a batch-184 layer
    in double takes minutes on the CPU), returned on the host."""
    import torch

    dev = torch.device(provider)
    xt, gt = torch.from_numpy(x).to(dev), torch.from_numpy(gy).to(dev)
    wt = torch.empty(s.w, dtype=torch.float32, device=dev)
    args = (list(s.stride), list(s.pads), list(s.dilation), False, [0, 0], s.group,
            [False, True, False])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run() -> torch.Tensor:
        dw = torch.ops.aten.convolution_backward(gt, xt, wt, None, *args)[1]
        sync()
        return dw

    def flagged(module, name: str, value: bool) -> Callable[[], torch.Tensor]:
        # The attribute, not mkldnn.flags(): that also sets TF32 flags and warns each call.
        def fn() -> torch.Tensor:
            was = getattr(module, name)
            setattr(module, name, value)
            try:
                return run()
            finally:
                setattr(module, name, was)
        return fn

    if dev.type == "cuda":
        fns = {"torch": run, "torch-benchmark": flagged(torch.backends.cudnn, "benchmark", True)}
    else:
        fns = {"torch": run, "torch-native": flagged(torch.backends.mkldnn, "enabled", False)}
    ref = torch.nn.grad.conv2d_weight(xt.double(), list(s.w), gt.double(), list(s.stride),
                                      list(s.pads), list(s.dilation), s.group).cpu().numpy()
    return fns, ref


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference relative to the largest reference magnitude."""
    scale = float(np.max(np.abs(ref))) or 1.0
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref))) / scale


class BoundForm:
    """One form's session with x and gy bound once (OrtValues on the provider's device,
    shared by every form of the shape) and dW bound to a preallocated buffer there, as
    ``benchmarks/cuda_kernel_forms.BoundForm`` does for memcc Graphs: a call runs the
    kernels and waits for them, and no host copy is timed. The same path on both providers,
    so the CPU tests run the code a GPU run uses."""

    def __init__(self, sess, values: dict, w_shape: Sequence[int], provider: str) -> None:
        import onnxruntime as ort

        self.session = sess
        self.binding = sess.io_binding()
        for i in sess.get_inputs():
            self.binding.bind_ortvalue_input(i.name, values[i.name])
        self.out = ort.OrtValue.ortvalue_from_shape_and_type(list(w_shape), np.float32,
                                                             provider, 0)
        self.binding.bind_ortvalue_output(sess.get_outputs()[0].name, self.out)

    def __call__(self) -> None:
        self.session.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()

    def fetch(self) -> np.ndarray:
        return np.array(self.out.numpy(), copy=True)


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _timed_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def open_form(s: ConvShape, form: str, cfg: RunConfig, values: dict
              ) -> tuple[onnx.ModelProto, BoundForm, float]:
    """The form's model, its bound session, and the time of its first run (cuDNN's
    algorithm choice and the arena's first allocations included)."""
    from memcc.backend.session import make_session

    model = form_model(s, form)
    sess = make_session(model, cfg.provider, cfg.session_settings())
    if cfg.provider == "cuda" and sess.get_providers()[0] != "CUDAExecutionProvider":
        # ORT falls back to the CPU, with only a warning, when the CUDA provider fails to load.
        raise RuntimeError(f"the session runs on {sess.get_providers()}, not CUDA: "
                           "check onnxruntime-gpu's CUDA and cuDNN libraries")
    bound = BoundForm(sess, values, s.w, cfg.provider)
    return model, bound, _timed_ms(bound)


def prepare_forms(s: ConvShape, cfg: RunConfig, values: dict, ref: np.ndarray
                  ) -> tuple[dict[str, dict], dict[str, BoundForm]]:
    """Every applicable form run once and checked: its row (or an ``error`` row when it
    cannot load or run, out of memory included), and the bound forms to time in rounds.
    A form slower than ``cfg.slow_ms`` keeps the time of one warm call (of its first call
    when that alone took ten times as long) and leaves the rounds."""
    forms: dict[str, dict] = {}
    bound: dict[str, BoundForm] = {}
    for form in FORMS[s.kind]:
        if form == "chunks2" and s.x[0] < 2:
            continue
        try:
            model, fn, first_ms = open_form(s, form, cfg, values)
            err = rel_err(fn.fetch(), ref)
            slow_ms = None
            if cfg.slow_ms is not None:
                slow_ms = first_ms if first_ms > 10 * cfg.slow_ms else _timed_ms(fn)
        except Exception as exc:  # one broken form must not hide the others' figures
            forms[form] = {"error": _error_text(exc)}
            continue
        forms[form] = {"nodes": sum(n.op_type != "Constant" for n in model.graph.node),
                       "ops": sorted({n.op_type for n in model.graph.node
                                      if n.op_type != "Constant"}),
                       "max_rel_err": err, "within_tolerance": err <= cfg.tolerance}
        if slow_ms is not None and slow_ms > cfg.slow_ms:
            forms[form].update(median_ms=slow_ms, min_ms=slow_ms, rounds=1, slow=True)
        else:
            bound[form] = fn
    return forms, bound


def _record_times(forms: dict[str, dict], times: dict[str, list[float]]) -> None:
    for form, ts in times.items():
        if form not in forms:
            continue
        forms[form].update(median_ms=float(np.median(ts)) * 1e3,
                           min_ms=float(np.min(ts)) * 1e3, rounds=len(ts))
        if "memcc" in times and form != "memcc":
            # Paired per round: form / memcc with its 95% bootstrap interval.
            ri = ratio_interval(times["memcc"], ts, resamples=2000)
            forms[form]["vs_memcc"] = {"ratio": ri.ratio, "low": ri.low, "high": ri.high}


def measure_shape(s: ConvShape, cfg: RunConfig) -> dict:
    """Every applicable form of ``s``: its dW against the float64 reference, its median
    time, and torch's; one interleaved timing for all (the same machine conditions per
    round). The fastest is the fastest form within ``cfg.tolerance`` (of all forms when
    none is)."""
    import onnxruntime as ort
    import torch

    x, gy = _data(s, cfg)
    torch.set_num_threads(cfg.threads)
    torch_fns, ref = _torch_fns(s, x, gy, cfg.provider)
    values = {k: ort.OrtValue.ortvalue_from_numpy(v, cfg.provider, 0)
              for k, v in (("x", x), ("gy", gy))}
    forms, bound = prepare_forms(s, cfg, values, ref)
    torch_err = max(rel_err(fn().cpu().numpy(), ref) for fn in torch_fns.values())
    times = interleaved_times({**bound, **torch_fns}, rounds=cfg.rounds, warmup=1)
    _record_times(forms, times)
    timed = {f: v["median_ms"] for f, v in forms.items() if "median_ms" in v}
    if not timed:
        raise RuntimeError("no form ran: " + "; ".join(f"{f}: {v['error']}"
                                                       for f, v in forms.items()))
    good = {f: ms for f, ms in timed.items() if forms[f]["within_tolerance"]} or timed
    fastest = min(good, key=good.get)
    torch_ms = {k: float(np.median(times[k])) * 1e3 for k in torch_fns}
    best = min(torch_ms, key=torch_ms.get)
    keys = TORCH_KERNELS[cfg.provider]
    return {**s.to_json(), "forms": forms,
            "torch": {"median_ms": torch_ms[best], "kernel": best,
                      **{f"{keys[k][0]}_ms": v for k, v in torch_ms.items()},
                      "max_rel_err": torch_err},
            "fastest": fastest, "fastest_ms": timed[fastest],
            "ratio_to_torch": timed[fastest] / torch_ms[best],
            "memcc_over_fastest": timed["memcc"] / timed[fastest] if "memcc" in timed
            else None}


def measure_safe(s: ConvShape, cfg: RunConfig) -> dict:
    """``measure_shape``, or the shape's row with an ``error`` (out of memory, a CUDA
    error) so that the run goes on; device memory handed back after every shape."""
    import gc

    try:
        return measure_shape(s, cfg)
    except Exception as exc:
        return {**s.to_json(), "error": _error_text(exc)}
    finally:
        gc.collect()
        if cfg.provider == "cuda":
            import torch

            torch.cuda.empty_cache()


def summarize(rows: list[dict]) -> dict:
    """How many shapes come within 2x of torch, where memcc's form is not the fastest, and
    the whole networks' sums (each shape counted once per layer it stands for)."""
    failed = {r["label"]: r["error"] for r in rows if "error" in r}
    rows = [r for r in rows if "error" not in r]
    within = [r["label"] for r in rows if r["ratio_to_torch"] <= WITHIN]
    per_family: dict[str, dict[str, float]] = {}
    for r in rows:
        fam = per_family.setdefault(r["family"], {"memcc_ms": 0.0, "fastest_ms": 0.0,
                                                  "torch_ms": 0.0, "layers": 0})
        fam["memcc_ms"] += r["count"] * r["forms"].get("memcc", {}).get("median_ms", 0.0)
        fam["fastest_ms"] += r["count"] * r["fastest_ms"]
        fam["torch_ms"] += r["count"] * r["torch"]["median_ms"]
        fam["layers"] += r["count"]
    # Shapes where a form beat memcc's in the paired rounds (interval wholly below 1).
    beats: dict[str, dict[str, list[str]]] = {}
    for r in rows:
        for f, v in r["forms"].items():
            if v.get("vs_memcc", {}).get("high", 1.0) < 1.0:
                beats.setdefault(r["kind"], {}).setdefault(f, []).append(r["label"])
    wins: dict[str, dict[str, int]] = {}
    for r in rows:
        kind = wins.setdefault(r["kind"], {})
        kind[r["fastest"]] = kind.get(r["fastest"], 0) + 1
    return {"shapes": len(rows), "within_2x_of_torch": len(within),
            "within_2x_labels": within,
            "memcc_fastest": sum(r["fastest"] == "memcc" for r in rows),
            "fastest_by_kind": wins, "faster_than_memcc": beats, "networks": per_family,
            "errors": {r["label"]: {f: v["error"] for f, v in r["forms"].items()
                                    if "error" in v}
                       for r in rows if any("error" in v for v in r["forms"].values())},
            "failed_shapes": failed}


def _cell(v: dict | None) -> str:
    if v is None:
        return "-"
    if "error" in v:
        return "error"
    mark = "" if v["within_tolerance"] else " (!)"
    if v.get("slow"):
        mark += " (1 run)"
    if v.get("vs_memcc", {}).get("high", 1.0) < 1.0:
        mark += "*"
    return f"{v['median_ms']:.2f}{mark}"


def format_tables(rows: list[dict], provider: str = "cpu") -> str:
    """One markdown table per kind of layer (the forms that apply differ)."""
    lines = []
    kernels = list(TORCH_KERNELS[provider].values())
    for kind, forms in FORMS.items():
        group = [r for r in rows if r["kind"] == kind and "error" not in r]
        if not group:
            continue
        cols = [f for f in forms if any(f in r["forms"] for r in group)]
        lines.append(f"\n{kind} layers (median ms per weight gradient; * faster than memcc's "
                     "form, paired 95% interval; (!) outside the error tolerance):\n")
        lines.append("| shape | layers | " + " | ".join(cols) + " | fastest | "
                     + " | ".join(col for _, col in kernels) + " | fastest/torch |")
        lines.append("|---|---|" + "---|" * len(cols) + "---|---|---|---|")
        for r in group:
            cells = [_cell(r["forms"].get(f)) for f in cols]
            torch_cells = [f"{r['torch'][key + '_ms']:.2f}" for key, _ in kernels]
            lines.append(f"| {r['label']} | {r['count']} | " + " | ".join(cells)
                         + f" | {r['fastest']} | " + " | ".join(torch_cells)
                         + f" | {r['ratio_to_torch']:.2f} |")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = [f"fastest standard form within {WITHIN:g}x of torch on "
             f"{summary['within_2x_of_torch']} of {summary['shapes']} shapes; memcc's form is "
             f"the fastest on {summary['memcc_fastest']}"]
    for kind, wins in summary["fastest_by_kind"].items():
        lines.append(f"  fastest on {kind} layers: " + ", ".join(
            f"{f} {k}" for f, k in sorted(wins.items(), key=lambda kv: -kv[1])))
    for kind, forms in summary["faster_than_memcc"].items():
        lines.append(f"  faster than memcc's form (paired 95% interval below 1) on {kind} "
                     "layers: " + ", ".join(f"{f} on {len(labels)}" for f, labels in sorted(
                         forms.items(), key=lambda kv: -len(kv[1]))))
    for fam, v in summary["networks"].items():
        lines.append(f"  {fam} ({v['layers']} layers): memcc's forms {v['memcc_ms']:.1f} ms, "
                     f"fastest per shape {v['fastest_ms']:.1f} ms, torch {v['torch_ms']:.1f} ms")
    for label, errs in summary["errors"].items():
        lines.append(f"  errors on {label}: {errs}")
    for label, err in summary["failed_shapes"].items():
        lines.append(f"  shape failed: {label}: {err}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the run
def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--provider", choices=["cpu", "cuda"], default="cpu",
                    help="ORT's provider and torch's device (default cpu)")
    ap.add_argument("--tf32", choices=["on", "off"], default="on",
                    help="CUDA only: TF32 on both sides (ORT use_tf32=1, torch's cuDNN and "
                         "matmul TF32 flags; default) or on neither")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resolution", type=int, default=64,
                    help="input pixels per side (224 for ImageNet; default 64)")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads, ORT and torch")
    ap.add_argument("--rounds", type=int, default=10, help="interleaved timing rounds")
    ap.add_argument("--models", nargs="+", choices=["resnet50", "mobilenetv2"],
                    default=["resnet50", "mobilenetv2"])
    ap.add_argument("--shape", type=parse_shape, action="append", default=None,
                    help="measure this layer instead of the networks' (repeatable): "
                         "NxCxHxW:MxCgxKHxKW[:sS][:pP][:dD][:gG]")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new shape after this many seconds (the first always "
                         "runs); the rest are listed as skipped")
    ap.add_argument("--slow-ms", type=float, default=None,
                    help="a form whose warm call takes longer is timed on that call alone "
                         "(default 250 on cuda, never on cpu)")
    ap.add_argument("--omp-wait-policy", default="PASSIVE",
                    help="OMP_WAIT_POLICY for torch's OpenMP workers, set before torch loads "
                         "(default PASSIVE, as benchmarks/torch_peer.py; 'inherit' keeps the "
                         "environment's)")
    ap.add_argument("--out", type=Path,
                    help="write every figure as JSON here (rewritten after every shape)")
    args = ap.parse_args(list(argv))
    for flag in ("batch", "resolution", "threads", "rounds"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1, not {getattr(args, flag)}")
    if args.resolution < 32 and args.shape is None:
        ap.error(f"--resolution {args.resolution}: the networks downsample 32x; use 32 or more")
    if args.budget_s is not None and args.budget_s < 0:
        ap.error(f"--budget-s {args.budget_s:g}: give 0 or more seconds")
    if args.slow_ms is not None and args.slow_ms <= 0:
        ap.error(f"--slow-ms {args.slow_ms:g}: give a positive number of milliseconds")
    if args.out is not None and (args.out.is_dir() or not args.out.parent.is_dir()):
        ap.error(f"--out {args.out}: give a file path in an existing folder")
    return args


def cuda_problem() -> str | None:
    """Why ``--provider cuda`` cannot run here (ORT's or torch's side), or None."""
    import torch

    from memcc.backend.session import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None and not torch.cuda.is_available():
        reason = (f"torch {torch.__version__} sees no CUDA device (built for CUDA "
                  f"{torch.version.cuda}); install a CUDA build of torch")
    return reason


def set_torch_tf32(on: bool) -> dict[str, bool]:
    """TF32 for torch's cuDNN convolutions and CUDA matmuls, through the flags every torch
    2.x reads (newer torch also has ``fp32_precision``, and refuses a mix of the two APIs);
    returns the flags as read back, for the JSON."""
    import torch

    torch.backends.cudnn.enabled = True
    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on
    return {"cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32),
            "cuda.matmul.allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}


def order_by_cost(shapes: Sequence[ConvShape]) -> list[ConvShape]:
    """Most network time first (FLOPs of the layer times the layers it stands for), so a
    run cut short by ``--budget-s`` has measured the layers that matter."""
    return sorted(shapes, key=lambda s: -s.flops * s.count)


def run_meta(args: argparse.Namespace, cfg: RunConfig) -> dict:
    import onnxruntime as ort
    import torch

    meta = {"batch": args.batch, "resolution": args.resolution, "threads": args.threads,
            "rounds": args.rounds, "onnxruntime": ort.__version__, "torch": torch.__version__,
            "machine": platform.machine(), "processor": platform.processor(),
            "custom_shapes": args.shape is not None, "models": args.models,
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "provider": cfg.provider,
            "device": platform.processor() or platform.machine(), "tf32": None,
            "tolerance": cfg.tolerance, "reference": f"torch float64 on {cfg.provider}",
            "budget_s": args.budget_s, "slow_ms": cfg.slow_ms,
            "io": "IOBinding: x and gy bound once on the device, dW to a preallocated "
                  "device buffer, every timed call synchronised"}
    if cfg.provider == "cuda":
        from memcc.backend.session import cudnn_conv_algo_search

        on = "1" if cfg.tf32 else "0"
        meta.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    cudnn=torch.backends.cudnn.version(),
                    tf32=(f"{'on' if cfg.tf32 else 'off'} on both sides: ORT use_tf32={on}; "
                          "torch " + ", ".join(f"{k}={v}" for k, v in
                                               set_torch_tf32(cfg.tf32).items())),
                    ort_cudnn_conv_algo_search=cudnn_conv_algo_search(),
                    torch_cudnn="heuristic (benchmark=False, torch's default) and "
                                "benchmark=True; the faster counts")
    return meta


def header(meta: dict) -> str:
    text = (f"# conv weight gradients on {meta['provider']} ({meta['device']}): onnxruntime "
            f"{meta['onnxruntime']}, torch {meta['torch']}, {meta['rounds']} rounds, "
            f"error tolerance {meta['tolerance']:g} against {meta['reference']}")
    if meta["tf32"]:
        text += (f"\n# TF32 {meta['tf32']}; ORT cuDNN algorithm search "
                 f"{meta['ort_cudnn_conv_algo_search']}; torch cuDNN {meta['torch_cudnn']}")
    else:
        text += f", {meta['threads']} threads"
    return text


def write_json(path: Path, meta: dict, rows: list[dict], skipped: list[str],
               pending: list[str]) -> None:
    """The whole result so far, replaced atomically: a run killed between shapes leaves
    every finished row (``complete`` false, the unmeasured shapes under ``pending``)."""
    payload = {"meta": meta, "complete": not pending, "shapes": rows,
               "summary": summarize(rows), "skipped": skipped, "pending": pending}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    tmp.replace(path)


def run_shapes(shapes: Sequence[ConvShape], cfg: RunConfig, budget_s: float | None,
               on_row: Callable[[list[dict], list[ConvShape]], None]
               ) -> tuple[list[dict], list[ConvShape]]:
    """Measure the shapes in order until ``budget_s`` seconds have passed (the first
    always runs); ``on_row(rows, still to do)`` after each. Returns rows and the skipped."""
    started = time.perf_counter()
    rows: list[dict] = []
    for i, s in enumerate(shapes):
        if rows and budget_s is not None and time.perf_counter() - started > budget_s:
            return rows, list(shapes[i:])
        row = measure_safe(s, cfg)
        rows.append(row)
        if "error" in row:
            print(f"[{i + 1}/{len(shapes)}] {s.family} {s.label}: FAILED {row['error']}",
                  flush=True)
        else:
            errs = ", ".join(f"{f} {v['max_rel_err']:.1e}" for f, v in row["forms"].items()
                             if "max_rel_err" in v)
            print(f"[{i + 1}/{len(shapes)}] {s.family} {s.label}: fastest {row['fastest']} "
                  f"{row['fastest_ms']:.2f} ms, torch {row['torch']['median_ms']:.2f} ms; "
                  f"max rel err {errs}", flush=True)
        on_row(rows, list(shapes[i + 1:]))
    return rows, []


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if args.omp_wait_policy != "inherit" and "torch" not in sys.modules:
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy  # libgomp reads it at load
    # torch before onnxruntime: ORT's CUDA provider then finds the CUDA and cuDNN libraries
    # torch loaded (ORT's documented order when both share a process).
    import torch  # noqa: F401

    slow_ms = args.slow_ms if args.slow_ms is not None else DEFAULT_SLOW_MS[args.provider]
    cfg = RunConfig(args.provider, args.threads, args.rounds, args.tf32 == "on", slow_ms)
    if cfg.provider == "cuda":
        problem = cuda_problem()
        if problem is not None:
            print(f"conv_weight_grad: --provider cuda: {problem}; or run with --provider cpu",
                  file=sys.stderr)
            return 2
        set_torch_tf32(cfg.tf32)
    started = time.perf_counter()
    shapes = args.shape or order_by_cost(network_shapes(args.models, args.batch,
                                                        args.resolution))
    meta = run_meta(args, cfg)
    print(header(meta), flush=True)

    def names(todo: Sequence[ConvShape]) -> list[str]:
        return [f"{t.family} {t.label}" for t in todo]

    def save(rows: list[dict], pending: list[ConvShape], skipped=()) -> None:
        if args.out is not None:
            meta["elapsed_s"] = round(time.perf_counter() - started, 1)
            write_json(args.out, meta, rows, names(skipped), names(pending))

    budget = None if args.budget_s is None else args.budget_s - (time.perf_counter() - started)
    rows, skipped = run_shapes(shapes, cfg, budget, save)
    summary = summarize(rows)
    print(format_tables(rows, cfg.provider))
    print()
    print(format_summary(summary))
    if skipped:
        print(f"skipped (over --budget-s {args.budget_s:g}): {'; '.join(names(skipped))}")
    save(rows, [], skipped)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
