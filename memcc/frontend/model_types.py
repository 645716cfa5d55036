"""What a forward model's element types let its step do, said before anything is built.

Two things a user who already trains in 16 bits runs into, neither of them memcc's making:

- A model exported under ``torch.autocast`` (``torch.onnx.export`` inside ``with
  torch.autocast("cpu", dtype=torch.bfloat16)``, either exporter, torch 2.13-2.15) writes
  a LayerNormalization whose input is bfloat16 and whose weight is float32: torch's
  ``layer_norm`` takes that, ONNX's one type ``T`` does not, and ONNX Runtime refuses to
  load the file. ONNX's shape inference, run by the loader in its lenient mode, passes it,
  so the step was built and only ``memcc run`` / ``train`` failed, naming a temporary
  ``session.onnx``. ``refuse_unloadable_types`` refuses the model at build, naming the
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
from dataclasses import dataclass

from onnx import TensorProto, defs, helper

from memcc.errors import InputError
from memcc.frontend.emit import Emitter
from memcc.frontend.export_signature import ExportNote, ExportWarning
from memcc.graph import Graph, TensorInfo, node_label

SIXTEEN_BIT = {TensorProto.FLOAT16: "float16", TensorProto.BFLOAT16: "bfloat16"}


@dataclass(frozen=True)
class _Inputs:
    """Of one op's schema: each formal input's type parameter ('' where the input has a
    fixed type), whether the last is variadic, and the element types each parameter takes."""

    params: tuple[str, ...]
    variadic: bool
    allowed: dict[str, frozenset[str]]


@functools.cache
def _schema_inputs(op_type: str, opset: int) -> _Inputs | None:
    """None for an op ONNX does not define at ``opset``."""
    try:
        schema = defs.get_schema(op_type, opset, "")
    except defs.SchemaError:
        return None
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs)
               for c in schema.type_constraints}
    formal = schema.inputs
    variadic = bool(formal) and formal[-1].option == defs.OpSchema.FormalParameterOption.Variadic
    return _Inputs(tuple(f.type_str if f.type_str in allowed else "" for f in formal),
                   variadic, allowed)


def _type_name(dtype: int) -> str:
    """ONNX's name of an element type as its schemas write it: 'bfloat16' of tensor(bfloat16)."""
    return TensorProto.DataType.Name(dtype).lower()


def _binding_problem(graph: Graph, node, opset: int, taken: bool
                     ) -> tuple[str, dict[int, list[str]]] | None:
    """A type parameter of ``node`` that its inputs bind to two element types, or (with
    ``taken``) to one the op does not take at ``opset``, with the inputs of each type; None
    where there is none (or the op, or its inputs' types, are unknown)."""
    schema = _schema_inputs(node.op_type, opset)
    if schema is None:
        return None
    names = schema.params
    bound: dict[str, dict[int, list[str]]] = {}
    for i, value in enumerate(node.input):
        k = i if i < len(names) else (len(names) - 1 if schema.variadic else -1)
        info = graph.info.get(value) if value else None
        if k < 0 or not names[k] or info is None:
            continue
        bound.setdefault(names[k], {}).setdefault(info.dtype, []).append(value)
    for param, types in bound.items():
        if len(types) > 1 or (taken and f"tensor({_type_name(next(iter(types)))})" not in
                              schema.allowed[param]):
            return param, types
    return None


def refuse_unloadable_types(graph: Graph, source: str, *, taken: bool = True) -> None:
    """Refuse a model one of whose ONNX ops is fed two element types where its schema asks
    for one, or (``taken``) a type the op does not take at the model's opset (the exporters
    write a bfloat16 Conv under autocast, which Conv takes from opset 22): ONNX Runtime
    loads no such file. The builder asks only the first: a step computes the ops its
    provider has no 16-bit kernel for in float32 (``passes/providers/sixteen_bit.py``), a
    bfloat16 Conv among them; the loader asks both where its run of the model failed."""
    opset = graph.opset
    for node in graph.nodes:
        if node.domain not in ("", "ai.onnx"):
            continue
        problem = _binding_problem(graph, node, opset, taken)
        if problem is None:
            continue
        param, types = problem
        said = "; ".join(f"{_type_name(t)} ({', '.join(v)})" for t, v in types.items())
        if len(types) > 1:
            what = (f"binds its type {param} to {len(types)} element types, {said}, where "
                    f"ONNX's {node.op_type} takes one")
        else:
            takes = sorted(t.removeprefix("tensor(").removesuffix(")")
                           for t in _schema_inputs(node.op_type, opset).allowed[param])
            what = (f"is fed {said}, which ONNX's {node.op_type} does not take at opset "
                    f"{opset} (its {param}: {', '.join(takes)})")
        hint = ("This is how torch.onnx.export writes some models exported under "
                "torch.autocast: export the float32 model without autocast and build it "
                "with --precision bf16 (or fp16), memcc's own autocast."
                if any(t in SIXTEEN_BIT for t in types) else
                "Re-export the model, or fix its types, so that ONNX Runtime loads it.")
        raise InputError(
            f"{source}: {node_label(node)} {what}: ONNX Runtime refuses to load such a file, "
            f"so no step built from it could run. {hint}")


def refuse_unrunnable_sixteen_bit(graph: Graph, failed: str, source: str) -> None:
    """Where the loader had to run a model to learn the shapes ONNX's inference left unknown
    and ONNX Runtime's CPU provider has no kernel for one of its 16-bit ops (a bfloat16
    Gemm of transformers GPT-2 exported under ``torch.autocast``), say that, not that the
    sizes may be wrong: the float32 export with ``--precision`` is what works."""
    if "Could not find an implementation" not in failed or not any(
            info.dtype in SIXTEEN_BIT for info in graph.info.values()):
        return
    raise InputError(
        f"{source}: ONNX shape inference left some values' shapes unknown, and memcc could "
        "not run the model to read them: ONNX Runtime's CPU provider has no 16-bit kernel "
        f"for one of its ops ({failed.strip()[:200]}). A model exported in 16 bits or under "
        "torch.autocast: export the float32 model and build it with --precision bf16 (or "
        "fp16), memcc's own autocast, whose steps compute such ops in float32.")


def sixteen_bit_already(graph: Graph) -> str:
    """What to add where ``--precision`` finds nothing to cast because the model's weights
    are 16-bit already (a module exported after ``.half()`` or ``.to(torch.bfloat16)``)."""
    kinds = sorted({SIXTEEN_BIT[graph.info[n].dtype] for n in graph.initializers
                    if n in graph.info and graph.info[n].dtype in SIXTEEN_BIT})
    if not kinds:
        return ""
    return (f". Its weights are {' and '.join(kinds)} already, as a module exported after "
            ".half() or .to(torch.bfloat16) has them: export the float32 module and build "
            "that with --precision, which keeps float32 master weights")


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


def widen_mixed_sixteen_bit(graph: Graph, source: str) -> int:
    """Compute in float32 every node whose inputs bind one type parameter to a 16-bit type
    and to float32, as torch's mixed-type kernels do: the 16-bit inputs of that parameter
    are cast up, and each output the file types 16-bit is cast back down. The number of
    nodes rewritten, noted.

    The exporters write such nodes under ``torch.autocast``: ``layer_norm`` of a bfloat16
    activation by float32 weights, which torch computes in float32 and returns in bfloat16,
    exported as one LayerNormalization that ONNX's single ``T`` forbids. Rewritten so, the
    file's types are ONNX's and the step's arithmetic is torch's (``tests/test_model_types.py``
    holds 3 SGD steps to torch's under autocast)."""
    emit: Emitter | None = None  # made at the first such node (it reads every name)
    nodes, rewritten = [], []
    for node in graph.nodes:
        problem = (_binding_problem(graph, node, graph.opset, False)
                   if node.domain in ("", "ai.onnx") else None)
        if problem is None or set(problem[1]) - set(SIXTEEN_BIT) != {TensorProto.FLOAT}:
            nodes.append(node)
            continue
        emit = emit or Emitter(graph, detached=True)
        for t, values in problem[1].items():
            for v in values if t in SIXTEEN_BIT else ():
                wide = emit.cast(v, TensorProto.FLOAT)
                node.input[:] = [wide if x == v else x for x in node.input]
        nodes.extend(emit.nodes)
        emit.nodes.clear()
        nodes.append(node)
        for k, y in enumerate(node.output):
            info = graph.info.get(y) if y else None
            if info is not None and info.dtype in SIXTEEN_BIT:
                node.output[k] = wide = emit.fresh(f"{y}.f32")
                graph.info[wide] = TensorInfo(TensorProto.FLOAT, info.shape)
                nodes.append(helper.make_node("Cast", [wide], [y], to=info.dtype,
                                              name=emit.fresh("Cast")))
        rewritten.append(node_label(node))
    if rewritten:
        graph.set_nodes(nodes)
        warnings.warn(
            f"{source}: {len(rewritten)} node(s) read a 16-bit input beside float32 ones, "
            f"which ONNX forbids and torch's autocast writes ({', '.join(rewritten[:3])}"
            f"{', ...' if len(rewritten) > 3 else ''}): each now computes in float32 and "
            "returns its 16-bit output, as torch's kernel does", ExportNote, stacklevel=3)
    return len(rewritten)
