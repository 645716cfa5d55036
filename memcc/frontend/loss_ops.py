"""ONNX's loss ops rewritten into ops memcc differentiates, at load time.

A model that computes its own loss (``F.cross_entropy``, ``F.nll_loss``, every HuggingFace
model called with ``labels=``) is exported with ``SoftmaxCrossEntropyLoss`` or
``NegativeLogLikelihoodLoss`` (opset 12+; both exporters write them). Neither has a gradient
rule, and ORT runs both as their ONNX function body (``frontend.ort_kernels``), so
``canonicalize`` replaces each by the same computation in plain ops:

- ``SoftmaxCrossEntropyLoss(scores, labels[, weights])``: ``LogSoftmax`` over axis 1 (its
  optional second output ``log_prob`` is that value), then the NLL below;
- ``NegativeLogLikelihoodLoss(log_prob, labels[, weights])`` over ``[N, C, d1, ...]`` with
  labels ``[N, d1, ...]`` (int32 or int64): ``-log_prob[n, label, d...]`` (by
  ``GatherElements`` on axis 1; before opset 16, by a mask: ``_picked``), times
  ``weights[label]`` when given; with ``ignore_index`` the ignored positions read class 0
  (an ignored -100 would index out of range) and count 0 through a ``Where`` (their
  gradient is 0, and a -inf picked there makes no nan).
  ``reduction``: ``none`` keeps ``[N, d1, ...]``, ``sum`` sums, ``mean`` divides the sum
  by the summed weights of the kept positions (their count without ``weights``): all
  ignored gives 0/0 = nan, as torch and ONNX give.

The ops match the ONNX definition (and torch's) up to float rounding. ``weights`` are class
weights, never trained: torch's ``nll_loss`` has no gradient for them, and the TorchScript
exporter stores a weight buffer as an initializer like any parameter, so the ``Gather`` that
reads them carries ``CLASS_WEIGHTS_KEY`` and ``parameters`` leaves such initializers out.
"""

from __future__ import annotations

import re

import numpy as np
import onnx
from onnx import TensorProto, helper

from memcc.errors import InputError
from memcc.frontend.static_values import Namer, ValueTypes, const_node, node_attr

LOSS_OPS = frozenset({"SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})
# On the Gather that reads a loss op's class weights: its data input is not trained.
CLASS_WEIGHTS_KEY = "memcc.class_weights"
_REDUCTIONS = ("mean", "sum", "none")
_INTS = (TensorProto.INT64, TensorProto.INT32)


def loss_shapes_needed(node: onnx.NodeProto) -> list[str]:
    """The values whose static type the rewrite of ``node`` reads."""
    return [node.input[0], node.input[1]]


class _Nodes:
    """The nodes of one rewrite, named apart from the model's and each other."""

    def __init__(self, node: onnx.NodeProto, fresh: Namer, opset: int) -> None:
        self.base = node.name or node.output[0]
        self.fresh, self.opset = fresh, opset
        self.nodes: list[onnx.NodeProto] = []

    def const(self, value: np.ndarray) -> str:
        c = const_node(self.fresh, value)
        self.nodes.append(c)
        return c.output[0]

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.fresh(f"{self.base}/{op_type}_output")
        self.nodes.append(helper.make_node(op_type, inputs, [out],
                                           name=self.fresh(f"{self.base}/{op_type}"), **attrs))
        return out

    def axes_op(self, op_type: str, x: str, axes: list[int], out: str | None = None) -> str:
        """Squeeze/Unsqueeze: ``axes`` an attribute before opset 13, an input from it."""
        if self.opset < 13:
            return self.op(op_type, [x], out, axes=axes)
        return self.op(op_type, [x, self.const(np.asarray(axes, np.int64))], out)


def rewrite_loss_op(node: onnx.NodeProto, types: ValueTypes, opset: int, fresh: Namer,
                    where: str) -> list[onnx.NodeProto]:
    """The nodes that compute ``node`` (a ``LOSS_OPS`` op), writing its outputs."""
    scores, labels = node.input[0], node.input[1]
    weights = node.input[2] if len(node.input) > 2 and node.input[2] else None
    reduction = node_attr(node, "reduction", b"mean")
    reduction = reduction.decode() if isinstance(reduction, bytes) else str(reduction)
    ignore = node_attr(node, "ignore_index", None)
    label = f"{where}: {node.op_type} node '{node.name or node.output[0]}'"
    dtype, rank = _checked_types(types, scores, labels, label)
    if reduction not in _REDUCTIONS:
        raise InputError(f"{label}: reduction '{reduction}' is none of {', '.join(_REDUCTIONS)}"
                         " (the ONNX standard's); export the model's logits instead and build"
                         " with --loss cross-entropy")
    if smoothing := _dropped_label_smoothing(node):
        raise InputError(
            f"{label}: PyTorch's cross_entropy(..., label_smoothing={smoothing}) was exported "
            "as this op, which has no label smoothing (the dynamo exporter drops it): the "
            "step would train the unsmoothed loss (memcc's --loss cross-entropy has no "
            "smoothing either). Write the smoothed loss out in the model, which exports as "
            "ops memcc differentiates: without ignored labels, (1 - e) * F.nll_loss(logp, "
            "y) + e * (-logp.mean(-1)).mean() with logp = F.log_softmax(logits, -1)")
    b = _Nodes(node, fresh, opset)
    if node.op_type == "SoftmaxCrossEntropyLoss":
        log_out = node.output[1] if len(node.output) > 1 and node.output[1] else None
        log_prob = _log_softmax_axis1(b, scores, rank, log_out)
    else:
        log_prob = scores
    target = labels
    if types[labels][0] != TensorProto.INT64:
        target = b.op("Cast", [labels], to=TensorProto.INT64)
    ignored = None
    if ignore is not None:
        ignored = b.op("Equal", [target, b.const(np.asarray(ignore, np.int64))])
        target = b.op("Where", [ignored, b.const(np.asarray(0, np.int64)), target])
    per = b.op("Neg", [_picked(b, log_prob, target, types[scores][1], dtype)])
    weight = None
    if weights is not None:
        weight = b.op("Gather", [weights, target], axis=0)
        b.nodes[-1].metadata_props.add(key=CLASS_WEIGHTS_KEY, value="1")
        per = b.op("Mul", [per, weight])
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    zero = b.const(np.asarray(0, np_dtype))
    if ignored is not None:
        per = b.op("Where", [ignored, zero, per])
    kept = weight
    if ignored is not None:  # each position's weight in the mean, 0 where ignored
        kept = b.op("Where", [ignored, zero, weight or b.const(np.asarray(1, np_dtype))])
    _reduce(b, per, reduction, kept, node.output[0])
    return b.nodes


# The FX call the dynamo exporter records on the node: cross_entropy_loss(input, target,
# weight, reduction, ignore_index, label_smoothing).
_CROSS_ENTROPY_CALL = re.compile(
    r"aten\.cross_entropy_loss\.default\]?\(args = \((?:[^,]+, ){5}([-+.\deE]+)\)")


def _dropped_label_smoothing(node: onnx.NodeProto) -> float:
    """The ``label_smoothing`` of the torch call this op was exported from (0.0 where none,
    or where no record says)."""
    fx = next((p.value for p in node.metadata_props if p.key == "pkg.torch.onnx.fx_node"), "")
    m = _CROSS_ENTROPY_CALL.search(fx)
    return float(m.group(1)) if m else 0.0


def _checked_types(types: ValueTypes, scores: str, labels: str, label: str
                   ) -> tuple[int, int]:
    """(the scores' element type, their rank); an ``InputError`` where the rewrite cannot
    know them or ONNX would refuse them."""
    st, lt = types.get(scores), types.get(labels)
    if st is None or st[1] is None or lt is None or lt[1] is None:
        raise InputError(f"{label}: the shapes of its inputs '{scores}' and '{labels}' are "
                         "not static after binding the model's dimensions; give each "
                         "symbolic dimension with --dim NAME=SIZE")
    if len(st[1]) < 2 or tuple(lt[1]) != (st[1][0], *st[1][2:]):
        raise InputError(f"{label}: scores {list(st[1])} and labels {list(lt[1])} are not "
                         "[N, C, d1, ...] and [N, d1, ...] as ONNX defines them")
    if lt[0] not in _INTS:
        raise InputError(f"{label}: labels '{labels}' of type "
                         f"{TensorProto.DataType.Name(lt[0])}; ONNX takes int32 or int64")
    return st[0], len(st[1])


def _picked(b: _Nodes, log_prob: str, target: str, shape: tuple[int, ...], dtype: int
            ) -> str:
    """``log_prob[n, target[n, d...], d...]``, shaped like ``target``. From opset 16 by
    ``GatherElements`` on axis 1 (its gradient scatters with ``reduction='add'``, which
    opset 16 brought); before, as the sum over axis 1 of ``log_prob`` where the class
    equals the label and 0 elsewhere (a ``Where``: exact, and no nan from a -inf
    elsewhere), whose gradient needs no scatter."""
    idx = b.axes_op("Unsqueeze", target, [1])
    if b.opset >= 16:
        return b.axes_op("Squeeze", b.op("GatherElements", [log_prob, idx], axis=1), [1])
    classes = np.arange(shape[1], dtype=np.int64).reshape([1, -1] + [1] * (len(shape) - 2))
    hit = b.op("Equal", [idx, b.const(classes)])
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    kept = b.op("Where", [hit, log_prob, b.const(np.asarray(0, np_dtype))])
    if b.opset < 13:
        return b.op("ReduceSum", [kept], axes=[1], keepdims=0)
    return b.op("ReduceSum", [kept, b.const(np.asarray([1], np.int64))], keepdims=0)


def _log_softmax_axis1(b: _Nodes, scores: str, rank: int, out: str | None) -> str:
    """LogSoftmax over axis 1. Before opset 13 LogSoftmax flattens the axes from ``axis``
    on into one, so scores with more than 2 axes move their classes last and back."""
    if b.opset >= 13 or rank == 2:
        return b.op("LogSoftmax", [scores], out, axis=1)
    perm = [0, *range(2, rank), 1]
    back = [0, rank - 1, *range(1, rank - 1)]
    last = b.op("LogSoftmax", [b.op("Transpose", [scores], perm=perm)], axis=rank - 1)
    return b.op("Transpose", [last], out, perm=back)


def _reduce(b: _Nodes, per: str, reduction: str, kept: str | None, out: str) -> None:
    """``out``: the per-position losses ``per`` reduced; ``mean`` divides by the sum of
    ``kept`` (each position's weight; None: every position weighs 1)."""
    if reduction == "none":
        b.op("Identity", [per], out)
    elif reduction == "sum":
        b.op("ReduceSum", [per], out, keepdims=0)
    elif kept is None:
        b.op("ReduceMean", [per], out, keepdims=0)
    else:
        total = b.op("ReduceSum", [per], keepdims=0)
        b.op("Div", [total, b.op("ReduceSum", [kept], keepdims=0)], out)
