"""Which PyTorch parameters each initializer of an exported model stands for (``ExportMap``).

In: the raw ONNX file as exported, before memcc rewrites a node: the dynamo exporter's
graph signature (every PyTorch parameter, by placeholder), the placeholder each
initializer came from (value_info metadata ``pkg.torch.onnx.original_node_name``), the FX
node each node was written for (``pkg.torch.onnx.fx_node``) and the copies its optimizer
folded (``pkg.onnxscript.optimizer.folded_from``); for TorchScript files, node names only.
Out: an ``ExportMap`` (``read_export_map``), kept as JSON on the ``Graph`` under
``EXPORT_MAP_KEY`` for the builder (``export_map_of``): which parameters the exporter
merged into one initializer, folded into constants, copied under made-up names, or that
torch ties. ``memcc build`` reports them and ``memcc export`` writes trained weights back
under every PyTorch name.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

import onnx

from memcc.frontend.export_signature import (
    SIGNATURE_PROP,
    file_props,
    parameter_placeholders,
)
from memcc.frontend.scope_ties import read_scope_ties
from memcc.graph import FLOAT_TYPES, Graph
from memcc.step import KIND_KEY

# Graph.metadata key under which load_graph keeps the ``ExportMap`` (JSON) for the builder.
EXPORT_MAP_KEY = "memcc.export_map"
# What the dynamo exporter records on initializers (value_info) and nodes.
ORIGINAL_NAME_PROP = "pkg.torch.onnx.original_node_name"
FOLDED_FROM_PROP = "pkg.onnxscript.optimizer.folded_from"
FX_NODE_PROP = "pkg.torch.onnx.fx_node"
NAME_SCOPES_PROP = "pkg.torch.onnx.name_scopes"
_FX_NAME = re.compile(r"^%(\S+) :")
_FX_ARG = re.compile(r"%(\w+)")


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
    ``copy_ops``: a copy whose parameter no initializer holds -> the op that made it from
    the parameter, where the exporter's records say (``_copy_ops``): ``memcc export`` writes
    the trained copy back under the parameter's name through that op's inverse.
    ``constants``: initializers the optimizer folded from values none of which is or was
    folded from a parameter (the attention scale of ``scaled_dot_product_attention``, the
    ones an ``InstanceNorm`` without affine is written with, a folded buffer): constants of
    the model, which the step does not train. ``maybe_tied``: unused parameters that the
    records say may be a second name of one of several parameters (``_tied_and_unused``).
    ``lookups``: a made-up initializer the optimizer folded from a lookup of some rows of
    one parameter that no initializer holds (``embedding_1`` <- ``wpe.weight[arange(S)]``,
    a position table looked up at a static length) -> that parameter (``_row_lookups``):
    the step trains those rows under a made-up name, and ``memcc export`` cannot write the
    table back. Filled in by ``folded_copies.row_lookups``, from the same records.
    """

    stands_for: dict[str, tuple[str, ...]] = field(default_factory=dict)
    merged: dict[str, tuple[str, ...]] = field(default_factory=dict)
    folded: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()
    copies: dict[str, tuple[str, ...]] = field(default_factory=dict)
    computed: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    copy_ops: dict[str, str] = field(default_factory=dict)
    constants: tuple[str, ...] = ()
    maybe_tied: dict[str, tuple[str, ...]] = field(default_factory=dict)
    lookups: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps({"stands_for": self.stands_for, "merged": self.merged,
                           "folded": list(self.folded), "unused": list(self.unused),
                           "copies": self.copies, "computed": self.computed,
                           "copy_ops": self.copy_ops, "constants": list(self.constants),
                           "maybe_tied": self.maybe_tied, "lookups": self.lookups})

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
                    for k, v in d.get("computed", {}).items()},
                   {k: str(v) for k, v in d.get("copy_ops", {}).items()},
                   tuple(d.get("constants", ())),
                   {k: tuple(v) for k, v in d.get("maybe_tied", {}).items()},
                   {k: str(v) for k, v in d.get("lookups", {}).items()})


def literal_list(text: str | None) -> list[str]:
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


@dataclass(frozen=True)
class _Records:
    """What the dynamo exporter recorded about parameters, indexed for ``read_export_map``."""

    placeholders: dict[str, str]  # FX placeholder -> PyTorch parameter name
    by_target: dict[str, str]     # PyTorch parameter name -> its placeholder
    origin: dict[str, str]        # initializer -> the placeholder it holds
    own: dict[str, str]           # placeholder -> the first initializer holding it
    # FX node -> (the placeholders it read, in argument order; the parameter initializers
    # its ONNX nodes read, in order; the module it ran in)
    groups: dict[str, tuple[list[str], list[str], str]]
    meta: dict[str, dict[str, str]]  # value -> its value_info metadata


def read_export_map(model: onnx.ModelProto) -> ExportMap | None:
    """Map the dynamo exporter's initializers back to PyTorch's parameters.

    Read from the raw file, before memcc rewrites a node. None for files without a graph
    signature (TorchScript) or without the per-node records (older exporters), where the
    names alone are all there is. A parameter without an initializer of its own is, in this
    order: merged (its FX node's ONNX nodes read another parameter's initializer of the same
    attribute, or the one initializer the FX node does not name where it is the one
    parameter the FX node names that no initializer holds, one that its own FX node reads
    too), copied (a made-up initializer was
    folded from it: a pre-transposed weight, trained under the made-up name), folded (its
    FX node survives but reads no initializer for it), tied (no FX node reads it, and its
    module's nodes read another module's parameter of the same attribute) or unused.
    """
    props = file_props(model)
    if KIND_KEY in props:  # a step memcc built: it records its own sources
        return None
    placeholders = parameter_placeholders(model)
    fx_nodes = [n for n in model.graph.node
                if any(p.key == FX_NODE_PROP for p in n.metadata_props)]
    if not placeholders and not props.get(SIGNATURE_PROP):
        return _read_scope_ties(model)
    if not placeholders or not fx_nodes:
        return None
    rec = _index_records(model, placeholders, fx_nodes)
    copies = _folded_copies(model, rec)
    copied = {rec.by_target[n] for names in copies.values() for n in names}
    merged_into = _merged_into(rec, copied)
    read_by_fx = {a for args, _, _ in rec.groups.values() for a in args}
    # Named by a folded_from record: the program read it, and the optimizer folded what it
    # read into a constant (a position table's static-length lookup): no alias of anything.
    into_constants = _folded_into_constants(model, rec) - copied - set(merged_into)
    tied, unused, maybe = _tied_and_unused(rec, read_by_fx, copied | into_constants,
                                           merged_into)
    tied, unlike = _same_kind_ties(model, rec, merged_into, tied)
    unused += unlike
    folded = sorted(placeholders[ph] for ph in placeholders
                    if ph not in rec.own and ph not in merged_into and ph not in copied
                    and (ph in read_by_fx or ph in into_constants))
    stands_for, merged = _names_per_initializer(rec, merged_into, tied)
    return ExportMap(stands_for, merged, tuple(folded), tuple(sorted(unused)), copies,
                     copy_ops=_copy_ops(model, rec, copies),
                     constants=_folded_constants(model, rec), maybe_tied=maybe)


def _index_records(model: onnx.ModelProto, placeholders: dict[str, str],
                   fx_nodes: list[onnx.NodeProto]) -> _Records:
    """Which placeholder each initializer holds, and one record per FX node."""
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
    groups: dict[str, tuple[list[str], list[str], str]] = {}
    for node in fx_nodes:
        nprops = {p.key: p.value for p in node.metadata_props}
        fx = nprops[FX_NODE_PROP].splitlines()[0]
        m = _FX_NAME.match(fx)
        name = m.group(1) if m else fx
        if name not in groups:
            call = fx.split("=", 1)[1] if "=" in fx else fx
            args = [a for a in dict.fromkeys(_FX_ARG.findall(call)) if a in placeholders]
            scopes = literal_list(nprops.get(NAME_SCOPES_PROP))
            groups[name] = (args, [], scopes[-2] if len(scopes) >= 2 else "")
        reads = groups[name][1]
        for i in node.input:
            if i in origin and i not in reads:
                reads.append(i)
    return _Records(placeholders, by_target, origin, own, groups, meta)


def _folded_copies(model: onnx.ModelProto, rec: _Records) -> dict[str, tuple[str, ...]]:
    """Made-up initializers folded from parameters (``val_14`` <- ``attn.qkv.weight``): the
    record names the parameter's initializer, which may be gone from the file."""
    copies: dict[str, tuple[str, ...]] = {}
    for t in model.graph.initializer:
        if t.name in rec.origin:
            continue
        src = literal_list(rec.meta.get(t.name, {}).get(FOLDED_FROM_PROP))
        phs = [rec.origin.get(x) or rec.by_target.get(x) for x in src]
        if src and all(phs):
            copies[t.name] = tuple(rec.placeholders[ph] for ph in phs if ph)
    return copies


def _folded_into_constants(model: onnx.ModelProto, rec: _Records) -> set[str]:
    """Placeholders without an initializer of their own that an initializer's
    ``folded_from`` record names (by placeholder, or by the parameter's name): the traced
    program read them, and the optimizer folded the computation into that constant (ALBERT's
    and BART's position tables: ``embedding_2`` <- ``position_embeddings.weight`` and the
    ``position_ids`` buffer)."""
    found: set[str] = set()
    for t in model.graph.initializer:
        for x in literal_list(rec.meta.get(t.name, {}).get(FOLDED_FROM_PROP)):
            ph = rec.origin.get(x) or rec.by_target.get(x) or (x if x in rec.placeholders
                                                               else None)
            if ph is not None and ph not in rec.own:
                found.add(ph)
    return found


def _known_kinds(model: onnx.ModelProto) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Value -> (element type, dims) wherever the file says both in full (initializers,
    graph inputs, value_info)."""
    kinds: dict[str, tuple[int, tuple[int, ...]]] = {}
    for v in (*model.graph.input, *model.graph.value_info):
        tt = v.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim)
        if tt.elem_type and tt.HasField("shape") and -1 not in dims:
            kinds[v.name] = (tt.elem_type, dims)
    kinds.update({t.name: (t.data_type, tuple(t.dims)) for t in model.graph.initializer})
    return kinds


def _same_kind_ties(model: onnx.ModelProto, rec: _Records, merged_into: dict[str, str],
                    tied: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """``tied`` without the ties between tensors the file gives different element types or
    shapes (one tensor under two names has one shape), and the names so dropped: a name is
    better written nowhere than under another tensor."""
    kinds = _known_kinds(model)
    keep: dict[str, str] = {}
    dropped: list[str] = []
    for alias, to in tied.items():
        ph = rec.by_target[to]
        holder = rec.own.get(ph) or merged_into.get(ph) or to
        mine, theirs = kinds.get(alias), kinds.get(holder)
        if mine is not None and theirs is not None and mine != theirs:
            dropped.append(alias)
        else:
            keep[alias] = to
    return keep, dropped


def _folded_constants(model: onnx.ModelProto, rec: _Records) -> tuple[str, ...]:
    """Float initializers no parameter stands for whose ``folded_from`` record names values
    none of which holds or is a parameter, nor was folded from one (records followed
    through the values they name): the optimizer folded them from constants, buffers and
    sizes alone (a scale; the ones and zeros ``InstanceNorm`` and ``LayerNorm`` without
    affine are written with; ``BCEWithLogitsLoss``'s ``pos_weight - 1``; rotary tables from
    ``inv_freq``), so they are no weight, whatever their made-up name: torch trains none of
    them. An initializer without a record stays a parameter (nothing says otherwise)."""
    records = {t.name: literal_list(rec.meta.get(t.name, {}).get(FOLDED_FROM_PROP))
               for t in model.graph.initializer}
    records.update({v: literal_list(m.get(FOLDED_FROM_PROP)) for v, m in rec.meta.items()
                    if v not in records})
    found = []
    for t in model.graph.initializer:
        if t.name in rec.origin or t.data_type not in FLOAT_TYPES:
            continue
        if records[t.name] and not _reaches_parameter(t.name, records, rec):
            found.append(t.name)
    return tuple(sorted(found))


def _reaches_parameter(name: str, records: dict[str, list[str]], rec: _Records) -> bool:
    """Whether a value the optimizer folded was folded from a parameter, directly or
    through values it folded before."""
    seen, todo = {name}, list(records.get(name, ()))
    while todo:
        x = todo.pop()
        if x in rec.origin or x in rec.by_target or x in rec.placeholders:
            return True
        if x not in seen:
            seen.add(x)
            todo.extend(records.get(x, ()))
    return False


def _copy_ops(model: onnx.ModelProto, rec: _Records, copies: dict[str, tuple[str, ...]]
              ) -> dict[str, str]:
    """The op that made each 2-D copy of one parameter, where every node reading the copy
    is a MatMul by it written for an ``aten.linear`` whose weight is that parameter: the
    exporter writes ``linear(x, W)`` as ``MatMul(x, Transpose(W))`` and its optimizer folds
    the Transpose (the dynamo exports of transformers' BERT, Llama and ViT: every Linear
    weight; measured equal to the parameter transposed in ``tests/test_exports_weights_back
    .py``). Other readers say nothing certain: no op."""
    dims = {t.name: len(t.dims) for t in model.graph.initializer}
    verdict: dict[str, bool] = {}
    for node in model.graph.node:
        for k, i in enumerate(node.input):
            if i not in copies or len(copies[i]) != 1:
                continue
            fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_PROP), "")
            call = fx.splitlines()[0].split("=", 1)[-1] if fx else ""
            args = _FX_ARG.findall(call.split("](", 1)[-1])
            linear = (node.op_type == "MatMul" and k == 1 and "aten.linear" in call
                      and len(args) >= 2 and args[1] == rec.by_target.get(copies[i][0]))
            verdict[i] = verdict.get(i, True) and linear
    return {c: "Transpose(perm=[1, 0])" for c, ok in verdict.items() if ok and dims[c] == 2}


def _merged_into(rec: _Records, copied: set[str]) -> dict[str, str]:
    """Placeholder -> the initializer of another parameter the exporter merged it into."""
    placeholders, origin = rec.placeholders, rec.origin
    # Initializers their own FX node still reads: only these can have absorbed another
    # parameter as they are (BatchNorm folded into a Conv leaves a Conv node carrying the
    # BatchNorm's FX node, reading a conv weight whose values the fold changed).
    own_read = {i for args, reads, _ in rec.groups.values() for i in reads
                if origin[i] in args}
    merged_into: dict[str, str] = {}
    unresolved: set[str] = set()
    for args, reads, _ in rec.groups.values():
        missing = [a for a in args if a not in rec.own and a not in copied]
        foreign = [i for i in reads if origin[i] not in args and i in own_read]
        pairs = []
        for ph in missing:
            pick = next((i for i in foreign if _attribute(placeholders[origin[i]])
                         == _attribute(placeholders[ph])), None)
            if pick is not None:
                foreign.remove(pick)
                pairs.append((ph, pick))
        rest = [ph for ph in missing if ph not in dict(pairs)]
        if len(rest) == 1 and len(foreign) == 1:
            # The one parameter the FX node names that no initializer holds, and the one
            # initializer its nodes read that it does not name: ConvNeXt-V2's zero
            # ``grn.bias``, read as the zero ``grn.weight`` (``Add(mul_1, grn.weight)``).
            pairs.append((rest[0], foreign[0]))
        for ph, pick in pairs:
            if merged_into.setdefault(ph, pick) != pick:
                unresolved.add(ph)  # two FX nodes disagree: claim nothing
    for ph in unresolved:
        merged_into.pop(ph, None)
    return merged_into


def _tied_and_unused(rec: _Records, read_by_fx: set[str], copied: set[str],
                     merged_into: dict[str, str]
                     ) -> tuple[dict[str, str], list[str], dict[str, tuple[str, ...]]]:
    """Parameters the traced program never reads: tied to another one, or unused.

    torch.export traces a tensor with several ``state_dict`` names through the placeholder
    of its last name in the signature only: every earlier name's placeholder is unread. So an
    unread parameter is unused, or an earlier name of a later parameter of the same
    attribute that some node reads. Which, is read from where the model ran (each node's
    module), in this order: its module's nodes read another module's parameter (GPT-2's
    ``wte`` looks up ``lm_head.weight``); its module never ran under its own path, and the
    modules with its parameter names that ran reading another module's all read one (T5's
    ``shared`` runs as ``encoder.embed_tokens`` and ``decoder.embed_tokens``, on
    ``lm_head.weight``); its module ran, and one child of it holds and reads such a
    parameter (BERT's ``cls.predictions.bias`` is its ``decoder.bias``). Else it is unused.
    The records hold no shapes: a module's own parameter that its forward never reads,
    beside a child's of the same attribute, is taken for that child's. The caller leaves
    out (in ``copied``) parameters a ``folded_from`` record names, which the program read,
    and drops ties the file's shapes refute (``_same_kind_ties``). Third: the unused
    parameters with several such children, by the children's parameters (ALBERT's
    ``predictions.bias``: its ``decoder.bias``, but ``dense.bias`` and ``LayerNorm.bias`` are
    as likely by the records), which no record decides between."""
    placeholders = rec.placeholders
    tied: dict[str, str] = {}
    rest: list[str] = []
    for ph, target in placeholders.items():
        if ph in rec.own or ph in read_by_fx or ph in copied:
            continue
        module = _module(target)
        others = {a for args, _, mod in rec.groups.values() if mod == module for a in args
                  if _attribute(placeholders[a]) == _attribute(target)
                  and (a in rec.own or a in merged_into)}
        if len(others) == 1:
            tied[target] = placeholders[others.pop()]
        else:
            rest.append(ph)
    order = {ph: k for k, ph in enumerate(placeholders)}
    ran = {mod for _, _, mod in rec.groups.values()}
    unused: list[str] = []
    maybe: dict[str, tuple[str, ...]] = {}
    for ph in rest:
        target = placeholders[ph]
        module = _module(target)
        if not module:
            to = None
        elif any(m == module or m.startswith(module + ".") for m in ran):
            below = [t for t in _read_below(rec, target, set(rec.own) | set(merged_into))
                     if order[rec.by_target[t]] > order[ph]]
            to = below[0] if len(below) == 1 else None
            if len(below) > 1:
                maybe[target] = tuple(below)
        else:
            to = _alias_module_read(rec, target, tied)
        if to is not None and order[rec.by_target[to]] > order[ph]:
            tied[target] = to
        else:
            unused.append(target)
    return tied, unused, maybe


def _module(target: str) -> str:
    """``model.h.0.ln_1.weight`` -> ``model.h.0.ln_1``."""
    return target.rsplit(".", 1)[0] if "." in target else ""


def _read_below(rec: _Records, target: str, held: set[str]) -> list[str]:
    """The parameters of ``target``'s attribute, held by an initializer, that a child of
    ``target``'s module holds and reads (``cls.predictions.decoder.bias`` for
    ``cls.predictions.bias``), sorted."""
    module = _module(target)
    found = {rec.placeholders[a] for args, _, mod in rec.groups.values()
             if mod.startswith(module + ".") for a in args
             if a in held and _attribute(rec.placeholders[a]) == _attribute(target)
             and _module(_module(rec.placeholders[a])) == module}
    return sorted(found)


def _alias_module_read(rec: _Records, target: str, tied: dict[str, str]) -> str | None:
    """The one parameter that the modules with the same parameter names as ``target``'s
    module, which ran reading another module's parameter, read for its attribute: the
    module ran under their paths (one module object, several names)."""
    def names_of(module: str) -> set[str]:
        return {_attribute(t) for t in rec.by_target if _module(t) == module}

    module = _module(target)
    reads = {to for t, to in tied.items() if _attribute(t) == _attribute(target)
             and _module(t) != module and names_of(_module(t)) == names_of(module)}
    return reads.pop() if len(reads) == 1 else None


def _names_per_initializer(rec: _Records, merged_into: dict[str, str], tied: dict[str, str]
                           ) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """``ExportMap.stands_for`` and ``ExportMap.merged``."""
    placeholders = rec.placeholders
    stands_for: dict[str, tuple[str, ...]] = {}
    merged: dict[str, tuple[str, ...]] = {}
    for init, ph in rec.origin.items():
        if rec.own.get(ph) != init:
            continue
        extra = sorted(placeholders[p] for p, i in merged_into.items() if i == init)
        names = [placeholders[ph], *extra]
        names += sorted(t for t, to in tied.items() if to in names)
        stands_for[init] = tuple(names)
        if extra:
            merged[init] = tuple(extra)
    return stands_for, merged


def _read_scope_ties(model: onnx.ModelProto) -> ExportMap | None:
    """Weight tying in a TorchScript export, from its node names (``scope_ties``)."""
    stands_for = read_scope_ties(model)
    return ExportMap(stands_for) if stands_for is not None else None


def export_map_of(graph: Graph) -> ExportMap | None:
    return ExportMap.from_json(graph.metadata.get(EXPORT_MAP_KEY))
