"""Liveness analysis: which buffers ORT holds at every node of a step, and the peak.

An analysis only (the graph is not changed). It predicts what the measured peak counts
(``backend/memory.py``) under the execution contract (``backend/session.py``), following
ORT's allocation planner (``core/framework/allocation_planner.cc``) and measurements on the
CPU execution provider of onnxruntime 1.31.1 (``tests/test_ort_facts.py`` pins each rule):

- Graph inputs, initializers and Constant-node outputs exist before the first node and for
  the whole step. ORT turns Constant nodes into initializers when it loads a graph; they
  never run. (The runner feeds initializers and constants as inputs, see
  ``backend/runner.py``, which changes nothing here.)
- A node's outputs are allocated while it runs; its inputs are freed after it, when it was
  the last consumer (in execution order) of every value sharing their buffer. So while node
  ``i`` runs, the live bytes are those live after node ``i-1``, plus its new outputs, plus
  its scratch.
- Graph outputs get their own buffer and are never freed during the step. A node output
  that no node consumes and that is not a graph output is never freed either. An update
  output bound to the buffer of the input it replaces (``in_place``) allocates nothing.
- Aliasing: Reshape, Squeeze, Unsqueeze, Flatten and Identity return their input's buffer
  (no allocation); the buffer lives until the last consumer of any alias. Not when the
  output is a graph output: then it is a fresh buffer.
- In place: Relu-like activations, Sigmoid, Tanh, Softmax, LogSoftmax, Clip, Cast and
  ScatterElements write into input 0 when this node is the only remaining use of that
  buffer, the buffer belongs to a node output (not an input, initializer or graph output),
  shapes are equal and the element sizes are equal.
- Planner buffer reuse between unrelated values is off (``enable_mem_reuse = False``), so
  freed memory is simply returned.
- Kernel scratch, allocated and freed inside one kernel, that measurably matters: Where
  builds both broadcast selections before merging them; Sum/Max/Min/Mean over more than two
  inputs keep one accumulator; Dropout makes its mask even when the mask is not an output;
  Softmax/LogSoftmax (opset >= 13) on a non-last axis transpose in and out; ConvTranspose
  expands one image into a column buffer; ScatterElements copies its indices into an int64
  vector (8 bytes per index, whatever their type). Conv's MLAS working buffer is left out
  here: a 64 KiB block per thread, or the whole im2col when a Conv has more filters than
  output positions (every weight gradient memcc writes as a Conv), but freed at once and,
  on the model zoo, never at the peak (measured/predicted 0.9997-1.0021,
  docs/MEMORY_TRUTH.md). With an arena it matters, because the region it took stays
  reserved: ``scratch_buffers`` adds it when given the CPU threads, which ``passes.analysis.arena``
  does for ``memcc run --arena``.
  Scratch of other kernels (Einsum's operand copies, pooling, thread-local MLAS buffers) is
  not modeled.

Bytes are ``TensorInfo.nbytes``; the allocator's page rounding (under 4 KiB per buffer) is
ignored. The default order is the file's; ORT runs a file in that order except that it hoists
ready Shape/Size nodes (``backend.profile_order.ort_priority_order`` gives the executed
order, and ``memcc run`` reports any difference).

Enters: a graph (with its ``TensorInfo``), an order, the updates written in place. Leaves: a
``LivenessReport``. Kernel scratch sizes come from ``kernel_scratch``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnx

from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.kernel_scratch import (  # noqa: F401 (re-exported)
    SCRATCH_OPS,
    VARIADIC_OPS,
    scratch_buffers,
    scratch_bytes,
)
from memcc.passes.analysis.node_table import NodeTable, resolve_order, rows_of
from memcc.step import TrainingStep, is_forward_tagged

HOST_COPY_OP = "MemcpyToHost"  # its output lives in host memory on a device provider

# How the CPU measurement allocates (backend/memory.py): every buffer of at least this many
# bytes is its own mmap of size + 16 header bytes, rounded up to whole pages.
CPU_MMAP_THRESHOLD = 4096
PAGE_BYTES = 4096
MMAP_HEADER_BYTES = 16


def allocation_bytes(nbytes: int) -> int:
    """Bytes a tensor of ``nbytes`` really occupies: small ones come from the heap as is,
    large ones are whole pages (up to 4 KiB more each; hundreds of buffers make megabytes)."""
    if nbytes < CPU_MMAP_THRESHOLD:
        return nbytes
    return -(-(nbytes + MMAP_HEADER_BYTES) // PAGE_BYTES) * PAGE_BYTES


# What glibc's heap costs a step beyond the bytes of its small buffers, under the CPU
# measurement: every buffer under CPU_MMAP_THRESHOLD, and the bookkeeping ORT allocates for
# each value, share one heap that fragments within a step and from one step to the next.
# It depends on the order in which ORT's threads allocate, not on which values are live, so
# it is not part of the predicted peak; plans keep room for it in the safety margin
# (``heap_allowance_bytes``). Measured on the min plans of 20 torchvision and timm models,
# both exporters, the worst of four steps: 162-1,664 bytes per small buffer beyond the
# prediction (26-940 run in place), above 1 KiB only where the base slack or the margin
# covers it (BENCHMARKS.md, "Heap allowance for small buffers").
HEAP_BYTES_PER_SMALL_BUFFER = 1024


def small_buffers(graph: Graph) -> int:
    """How many buffers of the step come from the heap: its inputs and stored values under
    the mmap threshold, and every value under it that a node writes (an alias included: ORT
    still allocates its tensor's bookkeeping there)."""
    def small(name: str) -> bool:
        ti = graph.info.get(name)
        return ti is not None and ti.nbytes < CPU_MMAP_THRESHOLD

    stored = set(graph.inputs) | set(graph.initializers)
    written = {o for n in graph.nodes for o in n.output if o} - stored
    return sum(1 for name in stored | written if small(name))


def heap_allowance_bytes(graph: Graph) -> int:
    """Room for glibc's heap (``HEAP_BYTES_PER_SMALL_BUFFER`` per small buffer). Only a
    step that allocates straight from malloc on the CPU needs it; compile decides where
    (``CompileOptions.slack_for``: not with an arena, which the arena model rounds)."""
    return HEAP_BYTES_PER_SMALL_BUFFER * small_buffers(graph)


ALIAS_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})
INPLACE_OPS = frozenset({
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "HardSigmoid", "Softplus", "Softsign",
    "ThresholdedRelu", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "Clip", "Cast",
    # Scatters into its data input: chained accumulation (the Gather gradient) costs one table.
    "ScatterElements",
})
NOT_EXECUTED = frozenset({"Constant"})

CATEGORIES = ("parameters", "optimizer_state", "gradients", "activations", "other", "scratch")
BEFORE_FIRST_NODE = -1


@dataclass(frozen=True)
class ValueLife:
    """One value: its size, when it appears and when its buffer goes away.

    ``birth`` is the index (in the analysed order) of the node that produces it, or -1 for
    values that exist before the first node. ``death`` is the index of the node after which
    its buffer is freed, or None when it stays to the end of the step. ``buffer`` names the
    value whose allocation holds it (itself unless aliased or updated in place); only a
    value with ``buffer == name`` adds bytes.
    """

    name: str
    nbytes: int
    birth: int
    death: int | None
    buffer: str
    category: str

    @property
    def owns_buffer(self) -> bool:
        return self.buffer == self.name


@dataclass(frozen=True)
class LivenessReport:
    """Bytes live at every node of one execution order, and what is live at the peak."""

    order: tuple[str, ...]
    values: Mapping[str, ValueLife]
    start_bytes: int
    live_during: tuple[int, ...]
    live_after: tuple[int, ...]
    scratch: tuple[int, ...]
    peak_bytes: int
    peak_step: int
    live_at_peak: tuple[str, ...]
    breakdown: Mapping[str, int]
    category_bytes: Mapping[str, int]
    # With ``host_copies``: the largest bytes held in host memory by swapped-out copies
    # (they are not in ``peak_bytes``, which then counts device memory only).
    host_peak_bytes: int = 0

    @property
    def peak_node(self) -> str | None:
        return self.order[self.peak_step] if self.peak_step >= 0 else None

    def to_json(self, *, per_node: bool = False) -> dict:
        out = {
            "peak_bytes": self.peak_bytes,
            "peak_step": self.peak_step,
            "peak_node": self.peak_node,
            "start_bytes": self.start_bytes,
            "breakdown_at_peak": dict(self.breakdown),
            "category_bytes": dict(self.category_bytes),
            "live_at_peak": list(self.live_at_peak),
            "nodes": len(self.order),
        }
        if self.host_peak_bytes:
            out["host_peak_bytes"] = self.host_peak_bytes
        if per_node:
            out["live_during"] = list(self.live_during)
            out["live_after"] = list(self.live_after)
        return out


# ---------------------------------------------------------------------------- entry point
def analyze_liveness(graph: Graph, order: Sequence[str | onnx.NodeProto] | None = None,
                     *, in_place: Mapping[str, str] | None = None,
                     host_copies: bool = False) -> LivenessReport:
    """Simulate ORT's buffer lifetimes over ``order`` (default: the graph's node order).

    ``in_place`` maps graph outputs to the graph inputs whose buffers they are written into
    (IOBinding, ``memcc.trainer``; ``passes.analysis.inplace`` says which are safe): such an output
    allocates nothing, it shares the input's buffer, which lives for the whole step anyway.
    ``host_copies`` counts what ``MemcpyToHost`` writes as host memory, apart from the
    peak (a device provider; on the CPU provider host and device are one memory, and the
    copies count like any buffer).
    """
    nodes = resolve_order(graph, order)
    table = NodeTable.of(nodes, rows_of(graph.shares) if graph.shares is not None else None)
    table.check(graph)
    categories = categorize(graph)
    ledger = _BufferLedger(graph, table, categories, in_place, host_copies)
    ledger.run()
    return ledger.report()


# ---------------------------------------------------------------------------- simulation
class _BufferLedger:
    """The buffers of one step as ORT's planner assigns them, filled by one pass over the
    nodes: which buffer each value lives in, each buffer's bytes, birth, death and remaining
    readers, and the live bytes during and after every node (read back by ``report``)."""

    def __init__(self, graph: Graph, table: NodeTable,
                 categories: Mapping[str, str],
                 in_place: Mapping[str, str] | None = None,
                 host_copies: bool = False) -> None:
        self.graph = graph
        self.in_place = dict(in_place or {})
        self.host_copies = host_copies
        self.host: set[str] = set()
        self.host_live = 0
        self.host_peak = 0
        self.nodes = table.nodes
        self.table = table
        self.categories = categories
        self.outputs = set(graph.outputs)
        self.uses: dict[str, int] = {}
        uses = self.uses
        for ins in table.ins:
            for i in ins:
                if i:
                    uses[i] = uses.get(i, 0) + 1
        self.buffer_of: dict[str, str] = {}
        self.buffer_bytes: dict[str, int] = {}
        self.remaining: dict[str, int] = {}
        self.pinned: set[str] = set()
        self.birth: dict[str, int] = {}
        self.buffer_death: dict[str, int] = {}
        self.live = 0
        self.start_bytes = 0
        self.live_during: list[int] = []
        self.live_after: list[int] = []
        self.scratch: list[int] = []

    def nbytes(self, name: str) -> int:
        ti = self.graph.info.get(name)
        return allocation_bytes(ti.nbytes) if ti is not None else 0

    def _new_buffer(self, name: str, birth: int, pinned: bool) -> int:
        self.buffer_of[name] = name
        size = self.buffer_bytes[name] = self.nbytes(name)
        self.remaining[name] = self.uses.get(name, 0)
        self.birth[name] = birth
        if pinned:
            self.pinned.add(name)
        return size

    def run(self) -> None:
        for name in _preexisting(self.graph, self.nodes):
            self.live += self._new_buffer(name, BEFORE_FIRST_NODE, pinned=True)
        self.start_bytes = self.live
        table = self.table
        for j, node in enumerate(self.nodes):
            self._step(j, node, table.ops[j], table.ins[j], table.outs[j])

    def _step(self, j: int, node: onnx.NodeProto, op: str, ins: tuple[str, ...],
              outs: tuple[str, ...]) -> None:
        # Run once per node of every plan judged: the dicts are bound to locals.
        if op in NOT_EXECUTED:
            self.live_during.append(self.live)
            self.live_after.append(self.live)
            self.scratch.append(0)
            return
        new = 0
        buffer_of, remaining, uses = self.buffer_of, self.remaining, self.uses
        in_place, outputs = self.in_place, self.outputs
        for k, out in enumerate(outs):
            if not out:
                continue
            if out in in_place:  # written into the buffer of the input it replaces
                target = buffer_of.get(in_place[out])
            else:
                target = None if out in outputs or k != 0 \
                    else self._shared_buffer(op, ins, out)
            if target is not None:
                buffer_of[out] = target
                self.birth[out] = j
                remaining[target] += uses.get(out, 0)
            elif self.host_copies and op == HOST_COPY_OP:
                self.host.add(out)
                self.host_live += self._new_buffer(out, j, pinned=out in outputs)
                self.host_peak = max(self.host_peak, self.host_live)
            else:
                unused = uses.get(out, 0) == 0
                new += self._new_buffer(out, j, pinned=out in outputs or unused)
        extra = scratch_bytes(node, self.graph.info, self.graph.opset) \
            if op in SCRATCH_OPS else 0
        self.scratch.append(extra)
        self.live_during.append(self.live + new + extra)
        self.live += new
        pinned, death = self.pinned, self.buffer_death
        for inp in ins:
            if not inp:
                continue
            b = buffer_of.get(inp)
            if b is None:  # consumed but never defined: an invalid graph; count nothing
                continue
            left = remaining[b] = remaining[b] - 1
            if left == 0 and b not in pinned and b not in death:
                death[b] = j
                if b in self.host:
                    self.host_live -= self.buffer_bytes[b]
                else:
                    self.live -= self.buffer_bytes[b]
        self.live_after.append(self.live)

    def _shared_buffer(self, op: str, ins: tuple[str, ...], out: str) -> str | None:
        """The buffer ``out`` (a node's first output) is written into instead of a new one,
        if ORT shares one."""
        if not ins or not ins[0]:
            return None
        src = ins[0]
        b = self.buffer_of.get(src)
        if b is None:
            return None
        if op in ALIAS_OPS:
            return b
        if op in INPLACE_OPS and b not in self.pinned and self.remaining[b] == 1:
            if _same_size(self.graph.info.get(src), self.graph.info.get(out)):
                return b
        return None

    def report(self) -> LivenessReport:
        values: dict[str, ValueLife] = {}
        owned, birth, death = self.buffer_bytes, self.birth, self.buffer_death
        categories = self.categories
        for name, b in self.buffer_of.items():
            # A buffer's owner was sized when it was made (``_new_buffer``).
            values[name] = ValueLife(
                name, owned[name] if name == b else self.nbytes(name), birth[name],
                death.get(b), b, categories.get(name, "activations"))
        peak, step = self.start_bytes, BEFORE_FIRST_NODE
        for j, v in enumerate(self.live_during):
            if v > peak:
                peak, step = v, j
        live = [b for b in self._buffers_live_at(step) if b not in self.host]
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for b in live:
            breakdown[values[b].category] += self.buffer_bytes[b]
        if step >= 0:
            breakdown["scratch"] += self.scratch[step]
        cat_bytes = dict.fromkeys(CATEGORIES, 0)
        for b, nbytes in self.buffer_bytes.items():
            if b not in self.host:
                cat_bytes[values[b].category] += nbytes
        return LivenessReport(
            order=tuple(n.name for n in self.nodes),
            values=values,
            start_bytes=self.start_bytes,
            live_during=tuple(self.live_during),
            live_after=tuple(self.live_after),
            scratch=tuple(self.scratch),
            peak_bytes=peak,
            peak_step=step,
            live_at_peak=tuple(sorted(live, key=lambda b: -self.buffer_bytes[b])),
            breakdown=breakdown,
            category_bytes=cat_bytes,
            host_peak_bytes=self.host_peak,
        )

    def _buffers_live_at(self, step: int) -> list[str]:
        """Buffers allocated while node ``step`` runs (-1: before the first node)."""
        live = []
        for b in self.buffer_bytes:
            born = self.birth[b]
            died = self.buffer_death.get(b)
            if born <= step and (died is None or died >= step):
                live.append(b)
        return live


def _preexisting(graph: Graph, nodes: Sequence[onnx.NodeProto]) -> list[str]:
    """Values that exist before the first node: inputs, initializers, Constant outputs."""
    seen: dict[str, None] = {}
    for name in graph.inputs:
        seen.setdefault(name, None)
    for name in graph.initializers:
        seen.setdefault(name, None)
    for n in nodes:
        if n.op_type in NOT_EXECUTED:
            for o in n.output:
                if o:
                    seen.setdefault(o, None)
    return list(seen)


def _same_size(a: TensorInfo | None, b: TensorInfo | None) -> bool:
    """ORT's SameSize: equal shapes and equal element sizes (types may differ)."""
    return a is not None and b is not None and a.shape == b.shape and a.itemsize == b.itemsize


# ---------------------------------------------------------------------------- categories
def _updated_by_forward(node: onnx.NodeProto) -> bool:
    return node.op_type == "BatchNormalization" or is_forward_tagged(node)


def categorize(graph: Graph) -> dict[str, str]:
    """Category of every value, from the training-step metadata written by ``memcc build``.

    parameters: trainable parameters (``memcc.parameters``) and their updated values;
    optimizer_state: other carried state (momentum, Adam moments, step counter) and its
    updates; gradients: each parameter's whole gradient (``TrainingStep.gradients``);
    other: data inputs, BatchNorm running statistics, non-trainable initializers and
    constants; activations: every other
    value a node produces (forward activations and backward intermediates alike).
    """
    step = TrainingStep.of(graph)
    state = step.state
    data = step.data_inputs
    params = step.trainable()
    # State the forward pass itself updates (BatchNorm running statistics: written by the
    # BatchNormalization node, or by the ops passes/providers/batchnorm_for_cuda.py puts in its
    # place)
    # is not optimizer state.
    # Looked up per state output, not through ``TrainingStep.roles``, whose walk of the whole
    # step would cost every simulation a quarter of its time.
    producer = graph.def_use().producer
    produced = producer.keys()
    forward_updated = {out for out in state if out in producer
                       and _updated_by_forward(producer[out])}
    cat: dict[str, str] = {}
    for name in produced:
        cat[name] = "activations"
    for name in list(graph.inputs) + list(graph.initializers):
        cat[name] = "other"
    for n in graph.nodes:
        if n.op_type in NOT_EXECUTED:
            for o in n.output:
                cat[o] = "other"
    for p in params:
        cat[p] = "parameters"
    for g in [*step.gradients().values(), *(f"{p}.grad" for p in params)]:
        if g in produced:
            cat[g] = "gradients"
    for out, inp in state.items():
        if inp in params:
            kind = "parameters"
        elif out in forward_updated:
            kind = "other"
        else:
            kind = "optimizer_state"
        cat[inp] = kind
        cat[out] = kind
    for d in data:
        cat[d] = "other"
    return cat

