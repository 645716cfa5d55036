"""Emit new ONNX nodes into a ``Graph`` with the spelling its opset needs.

Gradient rules, losses and optimizers all add nodes; they go through one ``Emitter`` so that
names never collide, every new value gets its static ``TensorInfo`` where the caller knows
it, and opset differences (axes as attribute or input, Split sizes, ...) live in one place.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.graph import Graph, TensorInfo, unique_namer


class Emitter:
    """Appends nodes to ``graph.nodes`` (or to ``self.nodes`` when ``detached``)."""

    def __init__(self, graph: Graph, *, prefix: str = "", detached: bool = False,
                 taken: Iterable[str] | None = None) -> None:
        """``taken``: the names to avoid when the caller knows them (default: every value
        and node name of ``graph``, one walk of the graph per emitter)."""
        self.graph = graph
        self.prefix = prefix
        self.nodes: list[onnx.NodeProto] = [] if detached else graph.nodes
        if taken is None:
            taken = set(graph.values()) | {n.name for n in graph.nodes if n.name}
        self._fresh = unique_namer(taken)
        # Every node this emitter made since the caller last reset it (autodiff tags a
        # rule's nodes from here: a rule may move some of them, so positions would lie).
        self.created: list[onnx.NodeProto] = []
        self._consts: dict[tuple, str] = {}

    @property
    def opset(self) -> int:
        return self.graph.opset

    def fresh(self, base: str) -> str:
        return self._fresh(self.prefix + base)

    # ------------------------------------------------------------------ core
    def op(
        self,
        op_type: str,
        inputs: Sequence[str],
        *,
        outputs: Sequence[str] | int = 1,
        name: str | None = None,
        info: TensorInfo | Sequence[TensorInfo | None] | None = None,
        **attrs,
    ) -> str | list[str]:
        """Add one node; return its output name (or names when ``outputs`` is a list/int>1).
        Nodes are in the standard ONNX domain: gradient rules and rewrites emit nothing else."""
        if isinstance(outputs, int):
            out_names = [self.fresh(op_type.lower()) for _ in range(outputs)]
            single = outputs == 1
        else:
            out_names = [o if o else "" for o in outputs]
            single = len(out_names) == 1
        node_name = self.fresh(name or op_type)
        attrs = {k: v for k, v in attrs.items() if v is not None}
        node = helper.make_node(op_type, list(inputs), out_names, name=node_name, domain="",
                                **attrs)
        self.nodes.append(node)
        self.created.append(node)
        infos = [info] if isinstance(info, TensorInfo) or info is None else list(info)
        for o, ti in zip(out_names, infos, strict=False):
            if o and ti is not None:
                self.graph.info[o] = ti
        return out_names[0] if single else out_names

    def const(self, value, dtype: int | np.dtype | None = None, *, name: str = "const") -> str:
        """A Constant node holding a small tensor; identical constants are shared."""
        arr = np.asarray(value)
        if dtype is not None:
            np_dtype = (
                helper.tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int) else dtype
            )
            arr = arr.astype(np_dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key in self._consts:
            return self._consts[key]
        out = self.fresh(name)
        node = helper.make_node(
            "Constant", [], [out], name=self.fresh("Constant"),
            value=numpy_helper.from_array(arr, out),
        )
        self.nodes.append(node)
        self.created.append(node)
        self.graph.info[out] = TensorInfo(
            helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(int(d) for d in arr.shape)
        )
        self._consts[key] = out
        return out

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), name="ints")

    def scalar(self, value: float, dtype: int) -> str:
        return self.const(np.asarray(value), dtype, name="scalar")

    def info(self, name: str) -> TensorInfo:
        return self.graph.info[name]

    # ------------------------------------------------------------------ opset-aware helpers
    def _reduce(self, op: str, x: str, axes: Sequence[int] | None, keepdims: bool,
                info: TensorInfo | None, axes_as_input_since: int) -> str:
        if axes is not None and len(axes) == 0:
            return x  # nothing to reduce (ONNX would read empty axes as "all")
        ti = info or self._reduced_info(x, axes, keepdims)
        if axes is None:
            return self.op(op, [x], keepdims=int(keepdims), info=ti)
        if self.opset >= axes_as_input_since:
            return self.op(op, [x, self.ints(axes)], keepdims=int(keepdims), info=ti)
        return self.op(op, [x], axes=list(axes), keepdims=int(keepdims), info=ti)

    def _reduced_info(self, x: str, axes, keepdims: bool) -> TensorInfo | None:
        src = self.graph.info.get(x)
        if src is None:
            return None
        rank = len(src.shape)
        ax = set(range(rank)) if axes is None else {a % rank for a in axes}
        if keepdims:
            shape = tuple(1 if i in ax else d for i, d in enumerate(src.shape))
        else:
            shape = tuple(d for i, d in enumerate(src.shape) if i not in ax)
        return TensorInfo(src.dtype, shape)

    def reduce_sum(self, x: str, axes: Sequence[int] | None, keepdims: bool = True,
                   info: TensorInfo | None = None) -> str:
        return self._reduce("ReduceSum", x, axes, keepdims, info, 13)

    def reduce_mean(self, x: str, axes: Sequence[int] | None, keepdims: bool = True,
                    info: TensorInfo | None = None) -> str:
        return self._reduce("ReduceMean", x, axes, keepdims, info, 18)

    def reduce_sum_square(self, x: str, axes: Sequence[int] | None, keepdims: bool = True,
                          info: TensorInfo | None = None) -> str:
        return self._reduce("ReduceSumSquare", x, axes, keepdims, info, 18)

    def unsqueeze(self, x: str, axes: Sequence[int], info: TensorInfo | None = None) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints(axes)], info=info)
        return self.op("Unsqueeze", [x], axes=list(axes), info=info)

    def reshape(self, x: str, shape: Sequence[int]) -> str:
        src = self.graph.info[x]
        if tuple(src.shape) == tuple(shape):
            return x
        return self.op("Reshape", [x, self.ints(shape)], info=TensorInfo(src.dtype, tuple(shape)))

    def cast(self, x: str, dtype: int) -> str:
        src = self.graph.info[x]
        if src.dtype == dtype:
            return x
        return self.op("Cast", [x], to=dtype, info=TensorInfo(dtype, src.shape))

    def zeros_like(self, ref: str) -> str:
        ti = self.graph.info[ref]
        return self.zeros(ti.shape, ti.dtype)

    def zeros(self, shape: Sequence[int], dtype: int) -> str:
        value = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(dtype)), "v")
        return self.op("ConstantOfShape", [self.ints(shape)], value=value,
                       info=TensorInfo(dtype, tuple(shape)))

    def expand(self, x: str, shape: Sequence[int]) -> str:
        src = self.graph.info[x]
        if tuple(src.shape) == tuple(shape):
            return x
        return self.op("Expand", [x, self.ints(shape)], info=TensorInfo(src.dtype, tuple(shape)))

    def binary(self, op: str, a: str, b: str, info: TensorInfo | None = None) -> str:
        """Elementwise op with numpy broadcasting of the static shapes."""
        if info is None:
            ia, ib = self.graph.info[a], self.graph.info[b]
            info = TensorInfo(ia.dtype, tuple(np.broadcast_shapes(ia.shape, ib.shape)))
        return self.op(op, [a, b], info=info)

    def add(self, a: str, b: str) -> str:
        return self.binary("Add", a, b)

    def sub(self, a: str, b: str) -> str:
        return self.binary("Sub", a, b)

    def mul(self, a: str, b: str) -> str:
        return self.binary("Mul", a, b)

    def div(self, a: str, b: str) -> str:
        return self.binary("Div", a, b)

    def neg(self, x: str) -> str:
        return self.op("Neg", [x], info=self.graph.info[x])

    def unary(self, op: str, x: str, **attrs) -> str:
        return self.op(op, [x], info=self.graph.info[x], **attrs)

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        src = self.graph.info[x]
        if list(perm) == list(range(len(perm))):
            return x
        shape = tuple(src.shape[p] for p in perm)
        return self.op("Transpose", [x], perm=list(perm), info=TensorInfo(src.dtype, shape))

    def sum_to_shape(self, g: str, shape: Sequence[int]) -> str:
        """Undo numpy broadcasting: reduce ``g`` down to ``shape``."""
        gi = self.graph.info[g]
        shape = tuple(shape)
        if gi.shape == shape:
            return g
        lead = len(gi.shape) - len(shape)
        axes = list(range(lead))
        for i, d in enumerate(shape):
            if d == 1 and gi.shape[lead + i] != 1:
                axes.append(lead + i)
        out = g
        if axes:
            out = self.reduce_sum(g, axes, keepdims=True)
        return self.reshape(out, shape)

