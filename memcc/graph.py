"""The graph structure every part of memcc shares.

A thin, mutable view over an ONNX graph with everything static resolved: every value has a
concrete dtype and shape (``TensorInfo``), initializers are numpy arrays, and nodes stay
``onnx.NodeProto`` so that attributes round-trip untouched. Passes read and write this one
structure; ``to_model`` turns it back into a ``ModelProto`` with nodes in list order, which is
the order the execution contract asks ORT to keep.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)

# Highest IR version the ORT packages memcc targets accept; newer onnx writes newer ones.
MAX_IR_VERSION = 10


@dataclass(frozen=True)
class TensorInfo:
    """Static type of one value: ONNX element type and a fully concrete shape."""

    dtype: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def itemsize(self) -> int:
        if self.dtype == TensorProto.STRING:
            return 8
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(self.dtype)).itemsize)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_TYPES

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(helper.tensor_dtype_to_np_dtype(self.dtype))


@dataclass
class Graph:
    """A training or forward graph with static shapes, in execution order."""

    nodes: list[onnx.NodeProto]
    inputs: list[str]
    outputs: list[str]
    initializers: dict[str, np.ndarray]
    info: dict[str, TensorInfo]
    opsets: dict[str, int] = field(default_factory=lambda: {"": 17})
    metadata: dict[str, str] = field(default_factory=dict)
    name: str = "memcc"

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> Graph:
        """Read a model whose value shapes are already inferred (see frontend.load)."""
        g = model.graph
        inits = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        info: dict[str, TensorInfo] = {}
        for vi in itertools.chain(g.input, g.value_info, g.output):
            ti = _tensor_info(vi)
            if ti is not None:
                info[vi.name] = ti
        for name, arr in inits.items():
            info[name] = TensorInfo(
                helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(int(d) for d in arr.shape)
            )
        opsets = {o.domain if o.domain != "ai.onnx" else "": o.version for o in model.opset_import}
        return cls(
            nodes=list(g.node),
            inputs=[i.name for i in g.input if i.name not in inits]
            + [i.name for i in g.input if i.name in inits],
            outputs=[o.name for o in g.output],
            initializers=inits,
            info=info,
            opsets=opsets,
            metadata={p.key: p.value for p in model.metadata_props},
            name=g.name or "memcc",
        )

    def to_model(self, *, with_value_info: bool = True) -> onnx.ModelProto:
        """Write a ModelProto whose node list is exactly ``self.nodes``, in order."""
        inputs = [self._value_info(n) for n in self.inputs]
        outputs = [self._value_info(n) for n in self.outputs]
        io = set(self.inputs) | set(self.outputs)
        value_info = []
        if with_value_info:
            for node in self.nodes:
                for o in node.output:
                    if o and o not in io and o in self.info:
                        value_info.append(self._value_info(o))
        inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in self.initializers.items()]
        graph = helper.make_graph(
            self.nodes, self.name, inputs, outputs, inits, value_info=value_info
        )
        opset_imports = [helper.make_opsetid(d, v) for d, v in sorted(self.opsets.items())]
        model = helper.make_model(graph, opset_imports=opset_imports, producer_name="memcc")
        model.ir_version = min(MAX_IR_VERSION, model.ir_version)
        for k, v in sorted(self.metadata.items()):
            model.metadata_props.add(key=k, value=v)
        return model

    def _value_info(self, name: str) -> onnx.ValueInfoProto:
        ti = self.info.get(name)
        if ti is None:
            return helper.make_empty_tensor_value_info(name)
        return helper.make_tensor_value_info(name, ti.dtype, list(ti.shape))

    # ------------------------------------------------------------------ queries
    @property
    def opset(self) -> int:
        """Version of the default ONNX domain, which decides how ops are spelled."""
        return self.opsets.get("", self.opsets.get("ai.onnx", 17))

    def producers(self) -> dict[str, onnx.NodeProto]:
        return {o: n for n in self.nodes for o in n.output if o}

    def consumers(self) -> dict[str, list[onnx.NodeProto]]:
        out: dict[str, list[onnx.NodeProto]] = {}
        for n in self.nodes:
            for i in n.input:
                if i:
                    out.setdefault(i, []).append(n)
        return out

    def values(self) -> Iterable[str]:
        """Every value name: graph inputs, initializers, node outputs."""
        seen: set[str] = set()
        for name in itertools.chain(self.inputs, self.initializers, (
            o for n in self.nodes for o in n.output if o
        )):
            if name not in seen:
                seen.add(name)
                yield name

    def copy(self) -> Graph:
        nodes = []
        for n in self.nodes:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            nodes.append(c)
        return Graph(
            nodes=nodes,
            inputs=list(self.inputs),
            outputs=list(self.outputs),
            initializers=dict(self.initializers),
            info=dict(self.info),
            opsets=dict(self.opsets),
            metadata=dict(self.metadata),
            name=self.name,
        )


def _tensor_info(vi: onnx.ValueInfoProto) -> TensorInfo | None:
    t = vi.type
    if not t.HasField("tensor_type"):
        return None
    tt = t.tensor_type
    if tt.elem_type == 0 or not tt.HasField("shape"):
        return None
    dims: list[int] = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value") or d.dim_value < 0:
            return None
        dims.append(int(d.dim_value))
    return TensorInfo(int(tt.elem_type), tuple(dims))


def unique_namer(taken: Iterable[str]):
    """Return ``fresh(base) -> str`` giving names that collide with nothing seen so far."""
    used = set(taken)
    counters: dict[str, int] = {}

    def fresh(base: str) -> str:
        if base not in used:
            used.add(base)
            return base
        k = counters.get(base, 0)
        while True:
            k += 1
            cand = f"{base}_{k}"
            if cand not in used:
                counters[base] = k
                used.add(cand)
                return cand

    return fresh


def node_label(node: onnx.NodeProto) -> str:
    """How errors name a node: its name when it has one, else its op and first output."""
    name = node.name or (node.output[0] if node.output else "?")
    return f"{node.op_type} node '{name}'"


def attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default

