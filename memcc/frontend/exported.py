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
"""

from __future__ import annotations

import ast
import hashlib
import itertools
import json
import re
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import onnx.numpy_helper

from memcc.graph import Graph, attr, node_label
from memcc.step import KIND_KEY
from memcc.union_find import UnionFind

SIGNATURE_PROP = "pkg.torch.export.ExportedProgram.graph_signature"
# Graph.metadata key under which load_graph keeps the parsed signature for the builder.
SIGNATURE_KEY = "memcc.export_signature"

# Names exporters make up for values they create (folded copies, constants), for files
# without a graph signature: TorchScript's ``onnx::MatMul_12``, onnxscript's ``val_3`` and
# the bias it adds when it folds BatchNorm into a Conv (``stem.0.weight_bias``). Names such
# as ``embedding_1`` are only judged against a signature: spelled like that, they could be
# a hand-named parameter (``fc_1``).
_MADE_UP = re.compile(r"^(onnx::.*|val_\d+|.*\.weight_bias)$")
_SIGNATURE_LINE = re.compile(r"^\s*(\S+): (\w+)(?: target='([^']*)')?")

# Graph.metadata key under which load_graph keeps the ``ExportMap`` (JSON) for the builder.
EXPORT_MAP_KEY = "memcc.export_map"
# What the dynamo exporter records on initializers (value_info) and nodes.
ORIGINAL_NAME_PROP = "pkg.torch.onnx.original_node_name"
FOLDED_FROM_PROP = "pkg.onnxscript.optimizer.folded_from"
FX_NODE_PROP = "pkg.torch.onnx.fx_node"
NAME_SCOPES_PROP = "pkg.torch.onnx.name_scopes"
_FX_NAME = re.compile(r"^%(\S+) :")
_FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                          onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE})
_FX_ARG = re.compile(r"%(\w+)")
# How to export so that every PyTorch parameter keeps an initializer of its own.
KEEP_EVERY_PARAMETER = "torch.onnx.export(..., dynamo=True, optimize=False)"


class ExportWarning(UserWarning):
    """The build goes on, but the step may not train what the user thinks it trains."""


class ExportNote(ExportWarning):
    """What memcc changed in an export so that the step trains what PyTorch trains: shown
    as a note, not a warning (an ``ExportWarning`` so that callers catching those see it)."""


@dataclass(frozen=True)
class Signature:
    """torch.export's view of the model's state, by ``state_dict`` name."""

    parameters: frozenset[str] = frozenset()
    buffers: frozenset[str] = frozenset()
    mutated_buffers: frozenset[str] = frozenset()

    def to_json(self) -> str:
        return json.dumps({"parameters": sorted(self.parameters),
                           "buffers": sorted(self.buffers),
                           "mutated_buffers": sorted(self.mutated_buffers)})

    @classmethod
    def from_json(cls, text: str | None) -> Signature | None:
        if not text:
            return None
        d = json.loads(text)
        return cls(frozenset(d.get("parameters", ())), frozenset(d.get("buffers", ())),
                   frozenset(d.get("mutated_buffers", ())))


def read_signature(model: onnx.ModelProto) -> Signature | None:
    """Parse the dynamo exporter's graph signature, if the file has one."""
    props = {p.key: p.value for p in getattr(model.graph, "metadata_props", ())}
    props.update({p.key: p.value for p in model.metadata_props})
    text = props.get(SIGNATURE_PROP)
    if not text:
        return None
    params: set[str] = set()
    buffers: set[str] = set()
    mutated: set[str] = set()
    for line in text.splitlines():
        m = _SIGNATURE_LINE.match(line)
        if not m or not m.group(3):
            continue
        kind, target = m.group(2), m.group(3)
        if kind == "PARAMETER":
            params.add(target)
        elif kind in ("BUFFER", "CONSTANT_TENSOR"):
            buffers.add(target)
        elif kind == "BUFFER_MUTATION":
            mutated.add(target)
    return Signature(frozenset(params), frozenset(buffers), frozenset(mutated))


def signature_of(graph: Graph) -> Signature | None:
    return Signature.from_json(graph.metadata.get(SIGNATURE_KEY))


# ---------------------------------------------------------------------------- export map
@dataclass(frozen=True)
class ExportMap:
    """Which PyTorch parameters (``state_dict`` names) each initializer of a dynamo export
    stands for, read from what the exporter recorded (``read_export_map``).

    ``stands_for``: initializer -> every PyTorch name its value is, its own first, then the
    parameters the exporter's optimizer merged into it, then those torch ties to any of
    them (GPT-2's ``transformer.wte.weight`` is ``lm_head.weight``). ``merged``: initializer
    -> the parameters merged into it (torch trains them apart; memcc, as exported, as one).
    ``folded``: parameters the traced program reads but no initializer holds any more (the
    optimizer folded them into constants, such as zero biases it removed). ``unused``:
    parameters the traced program never reads (or whose every reader was folded away).
    ``copies``: initializer under a made-up name -> the PyTorch parameters it was folded
    from (a pre-transposed weight, trained under the made-up name). ``computed``: a copy
    ``recompute_folded_copies`` replaced by a node reading its parameter -> (the PyTorch
    parameter, the initializer holding it, the op written: ``Transpose(perm=[1, 0])``).
    """

    stands_for: dict[str, tuple[str, ...]] = field(default_factory=dict)
    merged: dict[str, tuple[str, ...]] = field(default_factory=dict)
    folded: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    copies: dict[str, tuple[str, ...]] = field(default_factory=dict)
    computed: dict[str, tuple[str, str, str]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"stands_for": self.stands_for, "merged": self.merged,
                           "folded": list(self.folded), "unused": list(self.unused),
                           "copies": self.copies, "computed": self.computed})

    @classmethod
    def from_json(cls, text: str | None) -> ExportMap | None:
        if not text:
            return None
        d = json.loads(text)
        return cls({k: tuple(v) for k, v in d.get("stands_for", {}).items()},
                   {k: tuple(v) for k, v in d.get("merged", {}).items()},
                   tuple(d.get("folded", ())), tuple(d.get("unused", ())),
                   {k: tuple(v) for k, v in d.get("copies", {}).items()},
                   {k: (str(v[0]), str(v[1]), str(v[2]))
                    for k, v in d.get("computed", {}).items()})


def _literal_list(text: str | None) -> list[str]:
    """The exporter writes lists as Python literals (``['a', 'b']``)."""
    if not text:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else []


def _attribute(target: str) -> str:
    """``model.h.0.ln_1.weight`` -> ``weight``: a merge pairs a weight with a weight."""
    return target.rsplit(".", 1)[-1]


def read_export_map(model: onnx.ModelProto) -> ExportMap | None:
    """Map the dynamo exporter's initializers back to PyTorch's parameters.

    Read from the raw file, before memcc rewrites a node. None for files without a graph
    signature (TorchScript) or without the per-node records (older exporters), where the
    names alone are all there is. A parameter without an initializer of its own is, in this
    order: merged (its FX node's ONNX nodes read another parameter's initializer of the same
    attribute, one that its own FX node reads too), copied (a made-up initializer was
    folded from it: a pre-transposed weight, trained under the made-up name), folded (its
    FX node survives but reads no initializer for it), tied (no FX node reads it, and its
    module's nodes read another module's parameter of the same attribute) or unused.
    """
    props = {p.key: p.value for p in getattr(model.graph, "metadata_props", ())}
    props.update({p.key: p.value for p in model.metadata_props})
    if KIND_KEY in props:  # a step memcc built: it records its own sources
        return None
    placeholders: dict[str, str] = {}  # FX placeholder -> PyTorch parameter name
    for line in (props.get(SIGNATURE_PROP) or "").splitlines():
        m = _SIGNATURE_LINE.match(line)
        if m and m.group(2) == "PARAMETER" and m.group(3):
            placeholders[m.group(1)] = m.group(3)
    fx_nodes = [n for n in model.graph.node
                if any(p.key == FX_NODE_PROP for p in n.metadata_props)]
    if not placeholders and not props.get(SIGNATURE_PROP):
        return _read_scope_ties(model)
    if not placeholders or not fx_nodes:
        return None
    by_target = {t: p for p, t in placeholders.items()}
    meta = {v.name: {p.key: p.value for p in v.metadata_props}
            for v in (*model.graph.value_info, *model.graph.input) if v.metadata_props}
    origin: dict[str, str] = {}  # initializer -> the placeholder it holds
    for t in model.graph.initializer:
        ph = meta.get(t.name, {}).get(ORIGINAL_NAME_PROP)
        if ph in placeholders:
            origin[t.name] = ph
        elif t.name in by_target:
            origin[t.name] = by_target[t.name]
    own: dict[str, str] = {}
    for init, ph in origin.items():
        own.setdefault(ph, init)

    # Made-up initializers folded from parameters (``val_14`` <- ``attn.qkv.weight``): the
    # record names the parameter's initializer, which may be gone from the file.
    copies: dict[str, tuple[str, ...]] = {}
    for t in model.graph.initializer:
        if t.name in origin:
            continue
        src = _literal_list(meta.get(t.name, {}).get(FOLDED_FROM_PROP))
        phs = [origin.get(x) or by_target.get(x) for x in src]
        if src and all(phs):
            copies[t.name] = tuple(placeholders[ph] for ph in phs if ph)
    copied = {by_target[n] for names in copies.values() for n in names}

    # One record per FX node: the placeholders it read (in argument order), the parameter
    # initializers its ONNX nodes read (in order) and the module it ran in.
    groups: dict[str, tuple[list[str], list[str], str]] = {}
    for node in fx_nodes:
        nprops = {p.key: p.value for p in node.metadata_props}
        fx = nprops[FX_NODE_PROP].splitlines()[0]
        m = _FX_NAME.match(fx)
        name = m.group(1) if m else fx
        if name not in groups:
            call = fx.split("=", 1)[1] if "=" in fx else fx
            args = [a for a in dict.fromkeys(_FX_ARG.findall(call)) if a in placeholders]
            scopes = _literal_list(nprops.get(NAME_SCOPES_PROP))
            groups[name] = (args, [], scopes[-2] if len(scopes) >= 2 else "")
        reads = groups[name][1]
        for i in node.input:
            if i in origin and i not in reads:
                reads.append(i)

    read_by_fx = {a for args, _, _ in groups.values() for a in args}
    # Initializers their own FX node still reads: only these can have absorbed another
    # parameter as they are (BatchNorm folded into a Conv leaves a Conv node carrying the
    # BatchNorm's FX node, reading a conv weight whose values the fold changed).
    own_read = {i for args, reads, _ in groups.values() for i in reads if origin[i] in args}
    merged_into: dict[str, str] = {}
    unresolved: set[str] = set()
    for args, reads, _ in groups.values():
        missing = [a for a in args if a not in own and a not in copied]
        foreign = [i for i in reads if origin[i] not in args and i in own_read]
        for ph in missing:
            pick = next((i for i in foreign if _attribute(placeholders[origin[i]])
                         == _attribute(placeholders[ph])), None)
            if pick is None:
                continue
            foreign.remove(pick)
            if merged_into.setdefault(ph, pick) != pick:
                unresolved.add(ph)  # two FX nodes disagree: claim nothing
    for ph in unresolved:
        merged_into.pop(ph, None)

    # A parameter the traced program never reads, in a module whose nodes read another
    # module's parameter of the same attribute, is tied to it (torch.export traces a tied
    # weight through one placeholder only).
    tied: dict[str, str] = {}
    unused: list[str] = []
    for ph, target in placeholders.items():
        if ph in own or ph in read_by_fx or ph in copied:
            continue
        module = target.rsplit(".", 1)[0] if "." in target else ""
        others = {a for args, _, mod in groups.values() if mod == module for a in args
                  if _attribute(placeholders[a]) == _attribute(target)
                  and (a in own or a in merged_into)}
        if len(others) == 1:
            tied[target] = placeholders[others.pop()]
        else:
            unused.append(target)
    folded = sorted(placeholders[ph] for ph in placeholders
                    if ph not in own and ph not in merged_into and ph not in copied
                    and ph in read_by_fx)

    stands_for: dict[str, tuple[str, ...]] = {}
    merged: dict[str, tuple[str, ...]] = {}
    for init, ph in origin.items():
        if own.get(ph) != init:
            continue
        extra = sorted(placeholders[p] for p, i in merged_into.items() if i == init)
        names = [placeholders[ph], *extra]
        names += sorted(t for t, to in tied.items() if to in names)
        stands_for[init] = tuple(names)
        if extra:
            merged[init] = tuple(extra)
    return ExportMap(stands_for, merged, tuple(folded), tuple(sorted(unused)), copies)


# ---------------------------------------------------------------------------- folded copies
# Tensors of more dimensions than this are not searched for a transposition (6! orders).
_MAX_PERMUTED_RANK = 6


def _value_preserving_op(param: np.ndarray, copy: np.ndarray
                         ) -> tuple[str, tuple[int, ...]] | None:
    """The one op (``Identity``, ``Transpose`` with its perm, ``Reshape`` with its shape)
    that turns ``param`` into ``copy`` bit for bit, or None. None as well where several ops
    that move elements differently all fit (a constant-filled tensor equals its every
    transposition): then the values cannot say which op the exporter folded, and guessing
    would train the wrong function of the parameter."""
    if param.dtype != copy.dtype or param.size != copy.size or param.size == 0:
        return None
    candidates: list[tuple[str, tuple[int, ...]]] = []
    if param.shape == copy.shape:
        candidates.append(("Identity", ()))
    if param.ndim == copy.ndim and 1 < param.ndim <= _MAX_PERMUTED_RANK:
        candidates += [("Transpose", perm)
                       for perm in itertools.permutations(range(param.ndim))
                       if perm != tuple(range(param.ndim))
                       and tuple(param.shape[i] for i in perm) == copy.shape]
    if param.shape != copy.shape:
        candidates.append(("Reshape", tuple(int(d) for d in copy.shape)))
    positions = np.arange(param.size).reshape(param.shape)
    target = np.ascontiguousarray(copy).tobytes()
    found: dict[bytes, tuple[str, tuple[int, ...]]] = {}
    for op, arg in candidates:
        if np.ascontiguousarray(_apply(op, arg, param)).tobytes() == target:
            found.setdefault(np.ascontiguousarray(_apply(op, arg, positions)).tobytes(),
                             (op, arg))
    return next(iter(found.values())) if len(found) == 1 else None


def _apply(op: str, arg: tuple[int, ...], a: np.ndarray) -> np.ndarray:
    if op == "Transpose":
        return np.transpose(a, arg)
    if op == "Reshape":
        return a.reshape(arg)
    return a


def _op_text(op: str, arg: tuple[int, ...]) -> str:
    if op == "Transpose":
        return f"Transpose(perm={list(arg)})"
    if op == "Reshape":
        return f"Reshape(shape={list(arg)})"
    return "Identity"


def recompute_folded_copies(model: onnx.ModelProto, emap: ExportMap) -> ExportMap:
    """Compute each folded copy from its parameter again, in ``model`` (in place).

    The dynamo exporter's optimizer constant-folds ops on parameters: GPT-2's output layer
    reads ``val_303``, ``Transpose(lm_head.weight)`` folded, while the embedding reads
    ``lm_head.weight`` itself. Trained as found, the copy and its parameter drift apart;
    PyTorch trains one tensor. A copy folded from one parameter whose value is, bit for
    bit, that parameter transposed, reshaped or as is (checked here on the arrays: the
    record only names the source) is replaced by that op reading the parameter's
    initializer, so the step trains the parameter and its gradient sums both uses. A copy
    that fails the check stays a parameter under its made-up name (``report_parameters``
    warns). Returns the map with the replaced copies moved from ``copies`` to ``computed``.
    """
    if not emap.copies:
        return emap
    inits = {t.name: t for t in model.graph.initializer}
    taken = set(inits) | {o for n in model.graph.node for o in n.output}
    copies = dict(emap.copies)
    computed = dict(emap.computed)
    front: list[onnx.NodeProto] = []
    gone: set[str] = set()
    for name, params in emap.copies.items():
        if len(params) != 1 or name not in inits:
            continue
        holders = sorted(i for i, names in emap.stands_for.items()
                         if params[0] in names and i in inits and i not in gone)
        holders.sort(key=lambda i: emap.stands_for[i][0] != params[0])  # its own first
        if not holders:
            continue
        holder = holders[0]
        try:
            found = _value_preserving_op(onnx.numpy_helper.to_array(inits[holder]),
                                         onnx.numpy_helper.to_array(inits[name]))
        except Exception:  # data the file does not hold (external data not loaded)
            found = None
        if found is None:
            continue
        op, arg = found
        node_name = f"memcc.recompute/{name}"
        if op == "Transpose":
            node = onnx.helper.make_node(op, [holder], [name], name=node_name, perm=list(arg))
        elif op == "Reshape":
            shape = f"{name}.shape"
            while shape in taken:
                shape += "_"
            taken.add(shape)
            model.graph.initializer.append(
                onnx.numpy_helper.from_array(np.asarray(arg, dtype=np.int64), shape))
            node = onnx.helper.make_node(op, [holder, shape], [name], name=node_name)
        else:
            node = onnx.helper.make_node(op, [holder], [name], name=node_name)
        front.append(node)
        gone.add(name)
        del copies[name]
        computed[name] = (params[0], holder, _op_text(op, arg))
    if not gone:
        return emap
    kept = [t for t in model.graph.initializer if t.name not in gone]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    inputs = [i for i in model.graph.input if i.name not in gone]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    nodes = [*front, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return replace(emap, copies=copies, computed=computed)


def _read_scope_ties(model: onnx.ModelProto) -> ExportMap | None:
    """Weight tying in a TorchScript export, from its node names (``/model/lm_head/
    Transpose``: the module a node ran in). TorchScript stores a tied weight once, under one
    of its names, and the other module reads it: a node in module ``M`` that has no
    initializer of its own reads ``X.weight``, so ``M.weight`` is ``X.weight``. Only named
    float initializers are mapped; None when the file has no such node (no scope names, or
    no tying), so that the names alone decide, as before."""
    floats = {t.name for t in model.graph.initializer
              if t.data_type in _FLOAT_TYPES and not is_made_up_name(t.name)}
    owners = {f.rsplit(".", k)[0] for f in floats for k in range(1, f.count(".") + 1)}
    tied: dict[str, set[str]] = {}
    for node in model.graph.node:
        if not node.name.startswith("/") or node.name.count("/") < 2:
            continue
        module = _scope_module(node.name)
        if module in owners:
            continue  # the module has parameters of its own: not a tied reader
        for i in node.input:
            if i in floats and "." in i and not i.startswith(module + "."):
                tied.setdefault(i, set()).add(f"{module}.{_attribute(i)}")
    if not tied:
        return None
    stands_for = {f: (f, *sorted(tied.get(f, ()))) for f in sorted(floats)}
    return ExportMap(stands_for)


def _scope_module(node_name: str) -> str:
    """``/model/lm_head/Transpose`` -> ``model.lm_head``; TorchScript spells a Sequential's
    child with its parent's name (``/stem/stem.0/Conv`` -> ``stem.0``)."""
    parts: list[str] = []
    for seg in node_name[1:].split("/")[:-1]:
        if parts and seg.startswith(parts[-1] + "."):
            seg = seg[len(parts[-1]) + 1:]
        parts.append(seg)
    return ".".join(parts)


def export_map_of(graph: Graph) -> ExportMap | None:
    return ExportMap.from_json(graph.metadata.get(EXPORT_MAP_KEY))


# ---------------------------------------------------------------------------- BatchNorm
def restore_training_batchnorm(graph: Graph, source: str) -> list[str]:
    """Put BatchNorm written in inference form back in training mode where the signature
    proves torch ran it in train mode; warn where it cannot. Returns the restored nodes."""
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
    if kept:
        warnings.warn(
            f"{source}: {len(kept)} BatchNormalization node(s) use their running statistics "
            f"(inference form), e.g. {kept[0]}: the step trains with frozen statistics, "
            "unlike torch's train mode. If the model should train its BatchNorm, export "
            "with torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode."
            "TRAINING) or with dynamo=True and optimize=False.", ExportWarning, stacklevel=2)
    folded = sorted(b for b in (sig.mutated_buffers if sig else ())
                    if b.endswith("running_mean") and b not in graph.initializers)
    if folded:
        warnings.warn(
            f"{source}: the model was exported in train mode with BatchNorm "
            f"({len(folded)} layer(s), e.g. '{folded[0][:-len('.running_mean')]}'), but the "
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
    # Copies the exporter folded from this parameter that the step computes from it again
    # (``recompute_folded_copies``): (made-up name, op), e.g. ("val_303", "Transpose(...)").
    folded_copies: tuple[tuple[str, str], ...] = field(default=())

    def to_json(self) -> dict:
        d: dict = {"exported_name": self.exported_name, "named": self.named,
                   "pytorch_names": list(self.pytorch_names)}
        for key in ("tied_with", "merged", "copy_of"):
            if getattr(self, key):
                d[key] = list(getattr(self, key))
        if self.folded_copies:
            d["folded_copies"] = dict(self.folded_copies)
        return d


def is_made_up_name(name: str) -> bool:
    """True for names exporters invent for folded copies and constants."""
    return bool(_MADE_UP.match(name))


def parameter_sources(graph: Graph, params: list[str]) -> dict[str, ParameterSource]:
    """Initializer name, PyTorch-name status and weight tying of each parameter.

    With the dynamo exporter's records (``ExportMap``) every parameter also lists the
    PyTorch names it stands for; without them, its own name if it is a PyTorch name.
    Tying is found by value: exporters that split one PyTorch parameter into copies (a tied
    embedding and its pre-transposed output projection) leave equal or transposed-equal
    tensors. Constant-filled tensors (fresh LayerNorm weights) are equal without being tied,
    so they are not compared.
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
    comparable = [p for p, a in arrays.items()
                  if a.size > 1 and not np.all(a.reshape(-1) == a.reshape(-1)[0])]
    by_key: dict[str, list[str]] = {}
    for p in comparable:
        by_key.setdefault(key(arrays[p]), []).append(p)
    tied = UnionFind(comparable)
    for p in comparable:
        a = arrays[p]
        keys = [key(a)] + ([key(a.T)] if a.ndim == 2 else [])
        for k in keys:
            for q in by_key.get(k, []):
                tied.union(q, p)
    groups: dict[str, list[str]] = {}
    for p in comparable:
        groups.setdefault(tied.find(p), []).append(p)
    emap = export_map_of(graph)
    out: dict[str, ParameterSource] = {}
    for p in params:
        ties = [q for q in groups.get(tied.find(p), [p]) if q != p] if p in tied else []
        if emap is not None:
            names = emap.stands_for.get(p, (p,) if named(p) and p not in emap.copies else ())
            computes = tuple((c, op) for c, (_, init, op) in sorted(emap.computed.items())
                             if init == p)
            out[p] = ParameterSource(p, named(p), tuple(ties), names, emap.merged.get(p, ()),
                                     emap.copies.get(p, ()), computes)
        else:
            out[p] = ParameterSource(p, named(p), tuple(ties), (p,) if named(p) else ())
    return out


def _some(names: list[str] | tuple[str, ...], k: int = 6) -> str:
    return ", ".join(names[:k]) + (f" (+{len(names) - k} more)" if len(names) > k else "")


def report_parameters(sources: dict[str, ParameterSource], source: str,
                      sig: Signature | None, emap: ExportMap | None = None) -> None:
    """Warn about parameters without a PyTorch name, about weight tying, and (from the
    dynamo exporter's records) about PyTorch parameters the exporter merged or folded."""
    unnamed = [p for p, s in sources.items() if not s.named]
    if unnamed:
        shown = _some([p + (f" (folded from {', '.join(sources[p].copy_of)})"
                            if sources[p].copy_of else "") for p in unnamed])
        warnings.warn(
            f"{source}: {len(unnamed)} trained parameter(s) have names the exporter made up, "
            f"not PyTorch state_dict names: {shown}. They are folded copies (pre-transposed "
            "weights, constant-folded lookups). To map trained weights back by name, export "
            f"with {KEEP_EVERY_PARAMETER} or with dynamo=False "
            "and training=torch.onnx.TrainingMode.TRAINING.", ExportWarning, stacklevel=2)
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
            "tensor.", ExportWarning, stacklevel=2)


def _report_export_map(sources: dict[str, ParameterSource], source: str,
                       emap: ExportMap) -> None:
    """Name every PyTorch parameter the exporter's optimizer merged into another or folded
    into a constant: the step as exported trains a different model than torch would."""
    computed = [(c, torch_name, op) for c, (torch_name, init, op) in emap.computed.items()
                if init in sources]
    if computed:
        what = {"Identity": "an exact", "Transpose": "a transposed", "Reshape": "a reshaped"}
        told = "; ".join(f"{c} was {what[op.split('(')[0]]} copy of {n}: now computed from it "
                         f"({op}), trained as one" for c, n, op in computed[:4])
        more = f" (+{len(computed) - 4} more)" if len(computed) > 4 else ""
        warnings.warn(
            f"{source}: {told}{more}. The exporter's optimizer had folded "
            f"{'this op' if len(computed) == 1 else 'these ops'} on the parameter into a "
            "constant (checked: equal bit for bit); memcc computes the copy from the "
            "parameter again, so the step trains one tensor, as PyTorch does.",
            ExportNote, stacklevel=3)
    merged = {p: s.merged for p, s in sources.items() if s.merged}
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
            f"To train every parameter on its own, export with {KEEP_EVERY_PARAMETER}.",
            ExportWarning, stacklevel=3)
    if emap.folded:
        warnings.warn(
            f"{source}: {len(emap.folded)} PyTorch parameter(s) are no longer in the file: "
            "the exporter's optimizer folded them into constants (a zero bias it removed) "
            f"or into other weights (a BatchNorm into its convolution): {_some(emap.folded)}. "
            "They stay fixed at their values at export, and memcc "
            "export writes no value for them (load with load_state_dict(..., strict=False): "
            "the module keeps the values it was exported with, the ones the step used). To "
            f"train them, export with {KEEP_EVERY_PARAMETER}.", ExportWarning, stacklevel=3)
    if emap.unused:
        warnings.warn(
            f"{source}: {len(emap.unused)} PyTorch parameter(s) are not read by the exported "
            f"model and have no trained value: {_some(emap.unused)}.", ExportWarning,
            stacklevel=3)
