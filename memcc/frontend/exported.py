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
(``parameter_sources``) and the report on them (``report_parameters``), as warnings.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.export_map import ExportMap, export_map_of
from memcc.frontend.export_signature import (
    ExportNote,
    ExportWarning,
    Signature,
    is_made_up_name,
    signature_of,
)
from memcc.frontend.norm_modes import eval_mode_batchnorms, module_of, untracked_instance_norms
from memcc.graph import Graph, attr, node_label, unique_namer
from memcc.union_find import UnionFind

__all__ = [
    "ExportNote", "ExportWarning", "ParameterSource", "is_made_up_name",
    "parameter_sources", "report_parameters", "restore_training_batchnorm", "signature_of",
]

# How to export so that every PyTorch parameter keeps an initializer of its own.
KEEP_EVERY_PARAMETER = "torch.onnx.export(..., dynamo=True, optimize=False)"


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
        else:
            kept.append(node_label(node))
    if restored:
        warnings.warn(
            f"{source}: {len(restored)} BatchNormalization node(s) were exported in inference "
            "form although torch ran them in train mode (the dynamo exporter drops the "
            "flag); memcc restored batch statistics and carries the running statistics as "
            "state, as torch does.", ExportWarning, stacklevel=2)
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
    comparable = [p for p, a in arrays.items() if a.size > 1 and not _constant(a)]
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


def _constant(a: np.ndarray) -> bool:
    """Whether every element equals the first; a sample decides most arrays (trained or
    random weights) without a pass over all of them."""
    flat = a.reshape(-1)
    if np.any(flat[:64] != flat[0]):
        return False
    return bool(np.all(flat == flat[0]))


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


def _some(names: list[str] | tuple[str, ...], k: int = 6) -> str:
    return ", ".join(names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "")


def _copies_of_nothing(unnamed: list[str], sources: dict[str, ParameterSource]) -> str:
    """What to say of made-up names that copy no parameter memcc can see: buffers the
    exporter's optimizer folded look so (Llama's rotary cos and sin tables, ``unsqueeze_N``
    of a dynamo export with ``optimize=True``), and PyTorch trains no buffer."""
    orphans = [p for p in unnamed if not sources[p].copy_of and not sources[p].pytorch_names]
    if not orphans:
        return ""
    flags = " ".join(f"--freeze '{p}'" for p in orphans[:4])
    return (f" {len(orphans)} of them copy no parameter memcc can see "
            f"({_some(orphans, 4)}): buffers the exporter folded look like that (rotary "
            "position tables do), and PyTorch does not train buffers; if these are, keep them "
            f"fixed with {flags}{' ...' if len(orphans) > 4 else ''}.")


def report_parameters(sources: dict[str, ParameterSource], source: str,
                      sig: Signature | None, emap: ExportMap | None = None) -> None:
    """Warn about parameters without a PyTorch name, about weight tying, and (from the
    dynamo exporter's records) about PyTorch parameters the exporter merged or folded."""
    # Copies whose op is known go back under their parameter's name: no warning. Rows
    # looked up from a parameter get a warning of their own (``_report_lookups``).
    unnamed = [p for p, s in sources.items() if not s.named and not s.copy_op
               and not s.rows_of]
    if unnamed:
        shown = _some([p + (f" (folded from {', '.join(sources[p].copy_of)})"
                            if sources[p].copy_of else "") for p in unnamed])
        conv_folded = sum(p.startswith("onnx::Conv_") for p in unnamed)
        if conv_folded:  # its own short warning first: the step trains another model
            warnings.warn(
                f"{source}: exported in eval mode, its BatchNorms folded into the "
                f"convolutions ({conv_folded} parameters named onnx::Conv_N): the step "
                "trains without "
                "BatchNorm and its batch statistics, unlike PyTorch in train mode. Export "
                "with model.train() and torch.onnx.export(..., training=torch.onnx."
                "TrainingMode.TRAINING, do_constant_folding=False) to train it as PyTorch "
                "does.", ExportWarning, stacklevel=2)
        warnings.warn(
            f"{source}: {len(unnamed)} trained parameter(s) have names the exporter made up, "
            f"not PyTorch state_dict names: {shown}. They are folded copies (pre-transposed "
            f"weights, constant-folded lookups). To map trained weights back by name, "
            f"export with {KEEP_EVERY_PARAMETER} or with dynamo=False, "
            "training=torch.onnx.TrainingMode.TRAINING and do_constant_folding=False (its "
            "constant folding, on by default, makes the copies in train mode too)."
            + _copies_of_nothing(unnamed, sources), ExportWarning, stacklevel=2)
    if emap is not None:
        _report_export_map(sources, source, emap)
    elif sig is not None:
        missing = sorted(sig.parameters - set(sources))
        if missing and unnamed:
            warnings.warn(
                f"{source}: PyTorch parameters not trained under their own name: "
                f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''} (folded into "
                "the copies above, or not on a path to the loss).", ExportWarning,
                stacklevel=2)
    tied = sorted({tuple(sorted((p, *s.tied_with))) for p, s in sources.items()
                   if s.tied_with})
    if tied:
        groups = "; ".join(" = ".join(g) for g in tied[:4])
        warnings.warn(
            f"{source}: {len(tied)} group(s) of parameters hold the same values (weight "
            f"tying split into copies by the exporter, possibly transposed): {groups}. "
            "memcc trains each copy separately, so they drift apart; torch would train one "
            "tensor where they are copies of one parameter (not where they are distinct "
            "parameters that were equal at export, such as deep-copied layers).",
            ExportWarning, stacklevel=2)


def _report_export_map(sources: dict[str, ParameterSource], source: str,
                       emap: ExportMap) -> None:
    """Name every PyTorch parameter the exporter's optimizer merged into another or folded
    into a constant: the step as exported trains a different model than torch would."""
    _report_lookups(sources, source, emap)
    computed = [(c, torch_name, op) for c, (torch_name, init, op) in emap.computed.items()
                if init in sources and init not in emap.lookups]
    if computed:
        what = {"Identity": "an exact", "Transpose": "a transposed", "Reshape": "a reshaped",
                "Expand": "a broadcast (per batch slot)"}
        told = "; ".join(f"{c} was {what[op.split('(')[0]]} copy of {n}: now computed from it "
                         f"({op}), trained as one" for c, n, op in computed[:4])
        more = f" (+{len(computed) - 4} more)" if len(computed) > 4 else ""
        warnings.warn(
            f"{source}: {told}{more}. The exporter's optimizer had folded "
            f"{'this op' if len(computed) == 1 else 'these ops'} on the parameter into a "
            "constant (checked: equal bit for bit); memcc computes the copy from the "
            "parameter again, so the step trains one tensor, as PyTorch does.",
            ExportNote, stacklevel=3)
    merged = {p: s.merged for p, s in sources.items() if s.merged and s.pytorch_names}
    _report_merged_folds(sources, source, emap)
    if merged:
        n = sum(len(m) for m in merged.values())
        groups = "; ".join(f"{', '.join(m)} -> {p}" for p, m in list(merged.items())[:4])
        more = f" (+{len(merged) - 4} more groups)" if len(merged) > 4 else ""
        warnings.warn(
            f"{source}: the exporter's optimizer merged {n} PyTorch parameter(s) into "
            f"{len(merged)} initializer(s) that held equal values at export (freshly "
            f"initialised weights): {groups}{more}. memcc trains each group as one tied "
            "parameter: a different model from PyTorch's, which trains them apart; memcc "
            "export --format safetensors writes the group's trained value under every name. "
            f"To train every parameter on its own, export with {KEEP_EVERY_PARAMETER} (or "
            "give them distinct values before exporting).", ExportWarning, stacklevel=3)
    looked_up = {s.rows_of for s in sources.values() if s.rows_of}
    folded = [p for p in emap.folded if p not in looked_up]
    if folded:
        warnings.warn(
            f"{source}: {len(folded)} PyTorch parameter(s) are no longer in the file: "
            "the exporter's optimizer folded them into constants (a zero bias it removed) "
            "or into other weights (a BatchNorm into its convolution, an LSTM's or GRU's "
            f"weights into its gate-ordered W, R and B): {_some(folded)}. What was "
            "folded into a constant stays fixed at its value at export; a weight it was "
            "folded into trains under the exporter's name. memcc export writes no value for "
            "them under their PyTorch names (load with load_state_dict(..., strict=False): "
            "the module keeps the values it was exported with). To train and export them "
            f"as PyTorch has them, export with {KEEP_EVERY_PARAMETER}.", ExportWarning,
            stacklevel=3)
    if emap.unused:
        maybe = "".join(f" {n} may be a second name of one of {', '.join(c)}, or of none: "
                        "the records do not say which, so it gets no value." for n, c in
                        list(emap.maybe_tied.items())[:2])
        warnings.warn(
            f"{source}: {len(emap.unused)} PyTorch parameter(s) are not read by the exported "
            f"model and have no trained value: {_some(emap.unused)}. (Where torch ties one "
            "to another parameter, one tensor under two names, no record said which: load "
            f"with load_state_dict(..., strict=False).){maybe}", ExportWarning, stacklevel=3)


def _report_merged_folds(sources: dict[str, ParameterSource], source: str,
                         emap: ExportMap) -> None:
    """Name the parameters the optimizer merged into another's folded constant that the
    step trains under a made-up name (``merged_folds``): torch trains them apart, and no
    value is written back for either."""
    told = [f"{', '.join(s.merged)} with "
            f"{s.rows_of or ', '.join(s.copy_of) or 'another parameter'} "
            f"(trained as one, '{p}')" for p, s in sources.items()
            if s.merged and not s.pytorch_names]
    if told:
        warnings.warn(
            f"{source}: {len(told)} PyTorch parameter(s) held the same values at export as "
            "another, and the exporter's optimizer merged the constant it folded from each "
            f"into the other's: {_some(told, 4)}. The step trains one value where PyTorch "
            "trains two (the first loss matches; later steps drift apart), and memcc export "
            "writes neither back under its PyTorch name. To train each on its own, export "
            f"with {KEEP_EVERY_PARAMETER} (or give them distinct values before exporting).",
            ExportWarning, stacklevel=4)


def _report_lookups(sources: dict[str, ParameterSource], source: str,
                    emap: ExportMap) -> None:
    """Name every PyTorch parameter the exporter's optimizer folded into a lookup of some of
    its rows (``ExportMap.lookups``), and what the step trains instead."""
    rows = {p: s.rows_of for p, s in sources.items() if s.rows_of}
    if not rows:
        return
    shared = {init for c, (_, init, _) in emap.computed.items() if init in rows}
    told = "; ".join(
        f"{param} was folded into a lookup of some of its rows, which memcc trains as "
        f"'{p}'" + (" (one value shared by every batch slot, and by every position where each "
                     "held the same row)" if p in shared else "")
        for p, param in list(rows.items())[:4])
    more = f" (+{len(rows) - 4} more)" if len(rows) > 4 else ""
    warnings.warn(
        f"{source}: {told}{more}. The exporter's optimizer looked the rows up at the "
        "sizes the model was traced at (a position table at a static length) and folded "
        "them into a constant: the step trains those rows, as PyTorch would, but not the "
        "table, and memcc export cannot write the table back from them: PyTorch keeps its "
        "own values for it (load_state_dict(..., strict=False)). To train the table, "
        f"export with {KEEP_EVERY_PARAMETER} (or with dynamic shapes).", ExportWarning,
        stacklevel=4)
