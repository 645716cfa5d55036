"""What a training step holds on a CUDA device as ``backend.device_step`` runs it.

The runtime binds every carried value, a second buffer for each update it cannot write in
place, the batch and the outputs to buffers of their own, outside the step's arena; ORT
places the stored values (constants, frozen weights) at load, one ``cudaMalloc`` each; and
the arena is never shrunk between steps, so from the second step on it holds what the
first grew to. ``predict_device`` adds the three: the arena replay without shrink
(``passes.analysis.arena.replay_steps`` with
``ArenaSetup(shrink=False, outputs_in_arena=False)``), and the bound buffers and stored
values as device pages. ``predict_step`` arranges the step first, as the runtime does
(updates in place), and ``simulate(device="cuda")`` judges plans by it, so a plan is
priced the way it runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from memcc.errors import RuntimeFailure
from memcc.frontend.constants import constant_node_value
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.arena import (
    ArenaReport,
    ArenaSetup,
    cuda_pages_for,
    replay_steps,
    rounded_bytes,
)
from memcc.passes.analysis.arrange import ArrangedStep, arrange_step
from memcc.passes.analysis.host_state import host_resident
from memcc.passes.analysis.liveness import LivenessReport
from memcc.step import TrainingStep

# What a CUDA session of ORT holds for itself once it has run: cuBLAS and cuDNN handles and
# their workspaces. Measured on an H200 (CUDA 13, cuDNN 9, onnxruntime-gpu 1.31.1;
# benchmarks/cuda_h200_issue29/device_pieces.json): 66 MiB at creation and 64 MiB more at
# the first run, 148 MiB for a second session in the same process. Not the CUDA context
# nor the kernel code the libraries load for the process (a warm-up session's, kept).
# Plus 62 MiB that every step captured as a CUDA graph (memcc's default on CUDA) held
# beyond the model, exactly: measured minus predicted was 65,011,712 bytes on the zoo's
# MLP, GPT-2 and BERT steps alike (H200, 2026-11-27, benchmarks/cuda_check.py --phases
# truth; BENCHMARKS.md "Eighteenth session on an H200"); what ORT or CUDA allocates for it
# is not known. Counted for uncaptured steps too: over by 62 MiB there, never under.
CUDA_SESSION_BYTES = (130 + 62) << 20


@dataclass(frozen=True)
class DevicePrediction:
    """What the step holds on the device, by the arena model plus the buffers bound to it.

    ``steady_bytes``: from the second step on (the arena keeps what the first step grew
    to); ``first_step_bytes``: the first step's peak. Both count the bound buffers (state,
    spares, batch, outputs) and the stored values ORT places on the device, as device
    pages (``passes.analysis.arena.cuda_pages_for``)."""

    steady_bytes: int
    first_step_bytes: int
    bound_bytes: int
    stored_bytes: int
    arena: ArenaReport
    session_bytes: int = CUDA_SESSION_BYTES

    def to_json(self) -> dict:
        return {"steady_bytes": self.steady_bytes, "first_step_bytes": self.first_step_bytes,
                "bound_bytes": self.bound_bytes, "stored_bytes": self.stored_bytes,
                "session_bytes": self.session_bytes,
                "arena": self.arena.to_json(), "method": PREDICTION_METHOD}


PREDICTION_METHOD = ("arena replay without shrink (passes.analysis.arena, CUDA pages) + the "
                     "buffers bound to the step + the stored values ORT places on the device + the "
                     "session's own handles and workspaces (measured constant)")


def predict_device(graph: Graph, liveness: LivenessReport, *, aliased: Mapping[str, str],
                   updates: Mapping[str, str], steps: int = 2,
                   limit: int | None = None) -> DevicePrediction:
    """``DeviceStep``'s device bytes on CUDA for ``graph`` run in ``liveness``'s order."""
    report = replay_steps(graph, liveness,
                          ArenaSetup(feeds_in_arena=False, addresses_grow=True, cuda=True,
                                     shrink=False, outputs_in_arena=False, limit=limit),
                          steps=max(1, steps))
    bound, stored = _outside_sizes(graph, aliased, updates)
    outside = outside_arena_bytes(graph, aliased, updates)
    first = report.first_run_peak_bytes + outside
    steady = (report.peak_device_bytes or report.peak_reserved_bytes) + outside
    return DevicePrediction(steady, first, sum(bound), sum(stored), report)


def _outside_sizes(graph: Graph, aliased: Mapping[str, str], updates: Mapping[str, str]
                   ) -> tuple[list[int], list[int]]:
    bound = [int(ti.nbytes) for ti in bound_infos(graph, aliased, updates)]
    _, _, carried_inputs = _carried(updates)
    stored = [s for n, s in stored_sizes(graph).items() if n not in carried_inputs]
    return bound, stored


def outside_arena_bytes(graph: Graph, aliased: Mapping[str, str],
                        updates: Mapping[str, str]) -> int:
    """Device bytes the CUDA runtime holds beside the step's arena: the bound buffers and
    the stored values, in device pages (small buffers share pages whoever asked for them:
    the driver packs them), and the session's own handles and workspaces."""
    bound, stored = _outside_sizes(graph, aliased, updates)
    return cuda_pages_for([rounded_bytes(b) for b in bound if b] + stored) \
        + CUDA_SESSION_BYTES


def arena_limit(graph: Graph, aliased: Mapping[str, str], updates: Mapping[str, str],
                budget: int, *, source: str = "<step>") -> int:
    """The ``gpu_mem_limit`` for the step's arena that keeps the whole step within
    ``budget`` device bytes, or ``RuntimeFailure`` when what lives beside the arena alone
    does not fit."""
    outside = outside_arena_bytes(graph, aliased, updates)
    limit = int(budget) - outside
    if limit <= 0:
        raise RuntimeFailure(
            f"{source}: the step's state, stored values and the CUDA session's own handles "
            f"alone take {outside:,} device bytes, more than the limit {int(budget):,}")
    return limit


def predict_step(graph: Graph, *, steps: int = 2, limit: int | None = None,
                 early_updates: bool = True) -> tuple[ArrangedStep, DevicePrediction]:
    """The step as the CUDA runtime runs it (updates in place, moved early where that
    predicts a lower peak: ``passes.analysis.arrange``) and what it holds on the device. ``memcc
    run``, ``--verify``, ``memcc train`` and the planner's ``simulate(device="cuda")`` all
    take it from here, so a plan is judged the way it runs. ``early_updates=False``: the
    file's order only, which the runtime keeps unless moving updates predicts fewer live
    bytes, so a bound on what runs, at a third of the analysis (the planner's choice: it
    judges many candidate plans)."""
    step = TrainingStep.of(graph)
    a = arrange_step(graph, step, host_copies=True, early_updates=early_updates)
    return a, predict_device(a.graph, a.prediction, aliased=a.in_place.aliased,
                             updates=step.state, steps=steps, limit=limit)


def _carried(updates: Mapping[str, str]) -> tuple[list[str], list[str], set[str]]:
    outs = list(updates)
    ins = list(dict.fromkeys(updates.values()))
    return outs, ins, set(ins)


def stored_sizes(graph: Graph) -> dict[str, int]:
    """Bytes of each value the graph keeps itself: initializers and Constant nodes (on CUDA
    each becomes its own device allocation at load)."""
    sizes = {n: int(np.asarray(a).nbytes) for n, a in graph.initializers.items()}
    for node in graph.nodes:
        if node.op_type == "Constant" and node.output:
            v = constant_node_value(node)
            if v is not None:
                sizes[node.output[0]] = int(np.asarray(v).nbytes)
    return {n: s for n, s in sizes.items() if s}


def bound_infos(graph: Graph, aliased: Mapping[str, str], updates: Mapping[str, str]
                 ) -> list[TensorInfo]:
    """The device buffers a ``DeviceStep`` allocates: each carried value, a spare for each
    update not written in place, each data input, each output that is not an update; not
    the optimizer state it holds in host memory
    (``passes.analysis.host_state.host_resident``)."""
    _, carried, carried_set = _carried(updates)
    # Optimizer state offloaded to host memory (passes.lowering.offload_state) is bound there.
    host = _host_resident(graph, updates)
    infos = [graph.info[n] for n in carried if n not in host]
    infos += [graph.info[updates[o]] for o in updates
              if o not in aliased and updates[o] not in host]
    stored = set(graph.initializers) | {o for n in graph.nodes if n.op_type == "Constant"
                                        for o in n.output}
    infos += [graph.info[n] for n in graph.inputs
              if n not in carried_set and n not in stored and n in graph.info]
    infos += [graph.info[o] for o in graph.outputs if o not in updates and o in graph.info]
    return infos




def _host_resident(graph: Graph, updates: Mapping[str, str]) -> set[str]:
    return host_resident(graph, dict(updates))
