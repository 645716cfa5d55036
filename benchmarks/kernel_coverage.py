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
named ``InsertedPrecisionFreeCast_*``), ``inlined`` (ORT replaced the node by its ONNX
function body) or ``fails`` (no kernel: session creation fails). ``--provider cuda`` runs
the same sessions on ``CUDAExecutionProvider`` (needs onnxruntime-gpu and a GPU; not run
yet) and reads from ORT's profile which provider ran the node (``fallback``: the CPU).

    python -m benchmarks.kernel_coverage --cuda-from-source \
        onnxruntime/core/providers/cuda/cuda_execution_provider.cc \
        onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc \
        --check-against docs/OperatorKernels.md \
        --commit SHA --version 1.23.0 --json memcc/data/ort_cuda_16bit_kernels.json

regenerates the CUDA table that memcc ships, from the kernel registrations
(``RegisterCudaKernels``, and the ONNX-domain ones of ``RegisterCudaContribKernels``) of an
onnxruntime checkout: typed registrations name their type;
the 16-bit types of the untyped ones (``UNTYPED_16BIT``) were read from each kernel's
``KernelDefBuilder`` in ``onnxruntime/core/providers/cuda/**`` by hand, and the script refuses
a source whose untyped registrations that table does not cover. ``--check-against``
compares the result with the checkout's ``docs/OperatorKernels.md``, which ORT generates
from a CUDA build's kernel registry, and records the agreement in the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memcc.frontend.kernel_coverage import coverage_table, cuda_table, has_kernel_for

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
    # tensor/identity_op.cc (7-11), nn/dropout.cc (12-)
    "Dropout": {7: HALF, 10: HALF, 12: HALF, 13: BOTH},
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
    "Slice": _ALL, "DynamicSlice": _ALL, "GatherND": {11: HALF, 12: HALF, 13: BOTH}}
_SIXTEEN = {"MLFloat16": "float16", "BFloat16": "bfloat16"}
# Registrations in ORT's words, and the contrib table's shorthand for its ONNX-domain ones
# (CUDA_ONNX_OP_TYPED_CLASS_NAME(ver, type, name): LayerNormalization-1..16, ThresholdedRelu).
_ENTRY = re.compile(r"BuildKernelCreateInfo<\s*(?:ONNX_OPERATOR|(CUDA_ONNX_OP))_(VERSIONED_)?"
                    r"(TWO_TYPED_|TYPED_)?(?:KERNEL_)?CLASS_NAME\(([^)]*)\)\s*>")


def _function_table(source: str) -> str:
    """The ``function_table[]`` of ``RegisterCudaKernels`` / ``RegisterCudaContribKernels``,
    comments removed (a commented-out registration registers nothing)."""
    start = source.index("function_table[]")
    return re.sub(r"//[^\n]*", "", source[start:source.index("};", start)])


def parse_registrations(*sources: str) -> dict[str, list[list]]:
    """ONNX-domain op -> [[first opset, last opset or None, [16-bit types]]] registered by
    the function tables in the texts of ``cuda_execution_provider.cc`` and
    ``cuda_contrib_kernels.cc``."""
    ranges: dict[tuple[str, int, int | None], set[str]] = {}
    missing = []
    for m in (m for text in sources for m in _ENTRY.finditer(_function_table(text))):
        args = [a.strip() for a in m.group(4).split(",")]
        if m.group(1):
            args = ["kCudaExecutionProvider", "kOnnxDomain", *args]
        if args[1] != "kOnnxDomain":
            continue
        op, versioned, typed = args[-1], bool(m.group(2)), m.group(3) or ""
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


def _doc_rows(markdown: str) -> dict[tuple[str, int], dict[str, str]]:
    """(op, first opset) -> {constraint: its types as written} of the CUDA provider's
    ONNX-domain rows in ORT's ``docs/OperatorKernels.md``."""
    text = markdown[markdown.index("## Operators implemented by CUDAExecutionProvider"):]
    rows: dict[tuple[str, int], dict[str, str]] = {}
    op, domain = "", ""
    for line in text.splitlines()[1:]:
        if line.startswith("## "):
            break
        found = re.match(r"\|\*\*Operator Domain:\*\* \*(.*)\*", line)
        if found:
            domain = found.group(1)
            continue
        cells = line.split("|")
        if domain != "ai.onnx" or len(cells) < 5 or not re.match(r"\[?\d", cells[3]):
            continue
        op = cells[1] or op
        rows[op, int(re.match(r"\[?(\d+)", cells[3]).group(1))] = dict(
            re.findall(r"\*\*(\w+)\*\* = ([^<]*)", cells[4]))
    return rows


def check_against_doc(ops: dict[str, list[list]], markdown: str) -> tuple[int, list[str]]:
    """How many (op, opset range) entries of the parsed table agree with ORT's
    ``docs/OperatorKernels.md`` (which ORT generates from a CUDA build's kernel registry),
    and a line per entry that does not."""
    from memcc.frontend.kernel_coverage import float_constraint
    rows, agree, differ = _doc_rows(markdown), 0, []
    for op, ranges in ops.items():
        for lo, _, types in ranges:
            if (op, lo) not in rows:
                differ.append(f"{op}-{lo}: not in the doc")
                continue
            constraints = rows[op, lo]
            written = constraints.get(float_constraint(op, lo) or "", " ".join(
                constraints.values()))
            doc = sorted(t for t in BOTH if f"tensor({t})" in written)
            if doc == types:
                agree += 1
            else:
                differ.append(f"{op}-{lo}: source {types}, doc {doc}")
    return agree, differ


def write_cuda_table(sources: list[Path], commit: str, version: str, out: Path,
                     doc: Path | None = None) -> None:
    """Write the shipped CUDA table (``memcc/data/ort_cuda_16bit_kernels.json``), checked
    against ``doc`` (``docs/OperatorKernels.md`` of the same checkout) where given."""
    ops = parse_registrations(*(source.read_text() for source in sources))
    checked = ""
    if doc is not None:
        agree, differ = check_against_doc(ops, doc.read_text())
        checked = (f"docs/OperatorKernels.md of the same commit (generated by ORT from a CUDA "
                   f"build's kernel registry): {agree} (op, opset range) entries agree"
                   + (f"; differ: {'; '.join(differ)}" if differ else ""))
        print(checked)
    table = {
        "provider": "CUDAExecutionProvider",
        "read_from": "microsoft/onnxruntime onnxruntime/core/providers/cuda/"
                     "cuda_execution_provider.cc (RegisterCudaKernels), "
                     "onnxruntime/contrib_ops/cuda/cuda_contrib_kernels.cc (its ONNX-domain "
                     "registrations) and the KernelDefBuilder of each untyped kernel",
        "commit": commit,
        "onnxruntime_version": version,
        "measured": False,
        "note": "Read from source, not measured on a GPU. Per ONNX-domain op: [first opset, "
                "last opset (null: open), the 16-bit types of its float constraint (an "
                "input's where the output is not float: Equal, ArgMax, IsNaN)].",
        "checked_against": checked,
        "ops": ops,
    }
    head = json.dumps({k: v for k, v in table.items() if k != "ops"}, indent=1)[:-2]
    body = ",\n".join(f"  {json.dumps(op)}: {json.dumps(r)}" for op, r in ops.items())
    out.write_text(f'{head},\n "ops": {{\n{body}\n }}\n}}\n')  # one line per op
    n16 = sum(1 for r in ops.values() if any(t for *_, t in r))
    print(f"{len(ops)} ONNX-domain ops, {n16} with a 16-bit kernel at some opset -> {out}")


# One-node cases: op -> (inputs, attributes). An input is a shape (a float tensor of the type
# under test, positive values so that Log and Sqrt stay finite), an int64/bool array (a
# constant), or None (an omitted optional input). ``_at_opset`` adjusts the ops whose form
# changed at 18 (ReduceMean/ReduceMax: axes became an input).
X = (1, 2, 5, 5)
M = (2, 3)
CASES: dict[str, tuple[list, dict]] = {
    "MatMul": ([M, (3, 4)], {}),
    "Gemm": ([M, (3, 4), (4,)], {}),
    "Conv": ([X, (3, 2, 3, 3)], {}),
    "ConvTranspose": ([X, (2, 3, 3, 3)], {}),
    **{op: ([M, M], {}) for op in ("Add", "Sub", "Mul", "Div", "Pow", "Equal", "Sum", "Max",
                                   "Min")},
    **{op: ([M], {}) for op in ("Relu", "Sigmoid", "Tanh", "Erf", "Sqrt", "Reciprocal", "Exp",
                                "Log", "Neg", "Abs", "Identity", "Dropout", "Shape", "Softmax",
                                "LogSoftmax", "Flatten")},
    "Clip": ([M, (), ()], {}),
    "ReduceSum": ([M, np.array([1])], {}),
    "ReduceMean": ([M], {"axes": [1]}),
    "ReduceMax": ([M], {"axes": [1]}),
    "LayerNormalization": ([M, (3,), (3,)], {}),
    "BatchNormalization": ([X, (2,), (2,), (2,), (2,)], {}),
    "Where": ([np.array([[True, False, True], [False, True, False]]), M, M], {}),
    "Cast": ([M], {}),  # float32 in, the 16-bit type out (``to``)
    "Transpose": ([M], {"perm": [1, 0]}),
    "Reshape": ([M, np.array([3, 2])], {}),
    "Concat": ([M, M], {"axis": 0}),
    "Slice": ([M, np.array([0]), np.array([1]), np.array([0])], {}),
    "Gather": ([M, np.array([1, 0])], {"axis": 0}),
    "GatherElements": ([M, np.zeros(M, dtype=np.int64)], {"axis": 1}),
    "ScatterElements": ([M, np.array([[0], [2]]), (2, 1)], {"axis": 1}),
    "ScatterND": ([M, np.array([[1]]), (1, 3)], {}),
    "Expand": ([(2, 1), np.array([2, 3])], {}),
    "Unsqueeze": ([M, np.array([0])], {}),
    "Squeeze": ([(1, 3), np.array([0])], {}),
    "Split": ([M, np.array([1, 1])], {"axis": 0}),
    "Tile": ([M, np.array([2, 1])], {}),
    "CumSum": ([M, np.array(1)], {}),
    "Einsum": ([M, (3, 4)], {"equation": "ij,jk->ik"}),
    "MaxPool": ([X], {"kernel_shape": [2, 2]}),
    "AveragePool": ([X], {"kernel_shape": [2, 2]}),
    "GlobalAveragePool": ([X], {}),
}


def _at_opset(op: str, opset: int) -> tuple[list, dict]:
    inputs, attrs = CASES[op]
    if op in ("ReduceMean", "ReduceMax") and opset >= 18:
        return [*inputs, np.array(attrs["axes"])], {}
    return inputs, attrs


def one_node_model(op: str, dtype: int, opset: int) -> onnx.ModelProto:
    """``op`` at ``opset`` on constant inputs of ``dtype`` (its float ones), outputs untyped
    (ORT infers them); no graph inputs, so a run needs no feeds (numpy has no bfloat16)."""
    inputs, attrs = _at_opset(op, opset)
    names, inits = [], []
    for i, spec in enumerate(inputs):
        name = f"in{i}"
        if spec is None:
            name = ""
        elif isinstance(spec, np.ndarray):
            inits.append(numpy_helper.from_array(spec.astype(np.bool_ if spec.dtype == bool
                                                             else np.int64), name))
        else:
            values = np.linspace(0.1, 0.9, int(np.prod(spec))).tolist()
            elem = TensorProto.FLOAT if op == "Cast" else dtype
            inits.append(helper.make_tensor(name, elem, list(spec), values))
        names.append(name)
    if op == "Cast":
        attrs = {"to": dtype}
    n_out = 2 if op == "Split" else 1
    outs = [f"out{i}" for i in range(n_out)]
    node = helper.make_node(op, names, outs, name=f"{op}_node", **attrs)
    graph = helper.make_graph([node], op, [], [helper.make_empty_tensor_value_info(o)
                                               for o in outs], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9  # what onnxruntime 1.31 reads; onnx 1.23 writes a newer one
    return model


SESSION_PROVIDERS = {"cpu": ["CPUExecutionProvider"],
                     "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"]}


def session_says(model: onnx.ModelProto, provider: str = "cpu") -> str:
    """What a session with graph optimizations off does with ``model``'s one node:
    ``kernel`` (ran as written on ``provider``), ``casts`` (ran, but ORT inserted Casts
    around it: ``InsertedPrecisionFreeCast_*`` in the model it saves), ``inlined`` (ORT
    replaced it by its ONNX function body: Relu at opset 18 in float16 becomes Cast + Max),
    ``fallback`` (CUDA only: the profile shows it ran on the CPU provider) or ``fails`` (no
    session, or no run). The CUDA path needs a GPU and has not been run (no GPU when it was
    written)."""
    import onnxruntime as ort
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.optimized_model_filepath = str(Path(tmp) / "as_run.onnx")
        options.log_severity_level = 4
        options.enable_profiling = provider != "cpu"
        options.profile_file_prefix = str(Path(tmp) / "profile")
        try:
            sess = ort.InferenceSession(model.SerializeToString(), options,
                                        providers=SESSION_PROVIDERS[provider])
            binding = sess.io_binding()
            for out in sess.get_outputs():
                binding.bind_output(out.name)
            sess.run_with_iobinding(binding)
        except Exception:  # noqa: BLE001 - any failure is the answer
            return "fails"
        as_run = onnx.load(options.optimized_model_filepath)
        ran_on = providers_in_profile(sess.end_profiling()) if provider != "cpu" else {}
    name = model.graph.node[0].name
    if not any(n.name == name for n in as_run.graph.node):
        return "inlined"
    if ran_on.get(name, SESSION_PROVIDERS[provider][0]) != SESSION_PROVIDERS[provider][0]:
        return "fallback"
    inserted = [n for n in as_run.graph.node if n.name.startswith("InsertedPrecisionFreeCast")]
    return "casts" if inserted else "kernel"


def providers_in_profile(path: str) -> dict[str, str]:
    """Node name -> the provider ORT's profile (``enable_profiling``; its node events are
    named ``<node>_kernel_time``) says ran it."""
    events = json.loads(Path(path).read_text())
    return {e["name"].removesuffix("_kernel_time"): e["args"]["provider"] for e in events
            if e.get("cat") == "Node" and "provider" in e.get("args", {})}


TYPES = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}


def measure(ops: list[str], opsets: list[int], provider: str = "cpu") -> list[dict]:
    """Per (op, opset, type): what ``has_kernel_for`` says and what a session does."""
    rows = []
    for op in ops:
        for opset in opsets:
            for short, dtype in TYPES.items():
                rows.append({"op": op, "opset": opset, "type": short,
                             "registry": has_kernel_for(op, opset, dtype, provider),
                             "session": session_says(one_node_model(op, dtype, opset),
                                                     provider)})
    return rows


def _cell(values: dict[int, object]) -> str:
    shown = {k: ("yes" if v is True else "no" if v is False else v) for k, v in values.items()}
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return "; ".join(f"{k}: {v}" for k, v in shown.items())


def markdown_measured(rows: list[dict], opsets: list[int]) -> str:
    """op x {bf16, fp16} x {registry says, session says}; a cell that differs between the
    opsets names each; ``agree``: registry yes exactly where the session ran the node as
    written (``casts``, ``inlined`` and ``fails`` all mean ORT has no kernel of its own)."""
    head = ("| op | bf16 registry | bf16 session | fp16 registry | fp16 session | agree |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for op in dict.fromkeys(r["op"] for r in rows):
        cells, agree = [], True
        for short in TYPES:
            mine = [r for r in rows if r["op"] == op and r["type"] == short]
            cells.append(_cell({r["opset"]: r["registry"] for r in mine}))
            cells.append(_cell({r["opset"]: r["session"] for r in mine}))
            agree &= all(r["registry"] == (r["session"] == "kernel") for r in mine)
        lines.append(f"| {op} | {' | '.join(cells)} | {'yes' if agree else '**no**'} |")
    return "\n".join(lines)


def markdown_cuda(ops: list[str], opsets: list[int]) -> str:
    """The shipped CUDA table (read from source, not measured) for ``ops``."""
    by = {o: {r["op"]: r for r in coverage_table("cuda", ops, o)} for o in opsets}
    lines = ["| op | bf16 | fp16 |", "|---|---|---|"]
    for op in ops:
        lines.append(f"| {op} | {_cell({o: by[o][op]['bfloat16'] for o in opsets})} | "
                     f"{_cell({o: by[o][op]['float16'] for o in opsets})} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--opsets", type=int, nargs="+", default=[17, 18])
    parser.add_argument("--ops", nargs="+", default=list(CASES))
    parser.add_argument("--provider", choices=sorted(SESSION_PROVIDERS), default="cpu",
                        help="the provider the sessions run on (cuda: needs a GPU)")
    parser.add_argument("--out", type=Path, help="also write the Markdown here")
    parser.add_argument("--cuda-from-source", type=Path, nargs="+", metavar="CC",
                        help="regenerate the CUDA table from cuda_execution_provider.cc "
                             "and cuda_contrib_kernels.cc")
    parser.add_argument("--check-against", type=Path, metavar="MD",
                        help="with --cuda-from-source: ORT's docs/OperatorKernels.md to check")
    parser.add_argument("--commit", default="")
    parser.add_argument("--version", default="")
    parser.add_argument("--json", type=Path,
                        default=Path("memcc/data/ort_cuda_16bit_kernels.json"))
    args = parser.parse_args(argv)
    if args.cuda_from_source:
        write_cuda_table(args.cuda_from_source, args.commit, args.version, args.json,
                         args.check_against)
        return 0
    unknown = sorted(set(args.ops) - set(CASES))
    if unknown:
        print(f"kernel_coverage: no one-node case for {', '.join(unknown)}; known: "
              f"{', '.join(CASES)}", file=sys.stderr)
        return 2
    import onnxruntime
    wanted = SESSION_PROVIDERS[args.provider][0]
    if wanted not in onnxruntime.get_available_providers():
        print(f"kernel_coverage: this onnxruntime has no {wanted} (it has "
              f"{', '.join(onnxruntime.get_available_providers())}); install onnxruntime-gpu "
              "on a machine with a GPU for --provider cuda", file=sys.stderr)
        return 2
    rows = measure(args.ops, args.opsets, args.provider)
    table = cuda_table_header()
    text = (f"{SESSION_PROVIDERS[args.provider][0]}, onnxruntime {onnxruntime.__version__}, onnx "
            f"{onnx.__version__}, opsets {', '.join(map(str, args.opsets))}, "
            "graph optimizations off:\n\n" + markdown_measured(rows, args.opsets) +
            f"\n\nCUDAExecutionProvider, {table} (read from ORT's source registrations, "
            "not measured: no GPU):\n\n" + markdown_cuda(args.ops, args.opsets) + "\n")
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def cuda_table_header() -> str:
    """Which onnxruntime source the shipped CUDA table was read from."""
    t = cuda_table()
    return f"onnxruntime {t['onnxruntime_version']} at commit {t['commit'][:12]}"


if __name__ == "__main__":
    sys.exit(main())
