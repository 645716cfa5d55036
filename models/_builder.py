"""A small graph builder shared by the model zoo: onnx.helper + numpy, no torch, no downloads.

Every family writes its forward graph through ``GraphBuilder`` so that the conventions the rest
of memcc relies on hold everywhere:

- parameters are float32 initializers with torch/HF-like names (``layer1.0.conv1.weight``),
  because memcc treats every floating initializer on a path to the loss as trainable and
  reports per-parameter results under those names;
- every non-trainable constant (shapes, axes, scalars such as ``sqrt(d)``, masks) is a
  ``Constant`` node, never an initializer, so it is not mistaken for a parameter;
- BatchNormalization running statistics are the only non-trainable float initializers;
- weights come from one seeded generator in creation order, so a model is reproducible.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
# ORT wheels memcc targets read IR <= 10; opset 17 needs IR >= 8.
IR_VERSION = 8

Shape = Sequence[int | str]
# Own namespace inside memcc's metadata keys (memcc build writes memcc.kind, memcc.loss, ...).
META_PREFIX = "memcc.zoo."


class GraphBuilder:
    """Accumulates nodes, parameters and constants of one forward graph."""

    def __init__(self, name: str, seed: int = 0) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        # Initializers are written straight into the result: copying a multi-GB graph through
        # helper.make_graph/make_model would take seconds per copy.
        self._model = onnx.ModelProto()
        self.initializers = self._model.graph.initializer
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._names: set[str] = set()
        self._const_cache: dict[tuple, str] = {}

    # ------------------------------------------------------------------ naming
    def fresh(self, base: str) -> str:
        """A value name not used yet; readable names are kept when they are free."""
        name, k = base, 1
        while name in self._names:
            name = f"{base}_{k}"
            k += 1
        self._names.add(name)
        return name

    # ------------------------------------------------------------------ graph I/O
    def input(self, name: str, elem_type: int, shape: Shape) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    def output(self, value: str, name: str, elem_type: int, shape: Shape) -> str:
        """Expose ``value`` as graph output ``name``: its producer's output is renamed when
        nothing else reads it (no extra Identity node to plan around), else via Identity."""
        if value != name:
            self._names.add(name)
            producer = next((n for n in self.nodes if value in n.output), None)
            consumed = any(value in n.input for n in self.nodes)
            if producer is not None and not consumed:
                outs = [name if o == value else o for o in producer.output]
                del producer.output[:]
                producer.output.extend(outs)
            else:
                self.nodes.append(helper.make_node("Identity", [value], [name], name=name))
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, list(shape)))
        return name

    # ------------------------------------------------------------------ nodes
    def op(self, op_type: str, inputs: Sequence[str], name: str | None = None,
           outputs: int | Sequence[str] = 1, **attrs) -> str:
        """Add one node; returns its (first) output name. Use ``op_multi`` for several."""
        return self.op_multi(op_type, inputs, name, outputs, **attrs)[0]

    def op_multi(self, op_type: str, inputs: Sequence[str], name: str | None = None,
                 outputs: int | Sequence[str] = 1, **attrs) -> list[str]:
        base = name or op_type.lower()
        if isinstance(outputs, int):
            first = self.fresh(base)
            outs = [first] + [self.fresh(f"{first}.out{i}") for i in range(1, outputs)]
        else:
            outs = [self.fresh(o) for o in outputs]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=outs[0], **attrs))
        return outs

    def const(self, value, dtype: np.dtype | type | None = None, name: str | None = None) -> str:
        """A Constant node (one per distinct value), so constants never look like parameters.

        ``name`` is a hint for the first node holding that value."""
        arr = np.asarray(value, dtype=dtype)
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key in self._const_cache:
            return self._const_cache[key]
        out = self.fresh(name or "const")
        tensor = numpy_helper.from_array(arr, out)
        self.nodes.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
        self._const_cache.setdefault(key, out)
        return out

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64))

    def scalar(self, value: float) -> str:
        return self.const(np.float32(value))

    # ------------------------------------------------------------------ parameters
    def param(self, name: str, array: np.ndarray) -> str:
        if name in self._names:
            raise ValueError(f"parameter name {name!r} used twice")
        self._names.add(name)
        arr = np.ascontiguousarray(array, dtype=np.float32)
        tensor = self.initializers.add()
        tensor.name = name
        tensor.data_type = TensorProto.FLOAT
        tensor.dims.extend(arr.shape)
        tensor.raw_data = arr.tobytes()
        return name

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        data = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        data *= np.float32(std)
        return self.param(name, data)

    def he(self, name: str, shape: Sequence[int], fan_in: int) -> str:
        """He/Kaiming normal: keeps activation variance through ReLU layers."""
        return self.normal(name, shape, math.sqrt(2.0 / max(fan_in, 1)))

    def zeros(self, name: str, shape: Sequence[int]) -> str:
        return self.param(name, np.zeros(tuple(shape), np.float32))

    def ones(self, name: str, shape: Sequence[int]) -> str:
        return self.param(name, np.ones(tuple(shape), np.float32))

    # ------------------------------------------------------------------ result
    def model(self, doc: str = "", metadata: dict[str, object] | None = None) -> onnx.ModelProto:
        """Finish the model (call once: the builder hands over its ModelProto)."""
        model = self._model
        graph = model.graph
        graph.name = self.name
        graph.doc_string = doc
        graph.node.extend(self.nodes)
        graph.input.extend(self.inputs)
        graph.output.extend(self.outputs)
        model.opset_import.append(helper.make_opsetid("", OPSET))
        model.producer_name = "memcc.models"
        model.ir_version = IR_VERSION
        for key, value in (metadata or {}).items():
            text = value if isinstance(value, str) else json.dumps(value)
            model.metadata_props.add(key=key, value=text)
        return model


def batch_dim(batch: int, dynamic_batch: bool) -> int | str:
    """The batch dimension as declared on graph inputs/outputs (symbolic: bind with --dim)."""
    return "batch" if dynamic_batch else int(batch)


def float_input(b: GraphBuilder, shape: Shape, name: str = "input") -> str:
    return b.input(name, TensorProto.FLOAT, shape)


def logits_output(b: GraphBuilder, value: str, shape: Shape) -> str:
    return b.output(value, "logits", TensorProto.FLOAT, shape)


def metadata(family: str, options: dict[str, object], **extra: object) -> dict[str, object]:
    """Metadata stamped on every zoo model: what it is and how to make inputs for it."""
    meta: dict[str, object] = {"family": family, "options": options, **extra}
    return {f"{META_PREFIX}{k}": v for k, v in meta.items()}
