"""Ops that ONNX defines as functions of other ops, expanded by memcc at load time.

In: an ONNX model with inferred types, and the op types to leave alone (those memcc
differentiates and ORT runs as they are). Out: a new model in which every other op whose
schema gives a function body (``GroupNormalization``-21, ``RMSNormalization``-23,
``HardSwish``, ``Mish``...) is replaced by that body, made for the node's attributes and
input types and inlined by ``onnx.inliner``; None when nothing was expanded. Why: the
gradient rules then see ops they know, and ORT, which would inline such ops itself out of
the planned order (``frontend.ort_kernels``), runs the graph memcc planned.
"""

from __future__ import annotations

import onnx
import onnx.defs
import onnx.inliner
from onnx import helper

from memcc.frontend.loss_ops import LOSS_OPS
from memcc.frontend.sequences import SEQUENCE_OPS
from memcc.frontend.static_values import Namer, value_types


def expand_function_ops(model: onnx.ModelProto, keep: frozenset[str] | set[str]
                        ) -> onnx.ModelProto | None:
    """Expand ops whose ONNX schema defines them as a function of other ops and that either
    have no gradient rule (``GroupNormalization``-21, ``RMSNormalization``-23,
    ``RotaryEmbedding``-23...) or no ORT kernel (``HardSwish``, ``Mish``, ``Bernoulli``: ORT
    would inline them itself, out of the planned order; ``frontend.ort_kernels``): the
    schema's own body, made for this node's attributes and input types, becomes a
    model-local function that ``onnx.inliner`` inlines. Returns the new model, or None when
    nothing was expanded. ``keep``: op types memcc differentiates as they are and ORT runs
    as they are."""
    types = value_types(model)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    rewritten_here = SEQUENCE_OPS | LOSS_OPS | {"CastLike", "If", "GatherND"}
    bodies = {i: body for i, node in enumerate(model.graph.node)
              if node.domain in ("", "ai.onnx") and node.op_type not in keep
              and node.op_type not in rewritten_here
              and (body := _schema_function(node, opset, types)) is not None}
    if not bodies:  # the usual case: no copy of the model (its weights took seconds)
        return None
    functions: dict[str, onnx.FunctionProto] = {}
    original = model
    model = onnx.ModelProto()
    model.CopyFrom(original)
    fresh = Namer(model)
    for i, body in bodies.items():
        node = model.graph.node[i]
        name = fresh(f"{node.op_type}_expanded")
        body.name, body.domain = name, _EXPAND_DOMAIN
        del body.attribute[:]
        body.attribute.extend(a.name for a in node.attribute)
        functions[name] = body
        node.op_type, node.domain = name, _EXPAND_DOMAIN
    if not functions:
        return None
    model.functions.extend(functions.values())
    model.opset_import.append(helper.make_opsetid(_EXPAND_DOMAIN, 1))
    try:
        inlined = onnx.inliner.inline_local_functions(model)
    except Exception:
        return None  # leave the ops as they are: the gradient builder names them
    if any(n.domain == _EXPAND_DOMAIN for n in inlined.graph.node):
        return None
    for i, o in enumerate(inlined.opset_import):
        if o.domain == _EXPAND_DOMAIN:
            del inlined.opset_import[i]
            break
    return inlined


_EXPAND_DOMAIN = "memcc.expand"


def _schema_function(node: onnx.NodeProto, opset: int, types) -> onnx.FunctionProto | None:
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain or "")
    except Exception:
        return None
    try:
        if schema.has_context_dependent_function:
            tps = []
            for i in node.input:
                t = types.get(i)
                if t is None:
                    return None
                shape = list(t[1]) if t[1] is not None else None
                tps.append(helper.make_tensor_type_proto(t[0], shape).SerializeToString())
            version = _function_version(schema.context_dependent_function_opset_versions,
                                        opset)
            raw = schema.get_context_dependent_function_with_opset_version(
                version, node.SerializeToString(), tps)
        elif schema.has_function:
            raw = schema.get_function_with_opset_version(
                _function_version(schema.function_opset_versions, opset))
        else:
            return None
    except Exception:
        return None
    body = onnx.FunctionProto()
    body.ParseFromString(raw if isinstance(raw, bytes) else raw.SerializeToString())
    return body if body.node and _at_opset(body, opset) else None


def _at_opset(body: onnx.FunctionProto, opset: int) -> bool:
    """Declare ``body`` at the model's ONNX opset, which ``onnx.inliner`` requires (it leaves
    a function written for another version in place). Written for an older opset (HardSwish's
    body is opset 14's), it means the same at the model's when none of its ops changed in
    between; otherwise the op is left for ORT to inline."""
    for imp in body.opset_import:
        if imp.domain not in ("", "ai.onnx") or imp.version == opset:
            continue
        for node in body.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            try:
                then = onnx.defs.get_schema(node.op_type, imp.version, "").since_version
                now = onnx.defs.get_schema(node.op_type, opset, "").since_version
            except Exception:  # noqa: BLE001 - an op unknown at one of the versions
                return False
            if then != now:
                return False
        imp.version = opset
    return True


def _function_version(versions: list[int], opset: int) -> int:
    """The newest function body written for an opset no newer than the model's."""
    usable = [v for v in versions if v <= opset]
    return max(usable) if usable else min(versions)
