"""Which ops ONNX Runtime runs in bfloat16 and float16: measured on the CPU provider, read from
source for the CUDA provider.

Autocast (``--precision bf16|fp16``) computes an op in 16 bits only where the provider has a
kernel for it; elsewhere memcc computes it in float32 between Casts of its own
(``passes.providers.sixteen_bit``), asking ``memcc.frontend.kernel_coverage.has_kernel_for``.
This script checks that answer against what ORT does:

    python -m benchmarks.kernel_coverage [--opsets 17 18] [--out table.md]

builds a one-node model per (op, 16-bit type, opset), creates an ``InferenceSession`` on
``CPUExecutionProvider`` with graph optimizations off (``ORT_DISABLE_ALL``), runs it once, and
prints a Markdown table: per op and type, what the registry says (``has_kernel_for``) and
what the session says: ``kernel`` (ran as written), ``casts`` (ORT wrapped the node in Casts
to float itself: ``InsertCastTransformer`` still runs with optimizations off; seen in the
model ORT saves through ``SessionOptions.optimized_model_filepath``, whose inserted nodes are
named ``InsertedPrecisionFreeCast_*``), or ``fails`` (no kernel: session creation fails).

    python -m benchmarks.kernel_coverage --cuda-from-source cuda_execution_provider.cc \
        --commit SHA --version 1.23.0 --json memcc/data/ort_cuda_16bit_kernels.json

regenerates the CUDA table that memcc ships, from the kernel registrations
(``RegisterCudaKernels``) of an onnxruntime checkout: typed registrations name their type;
the 16-bit types of the untyped ones (``UNTYPED_16BIT``) were read from each kernel's
``KernelDefBuilder`` in ``onnxruntime/core/providers/cuda/**`` by hand, and the script refuses
a source whose untyped registrations that table does not cover.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path


BOTH = ("bfloat16", "float16")
HALF = ("float16",)
NONE: tuple[str, ...] = ()
# Untyped CUDA registrations (one kernel class for several types): op -> {first opset of the
# registration: 16-bit types of its float constraint}, read from the KernelDefBuilder of
# onnxruntime/core/providers/cuda/** at the commit the table names. "All fixed-size tensor
# types" (DataTypeImpl::AllFixedSizeTensorTypes, ...IRv9, AllTensorTypes, control flow's V)
# include both; AllIEEEFloatTensorTypes is float, double, MLFloat16.
_ALL = {lo: BOTH for lo in range(1, 30)}
UNTYPED_16BIT: dict[str, dict[int, tuple[str, ...]]] = {
    **{op: _ALL for op in (
        "Concat", "Unsqueeze", "Flatten", "Squeeze", "Identity", "Gather", "Expand",
        "Reshape", "Shape", "Size", "Transpose", "Split", "GatherElements",
        "ScatterElements", "ScatterND", "Trilu", "ConstantOfShape", "Compress", "Scatter",
        "ReverseSequence", "If", "Loop", "Scan", "MemcpyFromHost", "MemcpyToHost",
        "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceLength",
        "ConcatFromSequence", "SequenceErase", "SequenceInsert")},
    "Dropout": {7: HALF, 10: HALF, 12: HALF, 13: BOTH},         # tensor/identity_op.cc, nn/dropout.cc
    "Sum": {6: BOTH, 8: BOTH, 13: BOTH},                         # math/variadic_elementwise_ops.cc
    "Max": {6: BOTH, 12: BOTH, 13: BOTH},
    "Min": {6: BOTH, 12: BOTH, 13: BOTH},
    "Tile": {6: HALF, 13: BOTH},                                 # tensor/tile.cc
    "CumSum": {11: NONE, 14: HALF},                              # math/cumsum.cc
    "Pow": {12: HALF, 13: HALF, 15: HALF},                       # math/binary_elementwise_ops.cc
    "Mod": {10: HALF, 13: BOTH},
    "Clip": {11: NONE, 12: HALF, 13: HALF},                      # math/clip.cc
    "Einsum": {12: HALF},                                        # math/einsum.cc
    "TopK": {1: HALF, 10: HALF, 11: HALF},                       # math/topk.cc
    "IsNaN": {9: HALF, 13: BOTH, 20: BOTH},                      # math/unary_elementwise_ops.cc
    "IsInf": {10: NONE, 20: BOTH},
    "DepthToSpace": {1: HALF, 11: HALF, 13: HALF},               # tensor/space_depth_ops.cc
    "SpaceToDepth": {1: HALF, 13: HALF},
    "Range": {11: NONE},                                         # generator/range.cc
    "EyeLike": {9: NONE},                                        # tensor/eye_like.cc
    "NonMaxSuppression": {10: NONE, 11: NONE},                   # object_detection/
    "RandomNormal": {1: HALF}, "RandomUniform": {1: HALF},       # generator/random.cc
    "RandomNormalLike": {1: HALF}, "RandomUniformLike": {1: HALF},
}
# Cast's registrations are typed by its input (T1); its output T2 takes every type
# (CastOpTypeConstraints in tensor/cast_op.cc), 16-bit ones included.
OUTPUT_TAKES_BOTH = frozenset({"Cast"})
# Typed registrations whose type is the index type (Tind, indices), not the data's: the data
# constraint's 16-bit types by first opset (tensor/slice.cc: AllFixedSizeTensorTypes;
# tensor/gather_nd.cc: float, double, MLFloat16, int64, bool before 13, BFloat16 from 13).
INDEX_TYPED: dict[str, dict[int, tuple[str, ...]]] = {
    "Slice": _ALL, "GatherND": {11: HALF, 12: HALF, 13: BOTH}}
_SIXTEEN = {"MLFloat16": "float16", "BFloat16": "bfloat16"}
_ENTRY = re.compile(r"BuildKernelCreateInfo<\s*ONNX_OPERATOR_(VERSIONED_)?(TWO_TYPED_|TYPED_)?"
                    r"KERNEL_CLASS_NAME\(([^)]*)\)\s*>")


def parse_registrations(source: str) -> dict[str, list[list]]:
    """ONNX-domain op -> [[first opset, last opset or None, [16-bit types]]] registered by
    ``RegisterCudaKernels`` in the text of ``cuda_execution_provider.cc``."""
    start = source.index("static Status RegisterCudaKernels")
    body = re.sub(r"//[^\n]*", "", source[start:source.index("};", start)])
    ranges: dict[tuple[str, int, int | None], set[str]] = {}
    missing = []
    for m in _ENTRY.finditer(body):
        args = [a.strip() for a in m.group(3).split(",")]
        if args[1] != "kOnnxDomain":
            continue
        op, versioned, typed = args[-1], bool(m.group(1)), m.group(2) or ""
        lo = int(args[2])
        hi = int(args[3]) if versioned else None
        types = args[(4 if versioned else 3):-1]
        key = (op, lo, hi)
        found = ranges.setdefault(key, set())
        if op in OUTPUT_TAKES_BOTH:
            found.update(BOTH)
        elif op in INDEX_TYPED:
            found.update(INDEX_TYPED[op][lo])
        elif typed:  # OneHot's and RMSNormalization's names join several: int64_t_MLFloat16_..
            found.update(_SIXTEEN[t] for name in types for t in name.split("_")
                         if t in _SIXTEEN)
        elif op in UNTYPED_16BIT and lo in UNTYPED_16BIT[op]:
            found.update(UNTYPED_16BIT[op][lo])
        else:
            missing.append(f"{op}({lo}-{hi})")
    if missing:
        raise SystemExit("kernel_coverage: untyped registrations UNTYPED_16BIT does not cover "
                         f"(read their KernelDefBuilder and add them): {', '.join(missing)}")
    out: dict[str, list[list]] = {}
    for (op, lo, hi), types in sorted(ranges.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(op, []).append([lo, hi, sorted(types)])
    return out


def write_cuda_table(source: Path, commit: str, version: str, out: Path) -> None:
    """Write the shipped CUDA table (``memcc/data/ort_cuda_16bit_kernels.json``)."""
    ops = parse_registrations(source.read_text())
    table = {
        "provider": "CUDAExecutionProvider",
        "read_from": "microsoft/onnxruntime onnxruntime/core/providers/cuda/"
                     "cuda_execution_provider.cc (RegisterCudaKernels) and the "
                     "KernelDefBuilder of each untyped kernel",
        "commit": commit,
        "onnxruntime_version": version,
        "measured": False,
        "note": "Read from source, not measured on a GPU. Per ONNX-domain op: [first opset, "
                "last opset (null: open), the 16-bit types of its float constraint (an "
                "input's where the output is not float: Equal, ArgMax, IsNaN)].",
        "ops": ops,
    }
    out.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n")
    n16 = sum(1 for r in ops.values() if any(t for *_, t in r))
    print(f"{len(ops)} ONNX-domain ops, {n16} with a 16-bit kernel at some opset -> {out}")
