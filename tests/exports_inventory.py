"""Inventory of what the real torch.onnx exporters emit for the fixture families.

Gradient-rule authors need to know which ops, attributes and idioms real exports contain (and
which only appear in shape/mask arithmetic that never gets a gradient). This script exports
every family in ``exports.FAMILIES`` with both exporters, in eval mode and in training mode
(training with dropout p=0.1 so the Dropout form is visible), and writes the tables in
docs/EXPORTS.md between the ``inventory:start``/``inventory:end`` markers:

    python tests/exports_inventory.py --write docs/EXPORTS.md   # or print to stdout

"Differentiable path" below means: a node with an output from which the model output is
reachable and an input that is reachable from a trainable parameter (a floating-point
initializer other than BatchNormalization running statistics) -- exactly the nodes whose
gradient rule the builder will call.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import exports  # noqa: E402

from memcc.frontend import load as loadmod  # noqa: E402
from memcc.frontend.constants import constant_value  # noqa: E402
from memcc.graph import Graph  # noqa: E402

MASK_OPS = ("Where", "IsNaN", "Expand", "GatherElements", "GatherND", "Trilu", "Equal", "And",
            "Not", "Or", "CumSum", "Range", "Less", "LessOrEqual", "Greater", "GreaterOrEqual",
            "ConstantOfShape")
SHAPE_SOURCES = ("Shape", "Size")
# Inputs (by position) of ops on the differentiable path that hold compile-time parameters
# (axes, sizes, indices, pads...). A rule that reads them must find them constant.
PARAM_INPUTS = {
    "Slice": (1, 2, 3, 4), "Pad": (1, 2, 3), "Split": (1,), "Reshape": (1,), "Expand": (1,),
    "Tile": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "ReduceMean": (1,), "ReduceSum": (1,),
    "ReduceMax": (1,), "Gather": (1,), "GatherElements": (1,), "GatherND": (1,), "Clip": (1, 2),
    "Dropout": (1, 2), "Where": (0,), "Pow": (1,),
}
TRAIN_DROPOUT = 0.1


@dataclass
class Case:
    name: str
    exporter: str
    training: bool
    error: str | None = None
    export_s: float = 0.0
    opsets: dict[str, int] = field(default_factory=dict)
    ir: int = 0
    functions: list[str] = field(default_factory=list)
    ops: Counter = field(default_factory=Counter)
    dims: dict[str, int] = field(default_factory=dict)
    unknown_after_infer: Counter = field(default_factory=Counter)
    load_error: str | None = None
    diff_ops: Counter = field(default_factory=Counter)
    attrs: dict[str, dict[str, set]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    runtime_params: Counter = field(default_factory=Counter)
    inits_named: int = 0
    inits_other: list[str] = field(default_factory=list)

    @property
    def mode(self) -> str:
        return "train" if self.training else "eval"


def _op_key(node: onnx.NodeProto) -> str:
    dom = node.domain or ""
    return node.op_type if dom in ("", "ai.onnx") else f"{dom}::{node.op_type}"


def _short(value) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_short(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


# ------------------------------------------------------------------------ graph analyses
def _differentiable_nodes(graph: Graph) -> list[onnx.NodeProto]:
    running = {n.input[i] for n in graph.nodes if n.op_type == "BatchNormalization"
               for i in (3, 4) if len(n.input) > i}
    live = {name for name, arr in graph.initializers.items()
            if np.issubdtype(arr.dtype, np.floating) and name not in running}
    fwd: list[onnx.NodeProto] = []
    for n in graph.nodes:
        if any(i in live for i in n.input):
            fwd.append(n)
            live.update(o for o in n.output
                        if o and graph.info.get(o) is not None and graph.info[o].is_float)
    reach = set(graph.outputs)
    out: list[onnx.NodeProto] = []
    for n in reversed(fwd):
        if any(o in reach for o in n.output):
            out.append(n)
            reach.update(i for i in n.input if i in live)
    return out[::-1]


def _data_dependent(graph: Graph) -> set[str]:
    """Values that depend on graph-input *data* (not just on shapes, which dims fix)."""
    dep = set(graph.inputs) - set(graph.initializers)
    for n in graph.nodes:
        if n.op_type in SHAPE_SOURCES:
            continue
        if any(i in dep for i in n.input):
            dep.update(o for o in n.output if o)
    return dep


def _attr_table(nodes: list[onnx.NodeProto]) -> dict[str, dict[str, set]]:
    table: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for n in nodes:
        entry = table[_op_key(n)]
        for a in n.attribute:
            if a.type in (onnx.AttributeProto.TENSOR, onnx.AttributeProto.GRAPH):
                continue
            entry[a.name].add(_short(helper.get_attribute_value(a)))
        if not n.attribute:
            entry.setdefault("-", set())
    return {k: dict(v) for k, v in table.items()}


def _runtime_params(graph: Graph, nodes: list[onnx.NodeProto]) -> Counter:
    """Parameter inputs of differentiable-path ops that are not compile-time constants."""
    dep = _data_dependent(graph)
    found: Counter = Counter()
    for n in nodes:
        for pos in PARAM_INPUTS.get(n.op_type, ()):
            if pos >= len(n.input) or not n.input[pos]:
                continue
            name = n.input[pos]
            if n.op_type == "Where" or constant_value(graph, name) is not None:
                continue
            kind = "data" if name in dep else "foldable"
            found[f"{n.op_type}[{pos}] {kind}"] += 1
    return found


def _notes(model: onnx.ModelProto, graph: Graph, module_has_bn: bool, training: bool
           ) -> dict[str, str]:
    nodes = list(model.graph.node)
    notes: dict[str, str] = {}
    bns = [n for n in nodes if n.op_type == "BatchNormalization"]
    if bns:
        forms = Counter(f"training_mode={_short(_attr(n, 'training_mode', 0))}"
                        f", {len([o for o in n.output if o])} out" for n in bns)
        notes["BatchNorm"] = "; ".join(f"{k} x{v}" for k, v in forms.items())
    elif module_has_bn:
        notes["BatchNorm"] = "no BN node: folded into Conv/Gemm with the running statistics"
        if training:
            notes["BatchNorm"] += " (**train-mode BN lost**: batch statistics are not used)"
    drops = [n for n in nodes if n.op_type == "Dropout"]
    if drops:
        forms = Counter(_dropout_form(graph, n) for n in drops)
        notes["Dropout"] = "; ".join(f"{k} x{v}" for k, v in forms.items())
    lns = [n for n in nodes if n.op_type == "LayerNormalization"]
    if lns:
        axes = sorted({_attr(n, "axis", -1) for n in lns})
        notes["LayerNorm"] = f"LayerNormalization op (axis {axes}) x{len(lns)}"
    gelu = [n for n in nodes if n.op_type == "Gelu"]
    if gelu:
        notes["GELU"] = "; ".join(f"Gelu(approximate={k}) x{v}" for k, v in Counter(
            _short(_attr(n, "approximate", "none")) for n in gelu).items())
    elif any(n.op_type == "Erf" for n in nodes):
        notes["GELU"] = "decomposed with Erf"
    elif any(n.op_type == "Tanh" for n in nodes) and any(n.op_type == "Pow" for n in nodes):
        notes["GELU"] = "tanh formula (Pow/Mul/Add/Tanh) as written by the model"
    sm = [n for n in nodes if n.op_type == "Softmax"]
    if sm:
        notes["Softmax"] = f"axis {sorted({_attr(n, 'axis', -1) for n in sm})}"
    masks = Counter(n.op_type for n in nodes if n.op_type in MASK_OPS)
    if masks:
        notes["mask/index ops"] = ", ".join(f"{k} {v}" for k, v in sorted(masks.items()))
    return notes


def _attr(node: onnx.NodeProto, name: str, default):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _dropout_form(graph: Graph, node: onnx.NodeProto) -> str:
    def val(i: int) -> str:
        if len(node.input) <= i or not node.input[i]:
            return "absent"
        v = constant_value(graph, node.input[i])
        return "runtime" if v is None else _short(v.tolist())
    outs = len([o for o in node.output if o])
    return f"Dropout(ratio={val(1)}, training_mode={val(2)}, {outs} out)"


# ------------------------------------------------------------------------ per case
def analyse(name: str, exporter: str, training: bool) -> Case:
    case = Case(name, exporter, training)
    dropout = TRAIN_DROPOUT if training else 0.0
    try:
        path, module, _, dims = exports.export(name, exporter, training=training,
                                               dropout=dropout)
    except Exception as exc:  # noqa: BLE001 - the inventory reports exporter failures
        case.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        return case
    case.export_s = exports.export_seconds(name, exporter, training, dropout)
    case.dims = dims
    model = onnx.load(str(path))
    case.opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    case.ir = model.ir_version
    case.functions = [f"{f.domain}::{f.name}" for f in model.functions]
    for f in model.functions:
        case.ops.update(f"(fn) {_op_key(n)}" for n in f.node)
    case.ops.update(_op_key(n) for n in model.graph.node)
    case.unknown_after_infer = _unknown_after_inference(path, dims)
    try:
        graph = loadmod.load_graph(path, dims)
    except Exception as exc:  # noqa: BLE001
        case.load_error = f"{type(exc).__name__}: {exc}"
        return case
    import torch

    _count_initializers(case, model, module)
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())
    diff = _differentiable_nodes(graph)
    case.diff_ops = Counter(_op_key(n) for n in diff)
    case.attrs = _attr_table(diff)
    case.runtime_params = _runtime_params(graph, diff)
    case.notes = _notes(model, graph, has_bn, training)
    if training:
        case.notes["fixture p=0"] = _fixture_dropout(name, exporter)
    return case


def _count_initializers(case: Case, model: onnx.ModelProto, module) -> None:
    """Float tensors (>1 element) that are / are not named after a torch parameter or buffer.

    Exporters constant-fold Transpose(weight) and BN into new initializers with made-up names
    (``onnx::MatMul_655``, ``val_92``): those train as separate parameters under names the
    user does not know, and a tied weight stops being tied.
    """
    names = set(module.state_dict())
    for t in model.graph.initializer:
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                               onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE):
            continue
        if int(np.prod(t.dims)) <= 1:
            continue
        if t.name in names:
            case.inits_named += 1
        else:
            case.inits_other.append(f"{t.name}{list(t.dims)}")


def _fixture_dropout(name: str, exporter: str) -> str:
    """What the deterministic training fixture (dropout p=0) holds where Dropout was."""
    path, _, _, _ = exports.export(name, exporter, training=True, dropout=0.0)
    model = onnx.load(str(path))
    graph = Graph.from_model(model)
    forms = Counter(_dropout_form(graph, n) for n in model.graph.node if n.op_type == "Dropout")
    ids = sum(n.op_type == "Identity" for n in model.graph.node)
    text = "; ".join(f"{k} x{v}" for k, v in forms.items()) or "no Dropout"
    return f"{text}; Identity x{ids}"


def _unknown_after_inference(path: Path, dims: dict[str, int]) -> Counter:
    """What ONNX shape inference alone leaves unknown (load_graph then runs ORT for it)."""
    model = loadmod.read_model(path)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    loadmod._bind_input_dims(model, dict(dims), str(path))
    model = loadmod._infer(model, str(path))
    graph = Graph.from_model(model)
    producers = graph.producers()
    return Counter(producers[v].op_type for v in loadmod._unknown_values(graph) if v in producers)


# ------------------------------------------------------------------------ rendering
def _fmt_counter(c: Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "-"


def render(cases: list[Case], total_s: float) -> str:
    lines: list[str] = []
    add = lines.append
    add(f"Generated by `python tests/exports_inventory.py --write docs/EXPORTS.md` "
        f"(torch {_version('torch')}, onnxscript {_version('onnxscript')}, "
        f"transformers {_version('transformers')}, onnx {_version('onnx')}; "
        f"{total_s:.0f} s on this machine). Training exports use dropout p={TRAIN_DROPOUT}.")
    add("")
    add("### Summary")
    add("")
    add("| family | exporter | mode | opset (IR) | nodes | Shape nodes | dims | export s | "
        "float inits: torch-named / other | load_graph | left to ORT after inference |")
    add("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cases:
        if c.error:
            add(f"| {c.name} | {c.exporter} | {c.mode} | - | - | - | - | - | - | "
                f"**export fails**: `{c.error}` | - |")
            continue
        ops = ", ".join(f"{d} {v}" for d, v in c.opsets.items())
        load = "ok" if c.load_error is None else f"**{c.load_error}**"
        add(f"| {c.name} | {c.exporter} | {c.mode} | {ops} ({c.ir}) | {sum(c.ops.values())} | "
            f"{c.ops.get('Shape', 0)} | {', '.join(c.dims)} | {c.export_s:.1f} | "
            f"{c.inits_named} / {len(c.inits_other)} | {load} | "
            f"{_fmt_counter(c.unknown_after_infer)} |")
    add("")
    add("### Idioms per export")
    add("")
    add("| family | exporter | mode | notes |")
    add("|---|---|---|---|")
    for c in cases:
        if c.error:
            continue
        notes = "<br>".join(f"**{k}**: {v}" for k, v in c.notes.items()) or "-"
        if c.functions:
            notes += f"<br>**functions**: {', '.join(c.functions)}"
        add(f"| {c.name} | {c.exporter} | {c.mode} | {notes} |")
    add("")
    add("### Op types per export (all nodes; domain ai.onnx unless prefixed)")
    add("")
    for c in cases:
        if c.error:
            continue
        add(f"- **{c.name} / {c.exporter} / {c.mode}**: {_fmt_counter(c.ops)}")
    add("")
    add("### Float initializers not named after a torch parameter (folded copies)")
    add("")
    for c in cases:
        if c.inits_other:
            shown = ", ".join(f"`{n}`" for n in c.inits_other[:8])
            more = f" (+{len(c.inits_other) - 8} more)" if len(c.inits_other) > 8 else ""
            add(f"- **{c.name} / {c.exporter} / {c.mode}**: {shown}{more}")
    add("")
    add("### Ops on the differentiable path (gradient rules needed)")
    add("")
    union: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    attrs: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for c in cases:
        for op in c.diff_ops:
            tag = ("TS" if c.exporter == "torchscript" else "DY") + "-" + c.mode[0]
            union[op][c.name].append(tag)
        for op, table in c.attrs.items():
            for k, v in table.items():
                attrs[op][k].update(v)
    add("TS = TorchScript, DY = dynamo; -e = eval export, -t = training export.")
    add("")
    add("| op | attributes seen (name: values) | cases |")
    add("|---|---|---|")
    for op in sorted(union):
        seen = "; ".join(f"{k}: {', '.join(sorted(v)[:6])}{' ...' if len(v) > 6 else ''}"
                         for k, v in sorted(attrs[op].items()) if k != "-") or "-"
        where = "; ".join(f"{fam} ({', '.join(tags)})" for fam, tags in union[op].items())
        add(f"| {op} | {seen} | {where} |")
    add("")
    add(f"Union ({len(union)} ops): {', '.join(sorted(union))}")
    add("")
    add("### Parameter inputs of differentiable-path ops that are not compile-time constants")
    add("")
    add("`foldable`: computed only from constants and Shape/Size arithmetic, so fixed once dims "
        "are bound (a rule can fold it, or use the static shapes instead); `data`: depends on "
        "input values.")
    add("")
    for c in cases:
        if c.runtime_params:
            add(f"- **{c.name} / {c.exporter} / {c.mode}**: {_fmt_counter(c.runtime_params)}")
    return "\n".join(lines) + "\n"


def _version(mod: str) -> str:
    try:
        return __import__(mod).__version__
    except Exception:  # noqa: BLE001
        return "?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="replace the generated part of this file")
    ap.add_argument("--families", default=",".join(exports.FAMILIES))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cases = [analyse(n, e, t) for n in args.families.split(",")
             for e in exports.EXPORTERS for t in (False, True)]
    text = render(cases, time.perf_counter() - t0)
    if args.write is None:
        sys.stdout.write(text)
        return
    doc = args.write.read_text()
    start, end = "<!-- inventory:start -->\n", "<!-- inventory:end -->"
    head, _, rest = doc.partition(start)
    _, _, tail = rest.partition(end)
    args.write.write_text(head + start + text + end + tail)


if __name__ == "__main__":
    main()
