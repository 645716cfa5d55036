"""Which mode a dynamo export ran its normalization layers in, read from the signature.

In: a ``Graph`` loaded from a dynamo export (its graph signature: which buffers the
program mutates) and its nodes' records (the module each was written for, the FX call).
Out: the BatchNorm modules of a model exported in eval mode (``eval_mode_batchnorms``) and
the ``InstanceNorm(track_running_stats=True)`` modules exported in train mode
(``untracked_instance_norms``), which the builder warns of (``exported.py``). Both have
``running_mean`` buffers the program does not mutate, for different reasons: an eval-mode
BatchNorm normalizes by them (the step trains with frozen statistics), while torch's
exported train-mode ``instance_norm`` normalizes each sample by its own statistics, as
eager torch does, and drops the update eager torch makes to those buffers.
"""

from __future__ import annotations

import onnx

from memcc.frontend.export_map import FX_NODE_PROP, NAME_SCOPES_PROP, literal_list
from memcc.frontend.export_signature import signature_of
from memcc.graph import Graph


def module_of(node: onnx.NodeProto) -> str:
    """The PyTorch module a dynamo export wrote ``node`` for (its name scopes' last module),
    or "" where the file does not say."""
    text = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES_PROP), None)
    scopes = literal_list(text)
    return scopes[-2] if len(scopes) >= 2 else ""


def _instance_norm_modules(graph: Graph) -> set[str]:
    """Modules with a node written for a train-mode ``instance_norm`` (an
    ``InstanceNormalization``, or a node whose FX call is ``aten.instance_norm`` with
    ``use_input_stats``: in eval mode torch_lib writes a ``BatchNormalization`` over the
    running statistics instead)."""
    found = set()
    for node in graph.nodes:
        fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_PROP), "")
        call = fx.splitlines()[0] if fx else ""
        if node.op_type == "InstanceNormalization" or (
                "aten.instance_norm" in call and ", True, " in call.split("](", 1)[-1]):
            found.add(module_of(node))
    return found - {""}


def _unmutated_running_stats(graph: Graph) -> list[str]:
    """Modules whose ``running_mean`` is a buffer, where the program mutates none."""
    sig = signature_of(graph)
    if sig is None or any(b.endswith("running_mean") for b in sig.mutated_buffers):
        return []
    return sorted(b[:-len(".running_mean")] for b in sig.buffers if b.endswith("running_mean"))


def eval_mode_batchnorms(graph: Graph) -> list[str]:
    """The BatchNorm modules of a dynamo export made with the module in eval mode: the
    signature lists their running statistics as buffers, and the program mutates none of
    them (in train mode it mutates every one). Train-mode ``InstanceNorm``s with running
    statistics are left out: the program mutates theirs in no mode
    (``untracked_instance_norms``). Empty for other files."""
    instance = _instance_norm_modules(graph)
    return [m for m in _unmutated_running_stats(graph) if m not in instance]


def untracked_instance_norms(graph: Graph) -> list[str]:
    """The ``InstanceNorm(track_running_stats=True)`` modules of a dynamo export made in
    train mode: the step normalizes each sample by its own statistics, as torch does, but
    nothing updates their running statistics, which torch's train mode does (they are read
    in eval mode only)."""
    instance = _instance_norm_modules(graph)
    return [m for m in _unmutated_running_stats(graph) if m in instance]
