"""Folded copies of parameters computed from their parameter again.

In: a dynamo-exported ONNX model (in place, before memcc rewrites a node) and its
``ExportMap``, whose ``copies`` name the made-up initializers the exporter's optimizer
folded from a parameter (``val_303 = Transpose(lm_head.weight)``). Out: each copy whose
values are its parameter transposed, reshaped or as is, bit for bit, replaced by that op
reading the parameter's initializer, and the map with those copies moved from ``copies`` to
``computed``. So the step trains one tensor where PyTorch does.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import replace

import numpy as np
import onnx
import onnx.numpy_helper

from memcc.frontend.export_map import ExportMap

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
