"""Optimizer state in host memory: on the device only while its own update runs.

With ``--provider cuda`` the smallest budget a plan can reach is the backward pass's working
set plus every parameter and the whole optimizer state (SGD momentum: one more copy of the
parameters; AdamW's ``exp_avg`` and ``exp_avg_sq``: two), all bound on the device for the
whole step. The optimizer state is read and written by its update alone, so, as
ZeRO-Offload does, it can live in host memory and visit the device only for that update.

This pass makes chosen state inputs ``S`` (carried: ``S.new -> S``) host-resident:

- ``MemcpyFromHost(S) -> S.dev`` runs right before the first reader of ``S`` (its update),
  and every reader of ``S`` reads ``S.dev``;
- the update computes ``S.new.dev`` (the producer's output renamed, its readers rewired),
  and ``MemcpyToHost(S.new.dev) -> S.new`` runs right after it: ``S.new`` stays the step's
  output, in host memory.

Both copies are tagged ``memcc.role=update``, so they belong to the update's cone and move
with it when updates are scheduled early (``passes.analysis.update_schedule``). The graph records
the
host-resident inputs under ``HOST_STATE_KEY``; ``host_resident`` also reads them off the
graph's structure, so the runtime (``backend.device_step.DeviceStep``: binds those inputs and
outputs in host memory) and the device prediction (``passes.analysis.device_memory``: counts them
nowhere on the device) agree with any file that has the shape. The copies move the same
bytes and add no arithmetic: the step computes the same values bit for bit (the CPU provider
runs both copies as plain copies; tests/test_offload_state.py).

Priced by ``HostLink`` (two copies per tensor per step; ORT runs them on the compute stream,
so each adds its whole time). Predicted only: no GPU has run it yet (docs/CUDA.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import onnx

from memcc.graph import Graph, unique_namer
from memcc.passes.analysis.cost_model import HostLink
from memcc.passes.analysis.host_state import (  # noqa: F401 (re-exported)
    COPY_IN,
    COPY_OUT,
    host_resident,
)
from memcc.step import Role, TrainingStep, tag_node

HOST_STATE_KEY = "memcc.host_state"
DEVICE_SUFFIX = ".dev"
# State tensors below this many bytes stay on the device: a copy's latency (6.8 us on an
# H200) would cost more than the bytes are worth, and the CUDA arena rounds them up anyway.
MIN_OFFLOAD_BYTES = 64 << 10


@dataclass(frozen=True)
class StateOffload:
    """The rewritten step and what moved: ``tensors`` (state input, bytes), largest first."""

    graph: Graph
    tensors: tuple[tuple[str, int], ...]

    @property
    def bytes(self) -> int:
        return sum(b for _, b in self.tensors)

    def added_seconds(self, link: HostLink | None) -> float:
        """The copies' predicted time per step (one in, one out per tensor), 0 without a
        link (the CPU provider, where nothing is offloaded)."""
        if link is None:
            return 0.0
        return float(sum(link.round_trip(b) for _, b in self.tensors))

    def to_json(self, link: HostLink | None) -> dict:
        return {"tensors": [{"name": n, "bytes": b} for n, b in self.tensors],
                "bytes": self.bytes, "copies_per_step": 2 * len(self.tensors),
                "added_time_s": round(self.added_seconds(link), 6)}


def optimizer_state(graph: Graph, step: TrainingStep | None = None,
                    min_bytes: int = MIN_OFFLOAD_BYTES) -> list[tuple[str, int]]:
    """The carried inputs that are optimizer state and may live in host memory, largest
    first: not a parameter, every reader an update node (so idle through the forward and
    backward passes: BatchNorm statistics are read by the forward pass and stay), updated by
    an update node, a stored initial value, a tensor (AdamW's step counter, a scalar read by
    every update, stays) and at least ``min_bytes``."""
    step = step or TrainingStep.of(graph)
    roles = step.roles
    du = graph.def_use()
    params = step.trainable()
    outputs = set(graph.outputs)
    found = []
    for out, inp in step.state.items():
        ti = graph.info.get(inp)
        if inp in params or ti is None or inp not in graph.initializers or inp in outputs:
            continue
        readers = du.readers.get(inp, ())
        producer = du.producer.get(out)
        if not readers or producer is None or roles.get(producer.name) is not Role.UPDATE:
            continue
        if any(roles.get(r.name) is not Role.UPDATE for r in readers):
            continue
        if ti.shape and ti.nbytes >= min_bytes:  # not a counter (AdamW's step)
            found.append((inp, int(ti.nbytes)))
    return sorted(found, key=lambda t: (-t[1], t[0]))


def offload_state(graph: Graph, names: Iterable[str]) -> StateOffload:
    """A new graph with each of ``names`` (from ``optimizer_state``) host-resident (module
    docstring); ``graph`` is untouched."""
    names = list(dict.fromkeys(names))
    if not names:
        return StateOffload(graph, ())
    step = TrainingStep.of(graph)
    update_of = {inp: out for out, inp in step.state.items()}
    out = graph.copy()
    du = out.def_use()
    fresh = unique_namer(list(out.values()) + [n.name for n in out.nodes])
    position = {id(n): i for i, n in enumerate(out.nodes)}
    before: dict[int, list[onnx.NodeProto]] = {}
    after: dict[int, list[onnx.NodeProto]] = {}
    tensors = []
    for s in names:
        new = update_of.get(s)
        readers = sorted(du.readers.get(s, ()), key=lambda r: position[id(r)])
        producer = du.producer.get(new) if new is not None else None
        if new is None or not readers or producer is None:
            raise ValueError(f"'{s}' is not carried state with an update (optimizer_state "
                             "lists those that are)")
        dev, new_dev = fresh(s + DEVICE_SUFFIX), fresh(new + DEVICE_SUFFIX)
        out.info[dev] = out.info[s]
        out.info[new_dev] = out.info[new]
        copy_in = onnx.helper.make_node(COPY_IN, [s], [dev], name=fresh(f"{s}/{COPY_IN}"))
        for r in readers:
            for k, i in enumerate(r.input):
                if i == s:
                    du.rewire(r, k, dev)
        for r in list(du.readers.get(new, ())):
            for k, i in enumerate(r.input):
                if i == new:
                    du.rewire(r, k, new_dev)
        producer.output[list(producer.output).index(new)] = new_dev
        copy_out = onnx.helper.make_node(COPY_OUT, [new_dev], [new],
                                         name=fresh(f"{new}/{COPY_OUT}"))
        for node in (copy_in, copy_out):
            tag_node(node, role=Role.UPDATE.value)
        before.setdefault(id(readers[0]), []).append(copy_in)
        after.setdefault(id(producer), []).append(copy_out)
        tensors.append((s, int(out.info[s].nbytes)))
    nodes: list[onnx.NodeProto] = []
    for n in out.nodes:
        nodes.extend(before.get(id(n), ()))
        nodes.append(n)
        nodes.extend(after.get(id(n), ()))
    out.set_nodes(nodes)  # the producers' outputs were renamed: the index is rebuilt
    held = json.loads(out.metadata.get(HOST_STATE_KEY) or "[]")
    out.metadata[HOST_STATE_KEY] = json.dumps(sorted(set(held) | {s for s, _ in tensors}))
    return StateOffload(out, tuple(sorted(tensors, key=lambda t: (-t[1], t[0]))))
