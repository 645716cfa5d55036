"""Training-mode BatchNormalization written so that ONNX Runtime's CUDA provider runs it.

The CUDA provider refuses ``BatchNormalization`` with ``training_mode=1`` at opset 14 and
later when it creates the session: "Training mode does not support BN opset 14 (or higher)
yet" (onnxruntime-gpu 1.31.1 on an H100, measured). Every ``torch.onnx`` export of a
convnet in train mode has such nodes, and so has every step memcc builds from one, so on
CUDA no BatchNorm model would run at all.

On CUDA each such node becomes what its ONNX definition says it computes, in ops the CUDA
provider has kernels for:

- the batch mean, ``ReduceMean`` over every axis but the channels;
- the batch variance (the population one, as the ONNX definition and ORT's CPU kernel
  use), ``ReduceSumSquare`` of the centred input over the count;
- the output, from ``BatchNormalization`` in inference mode fed those statistics: one
  kernel, so the output costs no activation-sized temporaries beyond the centred input,
  which is freed once the variance exists;
- the running statistics, ``input * momentum + batch * (1 - momentum)`` per channel,
  of up to 32 statistics at once over their concatenation (as the optimizer updates the
  vector parameters, ``frontend/update_groups.py``): a few kernels per group instead of
  three per statistic.

The float32 backward (``frontend/gradients/batchnorm_backward.py``) begins with a
training-mode BatchNormalization of the input, momentum 0, for ``xhat`` and the batch
variance, reading two buffers a Split of a constant makes: here it becomes an inference-mode
BatchNormalization of the input fed the forward's batch mean and variance (the statistics
computed again, as a forward's are, where the forward's are not the same input's), and the
Split and its constant go. The general rule (``frontend/gradients/nn.py``, other dtypes)
recomputes the statistics from the input with reductions; there the backward reads the
forward's instead: the batch mean it uses is the forward's (the same value: the same
ReduceMean of the same input), and its variance is the forward's (the one the normalisation
used; the rule's own is the mean of squares, within an ulp or two of it). Either way two
activation-sized reductions (each two stages of sums on CUDA, below) and an activation-sized
Mul leave every BatchNorm's backward, and two [C]-sized values are kept from the forward to
the backward (``reuse_statistics``; the zoo's ResNet-50 step at batch 8, 224 px: 5.10 to 4.30
GB moved per step by ``passes/analysis/step_traffic.py`` when first written; not yet timed on
a GPU).

The arithmetic is not the CPU kernel's, so a step rewritten here matches the step as built
within a tolerance, not bit for bit (``tests/test_batchnorm_for_cuda.py`` states it).
Variants of BatchNormalization (``inverted``, ``bf16_saved``) do not apply to the rewritten
nodes: the planner sees standard ops there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from memcc.def_use import DefUse
from memcc.frontend.emit import Emitter
from memcc.frontend.update_groups import balanced_runs, emit_joined
from memcc.graph import Graph, attr, in_dependency_order
from memcc.step import DEFAULT_RULE, GRAD_OF_PROP, RULE_PROP, Role, node_props, tag_node


def is_training_batchnorm(node: onnx.NodeProto, opset: int) -> bool:
    """A BatchNormalization that computes batch statistics (opset 14+, training_mode=1)."""
    return (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            and opset >= 14 and int(attr(node, "training_mode", 0)) == 1)


def is_model_batchnorm(node: onnx.NodeProto, opset: int) -> bool:
    """A training-mode BatchNormalization of the model's, not a backward's statistics node
    (``_backward_of``): what carries running statistics."""
    return is_training_batchnorm(node, opset) and _backward_of(node) is None


def expand_training_batchnorm(graph: Graph, *, reuse_statistics: bool = True
                               ) -> tuple[Graph, dict]:
    """A copy of ``graph`` with every training-mode BatchNormalization written as above
    (``graph`` itself when there is none), and a report: how many of the model's nodes were
    rewritten and how many of their backwards read the forward's statistics
    (``reuse_statistics``)."""
    targets = [n for n in graph.nodes if is_training_batchnorm(n, graph.opset)]
    if not targets:
        return graph, {"batchnorm_rewritten": 0, "statistics_reused": 0}
    out = graph.copy()
    emit = Emitter(out, detached=True)
    nodes: list[onnx.NodeProto] = []
    stats: dict[str, _Statistics] = {}
    running: list[_RunningUpdate] = []
    renamed: dict[str, str] = {}
    buffers: set[str] = set()  # the running inputs of the backwards' statistics nodes
    reused = 0
    for node in out.nodes:
        if not is_training_batchnorm(node, out.opset):
            nodes.append(node)
            continue
        start, before = len(emit.nodes), len(running)
        source = _backward_of(node)
        if source is None:
            stats[node.name] = _emit_batchnorm(emit, node, running)
        else:
            buffers.update(node.input[3:5])
            reused += _emit_backward_statistics(
                emit, node, stats.get(source) if reuse_statistics else None, renamed)
        made = emit.nodes[start:]
        if source is not None:
            for n in made:
                n.metadata_props.extend(node.metadata_props)  # the backward's provenance
        nodes.extend(made)
        for u in running[before:]:  # its updates go after its nodes, or later, joined
            u.after = len(nodes)
    _read_renamed(nodes, renamed)
    nodes = _without_unread_buffers(nodes, buffers)
    nodes, groups = _update_running_statistics(emit, nodes, running)
    for n in emit.nodes:
        if not n.metadata_props:
            # The running statistics are no ancestors of the loss: the tag keeps them (and
            # every other node of a forward BatchNorm) in the forward pass
            # (TrainingStep.forward).
            tag_node(n, role=Role.FORWARD.value)
    if reuse_statistics:
        reused += _reuse_statistics(nodes, emit, stats)
    out.set_nodes(nodes)
    return out, {"batchnorm_rewritten": len(stats), "statistics_reused": reused,
                 "running_statistics_updates": groups}


def _backward_of(node: onnx.NodeProto) -> str | None:
    """The forward node whose backward ``node`` belongs to (None: a node of the model):
    memcc's float32 BatchNorm backward begins with a training-mode BatchNormalization of
    the forward's input for ``xhat`` and the batch variance
    (``frontend/gradients/batchnorm_backward.py``)."""
    return node_props(node).get(GRAD_OF_PROP) if node.metadata_props else None


@dataclass(frozen=True)
class _Statistics:
    """What a rewritten forward BatchNorm computed: its input, the batch mean as
    ``[1, C, 1, ...]`` and as ``[C]``, and the batch variance ``[C]`` (statistics' dtype)."""

    x: str
    mean_view: str
    mean: str
    var: str


def _emit_backward_statistics(emit: Emitter, node: onnx.NodeProto,
                              fwd: _Statistics | None, renamed: dict[str, str]) -> int:
    """Write a backward's statistics node (``_backward_of``): ``xhat`` from an
    inference-mode BatchNormalization fed the forward's batch statistics where they are
    the same input's in the same dtype (returns 1), else from the statistics computed
    again as a forward BatchNorm's are (returns 0). Its mean and variance outputs are
    recorded in ``renamed`` as the values that now hold them."""
    x, ones, zeros = node.input[:3]
    x_info = emit.info(x)
    if fwd is not None and fwd.x == x and emit.info(fwd.var).dtype == x_info.dtype:
        emit.op("BatchNormalization", [x, ones, zeros, fwd.mean, fwd.var],
                outputs=[node.output[0]], epsilon=float(attr(node, "epsilon", 1e-5)),
                info=x_info)
        renamed.update({node.output[1]: fwd.mean, node.output[2]: fwd.var})
        return 1
    own = _emit_batchnorm(emit, node, None)
    renamed.update({node.output[1]: own.mean, node.output[2]: own.var})
    return 0


def _without_unread_buffers(nodes: list[onnx.NodeProto], buffers: set[str]
                            ) -> list[onnx.NodeProto]:
    """``nodes`` less the Splits that made the backwards' statistics nodes their own running
    inputs, and the constants they split, which nothing reads once those nodes are
    rewritten."""
    def unread(kept: list[onnx.NodeProto], made_by) -> set[int]:
        read = {i for n in kept for i in n.input}
        return {id(n) for n in kept if made_by(n) and not any(o in read for o in n.output)}

    splits = unread(nodes, lambda n: bool(set(n.output) & buffers))
    split_inputs = {i for n in nodes if id(n) in splits for i in n.input}
    kept = [n for n in nodes if id(n) not in splits]
    constants = unread(kept, lambda n: n.op_type == "Constant" and n.output[0] in split_inputs)
    return [n for n in kept if id(n) not in constants]


def _read_renamed(nodes: list[onnx.NodeProto], renamed: dict[str, str]) -> None:
    """Point every input named in ``renamed`` at the value that holds it now."""
    for n in nodes:
        for k, value in enumerate(n.input):
            if value in renamed:
                n.input[k] = renamed[value]


@dataclass
class _RunningUpdate:
    """One running statistic's update, ``out = running * momentum + batch * (1 -
    momentum)``, and where its BatchNorm's nodes end in the new node list (``after``)."""

    running: str
    batch: str
    out: str
    momentum: float
    after: int = -1


def _update_running_statistics(emit: Emitter, nodes: list[onnx.NodeProto],
                               updates: list[_RunningUpdate]
                               ) -> tuple[list[onnx.NodeProto], int]:
    """The running statistics' updates, joined (``update_groups.balanced_runs`` by momentum
    and dtype; ``emit_joined``): one Concat-update-Split per group after the last of its
    BatchNorms (six kernels per BatchNorm were six per group; per element the same
    arithmetic, the same bits). Nodes that read an update before it is made (PyTorch's
    running-variance factor beside its BatchNorm) move after it, in their order. Returns
    the nodes and how many groups."""
    groups = balanced_runs(updates, lambda u: (u.momentum, emit.info(u.running).dtype))
    inserts: dict[int, list[onnx.NodeProto]] = {}
    for group in groups:
        start, m = len(emit.nodes), group[0].momentum
        if len(group) == 1:
            _mixed(emit, group[0].running, group[0].batch, m, group[0].out)
        else:
            emit_joined(emit, [[u.running for u in group], [u.batch for u in group]],
                        [u.out for u in group], lambda r, b, m=m: _mixed(emit, r, b, m))
        inserts.setdefault(max(u.after for u in group), []).extend(emit.nodes[start:])
    placed = [n for i in range(len(nodes) + 1)
              for n in (inserts.get(i, []) + ([nodes[i]] if i < len(nodes) else []))]
    return in_dependency_order(placed), len(groups)


def _mixed(emit: Emitter, running: str, batch: str, momentum: float, out: str | None = None
           ) -> str:
    """``running * momentum + batch * (1 - momentum)``, as ONNX's BatchNormalization
    updates a running statistic."""
    dtype = emit.info(running).dtype
    return emit.op("Add", [emit.mul(running, emit.scalar(momentum, dtype)),
                           emit.mul(batch, emit.scalar(1.0 - momentum, dtype))],
                   outputs=[out] if out else 1, info=emit.info(running))


def _reuse_statistics(nodes: list[onnx.NodeProto], emit: Emitter,
                      stats: dict[str, _Statistics]) -> int:
    """Make each rewritten BatchNorm's backward read the forward's mean and variance
    (module docstring), in place in ``nodes``; return how many backwards were changed.

    The default rule begins ``mean = ReduceMean(x)``, ``c = Sub(x, mean)``, ``sq = Mul(c, c)``,
    ``var = ReduceMean(sq)`` (``_batchnorm_train_grad``; its float32 form,
    ``gradients/batchnorm_backward.py``, reduces ``var`` to ``[C]``, the forward's own shape,
    so no view is made); a backward that does not begin so (another rule, or a variant's) is
    left as it is."""
    by_rule: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        props = node_props(n) if n.metadata_props else {}
        src = props.get(GRAD_OF_PROP)
        if src in stats and props.get(RULE_PROP, DEFAULT_RULE) == DEFAULT_RULE \
                and n.op_type != "Constant":  # the axes of an opset-18 reduction
            by_rule.setdefault(src, []).append(i)
    du = DefUse.build(nodes)
    drop: set[int] = set()
    inserts: dict[int, list[onnx.NodeProto]] = {}
    changed = 0
    for name, idx in by_rule.items():
        x, fwd_mean, fwd_var = stats[name].x, stats[name].mean_view, stats[name].var
        if len(idx) < 4:
            continue
        m, c, sq, v = (nodes[i] for i in idx[:4])
        if not (m.op_type == "ReduceMean" and m.input[0] == x
                and c.op_type == "Sub" and list(c.input) == [x, m.output[0]]
                and sq.op_type == "Mul" and list(sq.input) == [c.output[0]] * 2
                and v.op_type == "ReduceMean" and v.input[0] == sq.output[0]
                and du.reader_count(sq.output[0]) == 1
                and emit.info(v.output[0]).dtype == emit.info(fwd_var).dtype
                and emit.info(m.output[0]).shape == emit.info(fwd_mean).shape):
            continue
        start = len(emit.nodes)
        view = emit.reshape(fwd_var, list(emit.info(v.output[0]).shape))
        made = emit.nodes[start:]
        for old, new in ((m.output[0], fwd_mean), (v.output[0], view)):
            for r in list(du.readers.get(old, ())):
                for k, value in enumerate(r.input):
                    if value == old:
                        du.rewire(r, k, new)
        for n in made:
            n.metadata_props.extend(v.metadata_props)  # the backward's provenance
        if made:
            inserts[idx[3]] = made
        drop.update((idx[0], idx[2], idx[3]))
        changed += 1
    kept = []
    for i, n in enumerate(nodes):
        kept.extend(inserts.get(i, ()))
        if i not in drop:
            kept.append(n)
    nodes[:] = kept
    return changed


def _emit_batchnorm(emit: Emitter, node: onnx.NodeProto,
                    running: list[_RunningUpdate] | None) -> _Statistics:
    """Emit the node as the module docstring says, its running statistics' updates added
    to ``running`` (written later, joined; None: the node's running outputs are its batch
    statistics, ``_backward_of``); return what it computed."""
    x, scale, bias, mean_in, var_in = node.input[:5]
    x_info = emit.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    channels = int(x_info.shape[1])
    axes = [0] + list(range(2, rank))
    count = float(np.prod([x_info.shape[a] for a in axes]))
    eps = float(attr(node, "epsilon", 1e-5))
    momentum = float(attr(node, "momentum", 0.9))
    stat_dtype = emit.info(mean_in).dtype

    # The mean reduced to [C] and viewed as [1, C, 1, ...] for the subtraction: one view,
    # where a [1, C, 1, ...] mean needs one to [C] for the statistics and, once the sum is
    # written over trailing axes on CUDA, one back (issue 30).
    channel_mean = emit.reduce_mean(x, axes, keepdims=False)
    mean = emit.reshape(channel_mean, [1, channels] + [1] * (rank - 2))
    centred = emit.sub(x, mean)
    square_sum = emit.reduce_sum_square(centred, axes, keepdims=False)
    var = emit.cast(emit.mul(square_sum, emit.scalar(1.0 / count, dtype)), stat_dtype)
    batch_mean = emit.cast(channel_mean, stat_dtype)
    emit.op("BatchNormalization", [x, scale, bias, batch_mean, var],
            outputs=[node.output[0]], epsilon=eps, info=x_info)
    if node.name:  # reports and the backward's provenance name the node as it was
        emit.nodes[-1].name = node.name
    for k, (stat, batch) in enumerate(((mean_in, batch_mean), (var_in, var)), start=1):
        if running is not None and len(node.output) > k and node.output[k]:
            running.append(_RunningUpdate(stat, batch, node.output[k], momentum))
    return _Statistics(x, mean, batch_mean, var)
