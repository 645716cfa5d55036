"""Thread determinism of ONNX Runtime's CPU kernels for every op memcc emits.

memcc's ``--verify`` compares the original and the rewritten training step bit for bit, and
a gradient is only right if the kernel that computes it gives the same answer however ORT
splits the work. This script builds one tiny ONNX model per op (and per attribute variant
that picks a different kernel path), with inputs large enough that ORT's intra-op thread
pool really splits the work, and runs it on the CPU provider with ``intra_op_num_threads``
1, 2, 4 and 8, several times each (a fresh session per thread count, graph optimizations
off, sequential execution). Per case it reports:

- ``run_to_run``: every run at that thread count gave the same bytes (per thread count);
- ``across``: the output at every thread count is bit-identical to the 1-thread output;
- ``max_abs_vs_1t``: the largest absolute difference from the 1-thread output;
- for the accumulating scatters, ``max_err_f64``: the largest error against a float64 numpy
  reference (``np.add.at``), and ``eq_seq_f32``: whether every run equals float32
  ``np.add.at`` (one thread adding the updates in index order) bit for bit.

Uses only numpy, onnx and onnxruntime (no torch), so it runs against any ORT wheel:

    python benchmarks/thread_determinism.py                   # table
    python benchmarks/thread_determinism.py --json out.json   # also the raw results
    python benchmarks/thread_determinism.py --only Scatter    # cases whose name contains it

Five identical runs do not prove a kernel deterministic; a difference proves it is not.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # what memcc's zoo models and the steps it builds use
THREADS = (1, 2, 4, 8)
RUNS = 5

F32 = TensorProto.FLOAT


@dataclass
class Case:
    """One tiny model: ``node`` (or several) over ``feeds``; ``reference`` for scatters."""

    name: str
    op: str
    variant: str
    nodes: list[onnx.NodeProto]
    feeds: dict[str, np.ndarray]
    outputs: list[str]
    initializers: list[onnx.TensorProto] = field(default_factory=list)
    # float64 reference and the float32 sequential reference (np.add.at), for scatters
    reference: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None
    opset: int = OPSET
    # independent copies of the node(s) in one model: each run then calls the kernel this
    # many times, which raises the odds of catching a race in a short kernel
    copies: int = 1

    def all_outputs(self) -> list[str]:
        return [o if k == 0 else f"{o}__copy{k}" for k in range(self.copies)
                for o in self.outputs]

    def model(self) -> bytes:
        inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype),
                                                list(v.shape)) for k, v in self.feeds.items()]
        nodes = list(self.nodes)
        for k in range(1, self.copies):
            for node in self.nodes:
                clone = onnx.NodeProto()
                clone.CopyFrom(node)
                clone.name = f"{node.name or node.op_type}__copy{k}"
                del clone.output[:]
                clone.output.extend(f"{o}__copy{k}" if o else "" for o in node.output)
                nodes.append(clone)
        outputs = [helper.make_empty_tensor_value_info(o) for o in self.all_outputs()]
        graph = helper.make_graph(nodes, self.name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
        model.ir_version = 8
        return model.SerializeToString()


# ---------------------------------------------------------------------------- case helpers
def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _randn(shape, seed: int, dtype=np.float32) -> np.ndarray:
    return _rng(seed).standard_normal(shape).astype(dtype)


def _ints(values, name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=np.int64), name)


def _unary(op: str, shape, seed: int, positive: bool = False, variant: str = "",
           **attrs) -> Case:
    x = _randn(shape, seed)
    if positive:
        x = np.abs(x) + np.float32(0.5)
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    return Case(f"{op}{'/' + variant if variant else ''}", op, variant or _shape(shape),
                [node], {"x": x}, ["y"])


def _binary(op: str, a_shape, b_shape, seed: int, variant: str, positive_b: bool = False,
            dtype=np.float32) -> Case:
    a = _randn(a_shape, seed, dtype)
    b = np.asarray(_randn(b_shape, seed + 1, dtype))
    if positive_b:
        b = np.asarray(np.abs(b) + dtype(0.5), dtype=dtype)
    node = helper.make_node(op, ["a", "b"], ["y"])
    return Case(f"{op}/{variant}", op, variant, [node], {"a": a, "b": b}, ["y"])


def _shape(shape) -> str:
    return "x".join(str(d) for d in shape)


# ---------------------------------------------------------------------------- the cases
def elementwise_cases() -> list[Case]:
    n = (1024, 1024)  # 4 MiB of float32
    cases = [
        _binary("Add", n, n, 1, "same shape " + _shape(n)),
        _binary("Add", (16, 64, 32, 32), (64, 1, 1), 2, "broadcast per-channel"),
        _binary("Sub", n, n, 3, "same shape " + _shape(n)),
        _binary("Mul", n, n, 4, "same shape " + _shape(n)),
        _binary("Mul", n, (), 5, "times scalar"),
        _binary("Div", n, n, 6, "same shape " + _shape(n), positive_b=True),
        _binary("Pow", n, (), 7, "x ** scalar (AdamW bias correction, Pow rule)",
                positive_b=True),
    ]
    a = np.abs(_randn(n, 8)) + np.float32(0.5)
    cases.append(Case("Pow/x ** tensor", "Pow", "x ** tensor", [helper.make_node(
        "Pow", ["a", "b"], ["y"])], {"a": a, "b": _randn(n, 9)}, ["y"]))
    for op, pos in (("Neg", False), ("Sqrt", True), ("Exp", False), ("Log", True),
                    ("Reciprocal", True), ("Sign", False), ("Sin", False), ("Cos", False),
                    ("Tanh", False), ("Sigmoid", False), ("Erf", False), ("Relu", False),
                    ("Identity", False)):
        cases.append(_unary(op, n, 10, positive=pos))
    cases.append(_unary("Cast", n, 11, variant="float->double", to=TensorProto.DOUBLE))
    cases.append(_unary("Cast", n, 12, variant="float->float16", to=TensorProto.FLOAT16))
    # Clip with tensor bounds (inputs since opset 11)
    x = _randn(n, 13)
    cases.append(Case("Clip/min,max inputs", "Clip", "min,max inputs", [helper.make_node(
        "Clip", ["x", "lo", "hi"], ["y"])], {"x": x, "lo": np.asarray(-0.5, np.float32),
                                          "hi": np.asarray(0.7, np.float32)}, ["y"]))
    # comparisons and logic (bool results), Where
    for op in ("Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual"):
        a = np.round(_randn(n, 14) * 2).astype(np.float32)
        b = np.round(_randn(n, 15) * 2).astype(np.float32)
        cases.append(Case(f"{op}/float", op, "float", [helper.make_node(op, ["a", "b"], ["y"])],
                          {"a": a, "b": b}, ["y"]))
    p = _rng(16).random(n) < 0.5
    q = _rng(17).random(n) < 0.5
    cases.append(Case("And/bool", "And", "bool", [helper.make_node("And", ["a", "b"], ["y"])],
                      {"a": p, "b": q}, ["y"]))
    cases.append(Case("Not/bool", "Not", "bool", [helper.make_node("Not", ["a"], ["y"])],
                      {"a": p}, ["y"]))
    cases.append(Case("Where/float", "Where", "bool, float, float", [helper.make_node(
        "Where", ["c", "a", "b"], ["y"])], {"c": p, "a": _randn(n, 18), "b": _randn(n, 19)},
        ["y"]))
    idx = _rng(20).integers(-5000, 5000, size=n).astype(np.int64)
    cases.append(Case("Mod/int64", "Mod", "int64 by scalar (Gather index wrap)", [
        helper.make_node("Mod", ["a", "b"], ["y"])],
        {"a": idx, "b": np.asarray(977, dtype=np.int64)}, ["y"]))
    return cases


def matmul_cases() -> list[Case]:
    cases = []

    def mm(name, a_shape, b_shape, seed):
        a, b = _randn(a_shape, seed), _randn(b_shape, seed + 1)
        cases.append(Case(f"MatMul/{name}", "MatMul", f"{_shape(a_shape)} @ {_shape(b_shape)}",
                          [helper.make_node("MatMul", ["a", "b"], ["y"])], {"a": a, "b": b},
                          ["y"]))

    mm("2-D square", (512, 512), (512, 512), 30)
    mm("2-D long K (weight grad)", (64, 32768), (32768, 64), 32)
    mm("batched", (32, 128, 64), (32, 64, 128), 34)
    mm("batch x 2-D weight", (16, 128, 256), (256, 256), 36)
    mm("one-hot rows (Gather grad < opset 16)", (512, 4096), (4096, 256), 38)

    def gemm(name, a_shape, b_shape, seed, c_shape=None, **attrs):
        a, b = _randn(a_shape, seed), _randn(b_shape, seed + 1)
        feeds = {"a": a, "b": b}
        ins = ["a", "b"]
        if c_shape is not None:
            feeds["c"] = _randn(c_shape, seed + 2)
            ins.append("c")
        attr_s = ",".join(f"{k}={v}" for k, v in attrs.items()) or "plain"
        cases.append(Case(f"Gemm/{name}", "Gemm", f"{attr_s}; {_shape(a_shape)}, "
                          f"{_shape(b_shape)}" + (f", C {_shape(c_shape)}" if c_shape else ""),
                          [helper.make_node("Gemm", ins, ["y"], **attrs)], feeds, ["y"]))

    gemm("plain", (512, 512), (512, 512), 40)
    gemm("transA (weight grad, long K)", (32768, 64), (32768, 64), 42, transA=1)
    gemm("transB (input grad)", (4096, 256), (512, 256), 44, transB=1)
    gemm("transB + bias C (Linear forward)", (4096, 256), (512, 256), 46, c_shape=(512,),
         transB=1)
    gemm("alpha", (512, 512), (512, 512), 48, alpha=0.5)
    a, b = _randn((32, 128, 64), 50), _randn((32, 64, 128), 51)
    cases.append(Case("Einsum/bij,bjk->bik", "Einsum", "bij,bjk->bik",
                      [helper.make_node("Einsum", ["a", "b"], ["y"], equation="bij,bjk->bik")],
                      {"a": a, "b": b}, ["y"]))
    a, b = _randn((16384, 64), 52), _randn((16384, 32), 53)
    cases.append(Case("Einsum/ni,nj->ij (summed index)", "Einsum", "ni,nj->ij, n=16384",
                      [helper.make_node("Einsum", ["a", "b"], ["y"], equation="ni,nj->ij")],
                      {"a": a, "b": b}, ["y"]))
    return cases


def reduction_cases() -> list[Case]:
    cases = []

    def red(op, shape, axes, seed, keepdims=1, label=""):
        x = _randn(shape, seed)
        ax = "all" if axes is None else ",".join(map(str, axes))
        variant = f"{_shape(shape)} axes={ax} keepdims={keepdims}"
        if op == "ReduceSum" and axes is not None:  # axes input since opset 13
            node = helper.make_node(op, ["x", "axes"], ["y"], keepdims=keepdims)
            inits = [_ints(axes, "axes")]
        elif axes is not None:  # ReduceMean: attribute before opset 18
            node = helper.make_node(op, ["x"], ["y"], axes=list(axes), keepdims=keepdims)
            inits = []
        else:
            node = helper.make_node(op, ["x"], ["y"], keepdims=keepdims)
            inits = []
        cases.append(Case(f"{op}/{label or 'axes=' + ax}", op, variant, [node], {"x": x},
                          ["y"], initializers=inits))

    red("ReduceSum", (4 * 1024 * 1024,), None, 60, 0, "all axes, 1-D 4M")
    red("ReduceSum", (2048, 2048), None, 61, 0, "all axes, 2-D")
    red("ReduceSum", (32768, 128), [0], 62, 0, "leading axis (bias grad)")
    red("ReduceSum", (8, 512, 256), [0, 1], 63, 0, "leading axes [0,1]")
    red("ReduceSum", (4096, 1024), [1], 64, 1, "last axis (softmax dot)")
    red("ReduceSum", (32, 64, 32, 32), [0, 2, 3], 65, 1, "[0,2,3] (BN/conv bias)")
    red("ReduceSum", (64, 32, 4, 32, 4), [2, 4], 66, 1, "interleaved [2,4] (resize/tile)")
    red("ReduceMean", (4 * 1024 * 1024,), None, 67, 0, "all axes, 1-D 4M (loss)")
    red("ReduceMean", (32, 64, 32, 32), [0, 2, 3], 68, 1, "[0,2,3] (BN stats)")
    red("ReduceMean", (4096, 1024), [-1], 69, 1, "last axis (LayerNorm stats)")
    red("ReduceMean", (32, 64, 32, 32), [2, 3], 70, 1, "[2,3] (InstanceNorm stats)")
    return cases


def softmax_norm_cases() -> list[Case]:
    cases = []
    x = _randn((4096, 1024), 80)
    for op in ("Softmax", "LogSoftmax"):
        cases.append(Case(f"{op}/last axis", op, "4096x1024 axis=-1",
                          [helper.make_node(op, ["x"], ["y"], axis=-1)], {"x": x}, ["y"]))
    x = _randn((16, 256, 768), 81)
    cases.append(Case("LayerNormalization/+Mean,InvStdDev", "LayerNormalization",
                      "16x256x768 axis=-1, 3 outputs", [helper.make_node(
                          "LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], axis=-1)],
                      {"x": x, "s": _randn((768,), 82), "b": _randn((768,), 83)},
                      ["y", "mean", "inv"]))
    x = _randn((32, 64, 32, 32), 84)
    c = 64
    cases.append(Case("BatchNormalization/training_mode=1", "BatchNormalization",
                      "32x64x32x32, 3 outputs", [helper.make_node(
                          "BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv"],
                          training_mode=1)],
                      {"x": x, "s": _randn((c,), 85), "b": _randn((c,), 86),
                       "m": _randn((c,), 87), "v": np.abs(_randn((c,), 88)) + 1},
                      ["y", "rm", "rv"]))
    cases.append(Case("BatchNormalization/inference", "BatchNormalization",
                      "32x64x32x32", [helper.make_node(
                          "BatchNormalization", ["x", "s", "b", "m", "v"], ["y"])],
                      {"x": x, "s": _randn((c,), 85), "b": _randn((c,), 86),
                       "m": _randn((c,), 87), "v": np.abs(_randn((c,), 88)) + 1}, ["y"]))
    return cases


def conv_cases() -> list[Case]:
    cases = []

    def conv(op, name, x_shape, w_shape, seed, **attrs):
        x, w = _randn(x_shape, seed), _randn(w_shape, seed + 1)
        attr_s = " ".join(f"{k}={v}" for k, v in attrs.items())
        cases.append(Case(f"{op}/{name}", op, f"x {_shape(x_shape)}, w {_shape(w_shape)} "
                          f"{attr_s}", [helper.make_node(op, ["x", "w"], ["y"], **attrs)],
                          {"x": x, "w": w}, ["y"]))

    conv("Conv", "3x3 forward", (16, 64, 32, 32), (64, 64, 3, 3), 90,
         kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    conv("Conv", "3x3 stride 2", (16, 64, 32, 32), (128, 64, 3, 3), 92,
         kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])
    conv("Conv", "depthwise 3x3 (group=C)", (16, 128, 32, 32), (128, 1, 3, 3), 94,
         kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=128)
    # weight gradient as memcc emits it: x as [Cin, N, H, W], gy as weights [Cout, N, oh, ow]
    conv("Conv", "weight grad (batch as channels)", (64, 8, 32, 32), (64, 8, 32, 32), 96,
         kernel_shape=[32, 32], pads=[1, 1, 1, 1])
    conv("Conv", "1x1", (16, 256, 16, 16), (256, 256, 1, 1), 98, kernel_shape=[1, 1])
    conv("ConvTranspose", "3x3 input grad", (16, 64, 32, 32), (64, 64, 3, 3), 100,
         kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    conv("ConvTranspose", "3x3 stride 2 input grad", (16, 128, 16, 16), (128, 64, 3, 3), 102,
         kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2], output_padding=[1, 1])
    x = _randn((16, 64, 16, 16), 104)
    ones = np.ones((64, 1, 3, 3), np.float32)
    cases.append(Case("ConvTranspose/depthwise ones (AveragePool grad)", "ConvTranspose",
                      "x 16x64x16x16, ones 64x1x3x3 group=64 stride 2",
                      [helper.make_node("ConvTranspose", ["x", "w"], ["y"], kernel_shape=[3, 3],
                                        strides=[2, 2], pads=[1, 1, 0, 0], group=64)],
                      {"x": x, "w": ones}, ["y"]))
    return cases


def pool_cases() -> list[Case]:
    x = _randn((32, 64, 32, 32), 110)
    return [
        Case("MaxPool/2x2 s2 +Indices", "MaxPool", "32x64x32x32 k2 s2, 2 outputs",
             [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2],
                               strides=[2, 2])], {"x": x}, ["y", "i"]),
        Case("MaxPool/3x3 s2 p1 +Indices", "MaxPool", "32x64x32x32 k3 s2 p1 (overlapping)",
             [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3],
                               strides=[2, 2], pads=[1, 1, 1, 1])], {"x": x}, ["y", "i"]),
        Case("AveragePool/3x3 s2 p1", "AveragePool", "32x64x32x32 k3 s2 p1",
             [helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3],
                               strides=[2, 2], pads=[1, 1, 1, 1])], {"x": x}, ["y"]),
        Case("GlobalAveragePool/", "GlobalAveragePool", "32x64x32x32",
             [helper.make_node("GlobalAveragePool", ["x"], ["y"])], {"x": x}, ["y"]),
    ]


def _scatter_refs(rows: int, width: int, idx: np.ndarray, upd: np.ndarray
                  ) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
    def ref():
        shape = (rows,) if width == 0 else (rows, width)
        exact = np.zeros(shape, np.float64)
        np.add.at(exact, idx, upd.astype(np.float64))
        seq = np.zeros(shape, np.float32)
        np.add.at(seq, idx, upd)
        return exact, seq
    return ref


def gather_scatter_cases() -> list[Case]:
    cases = []
    # ScatterND reduction=add, the Gather gradient before the fix (positive control)
    rows, width, n = 50, 1024, 2048
    idx = _rng(120).integers(0, rows, size=n).astype(np.int64)
    upd = _randn((n, width), 121)
    cases.append(Case("ScatterND/reduction=add (Gather grad)", "ScatterND",
                      f"{n} updates of {width} into {rows} rows (repeats)", [helper.make_node(
                          "ScatterND", ["d", "i", "u"], ["y"], reduction="add")],
                      {"d": np.zeros((rows, width), np.float32), "i": idx[:, None], "u": upd},
                      ["y"], reference=_scatter_refs(rows, width, idx, upd), copies=8))
    uniq = _rng(122).permutation(4096)[:n].astype(np.int64)
    cases.append(Case("ScatterND/reduction=none (unique)", "ScatterND",
                      f"{n} unique rows of {width} into 4096", [helper.make_node(
                          "ScatterND", ["d", "i", "u"], ["y"])],
                      {"d": np.zeros((4096, width), np.float32), "i": uniq[:, None], "u": upd},
                      ["y"]))
    # ScatterElements reduction=add, 1-D flat (MaxPool grad, scatter_add_flat)
    size, n1 = 4096, 1 << 20
    idx1 = _rng(123).integers(0, size, size=n1).astype(np.int64)
    upd1 = _randn((n1,), 124)
    cases.append(Case("ScatterElements/add 1-D flat", "ScatterElements",
                      f"{n1} updates into {size} (repeats), axis 0", [helper.make_node(
                          "ScatterElements", ["d", "i", "u"], ["y"], axis=0, reduction="add")],
                      {"d": np.zeros((size,), np.float32), "i": idx1, "u": upd1}, ["y"],
                      reference=_scatter_refs(size, 0, idx1, upd1), copies=4))
    # ScatterElements reduction=add, 2-D axis 0 with row-broadcast indices (embedding grad)
    idx2 = np.repeat(idx[:, None], width, axis=1)
    cases.append(Case("ScatterElements/add 2-D axis 0 (row indices)", "ScatterElements",
                      f"[{n}, {width}] into [{rows}, {width}], index const along a row",
                      [helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0,
                                        reduction="add")],
                      {"d": np.zeros((rows, width), np.float32), "i": idx2, "u": upd}, ["y"],
                      reference=_scatter_refs(rows, width, idx, upd), copies=4))
    # the same with int32 indices, as the Gather gradient emits them since the ScatterND fix
    cases.append(Case("ScatterElements/add 2-D axis 0 (row indices, int32)", "ScatterElements",
                      f"[{n}, {width}] int32 indices into [{rows}, {width}]",
                      [helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0,
                                        reduction="add")],
                      {"d": np.zeros((rows, width), np.float32), "i": idx2.astype(np.int32),
                       "u": upd}, ["y"], reference=_scatter_refs(rows, width, idx, upd),
                      copies=4))
    # ... and with indices that vary along the row (GatherElements grad)
    w3 = 256
    idx3 = _rng(125).integers(0, rows, size=(n, w3)).astype(np.int64)
    upd3 = np.ascontiguousarray(upd[:, :w3])
    cols = np.broadcast_to(np.arange(w3), (n, w3))

    def ref3():
        exact = np.zeros((rows, w3), np.float64)
        np.add.at(exact, (idx3, cols), upd3.astype(np.float64))
        seq = np.zeros((rows, w3), np.float32)
        np.add.at(seq, (idx3, cols), upd3)
        return exact, seq
    cases.append(Case("ScatterElements/add 2-D axis 0 (free indices)", "ScatterElements",
                      f"[{n}, {w3}] into [{rows}, {w3}], random per element",
                      [helper.make_node("ScatterElements", ["d", "i", "u"], ["y"], axis=0,
                                        reduction="add")],
                      {"d": np.zeros((rows, w3), np.float32), "i": idx3, "u": upd3}, ["y"],
                      reference=ref3, copies=4))
    uniq1 = _rng(126).permutation(1 << 22)[: 1 << 20].astype(np.int64)
    cases.append(Case("ScatterElements/none 1-D unique", "ScatterElements",
                      "2^20 unique into 2^22", [helper.make_node(
                          "ScatterElements", ["d", "i", "u"], ["y"], axis=0)],
                      {"d": np.zeros((1 << 22,), np.float32), "i": uniq1,
                       "u": _randn((1 << 20,), 127)}, ["y"]))
    # forward selections memcc's loss and models use
    table = _randn((50257 // 4, 256), 128)
    tok = _rng(129).integers(0, table.shape[0], size=(16, 512)).astype(np.int64)
    cases.append(Case("Gather/embedding rows", "Gather", "12564x256 table, 16x512 ids",
                      [helper.make_node("Gather", ["t", "i"], ["y"], axis=0)],
                      {"t": table, "i": tok}, ["y"]))
    logp = _randn((8192, 512), 130)
    lab = _rng(131).integers(0, 512, size=(8192, 1)).astype(np.int64)
    cases.append(Case("GatherElements/loss pick", "GatherElements", "8192x512, axis=-1",
                      [helper.make_node("GatherElements", ["x", "i"], ["y"], axis=-1)],
                      {"x": logp, "i": lab}, ["y"]))
    oh_idx = _rng(132).integers(0, 1024, size=(4096,)).astype(np.int64)
    cases.append(Case("OneHot/axis 0", "OneHot", "4096 ids, depth 1024, axis=0",
                      [helper.make_node("OneHot", ["i", "depth", "vals"], ["y"], axis=0)],
                      {"i": oh_idx, "depth": np.asarray([1024], np.int64),
                       "vals": np.asarray([0, 1], np.float32)}, ["y"]))
    return cases


def shape_cases() -> list[Case]:
    x = _randn((32, 64, 32, 32), 140)
    cases = [
        Case("Transpose/NCHW->CNHW", "Transpose", "32x64x32x32 perm 1,0,2,3",
             [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0, 2, 3])], {"x": x}, ["y"]),
        Case("Transpose/2-D", "Transpose", "2048x1024",
             [helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])],
             {"x": _randn((2048, 1024), 141)}, ["y"]),
        Case("Reshape/", "Reshape", "32x64x32x32 -> 2048x1024",
             [helper.make_node("Reshape", ["x", "s"], ["y"])], {"x": x}, ["y"],
             initializers=[_ints([2048, 1024], "s")]),
        Case("Unsqueeze/", "Unsqueeze", "axis 4", [helper.make_node("Unsqueeze", ["x", "a"],
                                                                    ["y"])],
             {"x": x}, ["y"], initializers=[_ints([4], "a")]),
        Case("Expand/", "Expand", "1x64x1x1 -> 32x64x32x32",
             [helper.make_node("Expand", ["x", "s"], ["y"])], {"x": _randn((1, 64, 1, 1), 142)},
             ["y"], initializers=[_ints([32, 64, 32, 32], "s")]),
        Case("Slice/step 2", "Slice", "32x64x32x32 [:, :, 1::2, ::2]",
             [helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])], {"x": x}, ["y"],
             initializers=[_ints([1, 0], "st"), _ints([32, 32], "en"), _ints([2, 3], "ax"),
                           _ints([2, 2], "sp")]),
        Case("Slice/step -1", "Slice", "reverse axis 3",
             [helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])], {"x": x}, ["y"],
             initializers=[_ints([-1], "st"), _ints([-33], "en"), _ints([3], "ax"),
                           _ints([-1], "sp")]),
        Case("Pad/constant", "Pad", "32x64x32x32 pad 1 on H,W",
             [helper.make_node("Pad", ["x", "p"], ["y"], mode="constant")], {"x": x}, ["y"],
             initializers=[_ints([0, 0, 1, 1, 0, 0, 1, 1], "p")]),
        Case("Split/3 parts", "Split", "axis 1 into 16,16,32",
             [helper.make_node("Split", ["x", "s"], ["a", "b", "c"], axis=1)], {"x": x},
             ["a", "b", "c"], initializers=[_ints([16, 16, 32], "s")]),
        Case("Concat/axis 1", "Concat", "2 x 32x64x32x32 on axis 1",
             [helper.make_node("Concat", ["x", "z"], ["y"], axis=1)],
             {"x": x, "z": _randn((32, 64, 32, 32), 143)}, ["y"]),
        Case("ConstantOfShape/", "ConstantOfShape", "zeros 32x64x32x32",
             [helper.make_node("ConstantOfShape", ["s"], ["y"],
                               value=numpy_helper.from_array(np.zeros(1, np.float32), "v"))],
             {}, ["y"], initializers=[_ints([32, 64, 32, 32], "s")]),
        Case("Trilu/upper", "Trilu", "64x128x128", [helper.make_node("Trilu", ["x"], ["y"])],
             {"x": _randn((64, 128, 128), 144)}, ["y"]),
        Case("Flatten/", "Flatten", "axis 1", [helper.make_node("Flatten", ["x"], ["y"])],
             {"x": x}, ["y"]),
    ]
    return cases


def forward_cases() -> list[Case]:
    """Forward ops memcc differentiates: a step runs them, and recomputation clones them."""
    n = (512, 1024)  # 2 MiB of float32: these only need to be split, not timed
    cases = []
    for op, attrs in (("Abs", {}), ("Elu", {}), ("Selu", {}), ("Softplus", {}),
                      ("HardSigmoid", {}), ("HardSwish", {}), ("LeakyRelu", {"alpha": 0.1}),
                      ("Floor", {}), ("Ceil", {}), ("Round", {}), ("IsNaN", {}),
                      ("IsInf", {})):
        cases.append(_unary(op, n, 150, **attrs))
    for approx in ("none", "tanh"):
        case = _unary("Gelu", n, 151, variant=f"approximate={approx} (opset 20)",
                      approximate=approx)
        case.opset = 20
        cases.append(case)
    for op, k in (("Max", 2), ("Min", 2), ("Sum", 3), ("Mean", 3)):
        names = [f"x{i}" for i in range(k)]
        cases.append(Case(f"{op}/{k} inputs", op, f"{k} x {_shape(n)}",
                          [helper.make_node(op, names, ["y"])],
                          {nm: _randn(n, 152 + i) for i, nm in enumerate(names)}, ["y"]))
    x = _randn((16, 64, 32, 32), 160)
    cases.append(Case("InstanceNormalization/", "InstanceNormalization", "16x64x32x32",
                      [helper.make_node("InstanceNormalization", ["x", "s", "b"], ["y"])],
                      {"x": x, "s": _randn((64,), 161), "b": _randn((64,), 162)}, ["y"]))
    small = _randn((8, 32, 64, 64), 163)
    for mode in ("nearest", "linear"):
        cases.append(Case(f"Resize/{mode} x2", "Resize", f"8x32x64x64 scales 1,1,2,2 {mode}",
                          [helper.make_node("Resize", ["x", "", "sc"], ["y"], mode=mode)],
                          {"x": small}, ["y"], initializers=[numpy_helper.from_array(
                              np.asarray([1, 1, 2, 2], np.float32), "sc")]))
    cases.append(Case("DepthToSpace/DCR", "DepthToSpace", "16x64x32x32 blocksize 2",
                      [helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2)],
                      {"x": x}, ["y"]))
    cases.append(Case("SpaceToDepth/", "SpaceToDepth", "16x64x32x32 blocksize 2",
                      [helper.make_node("SpaceToDepth", ["x"], ["y"], blocksize=2)],
                      {"x": x}, ["y"]))
    cases.append(Case("Tile/", "Tile", "16x64x16x16 repeats 1,1,2,2",
                      [helper.make_node("Tile", ["x", "r"], ["y"])],
                      {"x": _randn((16, 64, 16, 16), 164)}, ["y"],
                      initializers=[_ints([1, 1, 2, 2], "r")]))
    r = _randn((2048, 1024), 165)
    for op in ("ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSumExp", "ReduceMax",
               "ReduceMin"):
        for axes in (None, [1]):
            attrs = {} if axes is None else {"axes": axes}
            cases.append(Case(f"{op}/{'all axes' if axes is None else 'last axis'}", op,
                              f"2048x1024 axes={'all' if axes is None else axes}",
                              [helper.make_node(op, ["x"], ["y"], keepdims=0, **attrs)],
                              {"x": r}, ["y"]))
    pos = np.abs(r) + np.float32(0.5)
    cases.append(Case("ReduceLogSum/last axis", "ReduceLogSum", "2048x1024 axes=[1]",
                      [helper.make_node("ReduceLogSum", ["x"], ["y"], axes=[1], keepdims=0)],
                      {"x": pos}, ["y"]))
    near_one = (np.float32(1) + _randn((2048, 1024), 166) * np.float32(1e-3))
    cases.append(Case("ReduceProd/last axis", "ReduceProd", "2048x1024 axes=[1]",
                      [helper.make_node("ReduceProd", ["x"], ["y"], axes=[1], keepdims=0)],
                      {"x": near_one.astype(np.float32)}, ["y"]))
    for axes in (None, [0, 2, 3]):
        ins = ["x"] if axes is None else ["x", "a"]
        inits = [] if axes is None else [_ints(axes, "a")]
        c = Case(f"ReduceMean/axes input {'all' if axes is None else axes} (opset 18)",
                 "ReduceMean", f"32x64x32x32 axes={'all' if axes is None else axes}",
                 [helper.make_node("ReduceMean", ins, ["y"], keepdims=1)],
                 {"x": _randn((32, 64, 32, 32), 167)}, ["y"], initializers=inits)
        c.opset = 18
        cases.append(c)
    cases.append(Case("GlobalMaxPool/", "GlobalMaxPool", "16x64x32x32",
                      [helper.make_node("GlobalMaxPool", ["x"], ["y"])], {"x": x}, ["y"]))
    cases.append(Case("ArgMax/last axis", "ArgMax", "2048x1024 axis=1",
                      [helper.make_node("ArgMax", ["x"], ["y"], axis=1)], {"x": r}, ["y"]))
    idx = _rng(168).integers(0, 1024, size=(4096, 2)).astype(np.int64)
    idx[:, 0] %= 16
    cases.append(Case("GatherND/", "GatherND", "16x1024x256 data, 4096 index pairs",
                      [helper.make_node("GatherND", ["x", "i"], ["y"])],
                      {"x": _randn((16, 1024, 256), 169), "i": idx}, ["y"]))
    cases.append(Case("Squeeze/", "Squeeze", "16x1x64x1024 axis 1",
                      [helper.make_node("Squeeze", ["x", "a"], ["y"])],
                      {"x": _randn((16, 1, 64, 1024), 170)}, ["y"],
                      initializers=[_ints([1], "a")]))
    return cases


def all_cases() -> list[Case]:
    return (elementwise_cases() + matmul_cases() + reduction_cases() + softmax_norm_cases()
            + conv_cases() + pool_cases() + gather_scatter_cases() + shape_cases()
            + forward_cases())


# ---------------------------------------------------------------------------- running
def make_session(model: bytes, threads: int, spinning: bool = True,
                 profile: bool = False) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(_tmpdir(), "td_profile")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def _tmpdir() -> str:
    import tempfile

    if not hasattr(_tmpdir, "path"):
        _tmpdir.path = tempfile.mkdtemp(prefix="thread_determinism_")  # type: ignore[attr-defined]
    return _tmpdir.path  # type: ignore[attr-defined]


def parallel_blocks(case: Case, threads: int = 4) -> list[int]:
    """Block sizes of the parallel sections the kernel entered (ORT's profiler records one
    per ThreadPool parallel loop); empty when the kernel never used the intra-op pool."""
    sess = make_session(case.model(), threads, profile=True)
    sess.run(case.all_outputs(), case.feeds)
    path = sess.end_profiling()
    with open(path) as f:
        events = json.load(f)
    os.remove(path)
    blocks: list[int] = []
    for ev in events:
        if ev.get("cat") == "Node" and ev.get("name", "").endswith("_kernel_time"):
            stats = ev.get("args", {}).get("thread_scheduling_stats", {})
            blocks += [int(b) for b in stats.get("main_thread", {}).get("block_size", [])]
    return blocks


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    if a.dtype == bool:
        return float(np.count_nonzero(a != b))
    a64, b64 = np.atleast_1d(a).astype(np.float64), np.atleast_1d(b).astype(np.float64)
    d = np.abs(a64 - b64)
    d[np.isnan(a64) & np.isnan(b64)] = 0.0
    return float(np.nanmax(d, initial=0.0)) if d.size else 0.0


def _digest(outputs: list[np.ndarray]) -> bytes:
    """Identity of one run's outputs: dtype, shape and exact bytes of each."""
    h = hashlib.blake2b(digest_size=16)
    for o in outputs:
        h.update(f"{o.dtype}{o.shape}".encode())
        h.update(np.ascontiguousarray(o).data)
    return h.digest()


def _timed_runs(sess: ort.InferenceSession, case: Case, runs: int
                ) -> tuple[list[list[np.ndarray]], list[float]]:
    """Each copy of the node counts as one run of the kernel."""
    outs, times = [], []
    width = len(case.outputs)
    for _ in range(runs):
        t = time.perf_counter()
        got = sess.run(case.all_outputs(), case.feeds)
        times.append(time.perf_counter() - t)
        outs += [got[k * width:(k + 1) * width] for k in range(case.copies)]
    return outs, times


def run_case(case: Case, threads=THREADS, runs: int = RUNS) -> dict:
    """``runs`` runs per thread count with ORT's default thread spinning and ``runs`` more
    with spinning off, each from a fresh session: on a machine with fewer cores than
    threads, which of the two lets worker threads really run at once varies."""
    model = case.model()
    per_thread: dict[int, list[list[np.ndarray]]] = {}
    median_ms: dict[int, float] = {}
    t0 = time.perf_counter()
    for t in threads:
        per_thread[t] = []
        for spinning in (True, False):
            sess = make_session(model, t, spinning=spinning)
            outs, times = _timed_runs(sess, case, runs)
            per_thread[t] += outs
            if spinning:
                median_ms[t] = round(1000 * float(np.median(times)), 3)
            del sess
    elapsed = time.perf_counter() - t0
    base = per_thread[threads[0]][0]
    base_key = _digest(base)
    result: dict = {"name": case.name, "op": case.op, "variant": case.variant,
                    "seconds": round(elapsed, 3), "parallel_blocks_at_4_threads":
                    parallel_blocks(case), "threads": {}}
    ref = case.reference() if case.reference else None
    for t in threads:
        outs = per_thread[t]
        keys = [_digest(r) for r in outs]
        diff = max(max(_max_abs(o, b) for o, b in zip(r, base, strict=True))
                   for r, k in zip(outs, keys, strict=True) if k != base_key) \
            if any(k != base_key for k in keys) else 0.0
        entry = {"kernel_runs": len(outs), "run_to_run_identical": len(set(keys)) == 1,
                 "identical_to_1_thread": all(k == base_key for k in keys),
                 "max_abs_diff_vs_1_thread": diff, "distinct_results": len(set(keys)),
                 "median_ms": median_ms[t]}
        if ref is not None:
            exact, seq = ref
            entry["max_err_vs_float64"] = max(
                float(np.max(np.abs(r[0].astype(np.float64) - exact))) for r in outs)
            entry["equal_to_sequential_float32"] = all(
                r[0].tobytes() == seq.tobytes() for r in outs)
        result["threads"][str(t)] = entry
    th = result["threads"].values()
    result["run_to_run_identical"] = all(e["run_to_run_identical"] for e in th)
    result["identical_across_threads"] = all(e["identical_to_1_thread"] for e in th)
    result["max_abs_diff_vs_1_thread"] = max(e["max_abs_diff_vs_1_thread"] for e in th)
    if ref is not None:
        result["max_err_vs_float64"] = {t: e["max_err_vs_float64"]
                                        for t, e in result["threads"].items()}
        result["equal_to_sequential_float32"] = all(
            e["equal_to_sequential_float32"] for e in th)
    if not result["run_to_run_identical"]:
        result["verdict"] = "races"
    elif not result["identical_across_threads"]:
        result["verdict"] = "per-thread-count"
    else:
        result["verdict"] = "deterministic"
    return result


def environment() -> dict:
    return {"onnxruntime": ort.__version__, "onnx": onnx.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "cpu_count": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else None, "threads": list(THREADS), "runs": RUNS, "opset": OPSET}


def _yn(v: bool) -> str:
    return "yes" if v else "NO"


def print_table(results: list[dict]) -> None:
    hdr = (f"{'case':<48} {'r2r@1/2/4/8':<12} {'across':<6} {'max|d| vs 1t':>12} "
           f"{'split':<5}  {'verdict':<16} scatter err vs f64 @1/2/4/8")
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        if r["verdict"] == "error":
            print(f"{r['name'][:48]:<48} ERROR {r['error'][:90]}")
            continue
        r2r = "/".join("y" if e["run_to_run_identical"] else "N"
                       for e in r["threads"].values())
        extra = ""
        if "max_err_vs_float64" in r:
            extra = " ".join(f"{v:.2g}" for v in r["max_err_vs_float64"].values())
            extra += "  (= seq f32: " + _yn(r["equal_to_sequential_float32"]) + ")"
        split = "yes" if r["parallel_blocks_at_4_threads"] else "no"
        print(f"{r['name'][:48]:<48} {r2r:<12} {_yn(r['identical_across_threads']):<6} "
              f"{r['max_abs_diff_vs_1_thread']:>12.3g} {split:<5}  "
              f"{r['verdict']:<16} {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE", help="write environment and results as JSON")
    ap.add_argument("--only", metavar="TEXT", help="only cases whose name contains TEXT")
    ap.add_argument("--runs", type=int, default=RUNS, help=f"runs per thread count ({RUNS})")
    args = ap.parse_args(argv)
    cases = [c for c in all_cases() if not args.only or args.only.lower() in c.name.lower()]
    env = environment()
    env["runs"] = args.runs
    print(f"onnxruntime {env['onnxruntime']}, onnx {env['onnx']}, numpy {env['numpy']}, "
          f"{env['cpu_count']} CPUs ({env['affinity']} usable), threads {list(THREADS)}, "
          f"{args.runs} runs each, {len(cases)} cases", flush=True)
    t0 = time.perf_counter()
    results = []
    for case in cases:
        try:
            results.append(run_case(case, runs=args.runs))
        except Exception as exc:  # an op this ORT build lacks: report it, keep going
            results.append({"name": case.name, "op": case.op, "variant": case.variant,
                            "verdict": "error", "error": str(exc).splitlines()[0][:300]})
    total = time.perf_counter() - t0
    print_table(results)
    counts = {v: sum(r["verdict"] == v for r in results)
              for v in ("deterministic", "per-thread-count", "races", "error")}
    print(f"\n{len(results)} cases in {total:.1f} s: " +
          ", ".join(f"{k} {v}" for k, v in counts.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "total_seconds": round(total, 2),
                       "results": results}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
