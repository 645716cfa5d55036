"""What a forward model's element types let its step do, said before anything is built.

Two things a user who already trains in 16 bits runs into, neither of them memcc's making:

- A model exported under ``torch.autocast`` (``torch.onnx.export`` inside ``with
  torch.autocast("cpu", dtype=torch.bfloat16)``, either exporter, torch 2.13-2.15) writes
  a LayerNormalization whose input is bfloat16 and whose weight is float32: torch's
  ``layer_norm`` takes that, ONNX's one type ``T`` does not, and ONNX Runtime refuses to
  load the file. ONNX's shape inference, run by the loader in its lenient mode, passes it,
  so the step was built and only ``memcc run`` / ``train`` failed, naming a temporary
  ``session.onnx``. ``refuse_mixed_type_bindings`` refuses the model at build, naming the
  node, and says what works (the float32 export and ``--precision``).
- A module exported after ``.half()`` or ``.to(torch.bfloat16)`` has 16-bit parameters, and
  its step updates them in 16 bits, as ``torch.optim`` does such a module: no float32
  master weights, so an update under half a unit in the last place of its weight is lost;
  with AdamW on float16, ``eps`` (1e-8) is 0 in float16 and ``(1 - beta2) * g**2`` rounds
  to 0 for a gradient under about 1e-2, so such elements get ``m / 0``, infinite or NaN, at
  the first step (torch's ``AdamW`` on a ``.half()`` module does the same).
  ``warn_sixteen_bit_parameters`` says so and names the flag that keeps master weights.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

from onnx import TensorProto, defs, helper

from memcc.errors import InputError
from memcc.frontend.export_signature import ExportWarning
from memcc.graph import Graph, node_label

SIXTEEN_BIT = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


@functools.cache
def _input_type_params(op_type: str, opset: int) -> tuple[tuple[str, ...], bool] | None:
    """Each formal input's type parameter ('' where the input has a fixed type) and whether
    the last one is variadic; None for an op ONNX does not define at ``opset``."""
    try:
        schema = defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return None
    params = {c.type_param_str for c in schema.type_constraints}
    formal = schema.inputs
    names = tuple(f.type_str if f.type_str in params else "" for f in formal)
    variadic = bool(formal) and formal[-1].option == defs.OpSchema.FormalParameterOption.Variadic
    return names, variadic


def _mixed_binding(graph: Graph, node, opset: int) -> tuple[str, dict[int, list[str]]] | None:
    """The first type parameter ``node``'s inputs bind to two element types, with the
    inputs of each type; None where every parameter has one type (or the op is unknown)."""
    found = _input_type_params(node.op_type, opset)
    if found is None:
        return None
    names, variadic = found
    bound: dict[str, dict[int, list[str]]] = {}
    for i, value in enumerate(node.input):
        k = i if i < len(names) else (len(names) - 1 if variadic else -1)
        info = graph.info.get(value) if value else None
        if k < 0 or not names[k] or info is None:
            continue
        bound.setdefault(names[k], {}).setdefault(info.dtype, []).append(value)
    return next(((param, types) for param, types in bound.items() if len(types) > 1), None)


def refuse_mixed_type_bindings(graph: Graph, source: str) -> None:
    """Refuse a model one of whose ONNX ops is fed two element types where its schema asks
    for one: ONNX Runtime loads no such file, so no step built from it would run."""
    opset = graph.opset
    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        mixed = _mixed_binding(graph, node, opset)
        if mixed is None:
            continue
        param, types = mixed
        said = "; ".join(f"{helper.tensor_dtype_to_string(t).removeprefix('TensorProto.').lower()}"
                         f" ({', '.join(v)})" for t, v in types.items())
        hint = ("This is how torch.onnx.export writes a model exported under torch.autocast "
                "(a LayerNorm's 16-bit input beside its float32 weight): export the float32 "
                "model without autocast and build it with --precision bf16 (or fp16), "
                "memcc's own autocast, which keeps such ops in float32."
                if any(t in SIXTEEN_BIT for t in types) else
                "Re-export the model, or fix its types, so that ONNX Runtime loads it.")
        raise InputError(
            f"{source}: {node_label(node)} binds its type {param} to {len(types)} element "
            f"types, {said}, where ONNX's {node.op_type} takes one: ONNX Runtime refuses to "
            f"load such a file, so no step built from it could run. {hint}")


def warn_sixteen_bit_parameters(graph: Graph, params: Sequence[str], optimizer: str,
                                source: str) -> None:
    """Warn where trained parameters are 16-bit: their update is 16-bit too (see above)."""
    by_type: dict[int, list[str]] = {}
    for p in params:
        dtype = graph.info[p].dtype
        if dtype in SIXTEEN_BIT:
            by_type.setdefault(dtype, []).append(p)
    if not by_type:
        return
    listed = "; ".join(f"{len(v)} trained parameter(s) are {SIXTEEN_BIT[t]} (e.g. {v[0]})"
                       for t, v in by_type.items())
    nan = (" With --optimizer adamw, eps (1e-8) is 0 in float16 and the second moment of a "
           "gradient under about 1e-2 rounds to 0, so such elements (a dead ReLU's weights, "
           "an unused embedding row) get an infinite or NaN update at the first step, as "
           "torch's AdamW gives a .half() module."
           if optimizer == "adamw" and TensorProto.FLOAT16 in by_type else "")
    warnings.warn(
        f"{source}: {listed}: the step updates them and their optimizer "
        "state in 16 bits, as torch.optim updates a module after .half() or "
        ".to(torch.bfloat16): there are no float32 master weights, so an update smaller "
        f"than half a 16-bit unit of its weight is lost.{nan} To train in 16 bits with "
        "float32 master weights, export the float32 model and build it with --precision "
        "bf16 (or fp16).", ExportWarning, stacklevel=3)
