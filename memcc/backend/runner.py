"""Run training steps in ONNX Runtime, measure them, and check them against the plan.

``run_steps`` is ``memcc run``. It reads a training step written by ``memcc build`` or
``memcc compile`` (the ``memcc.*`` metadata contract, read by ``memcc/step.py``), runs it for
a number of steps on one fixed batch, carries the state (updated parameters, optimizer
state, BatchNorm statistics) from each step to the next, and reports losses, step times,
the measured and the predicted peak, and whether ORT executed the planned order.

How a run is arranged, and why:

- The session gets the graph without any tensor data: every initializer (parameters,
  optimizer state, frozen weights) and every Constant node's value becomes a plain graph
  input that the runner feeds from arrays it holds. ORT then keeps no second copy of the
  state, and everything the step holds is allocated where the measurement sees it (see
  ``backend/memory.py``). Liveness treats inputs, initializers and constants alike, so the
  prediction is unchanged.
- Each step feeds the current state arrays and replaces them by the step's outputs (ORT's
  output buffers, returned to numpy without a copy); the old arrays and the other outputs
  are dropped before the next step, so every step holds the same things.
- The first run is a warm-up with profiling on: its profile gives the executed order
  (``backend/profile_order.py``); its arrays are freed before the baseline is taken, and
  its loss is not reported. Then ``steps`` measured steps run from the initial state.
- On CPU the warm-up and the steps run in a child process started with the allocator
  setting the measurement needs (``memory.run_child``). The parent only validates inputs,
  predicts the peak (``passes.analysis.liveness``) and prepares two files in a temporary directory:
  the session graph and an ``.npz`` of the initial state, constants and batch.
- ``step_time_s`` is the median wall time of ``session.run`` over the measured steps.

Enters: a step file and a ``RunRequest``. Leaves: a ``RunResult``. The batch and the step
contract it is checked against are ``step_feeds``; the CPU's measuring child is
``cpu_child``; CUDA's session is ``device_step``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from memcc.backend import memory
from memcc.backend.cpu_child import execute, run_options  # noqa: F401 (re-exported)
from memcc.backend.device_step import step_for_provider
from memcc.backend.profile_order import check_session_order, planned_order
from memcc.backend.session import provider_as_planned
from memcc.backend.step_feeds import (  # noqa: F401 (re-exported)
    StepSpec,
    load_data,
    read_step_spec,
    refuse_bfloat16_feeds,
    synthetic_feeds,
)
from memcc.errors import InputError
from memcc.frontend.constants import constant_node_value
from memcc.frontend.load import load_graph
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.arena import ArenaReport, ArenaSetup, cpu_arena_peak, replay_steps
from memcc.passes.analysis.liveness import LivenessReport, analyze_liveness
from memcc.passes.analysis.step_traffic import StepTraffic, step_traffic
from memcc.step import TrainingStep
from memcc.step import describe_type as _describe


@dataclass(frozen=True)
class RunResult:
    """What ``memcc run`` reports; ``to_json`` is the ``--json`` object."""

    model: str
    provider: str
    steps: int
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]
    step_time_s: float
    measured_peak_bytes: int | None
    measured_peak_bytes_per_step: tuple[int | None, ...]
    predicted_peak_bytes: int
    order_matches_plan: bool
    executed_order_mismatch: dict | None
    measurement_method: str
    seed: int
    data: str | None
    prediction: Mapping[str, object] = field(default_factory=dict)
    timing_method: str = "same process as the measurement"
    # CUDA (``backend.device_step``): the first step's peak, measured and predicted (the
    # arena grows in it and keeps its regions after), and how the step was run.
    first_step_measured_bytes: int | None = None
    first_step_predicted_bytes: int | None = None
    cuda_graph: str | None = None
    deterministic: bool | None = None
    # Nodes whose kernel ran on another provider (CUDA: CPU fallbacks, inserted copies).
    off_provider_nodes: tuple[str, ...] = ()
    # Kernels and bytes moved by one step of the graph that ran (passes/analysis/step_traffic.py).
    traffic: StepTraffic | None = None
    # What the user should know about how the step was run (a plan run off its provider).
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        m, p = self.measured_peak_bytes, self.predicted_peak_bytes
        return {
            "model": self.model,
            "steps": self.steps,
            "losses": list(self.losses),
            "step_times_s": list(self.step_times_s),
            "step_time_s": self.step_time_s,
            "measured_peak_bytes": m,
            "measured_peak_bytes_per_step": list(self.measured_peak_bytes_per_step),
            "predicted_peak_bytes": p,
            "measured_over_predicted": (m / p) if (m is not None and p) else None,
            "order_matches_plan": self.order_matches_plan,
            "executed_order_mismatch": self.executed_order_mismatch,
            "provider": self.provider,
            "measurement_method": self.measurement_method,
            "timing_method": self.timing_method,
            "seed": self.seed,
            "data": self.data,
            "prediction": dict(self.prediction),
            "first_step_measured_bytes": self.first_step_measured_bytes,
            "first_step_predicted_bytes": self.first_step_predicted_bytes,
            "cuda_graph": self.cuda_graph,
            "deterministic": self.deterministic,
            "off_provider_nodes": list(self.off_provider_nodes),
            "kernels_per_step": None if self.traffic is None else self.traffic.kernels,
            "bytes_moved_per_step": None if self.traffic is None else self.traffic.bytes_moved,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------- entry point
@dataclass(frozen=True)
class RunRequest:
    """What ``memcc run`` asks of ``run_steps`` (``run_steps`` says what each field does)."""

    steps: int = 5
    provider: str | None = None   # None: where the step was planned, else the CPU
    seed: int = 0
    data: str | os.PathLike | None = None
    isolate: bool | None = None
    separate_timing: bool = True
    in_place: bool = True
    arena: bool | None = None
    gpu_mem_limit: int | None = None
    cuda_graph: bool | None = None
    deterministic: bool = False


def run_steps(model_path: str | os.PathLike, request: RunRequest = RunRequest(), *,
              say: Callable[[str], None] | None = None) -> RunResult:
    """Run ``request.steps`` training steps of the file at ``model_path`` and measure them.

    ``isolate`` (default: on CPU, unless this already is the measuring process) runs the
    steps in a fresh child process so that the CPU measurement is exact. With
    ``separate_timing`` (default) the step times come from a second child that uses glibc's
    default allocator (``memory.timing_env``): the measuring process pays a page fault on
    every fresh buffer, which is not what a training run costs.

    ``in_place`` (default) runs the step as ``memcc.Trainer`` does and ``memcc compile``
    plans it (``passes.analysis.arrange``): updates written into the buffers of the values they
    replace (IOBinding), each update moved early where that predicts a lower peak, and the
    prediction counts the aliasing. ``in_place=False`` gives every update a buffer of its
    own (the copying runner, kept for comparisons). CUDA always runs in place.

    ``arena`` (CPU): allocate through ORT's arena with CUDA's settings instead of straight
    from malloc, and predict with ``passes.analysis.arena`` (the CUDA allocation rules, measured).
    On CUDA the arena is always on and always predicted that way. ``None``: as the step was
    compiled (``memcc compile --arena`` marks it).

    ``gpu_mem_limit`` (CUDA): the step may not hold more than this many device bytes (its
    arena is capped at what the bound buffers leave); a step that needs more fails
    (``RuntimeFailure``) instead of growing, so a step that runs is proved to fit.

    CUDA runs through ``backend.device_step`` (state on the device, bound once, no arena
    shrink, a CUDA graph where possible unless ``cuda_graph=False``; ``deterministic``:
    ORT's deterministic compute); the predicted peak is the steady state from the second
    step on, and the first step's peak is reported beside it.
    """
    if request.steps < 1:
        raise InputError("--steps must be at least 1")
    path = Path(model_path)
    graph = load_graph(path)
    spec = read_step_spec(graph, source=str(path))
    prov, note = provider_as_planned(request.provider,
                                     TrainingStep.of(graph).planned_provider)
    notes = [note] if note else []
    graph, _ = step_for_provider(graph, prov, deterministic=request.deterministic,
                                 notes=notes)
    refuse_bfloat16_feeds(graph, source=str(path), doing="run the step")
    feeds = (load_data(request.data, graph, spec) if request.data is not None
             else synthetic_feeds(graph, request.seed))
    if request.cuda_graph and prov != "cuda":
        raise InputError("--cuda-graph needs --provider cuda")
    if request.arena and prov == "cuda":
        raise InputError("--arena is for the CPU provider (CUDA always runs through its "
                         "arena)")
    if say is not None:   # nothing else prints until every run is done (a 6 s step: 63 s)
        n = request.steps
        warm = ("two steps to warm up (the CPU arena's first holds more) and check the order"
                if prov == "cpu" and _through_arena(request, graph)
                else "a step to warm up and check the order")
        say(f"running {path.name} on {prov}: {warm}, {n} "
            "measured" + (f", then {n} timed in a process of their own"
                          if prov == "cpu" and request.separate_timing else "")
            + "; the results print when all have run")
    if prov == "cuda":
        result = _run_on_device(path, graph, spec, feeds, request)
    else:
        result = _run_on_host(path, graph, spec, feeds, request, prov)
    return replace(result, notes=tuple(notes)) if notes else result


def _through_arena(request: RunRequest, graph: Graph) -> bool:
    """Whether the CPU run allocates through ORT's arena: as asked, else as compiled."""
    if request.arena is not None:
        return request.arena
    return TrainingStep.of(graph).allocator == "arena"


def _run_on_host(path: Path, graph: Graph, spec: StepSpec, feeds: Mapping[str, np.ndarray],
                 request: RunRequest, prov: str) -> RunResult:
    """``run_steps`` on the CPU provider: predicted (liveness, or the arena replay), then
    run in the measuring child (``cpu_child``) and, for the times, a second one."""
    graph, prediction, aliased = _arranged(path, graph, request.in_place)
    # --cuda-graph and --arena were checked against the provider by ``run_steps``.
    arena = _through_arena(request, graph)
    arena_report = None
    if arena:
        arena_report, arena_peak = arena_prediction(graph, prediction, spec,
                                                    steps=request.steps, provider=prov)
    isolate = request.isolate
    if isolate is None:
        isolate = prov == "cpu" and not memory.in_measuring_child()
    with tempfile.TemporaryDirectory(prefix="memcc-run-") as tmp:
        payload = prepare_run(graph, spec, feeds, Path(tmp), steps=request.steps,
                              provider=prov)
        payload["in_place"] = aliased
        payload["arena"] = bool(arena)
        if isolate:
            out = _run_children(payload, request.separate_timing)
        else:
            out = execute(payload)
    result = replace(_result(path, request, prov, prediction, out),
                     traffic=step_traffic(graph))
    if arena_report is not None:
        result = replace(result, predicted_peak_bytes=arena_peak,
                         prediction=dict(result.prediction) | {
                             "liveness_peak_bytes": prediction.peak_bytes,
                             "arena": arena_report.to_json()})
    return result


def _arranged(path: Path, graph: Graph, in_place: bool
              ) -> tuple[Graph, LivenessReport, dict[str, str]]:
    """The step as the CPU runs it, its predicted liveness and the updates written in
    place (``in_place``: arranged as ``memcc.Trainer`` runs it; else the copying runner)."""
    aliased: dict[str, str] = {}
    try:
        if in_place:
            from memcc.passes.analysis.arrange import arrange_step

            arrangement = arrange_step(graph, TrainingStep.of(graph))
            graph, prediction = arrangement.graph, arrangement.prediction
            aliased = dict(arrangement.in_place.aliased)
        else:
            prediction = analyze_liveness(graph)
    except ValueError as exc:  # the node list is not a topological order
        raise InputError(f"{path}: {exc}; write nodes in a topological order") from exc
    return graph, prediction, aliased


def _run_children(payload: dict, separate_timing: bool) -> dict:
    """The run in the measuring child and, with ``separate_timing``, its step times from a
    second child on glibc's default allocator (or ORT's CPU arena where the run uses it)."""
    out = memory.run_child("memcc.backend.runner", payload)
    if separate_timing:
        timed = memory.run_child("memcc.backend.runner", payload, measuring=False)
        out["step_times_s"] = timed["step_times_s"]
        out["timing"] = ("separate process, ORT's CPU arena" if payload["arena"] else
                         "separate process, default allocator")
    return out


def _run_on_device(path: Path, graph: Graph, spec: StepSpec, batch: Mapping[str, np.ndarray],
                   request: RunRequest) -> RunResult:
    """``run_steps`` on CUDA, in two sessions of the same step (``DeviceStep``), arranged
    as it trains: updates in place, early where that predicts a lower peak
    (``passes.analysis.device_memory.predict_step``, also what plans for CUDA are judged by).

    The first runs one profiled step, never captured (the order check reads ORT's profile
    of it), and is closed: the CUDA libraries load the kernels a step uses on their first
    launch and keep them for the process, which is no step's memory. NVML's reading after
    it is the baseline. The second is measured: its first step, then the state set back to
    its initial values, then ``steps`` steps (captured as a CUDA graph where possible).
    ``device_readings`` keeps NVML's view of each moment over the baseline."""
    import gc

    from memcc.backend.device_step import DeviceSettings, DeviceStep, StepRoles
    from memcc.passes.analysis.device_memory import predict_step

    steps = request.steps
    try:
        arrangement, device = predict_step(graph, steps=steps)
    except ValueError as exc:  # the node list is not a topological order
        raise InputError(f"{path}: {exc}; write nodes in a topological order") from exc
    graph, liveness = arrangement.graph, arrangement.prediction
    roles = StepRoles(loss=spec.loss, updates=spec.state, aliased=arrangement.in_place.aliased)

    def open_step(**kw) -> DeviceStep:
        return DeviceStep(graph, roles, DeviceSettings(provider="cuda",
                                                       gpu_mem_limit=request.gpu_mem_limit,
                                                       **kw), source=str(path))

    memory.device_baseline()  # a CUDA context before anything is measured
    with tempfile.TemporaryDirectory(prefix="memcc-run-") as tmp:
        warm = open_step(cuda_graph=False, profile_prefix=str(Path(tmp) / "memcc_order"))
        warm.run(batch)
        order = check_session_order(warm.session, planned_order(graph.nodes))
    del warm
    gc.collect()
    meter = memory.NvmlPeakMeter()
    baseline = meter.set_baseline()
    step = open_step(cuda_graph=request.cuda_graph)
    readings, out = _measure_on_device(step, batch, meter, baseline, steps)
    out["order"] = order.to_json()
    result = _result(path, request, "cuda", liveness, out)
    graph_note = "captured" if step.captured else step.cuda_graph_note
    if not step.captured and order.off_provider:
        graph_note = (f"{graph_note}; nodes not on the CUDA provider: "
                      f"{', '.join(order.off_provider[:5])}"
                      + (f" and {len(order.off_provider) - 5} more"
                         if len(order.off_provider) > 5 else ""))
    first = readings["first_step_bytes"]
    return replace(result, predicted_peak_bytes=device.steady_bytes,
                   first_step_measured_bytes=first,
                   first_step_predicted_bytes=device.first_step_bytes,
                   cuda_graph=graph_note, off_provider_nodes=order.off_provider,
                   deterministic=bool(request.deterministic), traffic=step_traffic(graph),
                   prediction=dict(result.prediction) | {
                       "liveness_peak_bytes": liveness.peak_bytes,
                       "device": device.to_json(), "device_readings": readings})


def _measure_on_device(step, batch: Mapping[str, np.ndarray], meter, baseline: int | None,
                       steps: int) -> tuple[dict[str, object], dict]:
    """The measured session's first step, the state set back, then ``steps`` steps under
    NVML: NVML's readings over the baseline, and the losses, times and peaks of the steps
    (the ``out`` ``_result`` reads, less the order)."""
    readings: dict[str, object] = {"baseline_used_bytes": baseline}
    if baseline is not None:
        readings["bound_bytes"] = meter.used() - baseline
    initial = step.state_dict()
    meter.start()
    step.run(batch)
    first = meter.stop()
    if baseline is not None:
        readings["between_steps_bytes"] = meter.used() - baseline
    step.load_state(initial)
    del initial
    losses, times, peaks = [], [], []
    for _ in range(steps):
        meter.start()
        t0 = time.perf_counter()
        out = step.run(batch)
        times.append(time.perf_counter() - t0)
        peaks.append(meter.stop())
        losses.append(out.loss)
    readings["first_step_bytes"] = first
    return readings, {"losses": losses, "step_times_s": times, "measured_per_step": peaks,
                      "method": meter.method + " (after a warm-up session)",
                      "timing": "same process as the measurement, NVML sampled meanwhile"}


def arena_prediction(graph: Graph, liveness: LivenessReport, spec: StepSpec, *, steps: int,
                     provider: str) -> tuple[ArenaReport, int]:
    """The arena's view of ``steps`` measured runs and the peak the meter will see.

    CUDA: the feeds are copied into the device arena every run and the outputs copied out,
    so the device peak is the arena's reserved bytes over its baseline. CPU (``--arena``):
    ``passes.analysis.arena.cpu_arena_peak``, the feeds where the runner keeps them plus the arena.
    """
    if provider != "cuda":
        return cpu_arena_peak(graph, liveness, steps=steps, meter=True)
    report = replay_steps(graph, liveness, ArenaSetup(feeds_in_arena=True, addresses_grow=True,
                                                      cuda=True), steps=steps)
    return report, report.measured_bytes


def _result(path: Path, request: RunRequest, provider: str, prediction: LivenessReport,
            out: Mapping) -> RunResult:
    """The ``RunResult`` of a run's ``out`` (what the child or the device measurement
    returned), with liveness's prediction; the drivers add the rest with ``replace``."""
    steps, seed, data = request.steps, request.seed, request.data
    per_step = tuple(out["measured_per_step"])
    known = [b for b in per_step if b is not None]
    times = tuple(out["step_times_s"])
    order = out["order"]
    return RunResult(
        model=str(path),
        provider=provider,
        steps=steps,
        losses=tuple(out["losses"]),
        step_times_s=times,
        step_time_s=statistics.median(times),
        measured_peak_bytes=max(known) if known else None,
        measured_peak_bytes_per_step=per_step,
        predicted_peak_bytes=prediction.peak_bytes,
        order_matches_plan=bool(order["order_matches_plan"]),
        executed_order_mismatch=order["first_mismatch"],
        measurement_method=out["method"],
        timing_method=out.get("timing", "same process as the measurement"),
        seed=seed,
        data=str(data) if data is not None else None,
        prediction={k: v for k, v in prediction.to_json().items() if k != "live_at_peak"}
        | {"live_at_peak": list(prediction.live_at_peak[:10])},
    )


# ---------------------------------------------------------------------------- preparation
def session_graph(graph: Graph) -> tuple[Graph, dict[str, np.ndarray]]:
    """The graph ORT gets (no tensor data) and the values the runner feeds instead.

    ``np.asarray(order="C")``, not ``np.ascontiguousarray``: the latter turns 0-d constants
    into shape (1,), which ORT accepts for a scalar input and then broadcasts to other ranks.
    """
    g = graph.copy()
    values = {n: np.asarray(a, order="C") for n, a in graph.initializers.items()
              if not _stays_in_graph(a)}
    kept = []
    for node in g.nodes:
        if node.op_type == "Constant" and len(node.output) == 1:
            v = constant_node_value(node)
            if v is not None and not _stays_in_graph(v):
                values[node.output[0]] = np.asarray(v, order="C")
                continue
        kept.append(node)
    g.nodes = kept
    g.initializers = {n: a for n, a in graph.initializers.items() if n not in values}
    g.inputs = list(graph.inputs) + [n for n in values if n not in graph.inputs]
    for name, arr in values.items():
        ti = TensorInfo(onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(arr.shape))
        known = g.info.setdefault(name, ti)
        if known != ti:  # ORT would take the array and broadcast differently than planned
            raise InputError(f"stored value '{name}' {_describe(ti)} does not match its "
                             f"declared type {_describe(known)}")
    return g, values


def _stays_in_graph(value: np.ndarray) -> bool:
    """bfloat16 constants (a 16-bit step's scalars) stay in the session graph: numpy has
    no bfloat16 of its own and ORT's Python API cannot feed one (``ml_dtypes``' arrays
    are refused)."""
    return np.asarray(value).dtype.name == "bfloat16"


def prepare_run(graph: Graph, spec: StepSpec, batch: Mapping[str, np.ndarray], tmp: Path, *,
                steps: int, provider: str) -> dict:
    """Write the session graph and the initial feeds into ``tmp``; return the run payload."""
    g, values = session_graph(graph)
    values.update(batch)
    model_file = tmp / "session.onnx"
    feeds_file = tmp / "feeds.npz"
    onnx.save_model(g.to_model(), str(model_file))
    np.savez(feeds_file, **values)
    return {
        "session_model": str(model_file),
        "feeds": str(feeds_file),
        "outputs": list(graph.outputs),
        "loss": spec.loss,
        "state": dict(spec.state),
        "planned": planned_order(graph.nodes),
        "steps": int(steps),
        "provider": provider,
        "profile_dir": str(tmp),
    }


# ---------------------------------------------------------------------------- execution
if __name__ == "__main__":  # the measuring child: python -m memcc.backend.runner --child -
    sys.exit(memory.child_main(sys.argv, execute))
