"""Buffers a dynamo-exported forward writes, besides BatchNorm's running statistics.

A forward may write a buffer in place: an exponential moving average of its features, a
codebook's usage counts, a step counter. torch.export records each write as a
``BUFFER_MUTATION`` output of the program (the value, the buffer), and the dynamo exporter
keeps the nodes that compute the value where the forward reads it after the write, but
drops the output itself. Read as it is, the file makes a step that reads the buffer as
exported at every step (the write is lost, so the model drifts from torch's from the second
step on) and that differentiates through the new value, which torch computes without
gradient: a buffer written in place under ``torch.no_grad()`` (written with gradient,
torch's second backward fails, so no model that trains in torch does that).

In: a ``Graph`` loaded from a dynamo export (its graph signature) and the BatchNorm
statistics the builder carries already. Out: ``buffer_updates``: each written buffer whose
new value the file still computes, carried as its next value (``carry_buffer_updates`` names
it ``<buffer>.new``) with the node computing it cut from the backward (``NO_GRAD_PROP``,
read by ``autodiff.differentiable_values``); and the buffers whose new value the file does
not hold (nothing the model outputs reads it, or the exporter's optimizer folded the buffer
into constants), which stay as exported and which the builder warns of; a buffer the forward
overwrites unread, which the exporter drops (``spectral_norm``'s ``_u``), is added as zeros
and carried, so that ``memcc export`` writes the value torch's eval mode reads. TorchScript
files record no writes (and do not tell buffers from parameters: README, ``--freeze``).

Which values the backward may not pass through: the file does not say which nodes torch ran
under ``torch.no_grad()``, and after the write every read of the buffer reads the value
written, under the value's own name. So the node is cut only where the value is the buffer's
alone: an Identity (the exporter's ``detach``) or a value computed from the old value of a
buffer the forward writes (a running mean, a queue, a counter: an in-place update, which a
model that trains in torch makes without gradient; or another buffer's, as
``spectral_norm``'s power iteration writes ``_u`` from ``_v`` and ``_v`` from ``_u``, where
the old ``_u`` is never read and the exporter drops it: cut all the same, since the weight
is divided by ``u . W v`` with both vectors constants, 2.7e-3 relative off torch after two
SGD steps when ``_u`` passed gradient). A value the model computed for itself and then
copied into the buffer (``buf.copy_(h)`` under ``torch.no_grad()``), also where ``h``
read another written buffer (features centred by a running mean, then kept: a value of
another buffer's is cut only where no data input reaches it, as none reaches
``spectral_norm``'s vectors), keeps its gradient,
which the model's own reads need; a read of the buffer after such a write would pass
gradient where torch's passes none, so the builder warns of the copy
(``buf.copy_(h.detach())`` makes the buffer's value its own). A value computed with
gradient from the buffer's old value and then copied into it (``f = 0.9 * buf + 0.1 * h``,
read by the model, then ``buf.copy_(f)`` under ``no_grad``) looks like an update: it is
cut as one unless the cut takes every path to the loss from some parameter away (torch
gives a parameter no gradient only where the forward reads it under ``no_grad`` alone, so
such a cut is taken for a copy of the model's own value: kept and warned of as one).
Missed: such a value that each parameter also reaches the loss by another path, which is
cut; and an update under ``no_grad`` that is a parameter's only way to the loss, which is
kept (the warning says to ``--freeze`` it, or to write ``buf.copy_(x.detach())``, which
makes either case exact).

Also here, ``warn_last_batch_statistics``: a training BatchNorm whose file says momentum 0,
which TorchScript writes for ``BatchNorm(momentum=None)`` (PyTorch's cumulative average over
every batch) of a fresh module: its factor ``1 / num_batches_tracked`` is fixed at export,
1 after the traced call, so the step keeps each batch's statistics alone, where torch's
averages drift apart from it from the second step on (2.2x the statistics' change off after
20 steps, a walk-through's figure). The file cannot tell it from ``momentum=1.0``; the
builder says what it does.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from memcc.frontend.autodiff import NO_GRAD_PROP, differentiable_values
from memcc.frontend.export_signature import ExportNote, ExportWarning, signature_of
from memcc.frontend.update import StepWriter
from memcc.graph import Graph, ancestors, attr, node_label

# BatchNorm's own buffers: the builder carries the statistics by the node's semantics
# (``update.carry_batchnorm_stats``) and the counter drives nothing a step computes. A
# name alone does not make a statistic BatchNorm's: timm's EvoNorm2dB0 writes a
# ``running_var`` of its own, without a ``running_mean`` (``_folded_statistic``).
_NORM_BUFFERS = (".running_mean", ".running_var")
_COUNTER = ".num_batches_tracked"


@dataclass(frozen=True)
class BufferUpdates:
    """``carried``: (value, buffer) pairs, the value the buffer's next value; ``lost``:
    written buffers whose new value the file does not hold (not those the file does not
    hold at all, overwritten unread: their values are computed anew, and noted)."""

    carried: tuple[tuple[str, str], ...] = ()
    lost: tuple[str, ...] = ()


def buffer_updates(graph: Graph, bn_stats, source: str, loss: str) -> BufferUpdates:
    """The buffers the forward writes, other than BatchNorm's, and the values written;
    tags each value's node as computed without gradient, and notes the lost writes.
    ``loss``: the step's loss, which a cut must not take parameters away from
    (``_starved_by``)."""
    sig = signature_of(graph)
    if sig is None:
        return BufferUpdates()
    carried_stats = {s for _, m, v in bn_stats for s in (m, v)}
    producers, readers = graph.producers(), graph.consumers()
    writes = [(v, b) for v, b in sig.mutations if b not in carried_stats and not
              b.endswith(_COUNTER) and not _folded_statistic(graph, b, sig.mutated_buffers)]
    written = {b for _, b in writes}
    data = {i for i in graph.inputs if i not in graph.initializers}
    carried, lost, copied, unread = [], [], [], []
    for value, buffer in writes:
        node = producers.get(value)
        reached = ancestors([value], producers)[1] if node is not None else set()
        # cut even where the buffer is lost (spectral_norm's _u, overwritten unread)
        cut = node is not None and _the_buffers_alone(node, buffer, reached, (written, data))
        starved = _starved_by(graph, loss, sig.parameters, node) if cut else []
        if starved:  # the model's own value, computed with gradient: keep it
            cut = False
            copied.append(f"'{buffer}' with '{value}', the only way '{starved[0]}' reaches "
                          "the loss")
        if cut:
            node.metadata_props.add(key=NO_GRAD_PROP, value="1")
        if node is not None and buffer not in graph.info and \
                not _reads_folded(graph, reached, sig.parameters | sig.buffers):
            unread.append(buffer)  # spectral_norm's _u: computed anew at each step,
            _hold_unread(graph, value, buffer)  # carried for memcc export and eval mode
            carried.append((value, buffer))
            continue
        if node is None or buffer not in graph.initializers or \
                graph.info[value].dtype != graph.info[buffer].dtype or \
                graph.info[value].shape != graph.info[buffer].shape:
            lost.append(buffer)
            continue
        if not cut and value in readers and not starved:
            copied.append(f"'{buffer}' with '{value}'")
        carried.append((value, buffer))
    if lost:
        warnings.warn(
            f"{source}: the forward writes {len(lost)} buffer(s) (e.g. '{lost[0]}') whose "
            "new value the step cannot carry: the file does not compute the value written "
            "(the exporter drops it where nothing the model outputs reads it) or does not "
            "hold the buffer (the exporter drops one the forward overwrites unread, and its "
            "optimizer folds buffers into constants: export with optimize=False). The step "
            "keeps them as exported, where torch's forward updates them.",
            ExportWarning, stacklevel=2)
    if unread:
        warnings.warn(
            f"{source}: the forward overwrites {len(unread)} buffer(s) it does not read "
            f"before (e.g. '{unread[0]}'), which the exporter does not keep: the step "
            "computes their values anew at each step, as torch's forward does, and carries "
            "the last (zeros before the first step) so that memcc export writes them for "
            "the module's eval mode.", ExportNote, stacklevel=2)
    if copied:
        warnings.warn(
            f"{source}: the forward copies into {len(copied)} buffer(s) a value it also "
            f"uses itself ({copied[0]}): the step carries the write and keeps the value's "
            "gradient for the model's own reads, but a read of the buffer after the write "
            "reads the same value and would pass gradient where torch passes none. Write "
            "buf.copy_(x.detach()) if the forward reads the buffer after writing it. A "
            "value computed from the buffer's old value is taken for the model's own only "
            "where parameters reach the loss through it alone: if the forward computes it "
            "under torch.no_grad(), --freeze those parameters (torch gives them no "
            "gradient), or write buf.copy_(x.detach()).", ExportWarning, stacklevel=2)
    return BufferUpdates(tuple(carried), tuple(lost))


def _the_buffers_alone(node: onnx.NodeProto, buffer: str, reached: set[str],
                       step: tuple[set[str], set[str]]) -> bool:
    """Whether the value ``node`` writes into ``buffer`` is the buffers' alone, so that no
    gradient may pass through it (module docstring): an Identity (``detach``), a value
    computed from the buffer's old value, or one computed from another written buffer's and
    from no data input (``spectral_norm``'s ``_u``). ``reached``: the values the written
    value is computed from; ``step``: the written buffers and the data inputs."""
    written, data = step
    return node.op_type == "Identity" or buffer in reached or \
        bool(written & reached) and not data & reached


def _starved_by(graph: Graph, loss: str, parameters: frozenset[str],
                node: onnx.NodeProto) -> list[str]:
    """The parameters that reach the loss, past the cuts already made, through ``node``
    alone (sorted): a cut that takes every path from a parameter to the loss away is not
    torch's (module docstring). None for an Identity, the exporter's ``detach``, which is
    the buffer's whatever it takes away."""
    if node.op_type == "Identity":
        return []
    wrt = sorted(p for p in parameters if p in graph.info)
    before = differentiable_values(graph, loss, wrt) & set(wrt)
    return sorted(before - differentiable_values(graph, loss, wrt, {node.name}))


def _folded_statistic(graph: Graph, buffer: str, mutated: frozenset[str]) -> bool:
    """Whether ``buffer`` is a running statistic of a BatchNorm (the forward writes both
    its module's ``running_mean`` and ``running_var``) that the file no longer holds: the
    exporter's optimizer folded the BatchNorm into its convolution, which the builder warns
    of (``exported.folded_batchnorms``). EvoNorm's lone ``running_var`` is no such one: its
    write is carried, or warned of as lost, as any other buffer's."""
    for suffix in _NORM_BUFFERS:
        if buffer.endswith(suffix):
            module = buffer[:-len(suffix)]
            return buffer not in graph.info and \
                {module + s for s in _NORM_BUFFERS} <= mutated
    return False


def _hold_unread(graph: Graph, value: str, buffer: str) -> None:
    """A buffer the file does not hold, as an initializer of zeros shaped like the value
    written into it: the forward never reads it (it overwrites it first), so the zeros
    reach nothing; carried, it holds the last value written, as torch's buffer does."""
    info = graph.info[value]
    graph.initializers[buffer] = np.zeros(info.shape, helper.tensor_dtype_to_np_dtype(
        info.dtype))
    graph.info[buffer] = info


def _reads_folded(graph: Graph, reached: set[str], state: frozenset[str]) -> bool:
    """Whether a value computed from ``reached`` reads an initializer that is no PyTorch
    parameter or buffer: a constant the exporter's optimizer folded, maybe from the buffer
    written (so a buffer missing from the file was folded, not overwritten unread)."""
    return any(v in graph.initializers and v not in state for v in reached)


def carry_buffer_updates(out: StepWriter, updates: BufferUpdates) -> list[str]:
    """Each written buffer's new value as a step output, ``<buffer>.new``, carried into
    the buffer at the next step as PyTorch's in-place write does; the outputs added."""
    outputs = []
    for value, buffer in updates.carried:
        new_name = out.namer.name(value, f"{buffer}.new")
        out.state[new_name] = buffer
        outputs.append(new_name)
    return outputs


def warn_last_batch_statistics(bn_stats, source: str) -> None:
    """Warn of training BatchNorms whose running statistics are each batch's alone (ONNX
    momentum 0): PyTorch's ``momentum=1.0``, or ``momentum=None`` exported by TorchScript."""
    last = [node_label(node) for node, _, _ in bn_stats
            if float(attr(node, "momentum", 0.9)) == 0.0]
    if last:
        warnings.warn(
            f"{source}: {len(last)} training BatchNormalization node(s) (e.g. {last[0]}) "
            "have momentum 0: each step sets their running statistics to that batch's "
            "alone, as PyTorch's momentum=1.0 does. TorchScript writes this for "
            "BatchNorm(momentum=None) (a cumulative average over all batches, whose factor "
            "the export fixed), which the step cannot follow: if that is the model, set a "
            "momentum (e.g. 0.1) before exporting.", ExportWarning, stacklevel=2)
