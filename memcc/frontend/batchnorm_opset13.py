"""An opset-13 model's training-form BatchNormalization read as opset 14 writes it.

Before opset 14, ONNX's BatchNormalization (version 9) has no ``training_mode``
attribute: a node with more outputs than ``Y`` (the running mean and variance, and
optionally the saved mean and variance) is the training form, and ORT then normalises with
the batch's statistics. ``torch.onnx.export(..., dynamo=False, training=TrainingMode.
TRAINING, opset_version=13)`` writes BatchNorm that way. memcc reads a training BatchNorm
by opset 14's ``training_mode=1`` (its gradient rules, the provider and lowering passes,
the recompute planner), so it differentiated such a node as frozen (gradients far from
torch's), warned that it was in inference form, and a plan of it crashed ORT.

So at load the model is rewritten into the form the same export writes at opset 14: the
default-domain opset import becomes 14 and each training-form BatchNormalization gets
``training_mode=1`` and the outputs (Y, running_mean, running_var), their names kept so
that the nodes reading them still match. Between 13 and 14 only BatchNormalization changed
meaning; the other ops with a new version at 14 (``_SAME_AT_14``) widened their types or
added an attribute whose default is version 13's behaviour. A model using an op that
changed otherwise is refused rather than rewritten (none does today; the check is for an
onnx whose opset 14 says more). Opset 14 has no saved mean and variance: a node whose 4th
or 5th output is read is refused, naming it. An inference-form node (``Y`` alone) stays.
Training steps memcc built are left alone.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import onnx
import onnx.defs

from memcc.errors import InputError
from memcc.frontend.export_signature import ExportNote, file_props
from memcc.graph import node_label
from memcc.step import KIND_KEY

_DEFAULT = ("", "ai.onnx")
# Ops whose version 14 keeps what version 13 computes: more input types (Add, Sub, Mul,
# Div, Relu, Identity, CumSum), or a new attribute whose default is the old behaviour
# (Reshape's allowzero=0, GRU/LSTM/RNN's layout=0).
_SAME_AT_14 = frozenset({"Add", "Sub", "Mul", "Div", "Relu", "Identity", "CumSum",
                         "Reshape", "GRU", "LSTM", "RNN"})


def lift_training_batchnorm(model: onnx.ModelProto, where: str) -> list[str]:
    """Rewrite ``model`` (in place) from opset 13 to 14 where it has a training-form
    BatchNormalization, with a note; the labels of the nodes rewritten (none: the model is
    as it was)."""
    opsets = [o for o in model.opset_import if o.domain in _DEFAULT]
    if len(opsets) != 1 or opsets[0].version != 13 or KIND_KEY in file_props(model):
        return []
    nodes = list(_all_nodes(model.graph))
    training = [n for n in nodes if _is_training_form(n)]
    if not training:
        return []
    read = {i for n in nodes for i in n.input} | {o.name for o in model.graph.output}
    for node in training:
        saved = [o for o in node.output[3:5] if o and o in read]
        if saved:
            raise InputError(
                f"{where}: {node_label(node)} is a training-form BatchNormalization of opset "
                f"13 whose saved mean or variance ('{saved[0]}') is read; opset 14 has no such "
                "outputs and memcc reads BatchNorm as opset 14 defines it. Re-export with "
                "opset_version >= 14 (torch.onnx.export(..., training=torch.onnx."
                "TrainingMode.TRAINING, opset_version=14) or later).")
    changed = sorted(_changed_at_14({n.op_type for n in nodes if n.domain in _DEFAULT}))
    if changed:
        raise InputError(
            f"{where}: opset 13 with training-form BatchNormalization (e.g. "
            f"{node_label(training[0])}), which memcc reads as opset 14 defines it, but the "
            f"model also uses {', '.join(changed)}, which opset 14 changed. Re-export with "
            "opset_version >= 14.")
    opsets[0].version = 14
    for node in training:
        outputs = list(node.output[:3])
        del node.output[:]
        node.output.extend(outputs)
        node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
    warnings.warn(
        f"{where}: opset 13, whose BatchNormalization is in training form by its running-"
        f"statistics outputs alone: {len(training)} such node(s) (e.g. "
        f"{node_label(training[0])}) normalise with batch statistics, as in torch's train "
        "mode; memcc reads the model as opset 14, those nodes with training_mode=1 (what "
        "torch.onnx writes at opset_version >= 14).", ExportNote, stacklevel=3)
    return [node_label(n) for n in training]


def _is_training_form(node: onnx.NodeProto) -> bool:
    """Version 9's training form: outputs beyond ``Y`` (ONNX and ORT both decide by their
    count, named or not)."""
    return (node.op_type == "BatchNormalization" and node.domain in _DEFAULT
            and len(node.output) > 1)


def _changed_at_14(ops: set[str]) -> set[str]:
    """The ops among ``ops`` whose version 14 may compute something else than version 13."""
    changed = set()
    for op in ops - _SAME_AT_14 - {"BatchNormalization"}:
        try:
            schema = onnx.defs.get_schema(op, 14, "")
        except onnx.defs.SchemaError:  # not an ONNX op: not ours to judge
            continue
        if schema.since_version == 14:
            changed.add(op)
    return changed


def _all_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """The graph's nodes and those of its subgraphs (they share the model's opsets)."""
    for node in graph.node:
        yield node
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _all_nodes(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    yield from _all_nodes(g)
