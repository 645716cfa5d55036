"""Values the dynamo exporter's optimizer folded, made what torch has again, in one call.

In: a dynamo-exported ONNX model (in place, before memcc rewrites a node) and its
``ExportMap``. Out: the map after ``folded_values_as_torch_has_them``: the folded copies of
one parameter computed from it again and the folded constants kept fixed
(``folded_copies``), and a value folded from a parameter that an initializer holds, beside
others whose share was zero at export, computed as ``Expand`` of that initializer
(``recompute_held_broadcasts``): an RNN's first step, ``linear(zeros, W_hh, b_hh)``, is
``b_hh`` broadcast, and the step then gives ``b_hh`` that step's gradient too; where no
initializer holds the parameter (a cell run once), its slot along the batch trains once
under a made-up name (``linear.slot``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace

import numpy as np
import onnx
import onnx.numpy_helper

from memcc.frontend.constants import broadcasts_to, constant_filled
from memcc.frontend.export_map import ExportMap
from memcc.frontend.export_signature import ExportNote
from memcc.frontend.folded_copies import (
    constant_broadcasts,
    drop_initializers,
    folded_from,
    fresh_name,
    input_batches,
    recompute_broadcast_copies,
    recompute_folded_copies,
    row_lookups,
    signature_names,
)
from memcc.frontend.merged_folds import merged_folds
from memcc.graph import FLOAT_TYPES


def _held_parameters(emap: ExportMap, inits: set[str]) -> dict[str, str]:
    """PyTorch parameter -> the initializer that holds it (its own, merged or tied)."""
    held: dict[str, str] = {}
    for init, names in emap.stands_for.items():
        if init in inits:
            for n in names:
                held.setdefault(n, init)
    return held


def _batch_slot(copy: np.ndarray, batches: set[int]) -> np.ndarray | None:
    """``copy`` with every axis before the last along which its slots are all equal bit for
    bit cut to one slot (``[B, H]`` -> ``[1, H]``, ``[1, B, H]`` -> ``[1, 1, H]``), where one
    such axis is an input's batch; else None."""
    slot, cut = copy, False
    for axis in range(copy.ndim - 1):
        if slot.shape[axis] < 2:
            continue
        first = np.take(slot, [0], axis=axis)
        if broadcasts_to(first, slot):
            cut |= slot.shape[axis] in batches
            slot = first
    return np.ascontiguousarray(slot) if cut else None


def _array_reader(inits: Mapping[str, onnx.TensorProto], weights: Mapping[str, np.ndarray]
                  ) -> Callable[[str], np.ndarray]:
    """An initializer's array by name, each read once: a parameter many folds name (a tied
    embedding's) is compared with each of them."""
    read: dict[str, np.ndarray] = {}

    def value(name: str) -> np.ndarray:
        if name not in read:
            read[name] = np.asarray(weights[name] if name in weights
                                    else onnx.numpy_helper.to_array(inits[name]))
        return read[name]
    return value


def recompute_held_broadcasts(model: onnx.ModelProto, emap: ExportMap,
                              weights: Mapping[str, np.ndarray] | None = None) -> ExportMap:
    """Compute each folded value that is a parameter broadcast from it again, in ``model``
    (in place).

    ``nn.RNN`` exported by dynamo with ``optimize=True`` runs its first step on a zero
    state: ``linear(zeros, weight_hh_l0, bias_hh_l0)``, which the optimizer folds into
    ``linear_1`` [1, B, H], ``bias_hh_l0`` broadcast; the later steps read ``bias_hh_l0``
    itself. Trained as a made-up parameter, ``linear_1`` took the first step's gradient
    and ``bias_hh_l0`` lacked it: 0.37 (relative) off torch's update after one SGD step.

    Taken: a float initializer no earlier rewrite claimed whose ``folded_from`` record names
    parameters, exactly one of which an initializer holds and broadcasts to it bit for bit.
    ``Expand`` of that initializer replaces it. The other parameters the record names gave
    nothing to the value at export (the weight multiplied by the zero state), and their
    gradient through it is zero as well where, as here, they multiplied constant zeros; a
    value that is the parameter times something equal to one at export would not be, and
    nothing in the record tells the two apart. So the value is left as it was where another
    parameter the record names is held and constant-filled (``b1 + b2`` with a zero ``b2``
    equals ``b1`` broadcast; ``b1 * g`` with ``g`` all ones too), and where the value is
    constant-filled (a zero bias broadcasts to any zeros, whatever the exporter folded): it
    trains under its made-up name, which ``report_parameters`` warns of.

    Where no initializer holds any parameter the record names (an ``nn.RNNCell`` called
    once, on ``hx=None``: ``bias_hh`` is read nowhere else), the arrays cannot say which
    parameter it is, nor its shape; but a value whose slots along an input's batch axis are
    equal is one value broadcast to the batch, and trained per slot it drifts apart as no
    torch parameter does. So its slot trains once, ``Expand``-ed, under a made-up name
    (``linear.slot``) recorded as folded from those parameters.
    """
    weights = weights or {}
    inits = {t.name: t for t in model.graph.initializer}
    held = _held_parameters(emap, set(inits))
    params, _ = signature_names(model)
    records, batches = folded_from(model), input_batches(model)
    known = {*emap.stands_for, *emap.copies, *emap.computed, *emap.constants, *emap.lookups}
    taken = set(inits) | {o for n in model.graph.node for o in n.output}
    copies, computed = dict(emap.copies), dict(emap.computed)
    front: list[onnx.NodeProto] = []

    value = _array_reader(inits, weights)

    for t in list(model.graph.initializer):
        named = sorted({params[x] for x in records.get(t.name, []) if x in params})
        if t.name in known or t.data_type not in FLOAT_TYPES or not named:
            continue
        try:
            copy = value(t.name)
            if constant_filled(copy):
                continue
            fits = [p for p in named if p in held and broadcasts_to(value(held[p]), copy)]
            if any(constant_filled(value(held[p])) for p in named if p in held and p not in fits):
                continue
            slot = None if any(p in held for p in named) else _batch_slot(copy, batches)
        except Exception:  # data the file does not hold (external data not loaded)
            continue
        if len(fits) == 1:
            source = held[fits[0]]
            computed[t.name] = (fits[0], source, f"Expand(shape={list(copy.shape)})")
        elif slot is not None:
            source = fresh_name(f"{t.name}.slot", taken)
            model.graph.initializer.append(onnx.numpy_helper.from_array(slot, source))
            copies[source] = tuple(named)
        else:
            continue
        shape = fresh_name(f"{t.name}.shape", taken)
        taken |= {shape, source}
        model.graph.initializer.append(
            onnx.numpy_helper.from_array(np.asarray(copy.shape, dtype=np.int64), shape))
        front.append(onnx.helper.make_node("Expand", [source, shape], [t.name],
                                           name=f"memcc.recompute/{t.name}"))
    if not front:
        return emap
    drop_initializers(model, {n.output[0] for n in front}, front)
    return replace(emap, copies=copies, computed=computed)


def folded_values_as_torch_has_them(model: onnx.ModelProto, emap: ExportMap,
                                    weights: Mapping[str, np.ndarray] | None,
                                    source: str) -> ExportMap:
    """``merged_folds``, ``row_lookups``, ``recompute_folded_copies``,
    ``recompute_broadcast_copies``, ``recompute_held_broadcasts`` and
    ``constant_broadcasts`` in turn (``model`` in place), saying which constants were kept
    fixed."""
    emap = merged_folds(model, emap)
    emap = replace(emap, lookups=row_lookups(model, emap))
    emap = recompute_broadcast_copies(model, recompute_folded_copies(model, emap, weights),
                                      weights)
    emap = constant_broadcasts(model, recompute_held_broadcasts(model, emap, weights),
                               weights)
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in model.graph.initializer}
    # One-element ones (a scale) go unsaid, as before tensors were taken too.
    if fixed := sorted(c for c in emap.constants if sizes.get(c, 1) > 1):
        warnings.warn(
            f"{source}: {len(fixed)} initializer(s) the exporter's optimizer folded from "
            f"buffers, constants and sizes alone (e.g. '{fixed[0]}': an attention mask "
            "repeated over the batch, the ones and zeros of a norm without affine, a folded "
            "buffer) are constants of the model, kept fixed as torch computes them each "
            "step, not trained", ExportNote, stacklevel=3)
    return emap
