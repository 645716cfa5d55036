"""Folded copies of parameters computed from their parameter again.

In: a dynamo-exported ONNX model (in place, before memcc rewrites a node) and its
``ExportMap``, whose ``copies`` name the made-up initializers the exporter's optimizer
folded from a parameter (``val_303 = Transpose(lm_head.weight)``). Out: each copy whose
values are its parameter transposed, reshaped or as is, bit for bit, replaced by that op
reading the parameter's initializer, and the map with those copies moved from ``copies`` to
``computed``. So the step trains one tensor where PyTorch does. A copy broadcast from a
parameter no initializer holds along the batch axis (``cls_token.expand(batch, -1, -1)``
folded into ``expand``) becomes ``Expand`` of an initializer under the parameter's name
(``recompute_broadcast_copies``); one folded from a lookup of some of the parameter's rows
(``ExportMap.lookups``: a position table looked up at a static length) becomes ``Expand``
of an initializer under a made-up name of its own (``embedding_1.rows``), since it is not
the parameter; one holding the same row at every position (BERT's token types, looked up at
a buffer of zeros) becomes ``Expand`` of that one vector (``_one_row_looked_up``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import onnx
import onnx.numpy_helper

from memcc.frontend.constants import broadcasts_to
from memcc.frontend.export_map import FOLDED_FROM_PROP, ExportMap, literal_list
from memcc.frontend.export_signature import signature_entries
from memcc.graph import FLOAT_TYPES

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


def recompute_folded_copies(model: onnx.ModelProto, emap: ExportMap,
                            weights: Mapping[str, np.ndarray] | None = None) -> ExportMap:
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
    ``weights``: the values of the initializers ``model`` holds as stubs, by name
    (``frontend/weights_apart.py``).
    """
    if not emap.copies:
        return emap
    weights = weights or {}

    def value(t: onnx.TensorProto) -> np.ndarray:
        return weights[t.name] if t.name in weights else onnx.numpy_helper.to_array(t)

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
            found = _value_preserving_op(value(inits[holder]), value(inits[name]))
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
    drop_initializers(model, gone, front)
    return replace(emap, copies=copies, computed=computed)


def _broadcast_source(copy: np.ndarray) -> np.ndarray | None:
    """The parameter a copy was broadcast from along its first axis (``token.expand(batch,
    -1, -1)``: the copy's first slot, of shape ``(1, ...)``), where every slot of the copy
    equals the first bit for bit; else None. Only the first axis is taken as broadcast: a
    constant-filled copy (a zero-initialized token) would fit a broadcast along any axis,
    and the batch axis is the one the exporter folded (it knew the batch size)."""
    if copy.ndim < 2 or copy.shape[0] < 2 or copy.size == 0:
        return None
    first = copy[:1]
    if not broadcasts_to(first, copy):
        return None
    return np.ascontiguousarray(first)


def recompute_broadcast_copies(model: onnx.ModelProto, emap: ExportMap,
                               weights: Mapping[str, np.ndarray] | None = None) -> ExportMap:
    """Compute each copy folded from a parameter broadcast to the batch from that parameter
    again, in ``model`` (in place).

    The dynamo exporter's optimizer folds ``cls_token.expand(batch, -1, -1)`` (DeiT, ViT in
    train mode) into a batch-sized initializer ``expand`` and drops the parameter. Trained as
    found, each batch slot gets a token of its own, and the same image in two slots gives
    two answers. A copy folded from one parameter that no initializer holds, whose every
    slot along the first axis equals the first, gets an initializer under the parameter's
    own name holding that slot, and ``Expand`` of it replaces the copy: the step trains the
    parameter once, its gradient summed over the batch as torch's is, and ``memcc export``
    writes it under its name. Returns the map with the copy moved from ``copies`` to
    ``computed`` and the parameter standing for itself.

    A copy folded from a lookup of some rows of the parameter (``ExportMap.lookups``:
    BART's ``embed_positions.weight[arange(S) + 2]`` expanded to the batch, ``embedding_1``
    [2, 16, 32] beside a [34, 32] table) holds the same rows in every slot too, and trains
    as one value shared by every slot as well; but it is not the parameter, so its slot
    gets an initializer of a made-up name of its own (``embedding_1.rows``), which the map's
    ``lookups`` then name instead of the copy: never written under the parameter's name,
    which torch holds in another shape. Where that slot holds one row at every position
    too (BERT's ``token_type_ids``, a buffer of zeros), the one row trains, as torch's
    does, ``Expand``-ed to every position as well (``_one_row_looked_up`` says when).
    """
    weights = weights or {}
    inits = {t.name: t for t in model.graph.initializer}
    taken = set(inits) | {o for n in model.graph.node for o in n.output} \
        | {i for n in model.graph.node for i in n.input} | {i.name for i in model.graph.input}
    held = {n for names in emap.stands_for.values() for n in names}
    copies, computed, merged = dict(emap.copies), dict(emap.computed), dict(emap.merged)
    stands_for = dict(emap.stands_for)
    front: list[onnx.NodeProto] = []
    # The first axis the exporter folded is the batch the model was traced at: a copy whose
    # first axis is no input's is not taken for one (a zero-initialized weight copied by
    # some op would fit a broadcast of its first row too).
    batches = input_batches(model)
    lookups, records = dict(emap.lookups), folded_from(model)
    for name, param in [*_copies_of_one_parameter(model, emap).items(),
                        *emap.lookups.items()]:
        rows = name in emap.lookups
        batch = name in inits and (inits[name].dims[:1] or [0])[0] in batches
        if name not in inits or (not rows and (param in held or param in taken)) \
                or name in emap.copy_ops or not (batch or rows):
            continue
        t = inits[name]
        try:
            copy = np.asarray(weights[name] if name in weights
                              else onnx.numpy_helper.to_array(t))
            source = _broadcast_source(copy) if batch else None
            if rows:
                source = _one_row_looked_up(copy, source, records.get(name, []))
        except Exception:  # data the file does not hold (external data not loaded)
            source = None
        if source is None:
            continue
        # A lookup of rows is no parameter: its one slot trains under a name of its own.
        own = fresh_name(f"{name}.rows", taken) if rows else param
        shape = fresh_name(f"{name}.shape", taken)
        taken |= {shape, own}
        model.graph.initializer.extend([
            onnx.numpy_helper.from_array(source, own),
            onnx.numpy_helper.from_array(np.asarray(copy.shape, dtype=np.int64), shape)])
        front.append(onnx.helper.make_node("Expand", [own, shape], [name],
                                           name=f"memcc.recompute/{name}"))
        copies.pop(name, None)
        into = _moved(merged, name, own)
        if rows:
            lookups[own] = lookups.pop(name)
            computed[name] = (own, own, f"Expand(shape={list(copy.shape)})")
            continue
        stands_for[param] = (param, *into)
        computed[name] = (param, param, f"Expand(shape={list(copy.shape)})")
    if not front:
        return emap
    gone = {n.output[0] for n in front}
    drop_initializers(model, gone, front)
    return replace(emap, stands_for=stands_for, copies=copies, computed=computed,
                   merged=merged, folded=tuple(p for p in emap.folded if p not in stands_for),
                   lookups=lookups)


def _moved(merged: dict[str, tuple[str, ...]], name: str, to: str) -> tuple[str, ...]:
    """The parameters the optimizer merged into the fold ``name`` (``merged_folds``), now
    kept under ``to``, the initializer that replaces it."""
    into = merged.pop(name, ())
    if into:
        merged[to] = into
    return into


def _one_row_looked_up(copy: np.ndarray, slot: np.ndarray | None,
                       record: list[str]) -> np.ndarray | None:
    """What the step trains for a lookup of rows ``copy`` [1 or B, S, ...]: one vector
    ``(1, 1, ...)`` where every position holds the same row, else the slot shared by the
    batch (``slot``, from ``_broadcast_source``; None where the batch slots differ or the
    first axis is no batch: then the copy trains as found).

    BERT's token-type embedding is looked up at ``token_type_ids``, a buffer of zeros: the
    exporter folds ``token_type_embeddings.weight[zeros(B, S)]`` into ``embedding_2``
    [B, S, d] holding row 0 of the table S times. Torch trains that one row, its gradient
    summed over the batch and the positions; trained as S vectors (one per position),
    they took S different steps, none of them torch's, and drifted apart. So where every
    position of the one slot equals the first bit for bit, one vector is trained and
    ``Expand``-ed to the copy's shape.

    The risk: equal values do not prove one row. A position table whose rows are equal at
    export (zero- or constant-initialised) looked up at ``arange(S)`` gives equal positions
    too, and torch trains each of its rows apart: collapsed, they would stay equal for ever.
    So the collapse is taken only where (a) the ``folded_from`` record names no ``arange``
    (the indices come from a buffer or constants, not from a range of positions), and (b)
    the vector is not constant-filled (a zero-initialised table, whose rows are equal
    whatever indices a buffer holds: BERT keeps its position ids in a buffer too). Distinct
    rows of a table that is not constant-filled do not coincide bit for bit, so (b) leaves
    only a table built of one repeated row, looked up at a buffer of positions."""
    base = slot if slot is not None else (copy if copy.shape[:1] == (1,) else None)
    if base is None or base.ndim < 3 or base.shape[1] < 2 or base.size == 0 or \
            any(_NUMBERED.sub("", x) == "arange" for x in record):
        return slot
    one = np.ascontiguousarray(base[:, :1])
    flat = one.reshape(-1)
    if not broadcasts_to(one, base) or \
            flat.tobytes() == np.repeat(flat[:1], flat.size).tobytes():
        return slot
    return one


def fresh_name(name: str, taken: set[str]) -> str:
    while name in taken:
        name += "_"
    return name


# FX ops (an FX node is named after its op: ``expand``, ``unsqueeze_3``) that give a tensor
# another shape, broadcast or copy it, but leave its values where they are: a folded chain of
# these alone on one parameter is that parameter broadcast (DeiT's
# ``cls_token.expand(B, -1, -1)``), which the step can compute from it again.
_SHAPE_OPS = frozenset({
    "expand", "expand_copy", "broadcast_to", "repeat", "unsqueeze", "unsqueeze_copy",
    "squeeze", "squeeze_copy", "view", "view_copy", "reshape", "_unsafe_view", "clone",
    "contiguous", "alias", "alias_copy", "detach", "detach_copy", "lift_fresh_copy",
    "_to_copy", "to"})
_EXPORTER_CONSTANT = re.compile(r"^val_\d+$")
_NUMBERED = re.compile(r"_\d+$")


def row_lookups(model: onnx.ModelProto, emap: ExportMap) -> dict[str, str]:
    """Made-up float initializers the optimizer folded from a lookup of rows of one
    parameter that no initializer holds (``emap.folded``) -> that parameter
    (``ExportMap.lookups``); read from the file as exported, before any rewrite.

    A position table looked up at a static length (``wpe.weight[arange(S)]``, BART's
    ``embed_positions.weight[arange(S) + 2]``, maybe expanded to the batch) is folded into
    ``embedding_1`` [1 or B, S, d], whose ``folded_from`` record names the parameter, the
    exporter's constants (``val_N``) and the traced FX nodes in between (``arange``,
    ``add``, ``index``, ``expand``; or a buffer: BERT's ``token_type_ids``). A broadcast of
    the parameter itself (DeiT's ``cls_token.expand``) is recorded with the parameter and
    constants alone. So the two are told apart by what the record (and the initializer's
    own name, the last FX node folded: ``embedding_1``) names besides the parameter and the
    constants: FX nodes of ops that only reshape, broadcast or copy (``_SHAPE_OPS``) leave
    the parameter's values as they are; any other op (a lookup ``embedding``/``index``/
    ``gather``/``slice``/``select``, the ``arange`` and ``add`` computing its indices,
    arithmetic) or a buffer means the copy holds something computed from the parameter,
    not the parameter, and cannot be written under its name. Names are a convention of the
    exporter, so where the file also gives the parameter's shape (a value_info of its name
    or placeholder), a copy neither of whose sizes (whole, or one slot along the first
    axis) is the parameter's is taken for a lookup too, whatever its record says; the
    dynamo exporter writes no shape for a parameter it folded away, so there the names
    decide."""
    params, _ = signature_names(model)
    records, folded = folded_from(model), set(emap.folded)
    sizes = {v.name: [d.dim_value if d.HasField("dim_value") else -1
                      for d in v.type.tensor_type.shape.dim]
             for v in (*model.graph.input, *model.graph.value_info)
             if v.type.tensor_type.HasField("shape")}
    placeholders = {target: ph for ph, target in params.items() if ph != target}
    found: dict[str, str] = {}
    for t in model.graph.initializer:
        if t.name in emap.stands_for or t.name in emap.copies or \
                t.data_type not in FLOAT_TYPES:
            continue
        src = records.get(t.name, [])
        from_params = {params[x] for x in src if x in params}
        if len(from_params) != 1 or not from_params <= folded:
            continue
        param = from_params.pop()
        others = [x for x in [t.name, *src]
                  if x not in params and not _EXPORTER_CONSTANT.match(x)]
        computed = any(_NUMBERED.sub("", x) not in _SHAPE_OPS for x in others)
        dims = sizes.get(param) or sizes.get(placeholders.get(param, ""))
        if not computed and dims and -1 not in dims:
            size = int(np.prod(dims, dtype=np.int64))
            whole = int(np.prod(t.dims, dtype=np.int64))
            computed = size not in (whole, int(np.prod(t.dims[1:], dtype=np.int64)))
        if computed:
            found[t.name] = param
    return found


def _copies_of_one_parameter(model: onnx.ModelProto, emap: ExportMap) -> dict[str, str]:
    """Made-up initializer -> the one parameter it was folded from: ``emap.copies`` of one
    parameter, and initializers whose ``folded_from`` record names one parameter that no
    initializer holds (``emap.folded``) and otherwise only values that are neither a
    placeholder of the graph signature (a buffer, an input) nor a graph input: the
    exporter's constants (``expand`` <- ``cls_token`` and the expand's sizes)."""
    found = {c: ps[0] for c, ps in emap.copies.items() if len(ps) == 1}
    params, named = signature_names(model)
    records, folded = folded_from(model), set(emap.folded)
    for t in model.graph.initializer:
        if t.name in found or t.name in emap.stands_for or t.name in emap.lookups:
            continue
        src = records.get(t.name, [])
        from_params = {params[x] for x in src if x in params}
        others = [x for x in src if x not in params]
        if len(from_params) == 1 and from_params <= folded \
                and not any(x in named for x in others):
            found[t.name] = from_params.pop()
    return found


def drop_initializers(model: onnx.ModelProto, gone: set[str],
                       front: list[onnx.NodeProto]) -> None:
    """``model`` without the initializers (and graph inputs) named in ``gone``, and with the
    nodes ``front`` that now compute them put first."""
    kept = [t for t in model.graph.initializer if t.name not in gone]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    inputs = [i for i in model.graph.input if i.name not in gone]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    nodes = [*front, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def signature_names(model: onnx.ModelProto) -> tuple[dict[str, str], set[str]]:
    """From the graph signature: placeholder or parameter name -> parameter name, and every
    name it gives a placeholder (parameters, buffers, inputs) with the graph's inputs."""
    params: dict[str, str] = {}
    named: set[str] = {i.name for i in model.graph.input}
    for placeholder, kind, target, _ in signature_entries(model):
        named |= {placeholder, target or placeholder}
        if kind == "PARAMETER" and target:
            params[placeholder] = params[target] = target
    return params, named


def folded_from(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Initializer -> the values the exporter's optimizer folded it from (its record)."""
    out: dict[str, list[str]] = {}
    for v in model.graph.value_info:
        for p in v.metadata_props:
            if p.key == FOLDED_FROM_PROP:
                out[v.name] = literal_list(p.value)
    return out


def constant_broadcasts(model: onnx.ModelProto, emap: ExportMap,
                        weights: Mapping[str, np.ndarray] | None = None) -> ExportMap:
    """The map with made-up initializers that are constants repeated over the batch added
    to ``constants`` (never trained).

    The optimizer folds an attention mask computed from buffers and sizes alone, expanded
    to the batch (DeiT's ``val_78``, ``(4, 1, 18, 18)``), into a batch-sized initializer;
    trained as found, each batch slot got a mask of its own, where torch computes the same
    constant every step. Taken: a float initializer no parameter stands for, whose first
    axis is an input's (the batch the model was traced at, 2 or more), every slot equal to
    the first bit for bit, and whose ``folded_from`` record names no parameter."""
    weights = weights or {}
    params, _ = signature_names(model)
    batches = input_batches(model)
    known = set(emap.stands_for) | set(emap.copies) | set(emap.computed) | set(emap.constants)
    records, found = folded_from(model), []
    for t in model.graph.initializer:
        if t.name in known or not t.dims or t.dims[0] not in batches or \
                t.data_type not in FLOAT_TYPES:
            continue
        src = records.get(t.name, [])
        if not src or any(x in params for x in src):
            continue
        try:
            value = weights[t.name] if t.name in weights else onnx.numpy_helper.to_array(t)
        except Exception:  # data the file does not hold (external data not loaded)
            continue
        if _broadcast_source(np.asarray(value)) is not None:
            found.append(t.name)
    if not found:
        return emap
    return replace(emap, constants=tuple(sorted({*emap.constants, *found})))


def input_batches(model: onnx.ModelProto) -> set[int]:
    """The first axes of the data inputs (the batch the model was traced at), 2 or more: a
    batch of 1 would make any ``(1, ...)`` tensor look broadcast."""
    inits = {t.name for t in model.graph.initializer}
    return {int(i.type.tensor_type.shape.dim[0].dim_value) for i in model.graph.input
            if i.name not in inits and len(i.type.tensor_type.shape.dim) > 0} - {0, 1}
