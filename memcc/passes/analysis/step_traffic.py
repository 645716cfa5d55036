"""Step traffic: how many kernels one training step launches and how many bytes they move.

An analysis only (the graph is not changed). Issue 30 asks that a slow step be visible
without a profiler: ORT's profile of a ResNet-50 step showed 1,014 Mul nodes and 53
ReduceSumSquares taking most of the time, which a node count and a byte count per op type
show as well. The compile report (``baseline`` and ``plan``), ``memcc run --json`` and
``memcc analyze`` carry these numbers; they come from the graph alone, in one pass over its
nodes, so they cost nothing next to planning.

What is modelled (ORT runs memcc's steps with its graph optimizations off,
``backend/session.py``, so every node of the file is one kernel call):

- ``kernels``: every node except ``Constant``, which ORT turns into an initializer when it
  loads the graph (it never runs; ``passes.analysis.liveness.NOT_EXECUTED``). View ops (Reshape,
  Squeeze, Unsqueeze, Flatten, Identity) and Shape/Size are counted: ORT calls their kernels
  even where they copy nothing. Recompute clones and swap copies (MemcpyToHost /
  MemcpyFromHost) in a rewritten step are nodes, so a plan's count is its baseline's plus
  the nodes its lowering added. Not counted: the copies ORT inserts itself around nodes
  that fall back to another provider (CUDA), and the kernels inside one node (a Conv's
  im2col, a fused kernel's several launches): one node, one kernel.
- ``bytes_moved``: for every counted node, the bytes of each input slot it reads plus the
  bytes of each output it writes (``TensorInfo.nbytes``, as the liveness analysis sizes
  values). A value read by two slots of one node (``Mul(x, x)``) counts twice. It is the
  tensors' traffic, not the memory system's: caches, a kernel's scratch (Conv's column
  buffer) and re-reads inside a kernel (a MatMul's tiles) are not counted. Exceptions:
  - View ops move 0 bytes where ORT aliases their output to input 0 (its allocation
    planner reuses the input's buffer for kernels that declare an alias, and the kernel's
    copy is skipped when source and target are the same buffer: ``CopyCpuTensor`` in ORT's
    ``core/providers/cpu/tensor/utils.h`` copies only ``if (target != source)``; measured in
    ``tests/test_ort_facts.py``, ``reshape_alias``). Where the output is a graph output ORT
    gives it its own buffer and the kernel copies: input 0 read, output written (the
    liveness analysis's rule, ``passes.analysis.liveness.ALIAS_OPS``).
  - Shape and Size read only their input's shape, not its data: the output alone counts.
  - A value without a static type counts 0 bytes; ``unsized_values`` says how many such
    reads and writes there were (0 on every step memcc builds).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import onnx

from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.liveness import ALIAS_OPS, NOT_EXECUTED

SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})  # read their input's shape, not its data


@dataclass(frozen=True)
class OpTraffic:
    """Kernels and bytes moved by the nodes of one op type."""

    kernels: int
    bytes_moved: int

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "bytes_moved": self.bytes_moved}


@dataclass(frozen=True)
class StepTraffic:
    """Kernels one step launches and the bytes they read and write (module docstring)."""

    kernels: int
    bytes_moved: int
    # op type (``domain.op`` outside the default domain) -> its share, most bytes first
    by_op: Mapping[str, OpTraffic] = field(default_factory=dict)
    unsized_values: int = 0

    def to_json(self) -> dict:
        return {"kernels": self.kernels, "bytes_moved": self.bytes_moved,
                "by_op": {op: t.to_json() for op, t in self.by_op.items()},
                "unsized_values": self.unsized_values}


def op_key(node: onnx.NodeProto) -> str:
    """How ``by_op`` names a node's op: ``Mul``, or ``com.microsoft.FusedMatMul``."""
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def step_traffic(step: Graph | Iterable[onnx.NodeProto], *,
                 info: Mapping[str, TensorInfo] | None = None,
                 outputs: Iterable[str] = ()) -> StepTraffic:
    """Kernels and bytes moved of ``step``: a ``Graph`` (a step as built or a plan's
    rewritten step), or a node list with ``info`` (the value types) and ``outputs`` (the
    graph outputs, which view ops copy into instead of aliasing)."""
    if isinstance(step, Graph):
        nodes: Iterable[onnx.NodeProto] = step.nodes
        info = step.info if info is None else info
        graph_outputs = set(step.outputs) | set(outputs)
    else:
        nodes = step
        if info is None:
            raise TypeError("step_traffic of a node list needs info= (the value types)")
        graph_outputs = set(outputs)
    kernels = 0
    moved = 0
    unsized = 0
    per_op: dict[str, list[int]] = {}

    def size(name: str) -> int:
        nonlocal unsized
        ti = info.get(name)
        if ti is None:
            unsized += 1
            return 0
        return ti.nbytes

    for node in nodes:
        if node.op_type in NOT_EXECUTED:
            continue
        op = node.op_type
        if op in ALIAS_OPS and node.input and node.input[0] and not any(
                o in graph_outputs for o in node.output if o):
            nbytes = 0  # output 0 is input 0's buffer: nothing is read or written
        elif op in ALIAS_OPS:
            # A copy into a fresh buffer (a graph output): the data in, the data out (a
            # Reshape's shape operand is not data).
            nbytes = (size(node.input[0]) if node.input and node.input[0] else 0) + sum(
                size(o) for o in node.output if o)
        else:
            reads = () if op in SHAPE_ONLY_OPS else node.input
            nbytes = sum(size(i) for i in reads if i) + sum(size(o) for o in node.output if o)
        kernels += 1
        moved += nbytes
        acc = per_op.setdefault(op_key(node), [0, 0])
        acc[0] += 1
        acc[1] += nbytes
    by_op = {op: OpTraffic(k, b) for op, (k, b) in
             sorted(per_op.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))}
    return StepTraffic(kernels=kernels, bytes_moved=moved, by_op=by_op, unsized_values=unsized)
