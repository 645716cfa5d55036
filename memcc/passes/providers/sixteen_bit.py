"""A 16-bit step as a provider can run it: ops without a 16-bit kernel there compute in
float32 between casts.

In: a step built with ``--precision bf16`` or ``fp16`` (``frontend.autocast``: the
provider-neutral policy) and the provider. Out: the same step where every node that reads
or writes a 16-bit float value and has no kernel for those types on the provider
(``frontend.kernel_coverage``) reads float32 copies of its 16-bit operands and writes its
16-bit results through a Cast down from float32; a report of what was rewritten, per op.

Why memcc does this itself: ONNX Runtime's CPU provider has almost no bfloat16 kernels
(onnxruntime 1.31: Cast, the shape ops, LayerNormalization), so a bfloat16 step would not
load; for float16 it inserts such Casts itself when it creates the session
(``InsertCastTransformer``), buffers that no plan counted. Done here, the step the planner
sees is the step that runs. The arithmetic is what a 16-bit kernel does where that
computes in float32 and rounds its result (tensor cores' bfloat16 products accumulate in
float32; ORT's CUDA elementwise kernels for bfloat16 compute in float): values between ops
are 16-bit, the bytes held across the step are 16-bit, only the working copies of one
node are float32.
"""

from __future__ import annotations

from collections import Counter

import onnx
from onnx import TensorProto

from memcc.frontend.emit import Emitter
from memcc.frontend.kernel_coverage import has_kernel_bound
from memcc.graph import SIXTEEN_BIT_TYPES, Graph, TensorInfo

F32 = TensorProto.FLOAT
# Kernels the registry lists for 16-bit types that refuse them at run time: onnxruntime
# 1.31's CPU ScatterElements / ScatterND add float16 only without a reduction
# ("MLFloat16 data type is not supported with ScatterElements opset 16 when reduction is
# 'add'"): tests/test_sixteen_bit.py.
_REDUCING_SCATTERS = frozenset({"ScatterElements", "ScatterND"})


def for_provider(graph: Graph, provider: str) -> tuple[Graph, dict]:
    """The step with every 16-bit node ``provider`` has no kernel for computed in float32
    between casts; ``{"sixteen_bit_emulated": {op: count}}`` (the pass contract,
    ``memcc/pass_contract.py``), ``{}`` where nothing was. A step without 16-bit values
    comes back as it was."""
    if not any(ti.dtype in SIXTEEN_BIT_TYPES for ti in graph.info.values()):
        return graph, {}
    out = graph.copy()
    emit = Emitter(out, prefix="f32/", detached=True)
    nodes: list[onnx.NodeProto] = []
    done: Counter[str] = Counter()
    for node in out.nodes:
        bound = _bound_types(out, node)
        if bound is None or (has_kernel_bound(node.op_type, out.opset, bound, provider,
                                              node.domain) and not _refused(node)):
            nodes.append(node)
            continue
        nodes.extend(_in_float32(out, emit, node))
        done[node.op_type] += 1
    if not done:
        return graph, {}
    out.set_nodes(nodes)
    return out, {"sixteen_bit_emulated": dict(sorted(done.items()))}


def describe_emulated(emulated: dict[str, int]) -> str:
    """``for_provider``'s ``sixteen_bit_emulated`` in words, most nodes first: ``69 node(s)
    of the step (MatMul 31, Mul 12, ...)`` (compile's warning and run's and train's notes)."""
    ops = ", ".join(f"{op} {n}" for op, n in sorted(emulated.items(), key=lambda kv: -kv[1]))
    return f"{sum(emulated.values())} node(s) of the step ({ops})"


def _refused(node: onnx.NodeProto) -> bool:
    return node.op_type in _REDUCING_SCATTERS and any(
        a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute)


def _bound_types(graph: Graph, node: onnx.NodeProto) -> dict[str, int] | None:
    """Type constraint -> element type as ``node``'s values bind them, where one of them
    is a 16-bit float; None otherwise (or for an op this onnx does not know)."""
    if node.op_type == "Constant":  # not a kernel: ORT makes it an initializer
        return None
    values = [(v, k, False) for k, v in enumerate(node.input) if v] + \
        [(v, k, True) for k, v in enumerate(node.output) if v]
    if not any(v in graph.info and graph.info[v].dtype in SIXTEEN_BIT_TYPES for v, _, _ in values):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, graph.opset, node.domain or "")
    except Exception:  # noqa: BLE001 - not ours to judge
        return None
    bound: dict[str, int] = {}
    for v, k, is_out in values:
        formal = schema.outputs if is_out else schema.inputs
        if not formal or v not in graph.info:
            continue
        bound.setdefault(formal[min(k, len(formal) - 1)].type_str, graph.info[v].dtype)
    return bound


def _in_float32(graph: Graph, emit: Emitter, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """``node`` reading float32 copies of its 16-bit operands and writing its 16-bit
    results through Casts down: the nodes to put where it stood."""
    before = len(emit.nodes)
    widened: dict[str, str] = {}
    for k, v in enumerate(node.input):
        if v and v in graph.info and graph.info[v].dtype in SIXTEEN_BIT_TYPES:
            if v not in widened:
                widened[v] = emit.op("Cast", [v], to=F32,
                                     info=TensorInfo(F32, graph.info[v].shape))
            node.input[k] = widened[v]
    pre = emit.nodes[before:]
    post: list[onnx.NodeProto] = []
    for k, y in enumerate(node.output):
        if not y or y not in graph.info or graph.info[y].dtype not in SIXTEEN_BIT_TYPES:
            continue
        info = graph.info[y]
        wide = emit.fresh(f"{y}.f32")
        graph.info[wide] = TensorInfo(F32, info.shape)
        node.output[k] = wide
        post.append(onnx.helper.make_node("Cast", [wide], [y], to=info.dtype,
                                          name=emit.fresh("Cast")))
    _retype_float_attributes(node)
    return [*pre, node, *post]


def _retype_float_attributes(node: onnx.NodeProto) -> None:
    """Attributes that name the computing type (a ``Cast``'s ``to`` is the node's own
    business; ``EyeLike`` / ``RandomNormalLike``'s ``dtype``) follow it to float32."""
    for a in node.attribute:
        if a.name == "dtype" and a.i in SIXTEEN_BIT_TYPES:
            a.i = F32
