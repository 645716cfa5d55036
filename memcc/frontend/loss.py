"""The loss a training step minimises, and the data inputs it adds.

In: the forward graph (its first floating-point output is the logits, or the loss itself
with ``--loss none``), its emitter, the ``BuildOptions``. Out: the nodes that compute the
scalar ``loss`` appended to the graph, and a ``StepLoss``: the loss value, the step's data
inputs (the model's own plus ``labels`` or ``target``), the integer ranges of index inputs
(token ids, labels) that the runner draws random batches from, the label value that
``--ignore-index`` makes count for nothing, and the chunked loss whose gradients seed the
autodiff where ``--loss-chunks`` > 1.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
from onnx import TensorProto

from memcc.errors import InputError
from memcc.frontend.build_options import BuildOptions
from memcc.frontend.chunked_loss import ChunkedLoss, emit_chunked_loss
from memcc.frontend.emit import Emitter
from memcc.frontend.export_signature import ExportNote
from memcc.graph import Graph, TensorInfo, attr
from memcc.step import LABELS


@dataclass(frozen=True)
class StepLoss:
    """The loss value and what the step's data inputs became with it."""

    loss: str
    data_inputs: list[str]
    int_ranges: dict[str, list[int]]   # integer input -> [low, high) it ranges over
    chunked: ChunkedLoss | None        # --loss-chunks > 1: seeds and nodes for the autodiff
    # integer input -> the value outside its range it may also hold (--ignore-index: labels)
    ignored: dict[str, int] = field(default_factory=dict)


def add_loss(graph: Graph, emit: Emitter, opts: BuildOptions, source: str) -> StepLoss:
    """Append the loss of ``opts.loss`` to ``graph`` and say what inputs the step takes."""
    logits = first_float_output(graph, source)
    data_inputs = [i for i in graph.inputs if i not in graph.initializers]
    int_ranges = index_ranges(graph, data_inputs)
    if opts.loss == "cross-entropy":
        moved = classes_last(graph, emit, logits, opts.class_axis, source)
        if moved != logits and (opts.loss_chunks or 1) > 1:
            raise InputError(f"{source}: --loss-chunks {opts.loss_chunks} with --class-axis "
                             f"{opts.class_axis}: the chunked loss splits a vocabulary "
                             "projection whose classes are the last axis; give one or the "
                             "other")
        logits = moved
    loss, extra_inputs, label_range, chunked = emit_loss(graph, emit, logits, opts, source)
    int_ranges.update(label_range)
    # BuildOptions allows --ignore-index with cross-entropy only.
    ignored = {LABELS: opts.ignore_index} if opts.ignore_index is not None else {}
    return StepLoss(loss, data_inputs + extra_inputs, int_ranges, chunked, ignored)


def first_float_output(graph: Graph, source: str) -> str:
    for o in graph.outputs:
        ti = graph.info.get(o)
        if ti is not None and ti.is_float:
            return o
    raise InputError(
        f"{source}: the model has no floating-point output to train on (outputs: "
        f"{', '.join(graph.outputs) or 'none'}). memcc builds the loss from the first "
        "floating-point output (logits, or the scalar loss with --loss none)."
    )


def _later_scalars(graph: Graph) -> str:
    """What to say where --loss none finds no scalar first output but a later one is."""
    scalars = [o for o in graph.outputs[1:] if graph.info.get(o) is not None
               and graph.info[o].is_float and graph.info[o].numel == 1]
    if not scalars:
        return ""
    return (f"; its output '{scalars[0]}' is a scalar: if that is the loss, export the model "
            "with it first (return the loss before the logits, as transformers models do "
            "when given labels)")


def _own_loss_hint(graph: Graph, name: str) -> str:
    """Why a model may already hold the data input the loss adds: it takes it itself,
    because it computes its own loss (a module that returns ``cross_entropy(z, labels)``)."""
    if name not in graph.inputs:
        return ""
    return (f": an input of the model, as in a model that computes its own loss. If it does, "
            "build it with --loss none, which trains its first output as the loss"
            f"{_later_scalars(graph)}")


def moves_classes(axis: int | None, rank: int) -> bool:
    """Whether ``--class-axis axis`` names another axis than the last of ``rank`` axes
    (``classes_last`` then moves it last)."""
    return axis is not None and rank > 0 and axis % rank != rank - 1


def classes_last(graph: Graph, emit: Emitter, logits: str, axis: int | None,
                 source: str) -> str:
    """The logits with their class axis last, where cross-entropy takes it.

    torch's ``cross_entropy`` reads the classes on axis 1 (``[N, C, H, W]`` for a
    segmentation model), a language model's logits have them last (``[B, T, V]``, flattened
    before torch's loss). memcc takes the last axis unless ``--class-axis`` says otherwise;
    another axis is moved last by one Transpose (exact; the logits' gradient goes back
    through its inverse), so the loss and its gradient rules stay the ones over the last
    axis. Logits of rank 4 or more without ``--class-axis`` get a note: the last axis of an
    image-shaped output is a width more often than a class axis."""
    shape = graph.info[logits].shape
    rank = len(shape)
    if axis is None:
        if rank >= 4:
            warnings.warn(
                f"{source}: cross-entropy over the last axis of '{logits}' "
                f"{list(shape)}: {shape[-1]} classes, labels {list(shape[:-1])}. A model "
                "with its classes on axis 1, as PyTorch's segmentation models have them "
                f"([N, C, H, W]), needs --class-axis 1 (labels {[shape[0], *shape[2:]]})",
                ExportNote, stacklevel=3)
        return logits
    if not -rank <= axis < rank or rank == 0:
        raise InputError(f"{source}: --class-axis {axis}: '{logits}' has {rank} axes "
                         f"{list(shape)}; give one from {-rank} to {rank - 1}")
    if not moves_classes(axis, rank):
        return logits
    axis %= rank
    perm = [i for i in range(rank) if i != axis] + [axis]
    ti = graph.info[logits]
    return emit.op("Transpose", [logits], perm=perm,
                   info=TensorInfo(ti.dtype, tuple(shape[i] for i in perm)))


def index_ranges(graph: Graph, data_inputs: list[str]) -> dict[str, list[int]]:
    """Integer inputs used as Gather indices range over the gathered axis (token ids)."""
    ranges: dict[str, list[int]] = {}
    consumers = graph.consumers()
    for name in data_inputs:
        ti = graph.info[name]
        if ti.is_float or ti.dtype == TensorProto.BOOL:
            continue
        for node in _through_casts(graph, name, consumers):
            if node.op_type == "Gather" and len(node.input) > 1 and \
                    node.input[1] in _cast_chain(graph, name, consumers):
                table = graph.info[node.input[0]]
                axis = attr(node, "axis", 0) % len(table.shape)
                ranges[name] = [0, int(table.shape[axis])]
    return ranges


def _cast_chain(graph: Graph, name: str, consumers) -> set[str]:
    chain = {name}
    frontier = [name]
    while frontier:
        v = frontier.pop()
        for n in consumers.get(v, []):
            if n.op_type in ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"):
                for o in n.output:
                    if o not in chain:
                        chain.add(o)
                        frontier.append(o)
    return chain


def _through_casts(graph: Graph, name: str, consumers):
    for v in _cast_chain(graph, name, consumers):
        yield from consumers.get(v, [])


_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def emit_loss(graph: Graph, emit: Emitter, logits: str, opts: BuildOptions, source: str
              ) -> tuple[str, list[str], dict, ChunkedLoss | None]:
    """The loss value of ``opts.loss``, the data inputs it adds, their integer ranges, and
    (``--loss-chunks`` > 1) the chunked loss whose gradients the autodiff takes as seeds."""
    kind, chunks = opts.loss, opts.loss_chunks or 1
    ti = graph.info[logits]
    taken = set(graph.values())
    if ti.dtype in _HALF and kind != "none":
        # The model computes in its exported 16-bit type; the loss is taken in float32, as
        # torch's autocast does for cross-entropy and MSE (a 16-bit log-softmax over a large
        # vocabulary loses the small probabilities, and ORT's CPU provider has no 16-bit
        # ScatterElements-add for the loss gradient). The Cast's gradient brings it back.
        ti = TensorInfo(TensorProto.FLOAT, ti.shape)
        logits = emit.cast(logits, TensorProto.FLOAT)
    if "loss" in taken and kind != "none":
        raise InputError(
            f"{source}: the model already has a value named 'loss', the name --loss {kind} "
            "gives the loss it adds. If the model's first output already is the scalar loss, "
            "build with --loss none; otherwise rename that value in the model")
    if kind == "none":
        if ti.numel != 1:
            raise InputError(
                f"{source}: --loss none needs the first floating-point output to be the "
                f"scalar loss, but '{logits}' has shape {list(ti.shape)}"
                f"{_later_scalars(graph)}"
            )
        loss = emit.op("Reshape", [logits, emit.ints([])], outputs=["loss"],
                       info=TensorInfo(ti.dtype, ())) if logits != "loss" else logits
        return loss, [], {}, None
    if kind == "mse":
        for name in ("target",):
            if name in taken:
                raise InputError(f"{source}: the model already has a value named '{name}'"
                                 f"{_own_loss_hint(graph, name)}")
        graph.info["target"] = ti
        diff = emit.sub(logits, "target")
        sq = emit.mul(diff, diff)
        loss = emit.op("ReduceMean", [sq], outputs=["loss"], keepdims=0,
                       info=TensorInfo(ti.dtype, ()))
        return loss, ["target"], {}, None
    # cross-entropy over the last axis, mean over the positions (torch's default)
    if len(ti.shape) < 1 or ti.shape[-1] < 1:
        own = (". A scalar first output is a loss the model computes itself: build with "
               "--loss none") if not ti.shape else ""
        raise InputError(f"{source}: cross-entropy needs logits with a class axis; "
                         f"'{logits}' has shape {list(ti.shape)}{own}")
    if "labels" in taken:
        raise InputError(f"{source}: the model already has a value named 'labels'"
                         f"{_own_loss_hint(graph, 'labels')}")
    label_shape = ti.shape[:-1]
    graph.info["labels"] = TensorInfo(TensorProto.INT64, label_shape)
    ranges = {"labels": [0, int(ti.shape[-1])]}
    if chunks > 1:
        chunked = emit_chunked_loss(graph, emit, logits, chunks, source)
        return chunked.loss, ["labels"], ranges, chunked
    return cross_entropy(emit, logits, ti, opts.ignore_index), ["labels"], ranges, None


def _picked(emit: Emitter, logp: str, idx: str, ti: TensorInfo, info: TensorInfo) -> str:
    """``logp`` at the label ``idx`` along the last axis, keeping that axis (size 1). From
    opset 16 a ``GatherElements`` (its gradient scatters with ``reduction='add'``, which
    opset 16 brought); before, the sum over the class axis of ``logp`` where the class
    equals the label and 0 elsewhere (Equal, Where, ReduceSum: exact, and its gradient
    needs no scatter), as ``loss_ops._picked`` does for ONNX's own loss ops."""
    if emit.opset >= 16:
        return emit.op("GatherElements", [logp, idx], axis=-1, info=info)
    classes = emit.const(np.arange(ti.shape[-1], dtype=np.int64))
    hit = emit.op("Equal", [idx, classes], info=TensorInfo(TensorProto.BOOL, ti.shape))
    kept = emit.op("Where", [hit, logp, emit.scalar(0.0, ti.dtype)], info=ti)
    return emit.reduce_sum(kept, [-1], keepdims=True, info=info)


def cross_entropy(emit: Emitter, logits: str, ti: TensorInfo, ignore_index: int | None
                  ) -> str:
    """``loss``: torch's ``cross_entropy(logits, labels, ignore_index=...)``, classes last.

    Without ``ignore_index``: ``-mean(logp[labels])`` over every position (LogSoftmax,
    Unsqueeze, GatherElements, ReduceMean, Neg). With it, the positions whose label equals
    it count for nothing: ``sum of -logp[label] over the kept positions / their count``.
    Their labels are replaced by 0 before the GatherElements (an ignored value such as -100
    or 255 would index out of range) and what it picks there is replaced by 0 (so a -inf
    log-probability there cannot make a nan); the count is summed as -1 per kept position,
    which makes the quotient the loss with no Neg: Equal, Where, GatherElements, Where,
    ReduceSum, Where, ReduceSum, Div. Every ignored position gets a zero gradient. With
    every position ignored the loss is 0/0 = nan and every gradient 0, as torch gives (its
    ``reduction="mean"`` divides by a total weight of 0)."""
    label_shape = ti.shape[:-1]
    pos = TensorInfo(TensorProto.INT64, label_shape + (1,))
    picked_info, scalar = TensorInfo(ti.dtype, label_shape + (1,)), TensorInfo(ti.dtype, ())
    logp = emit.op("LogSoftmax", [logits], axis=-1, info=ti)
    idx = emit.unsqueeze("labels", [-1], info=pos)
    if ignore_index is None:
        picked = _picked(emit, logp, idx, ti, picked_info)
        mean = emit.reduce_mean(picked, None, keepdims=False, info=scalar)
        return emit.op("Neg", [mean], outputs=["loss"], info=scalar)
    ignored = emit.op("Equal", [idx, emit.scalar(ignore_index, TensorProto.INT64)],
                      info=TensorInfo(TensorProto.BOOL, pos.shape))
    safe = emit.op("Where", [ignored, emit.scalar(0, TensorProto.INT64), idx], info=pos)
    picked = _picked(emit, logp, safe, ti, picked_info)
    zero = emit.scalar(0.0, ti.dtype)
    kept = emit.op("Where", [ignored, zero, picked], info=picked_info)
    total = emit.reduce_sum(kept, None, keepdims=False, info=scalar)
    minus_ones = emit.op("Where", [ignored, zero, emit.scalar(-1.0, ti.dtype)],
                         info=picked_info)
    minus_count = emit.reduce_sum(minus_ones, None, keepdims=False, info=scalar)
    return emit.op("Div", [total, minus_count], outputs=["loss"], info=scalar)
