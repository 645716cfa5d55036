"""Autocast: the forward model computing in bfloat16 or float16 where PyTorch's autocast does.

People who train on GPUs train in mixed precision (``torch.autocast``): matrix products and
convolutions in 16-bit, which halves their operands' memory and traffic and runs them at
tensor-core rates, while what is numerically delicate stays in float32. This rewrite gives
an exported float32 forward model the same types before memcc differentiates it, so the
backward follows by the ordinary rules (a Cast's gradient is a Cast back: parameters get
float32 gradients, and the optimizer updates float32 master weights).

The policy, op by op in node order, modelled on PyTorch's CUDA autocast lists:

- ``LOWER`` (MatMul, Gemm, Conv, ConvTranspose, Einsum): every float operand in 16-bit;
- ``FLOAT32`` (softmax and log-softmax, reductions, exp/log/pow/reciprocal, layer and group
  norms, the losses): 16-bit operands cast up; output float32. ReduceMean is here too,
  although torch's ``mean`` is not on its list: a decomposed LayerNorm is ReduceMean, Sub,
  Pow, ReduceMean, and its statistics belong in float32;
- ``FLOAT32_INSIDE`` (BatchNormalization): computed in float32 between casts, its output in
  the input's type, as cuDNN's batch norm takes and returns 16-bit activations;
- every other op runs in the widest type among its activation operands (float32 when one
  is float32, as torch's type promotion makes ``fp32 + bf16`` float32). Initializers and
  constants (``Constant`` nodes too) do not vote: they follow the activations (a bias added
  to a 16-bit product is cast, as ``torch.addmm``'s is), so a ``Div`` by a scalar stays
  16-bit. A ``Div`` of a
  constant by an activation (torch's ``__rdiv__``) is float32.

Operands are cast once per value and type (one Cast however many readers). Which operands
are cast comes from the op's ONNX schema: those bound to the same type constraint as its
first output (a Dropout's ratio, a Resize's scales, a Shape's output keep their types).
Ops of other domains are left in float32.

After differentiation, ``recast_in_backward`` makes the backward read a widened value by a
Cast of its own from the 16-bit source, so that the step keeps the 16-bit value across the
peak, not its float32 copy (a LayerNorm's input, a BatchNorm's input).

Whether a provider has a 16-bit kernel for each op is not decided here: the built step is
the provider-neutral policy, and ``passes.providers.sixteen_bit`` computes in float32
between 16-bit casts whatever the provider cannot run in 16-bit.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto

from memcc.frontend.emit import Emitter
from memcc.frontend.kernel_coverage import float_constraint
from memcc.graph import SIXTEEN_BIT_TYPES, Graph, TensorInfo, attr
from memcc.step import tag_node

SIXTEEN = {"bf16": TensorProto.BFLOAT16, "fp16": TensorProto.FLOAT16}  # --precision
F32 = TensorProto.FLOAT
LOWER = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
FLOAT32 = frozenset({
    "Softmax", "LogSoftmax", "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceProd",
    "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "CumSum", "Exp", "Log",
    "Pow", "Reciprocal", "Softplus", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "LpNormalization", "SoftmaxCrossEntropyLoss",
    "NegativeLogLikelihoodLoss", "Acos", "Asin", "Cosh", "Sinh", "Tan",
})
FLOAT32_INSIDE = frozenset({"BatchNormalization"})
# On the Casts autocast made (``memcc.autocast``), so that later passes can tell them from
# the model's own Casts.
CAST_TAG = "autocast"


@dataclass
class AutocastSummary:
    """What autocast did: nodes per computing type, and the Casts it added."""

    precision: str
    by_type: dict[str, int] = field(default_factory=dict)
    casts: int = 0
    recast_in_backward: int = 0

    def as_dict(self) -> dict:
        return {"precision": self.precision, "nodes_by_type": dict(self.by_type),
                "casts_added": self.casts, "recast_in_backward": self.recast_in_backward}


def autocast(graph: Graph, precision: str, *, stop_at: int | None = None
             ) -> tuple[Graph, AutocastSummary]:
    """Rewrite ``graph``'s first ``stop_at`` nodes (default all: the forward model, not
    the loss) to compute as the module docstring says; ``precision`` "bf16" or "fp16"
    ("fp32": unchanged). Edits ``graph`` in place and returns it."""
    summary = AutocastSummary(precision)
    if precision == "fp32":
        return graph, summary
    low = SIXTEEN[precision]
    end = len(graph.nodes) if stop_at is None else stop_at
    forward, rest = graph.nodes[:end], graph.nodes[end:]
    graph.nodes = []
    caster = _Caster(graph, Emitter(graph, prefix="autocast/"))
    fixed = set(graph.initializers) | {o for n in forward if n.op_type == "Constant"
                                       for o in n.output}
    for node in forward:
        target = _computing_type(graph, node, low, fixed)
        after: list[onnx.NodeProto] = []
        if target is not None:
            after = _retype(graph, caster, node, target)
            key = onnx.helper.tensor_dtype_to_string(target).removeprefix("TensorProto.")
            summary.by_type[key] = summary.by_type.get(key, 0) + 1
        graph.nodes.append(node)
        graph.nodes.extend(after)
    graph.nodes.extend(rest)
    graph.set_nodes(graph.nodes)
    summary.casts = caster.count
    return graph, summary


class _Caster:
    """One Cast per (value, type), emitted where first needed."""

    def __init__(self, graph: Graph, emit: Emitter) -> None:
        self.graph, self.emit = graph, emit
        self.cache: dict[tuple[str, int], str] = {}
        self.count = 0

    def to(self, value: str, dtype: int) -> str:
        info = self.graph.info[value]
        if info.dtype == dtype:
            return value
        key = (value, dtype)
        if key not in self.cache:
            out = self.emit.op("Cast", [value], to=dtype, info=TensorInfo(dtype, info.shape))
            tag_node(self.graph.nodes[-1], autocast="cast")
            self.cache[key] = out
            self.count += 1
        return self.cache[key]


def _float_slots(graph: Graph, node: onnx.NodeProto) -> tuple[list[int], list[int]] | None:
    """(input positions, output positions) bound to the type constraint of the node's first
    output, where that output is float32; None for a node that does not compute in it."""
    if node.domain not in ("", "ai.onnx") or not node.output or not node.output[0]:
        return None
    out0 = graph.info.get(node.output[0])
    if out0 is None or out0.dtype != F32:
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, graph.opset, "")
    except Exception:  # noqa: BLE001 - unknown to this onnx: leave it alone
        return None
    constraint = float_constraint(node.op_type, graph.opset)
    formal_in = list(schema.inputs)
    ins = [k for k, name in enumerate(node.input) if name and formal_in
           and formal_in[min(k, len(formal_in) - 1)].type_str == constraint
           and graph.info.get(name) is not None and graph.info[name].is_float]
    formal_out = list(schema.outputs)
    outs = [k for k, name in enumerate(node.output) if name and formal_out
            and formal_out[min(k, len(formal_out) - 1)].type_str == constraint]
    return (ins, outs) if ins else None


def _computing_type(graph: Graph, node: onnx.NodeProto, low: int, fixed: Collection[str]
                    ) -> int | None:
    """The type ``node`` computes in under the policy (its output type: FLOAT32_INSIDE
    returns the type its output keeps), or None where autocast leaves it alone.
    ``fixed``: initializers and ``Constant`` outputs, which do not vote."""
    slots = _float_slots(graph, node)
    if slots is None:
        return None
    ins, _ = slots
    if node.op_type in LOWER:
        return low
    types = [graph.info[node.input[k]].dtype for k in ins]
    if node.op_type in FLOAT32:
        return F32 if any(t != F32 for t in types) else None
    activations = [graph.info[node.input[k]].dtype for k in ins
                   if node.input[k] not in fixed]
    if node.op_type in FLOAT32_INSIDE:
        return low if activations and activations[0] == low else None
    if node.op_type == "Div" and ins and ins[0] == 0 and node.input[0] in fixed:
        return F32 if any(t != F32 for t in types) else None
    if not activations or all(t == F32 for t in activations):
        return F32 if any(t != F32 for t in types) else None
    return F32 if F32 in activations else low


def _retype(graph: Graph, caster: _Caster, node: onnx.NodeProto, target: int
            ) -> list[onnx.NodeProto]:
    """Cast ``node``'s float operands to the type it computes in and retype its outputs;
    a FLOAT32_INSIDE node computes in float32 and casts its first output back (the Cast
    returned, to be placed right after the node)."""
    ins, outs = _float_slots(graph, node)  # type: ignore[misc]
    inside = F32 if node.op_type in FLOAT32_INSIDE else target
    for k in ins:
        node.input[k] = caster.to(node.input[k], inside)
    if node.op_type in FLOAT32_INSIDE:
        y = node.output[0]
        wide = caster.emit.fresh(f"{y}.f32")
        node.output[0] = wide
        graph.info[wide] = graph.info[y]
        cast = onnx.helper.make_node("Cast", [wide], [y], to=target,
                                     name=caster.emit.fresh("Cast"))
        tag_node(cast, autocast="cast")
        graph.info[y] = TensorInfo(target, graph.info[y].shape)
        caster.count += 1
        return [cast]
    for k in outs:
        name = node.output[k]
        if name and name in graph.info:
            graph.info[name] = TensorInfo(target, graph.info[name].shape)
    return []


def recast_in_backward(graph: Graph, first_backward: int,
                       outputs: Collection[str] = ()) -> int:
    """Give the backward readers of an autocast Cast's output a Cast of their own, placed
    before the first of them, where the Cast's source is held anyway: a widening Cast
    (16-bit -> float32) of an activation, whose 16-bit source the backward needs less
    bytes to keep, and any Cast of a parameter or a data input, which live through the
    whole step. Returns how many Casts were added. ``first_backward``: the index of the
    backward's first node; ``outputs``: step outputs, whose readers are left alone.

    Without this, a float32 copy made for a float32 op (a LayerNorm's input) would be
    held from the forward to the backward, at twice the bytes of its 16-bit source, and
    every weight's 16-bit copy would be held next to the weight itself (as torch.autocast
    holds it: its cast cache and autograd keep it). The price: one more Cast per such
    value per step."""
    nodes = graph.nodes
    held = set(graph.inputs) | set(graph.initializers)
    widened = {n.output[0]: n for n in nodes[:first_backward]
               if n.op_type == "Cast" and _is_autocast(n)
               and (_widens(graph, n) or n.input[0] in held)}
    if not widened:
        return 0
    first_reader: dict[str, int] = {}
    for k in range(first_backward, len(nodes)):
        for name in nodes[k].input:
            if name in widened and name not in outputs:
                first_reader.setdefault(name, k)
    if not first_reader:
        return 0
    emit = Emitter(graph, prefix="autocast/", detached=True)
    inserts: dict[int, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    for name, k in first_reader.items():
        src = widened[name]
        new = emit.op("Cast", [src.input[0]], to=graph.info[name].dtype, info=graph.info[name])
        node = emit.nodes[-1]
        tag_node(node, autocast="recast")
        inserts.setdefault(k, []).append(node)
        renamed[name] = new
    out: list[onnx.NodeProto] = []
    for k, node in enumerate(nodes):
        out.extend(inserts.get(k, ()))
        if k >= first_backward:
            for j, name in enumerate(node.input):
                if name in renamed:
                    node.input[j] = renamed[name]
        out.append(node)
    nodes[:] = out  # in place: emitters hold this list
    graph.set_nodes(nodes)
    return len(renamed)


def _is_autocast(node: onnx.NodeProto) -> bool:
    return any(p.key == f"memcc.{CAST_TAG}" for p in node.metadata_props)


def _float32_identity(graph: Graph, node: onnx.NodeProto) -> bool:
    """A Cast from float32 or a 16-bit float to one of them: the identity in float32."""
    floats = (F32, *SIXTEEN_BIT_TYPES)
    src = graph.info.get(node.input[0])
    return src is not None and src.dtype in floats and attr(node, "to") in floats


def _widens(graph: Graph, node: onnx.NodeProto) -> bool:
    src, dst = graph.info.get(node.input[0]), graph.info.get(node.output[0])
    return src is not None and dst is not None and dst.dtype == F32 \
        and src.dtype in SIXTEEN_BIT_TYPES


def without_autocast(graph: Graph, keep: Collection[str] = ()) -> Graph:
    """``graph`` with autocast's Casts taken out and its 16-bit values float32 again: the
    forward model as exported, for ``memcc train``'s export of trained weights (master
    weights are float32; a user runs the model as it came, or autocasts it again). So are
    the Casts ``passes/providers/sixteen_bit.py`` adds where a compiled step computes a node
    in float32 for its provider (``f32/Cast_14``), and every other Cast between float32 and
    a 16-bit type: identities once every 16-bit value is float32 (kept, the 16-bit target
    of one would contradict its float32 output's type, and ONNX Runtime refuses the
    model). A Cast writing one of the graph's outputs or of ``keep`` (the forward model's
    outputs) becomes an Identity, keeping the name. A graph without autocast's Casts comes
    back as it is."""
    if not any(n.op_type == "Cast" and _is_autocast(n) for n in graph.nodes):
        return graph
    g = graph.copy()
    outputs = set(g.outputs) | set(keep)
    source: dict[str, str] = {}
    nodes = []
    for n in g.nodes:
        if n.op_type == "Cast" and (_is_autocast(n) or _float32_identity(g, n)):
            if n.output[0] in outputs:  # keep the name the model's users read
                n.op_type = "Identity"
                del n.attribute[:]
                nodes.append(n)
            else:
                source[n.output[0]] = n.input[0]
            continue
        nodes.append(n)
    for n in nodes:
        for k, name in enumerate(n.input):
            while name in source:
                name = source[name]
            n.input[k] = name
    g.set_nodes(nodes)
    for name, info in list(g.info.items()):
        if info.dtype in SIXTEEN_BIT_TYPES:
            g.info[name] = TensorInfo(F32, info.shape)
    return g
