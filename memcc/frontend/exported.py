"""What the exporter says about the model, and what a user must know before training it.

The dynamo exporter records torch.export's graph signature in the ONNX graph's metadata
(``pkg.torch.export.ExportedProgram.graph_signature``): which initializers are PyTorch
parameters and buffers (by ``state_dict`` name) and which buffers the forward mutates.
TorchScript files carry no such record, so there names are judged by their spelling.
From that this module tells the builder:

- which float initializers are buffers (never trained, whatever their names);
- where each trained parameter came from (its initializer name, whether that is a PyTorch
  name, and which other parameters hold the same values: weight tying that the exporter
  split into copies), for ``memcc build``'s report and for mapping trained weights back;
- which PyTorch parameters each initializer stands for in a dynamo export (``ExportMap``):
  the exporter's optimizer (``optimize=True``, its default) merges parameters with equal
  values (every freshly initialised LayerNorm weight) into one initializer and folds others
  into constants (zero biases it drops). The signature lists every PyTorch parameter, each
  initializer names the placeholder it came from (value_info metadata
  ``pkg.torch.onnx.original_node_name``), and each node names the FX node it was written
  for (``pkg.torch.onnx.fx_node``, whose arguments name the placeholders it read): a
  placeholder whose FX node now reads another parameter's initializer was merged into it,
  one whose FX node reads none was folded (``read_export_map`` has the whole order). In
  TorchScript files only a tied weight is read, from node names (``_read_scope_ties``);
- BatchNorm written in inference form for a model exported in train mode: dynamo's torch_lib
  drops the training flag, so a step built from it would silently train a different model.
  Where the signature proves the layer was in train mode (its running statistics are mutated
  buffers) and the BatchNormalization node is still there (``optimize=False``), memcc puts
  the layer back in training mode; where the exporter's optimizer folded it into a Conv, the
  batch statistics are gone and memcc can only warn.

The pieces live by job: the signature and the names exporters make up
(``export_signature``), the export map (``export_map``), folded copies computed again
(``folded_copies``). This module holds what the builder asks of them: BatchNorm put back in
training mode (``restore_training_batchnorm``), each parameter's source
(``parameter_sources``); the report on them, as warnings, is ``parameter_report``.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.constants import constant_filled
from memcc.frontend.export_map import export_map_of
from memcc.frontend.export_signature import (
    ExportNote,
    ExportWarning,
    is_made_up_name,
    signature_of,
)
from memcc.frontend.norm_modes import eval_mode_batchnorms, module_of, untracked_instance_norms
from memcc.graph import Graph, attr, node_label, unique_namer
from memcc.union_find import UnionFind

__all__ = [
    "ExportNote", "ExportWarning", "ParameterSource", "is_made_up_name",
    "parameter_sources", "restore_training_batchnorm", "signature_of",
]

# ---------------------------------------------------------------------------- BatchNorm
def folded_batchnorms(graph: Graph) -> list[str]:
    """The BatchNorm modules torch ran in train mode (their running mean is a buffer the
    program mutates) whose statistics the file no longer holds: the dynamo exporter's
    optimizer folded them into the convolutions before them."""
    sig = signature_of(graph)
    return sorted(b[:-len(".running_mean")] for b in (sig.mutated_buffers if sig else ())
                  if b.endswith("running_mean") and b not in graph.initializers)


def statistics_apart(graph: Graph, source: str) -> list[str]:
    """Give BatchNorm running statistics that share an initializer with a weight one of
    their own (the same values); the names given.

    The dynamo exporter's optimizer stores equal initializers once: a fresh BatchNorm's
    running variance (ones) and mean (zeros) are its weight and bias, so the node reads
    ``BatchNormalization(x, w, b, b, w)`` (timm mixnet, whose BatchNorm follows a Concat and
    is not folded into a convolution). Statistics are never trained, so the weight and bias
    were not either, and a train-mode layer could not get its running statistics back. Each
    statistic gets the PyTorch buffer's name where the signature has it (``bn.running_mean``)
    and a made-up one (``bn.bias.running_mean``) elsewhere."""
    sig = signature_of(graph)
    read = {i for n in graph.nodes for k, i in enumerate(n.input)
            if i and not (n.op_type == "BatchNormalization" and k in (3, 4))}
    read |= set(graph.outputs)
    fresh = unique_namer([*graph.initializers, *graph.info, *graph.inputs])
    du, given = graph.def_use(), []
    for node in graph.nodes:
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        module = module_of(node)
        for k, what in ((3, "running_mean"), (4, "running_var")):
            stat, buffer = node.input[k], f"{module}.{what}"
            named = sig is not None and module and buffer in sig.buffers
            if stat not in graph.initializers or stat == buffer or \
                    not (stat in read or named):
                continue
            name = buffer if named and (buffer in given or buffer not in graph.info) \
                else fresh(f"{stat}.{what}")
            if name not in given:
                graph.initializers[name] = np.array(graph.initializers[stat])
                graph.info[name] = graph.info[stat]
                given.append(name)
            du.rewire(node, k, name)
    if given:
        warnings.warn(
            f"{source}: the exporter stored {len(given)} BatchNorm running statistic(s) as "
            f"the weights holding the same values (e.g. '{given[0]}'), which left those "
            "weights untrained; each statistic has its own copy now, and the weights train "
            "as in torch.", ExportNote, stacklevel=3)
    return given


def restore_training_batchnorm(graph: Graph, source: str) -> list[str]:
    """Put BatchNorm written in inference form back in training mode where the signature
    proves torch ran it in train mode; warn where it cannot. Returns the restored nodes.
    Statistics the exporter stored as weights get their own initializers first
    (``statistics_apart``)."""
    statistics_apart(graph, source)
    sig = signature_of(graph)
    restored: list[str] = []
    kept: list[str] = []
    for node in graph.nodes:
        if node.op_type != "BatchNormalization" or attr(node, "training_mode", 0):
            continue
        if len(node.input) < 5:
            continue
        stats = set(node.input[3:5])
        if sig is not None and stats <= sig.mutated_buffers and \
                stats <= set(graph.initializers):
            for a in list(node.attribute):
                if a.name == "training_mode":
                    node.attribute.remove(a)
            node.attribute.append(onnx.helper.make_attribute("training_mode", 1))
            restored.append(node.name)
        elif stats & set(graph.initializers):  # not statistics the forward computes
            kept.append(node_label(node))  # (BatchNorm(track_running_stats=False)'s)
    if restored:
        warnings.warn(
            f"{source}: {len(restored)} BatchNormalization node(s) were exported in inference "
            "form although torch ran them in train mode (the dynamo exporter drops the "
            "flag); memcc restored batch statistics and carries the running statistics as "
            "state, as torch does.", ExportNote, stacklevel=2)  # fixed: a note, not a warning
    in_eval = eval_mode_batchnorms(graph)
    if in_eval:
        warnings.warn(
            f"{source}: exported with the module in eval mode: the exported program updates "
            f"none of its {len(in_eval)} BatchNorm(s)' running statistics (e.g. "
            f"'{in_eval[0]}'), so the step trains with frozen statistics"
            + (" (or, where the exporter's optimizer folded them into the convolutions, "
               "none)" if not kept else "")
            + ", unlike PyTorch in train mode. Call module.train() before "
            "torch.onnx.export(..., dynamo=True, optimize=False) to train them as PyTorch "
            "does.", ExportWarning, stacklevel=2)
    elif kept:
        warnings.warn(
            f"{source}: {len(kept)} BatchNormalization node(s) use their running statistics "
            f"(inference form), e.g. {kept[0]}: the step trains with frozen statistics, "
            "unlike torch's train mode. If the model should train its BatchNorm, export "
            "with torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode."
            "TRAINING) or with dynamo=True and optimize=False.", ExportWarning, stacklevel=2)
    if untracked := untracked_instance_norms(graph):
        warnings.warn(
            f"{source}: {len(untracked)} InstanceNorm(track_running_stats=True) layer(s) "
            f"(e.g. '{untracked[0]}') exported in train mode: the step normalizes each "
            "sample by its own statistics, as torch does, but the exported program updates "
            "none of their running statistics, which torch's train mode does (eval mode "
            "reads them): they stay as exported, and memcc export writes none (load its weights "
            "with load_state_dict(..., strict=False)).",
            ExportWarning, stacklevel=2)
    folded = folded_batchnorms(graph)
    if folded:
        warnings.warn(
            f"{source}: the model was exported in train mode with BatchNorm "
            f"({len(folded)} layer(s), e.g. '{folded[0]}'), but the "
            "exporter's optimizer folded them into the convolutions: batch statistics are "
            "gone and the step trains a different model. Export with torch.onnx.export(..., "
            "dynamo=True, optimize=False) (memcc restores the batch statistics) or with "
            "dynamo=False, training=torch.onnx.TrainingMode.TRAINING.",
            ExportWarning, stacklevel=2)
    return restored


# ---------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class ParameterSource:
    """Where a trained parameter came from in the exported file."""

    exported_name: str
    named: bool  # the initializer name is the PyTorch state_dict name
    tied_with: tuple[str, ...] = field(default=())  # same values, as is or transposed
    # Every PyTorch state_dict name whose value this parameter is (its own first; those the
    # exporter merged into it; those torch ties to them): ``memcc export`` writes it under
    # each. Empty for a made-up name that stands for no PyTorch parameter as it is.
    pytorch_names: tuple[str, ...] = field(default=())
    merged: tuple[str, ...] = field(default=())  # of pytorch_names, merged by the exporter
    copy_of: tuple[str, ...] = field(default=())  # a made-up copy folded from these
    # The op that made the copy from its one parameter (``ExportMap.copy_ops``), whose
    # inverse ``memcc export`` applies to write it under that parameter's name; "": unknown.
    copy_op: str = ""
    # Copies the exporter folded from this parameter that the step computes from it again
    # (``recompute_folded_copies``): (made-up name, op), e.g. ("val_303", "Transpose(...)").
    folded_copies: tuple[tuple[str, str], ...] = field(default=())
    # The PyTorch parameter some of whose rows this made-up parameter is, looked up and
    # folded by the exporter (``ExportMap.lookups``: ``embedding_1`` <- ``wpe.weight``): no
    # value of that parameter, so ``memcc export`` writes nothing under its name.
    rows_of: str = ""

    def to_json(self) -> dict:
        d: dict = {"exported_name": self.exported_name, "named": self.named,
                   "pytorch_names": list(self.pytorch_names)}
        for key in ("tied_with", "merged", "copy_of"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.folded_copies:
            d["folded_copies"] = dict(self.folded_copies)
        if self.copy_op:
            d["copy_op"] = self.copy_op
        if self.rows_of:
            d["rows_of"] = self.rows_of
        return d


def parameter_sources(graph: Graph, params: list[str]) -> dict[str, ParameterSource]:
    """Initializer name, PyTorch-name status and weight tying of each parameter.

    With the dynamo exporter's records (``ExportMap``) every parameter also lists the
    PyTorch names it stands for; without them, its own name if it is a PyTorch name.
    Tying is found by value: exporters that split one PyTorch parameter into copies (a tied
    embedding and its pre-transposed output projection) leave equal or transposed-equal
    tensors. Constant-filled tensors (fresh LayerNorm weights) are equal without being tied,
    so they are not compared, and neither are two tensors known to hold distinct PyTorch
    parameters (under their own names, or folded from them): deep-copied layers.
    """
    sig = signature_of(graph)

    def named(p: str) -> bool:
        if sig is not None:
            return p in sig.parameters or p in sig.buffers
        return not is_made_up_name(p)

    def key(a: np.ndarray) -> str:
        return hashlib.sha1(np.ascontiguousarray(a).tobytes() + str(a.shape).encode()
                            + a.dtype.str.encode()).hexdigest()

    arrays = {p: np.asarray(graph.initializers[p]) for p in params}
    comparable = [p for p, a in arrays.items() if a.size > 1 and not constant_filled(a)]
    tied = UnionFind(comparable)
    # Hashing every weight (and every matrix's transpose) took seconds on a GPT-2-size
    # model: only parameters whose cheap fingerprint matches another's can be equal.
    candidates: dict[tuple, list[str]] = {}
    for p in comparable:
        candidates.setdefault(_fingerprint(arrays[p]), []).append(p)
    for group in candidates.values():
        if len(group) < 2:
            continue
        by_key: dict[str, list[str]] = {}
        for p in group:
            by_key.setdefault(key(arrays[p]), []).append(p)
        for p in group:
            a = arrays[p]
            keys = [key(a)] + ([key(a.T)] if a.ndim == 2 else [])
            for k in keys:
                for q in by_key.get(k, []):
                    tied.union(q, p)
    groups: dict[str, list[str]] = {}
    for p in comparable:
        groups.setdefault(tied.find(p), []).append(p)
    emap = export_map_of(graph)

    def origin(p: str) -> set[str]:
        """The PyTorch parameters ``p`` is known to hold (empty: not known)."""
        if emap is None:
            return {p} if named(p) else set()
        return set(emap.stands_for.get(p, ())) | set(emap.copies.get(p, ()))

    out: dict[str, ParameterSource] = {}
    for p in params:
        # Two tensors known to hold distinct PyTorch parameters are not a tie the exporter
        # split: torch trains them apart too (layers deep-copied at construction, as
        # nn.TransformerEncoder's, are equal until the first step).
        ties = [q for q in groups.get(tied.find(p), [p]) if q != p
                and not (origin(p) and origin(q) and not origin(p) & origin(q))] \
            if p in tied else []
        if emap is not None:
            names = emap.stands_for.get(p, (p,) if named(p) and p not in emap.copies else ())
            computes = tuple((c, op) for c, (_, init, op) in sorted(emap.computed.items())
                             if init == p)
            out[p] = ParameterSource(p, named(p), tuple(ties), names, emap.merged.get(p, ()),
                                     emap.copies.get(p, ()), copy_op=emap.copy_ops.get(p, ""),
                                     folded_copies=computes, rows_of=emap.lookups.get(p, ""))
        else:
            out[p] = ParameterSource(p, named(p), tuple(ties), (p,) if named(p) else ())
    return out


def _fingerprint(a: np.ndarray) -> tuple:
    """Equal for two arrays that hold the same values, and for a matrix and its transpose
    (tied weights exported as copies): the dtype, the shape (a matrix's in either order)
    and a few values' bytes (the start of a matrix's first row and of its first column, in
    either order; else the first and last elements), read without a pass over the array:
    a whole column reads every row's page (the file's, where the weights are still in it:
    ``frontend/weights_apart.py``). Arrays whose fingerprints match are compared exactly
    (by hash)."""
    if a.ndim == 2:
        edges = sorted((a[0, :64].tobytes(), a[:64, 0].tobytes()))
        return (a.dtype.str, tuple(sorted(a.shape)), *edges)
    flat = a.reshape(-1)
    return (a.dtype.str, a.shape, flat[:64].tobytes(), flat[-64:].tobytes())
