"""The graph structure every part of memcc shares.

A thin, mutable view over an ONNX graph with everything static resolved: every value has a
concrete dtype and shape (``TensorInfo``), initializers are numpy arrays, and nodes stay
``onnx.NodeProto`` so that attributes round-trip untouched. Passes read and write this one
structure; ``to_model`` turns it back into a ``ModelProto`` with nodes in list order, which is
the order the execution contract asks ORT to keep.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memcc.def_use import DefUse

FLOAT_TYPES = frozenset(
    {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
)
# The 16-bit float types a ``--precision bf16|fp16`` step computes in (frontend/autocast.py).
SIXTEEN_BIT_TYPES = frozenset({TensorProto.BFLOAT16, TensorProto.FLOAT16})

# Highest IR version the ORT packages memcc targets accept; newer onnx writes newer ones.
MAX_IR_VERSION = 10


@functools.cache
def _itemsize(dtype: int) -> int:
    if dtype == TensorProto.STRING:
        return 8
    return int(np.dtype(helper.tensor_dtype_to_np_dtype(dtype)).itemsize)


@dataclass(frozen=True)
class TensorInfo:
    """Static type of one value: ONNX element type and a fully concrete shape."""

    dtype: int
    shape: tuple[int, ...]

    # Cached: the simulator asks for every value's size on every plan it judges, and
    # computing it through numpy dominated a 5,000-node compile's liveness walks.
    @functools.cached_property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def itemsize(self) -> int:
        return _itemsize(self.dtype)

    @functools.cached_property
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
    _def_use: DefUse | None = field(default=None, init=False, repr=False, compare=False)
    # ``copy(share_nodes=True)``: the graph whose node objects this one holds, and a cache
    # slot for what an analysis reads of each node once per graph (passes/analysis/node_table).
    shares: Graph | None = field(default=None, init=False, repr=False, compare=False)
    _rows: object = field(default=None, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_model(cls, model: onnx.ModelProto,
                   weights: Mapping[str, np.ndarray] | None = None) -> Graph:
        """Read a model whose value shapes are already inferred (see frontend.load).
        ``weights``: the values of initializers the model holds as stubs, by name
        (``frontend/weights_apart.py``)."""
        g = model.graph
        weights = weights or {}
        inits = {t.name: weights[t.name] if t.name in weights and not t.HasField("raw_data")
                 else numpy_helper.to_array(t) for t in g.initializer}
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

    def def_use(self) -> DefUse:
        """The def-use index of ``self.nodes``, built on first use and then kept.

        Passes that edit the graph keep it correct through ``DefUse``'s edit methods or
        ``set_nodes``; replacing or resizing ``self.nodes`` directly makes the next call
        rebuild it. Code that edits nodes in place without telling the index (the frontend
        while it emits) uses ``producers()`` / ``consumers()``, which always rebuild.
        """
        du = self._def_use
        if du is None or not du.tracks(self.nodes):
            du = self._def_use = DefUse.build(self.nodes)
        return du

    def set_nodes(self, nodes: list[onnx.NodeProto], index: DefUse | None = None) -> None:
        """Replace the node list; ``index`` is its def-use index when the caller kept one."""
        self.nodes = nodes
        self._def_use = index if index is not None and index.tracks(nodes) else None

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

    def copy(self, *, with_index: bool = True, share_nodes: bool = False) -> Graph:
        """A deep copy of the nodes; the def-use index comes along (remapped, cheaper than
        a rebuild) when this graph has a current one and ``with_index``.

        ``share_nodes``: the same node objects instead (a simulation's lowering copied
        every node of the step for each plan judged, and edits few): the caller must not
        edit a node in place before ``DefUse.own`` gave it one of its own."""
        nodes = list(self.nodes)
        for k, n in enumerate(() if share_nodes else self.nodes):
            nodes[k] = c = onnx.NodeProto()
            c.CopyFrom(n)
        g = Graph(nodes, list(self.inputs), list(self.outputs), dict(self.initializers),
                  dict(self.info), dict(self.opsets), dict(self.metadata), self.name)
        if share_nodes:
            g.shares = self.shares or self
        du = self._def_use
        if with_index and du is not None and du.tracks(self.nodes):
            g._def_use = du.remapped(self.nodes, nodes)
        return g


def ancestors(values: Iterable[str], producer: Mapping[str, onnx.NodeProto],
              inputs_of: Callable[[onnx.NodeProto], Iterable[str]] = lambda n: n.input,
              ) -> tuple[list[onnx.NodeProto], set[str]]:
    """The producers ``values`` depend on (each once, in the order reached) and every value
    reached, ``values`` included. ``inputs_of`` says which inputs of a producer to follow
    (all by default; a caller restricts it to differentiable paths, say)."""
    nodes: list[onnx.NodeProto] = []
    taken: set[int] = set()
    seen: set[str] = set()
    stack = [v for v in values if v]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        node = producer.get(v)
        if node is None or id(node) in taken:
            continue
        taken.add(id(node))
        nodes.append(node)
        stack.extend(i for i in inputs_of(node) if i)
    return nodes, seen


def behind(value: str, producer: Mapping[str, onnx.NodeProto],
           passes: Callable[[onnx.NodeProto], bool]) -> tuple[str, list[onnx.NodeProto]]:
    """``value`` followed back through its producers while ``passes`` accepts them (each
    read through its first input: Casts, a scaling by a constant): the value the chain
    starts from, and the nodes passed, nearest first. Where a rewrite wrapped a value
    (a 16-bit provider's Casts, the running variance's correction, a recompute's copy),
    the passes that must find the value itself look through the wrapping with this."""
    passed: list[onnx.NodeProto] = []
    node = producer.get(value)
    while node is not None and node.input and passes(node):
        passed.append(node)
        value = node.input[0]
        node = producer.get(value)
    return value, passed


def in_dependency_order(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in their order, except that a node reading a value another of them makes
    later waits until it is made, then comes first (Kahn's algorithm, the earliest ready
    node first). Values no node makes (inputs, initializers) are ready from the start. A
    cycle leaves ``nodes`` as they are (``topological_problems`` says why)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    waits = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in dict.fromkeys(n.input):
            j = producer.get(x) if x else None
            if j is not None and j != i:
                waits[i] += 1
                readers.setdefault(j, []).append(i)
    ready = [i for i, w in enumerate(waits) if w == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for r in readers.get(i, ()):
            waits[r] -= 1
            if waits[r] == 0:
                heapq.heappush(ready, r)
    return order if len(order) == len(nodes) else list(nodes)


def topological_problems(graph: Graph) -> list[str]:
    """Why ``graph.nodes`` is not a valid execution order (empty: it is).

    Every node input must be a graph input, an initializer, or an output of an earlier
    node; no value may be produced twice. The lowering passes ``ensure`` this.
    """
    ready = set(graph.inputs) | set(graph.initializers)
    problems: list[str] = []
    for n in graph.nodes:
        for i in n.input:
            if i and i not in ready:
                problems.append(f"{node_label(n)} reads '{i}' before it is produced")
        for o in n.output:
            if o:
                if o in ready:
                    problems.append(f"{node_label(n)} produces '{o}' a second time")
                ready.add(o)
    missing = [o for o in graph.outputs if o not in ready]
    if missing:
        problems.append(f"graph outputs {missing} are never produced")
    return problems


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


def text_attr(node: onnx.NodeProto, name: str, default: str) -> str:
    """A string attribute as ``str`` (onnx hands them back as ``bytes``)."""
    value = attr(node, name, default)
    return value.decode() if isinstance(value, bytes) else str(value)

