"""MaxPool variants (registered in ``variants.VARIANTS``).

The default MaxPool rule (``nn._maxpool_grad``) keeps the argmax indices from the forward
pass to the backward, as int32: as many bytes as the pooled output. ``recompute`` keeps
nothing but the pool's input X and finds the indices again in the backward by running the
same MaxPool on X. ORT's kernel is deterministic, so they are the same indices and the
gradient is the default's bit for bit. It pays where X is kept for the backward anyway (a
Relu in front, whose default rule reads it), which is how CNNs use MaxPool.

A ``from_input`` variant (argmax rebuilt by comparing X with the upsampled output) is not
built: it would keep the same X as ``recompute``, and its backward would need an X-sized
copy of X to find each window's first maximum, where ``recompute`` needs only
output-sized buffers (docs/VARIANTS.md).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from memcc.errors import GradientError
from memcc.frontend.gradients.nn import scatter_to_argmax
from memcc.frontend.gradients.registry import GradContext
from memcc.frontend.gradients.shape_ops import slice_values
from memcc.frontend.gradients.variant_registry import EXACT, VariantContext, register_variant
from memcc.graph import TensorInfo, attr, node_label
from memcc.step import rule_io

Grads = list[str | None]


def _indices_take_no_gradient(node: onnx.NodeProto) -> bool:
    """The step's record of the rule says no gradient was read for the Indices output (a
    step without the record offers no variant at all:
    ``passes/lowering/variant_substitution.substitutable``)."""
    gouts, _ = rule_io(node) or ([], [])
    return not any(gouts[1:])


def _recompute_applies(ctx: GradContext, node: onnx.NodeProto) -> bool:
    """Row-major indices (storage_order 0, as the default rule requires), a float input
    and no gradient through the Indices output."""
    return (int(attr(node, "storage_order", 0)) == 0
            and ctx.info(node.input[0]).is_float
            and _indices_take_no_gradient(node))


def _node_attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _argmax_again(ctx: GradContext, node: onnx.NodeProto) -> str:
    """MaxPool's int64 Indices, recomputed in the backward from X with the forward node's
    own attributes (same kernel, same ties, same indices). The indices stay int64: a cast
    to int32 would only add a buffer while the int64 one is live."""
    y_info = ctx.info(node.output[0])
    pooled, indices = ctx.emit.op(
        "MaxPool", [node.input[0]], outputs=2,
        info=[y_info, TensorInfo(TensorProto.INT64, y_info.shape)], **_node_attrs(node))
    _release(ctx, pooled)
    return indices


def _release(ctx: GradContext, value: str) -> None:
    """ORT never frees an output that no node reads (tests/test_ort_facts.py), so the
    recomputed pooled output, which the backward does not need, would stay to the end of
    the step. A one-element Slice reads it, so it is freed right there; only that element
    stays."""
    rank = len(ctx.info(value).shape)
    slice_values(ctx.emit, value, [0] * rank, [1] * rank, list(range(rank)))


@register_variant("MaxPool", name="recompute", tier=EXACT, applies=_recompute_applies)
def _maxpool_recompute(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """Backward from the input X instead of the saved indices: the backward runs the
    MaxPool again on X for its Indices and scatters as the default does. Frees the
    output-sized indices from the forward pass to the backward (and the forward node no
    longer computes them), at the cost of a second MaxPool."""
    if any(g is not None for g in gouts[1:]):
        raise GradientError(f"{node_label(node)}: gradient flows into the Indices output")
    if gouts[0] is None or not ctx.needs_grad(node.input[0]):
        return [None]
    return [scatter_to_argmax(ctx, node, _argmax_again(ctx, node), gouts[0])]
