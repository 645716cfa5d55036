"""The measuring child of a CPU run (``memcc run`` on the CPU provider).

Enters: the run payload ``runner.prepare_run`` writes (the session graph's file, an
``.npz`` of the initial state, constants and batch, the outputs, loss and state, the
planned order, the number of steps). Leaves: plain JSON-able data: the losses, step times,
each step's measured peak, the meter's method and whether ORT ran the planned order. It
runs in the process ``memory.run_child`` starts (``python -m memcc.backend.runner
--child``), whose allocator setting the measurement needs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from memcc.backend import memory
from memcc.backend.memory import load_npz
from memcc.backend.profile_order import check_session_order
from memcc.backend.session import SessionSettings, make_session
from memcc.errors import RuntimeFailure


def execute(payload: Mapping) -> dict:
    """Warm-up (profiled, order check), baseline, then the measured steps, on the CPU
    (CUDA runs through ``_run_on_device``). Runs in the measuring child; returns plain
    JSON-able data.
    """
    provider = payload["provider"]
    outputs = list(payload["outputs"])
    state = dict(payload["state"])
    loss_name = payload["loss"]
    prefix = str(Path(payload["profile_dir"]) / "memcc_order")
    arena = bool(payload.get("arena"))
    session = make_session(payload["session_model"], provider,
                           SessionSettings(profile=True, profile_prefix=prefix,
                                           cpu_arena=arena))
    meter = memory.CpuPeakMeter()
    options = run_options(arena=arena)

    aliased = dict(payload.get("in_place") or {})

    def run(feeds):
        if aliased:
            return _run_in_place(session, outputs, feeds, aliased, options)
        return _run(session, outputs, feeds, options)

    feeds = load_npz(payload["feeds"])
    run(feeds)
    order = check_session_order(session, payload["planned"])
    if arena:
        # After the first run ORT's CPU arena can hold more than it holds between later
        # steps, and a baseline taken then counts that as the session's own: on two compiled
        # --arena plans of real exports the steps read 2.3 MB (a transformers ResNet, batch
        # 16, 9.43-9.55 MB after two or three warm-up runs) and 7.2 MB (MobileNetV2, batch
        # 16, 73.1-73.3 MB) low after one (BENCHMARKS.md, session 43). A second run puts the
        # baseline between two steady steps. Without the arena one run gives what two do.
        run(feeds)
    del feeds
    meter.set_baseline()

    feeds = load_npz(payload["feeds"])
    losses, times, peaks = [], [], []
    for _ in range(int(payload["steps"])):
        meter.start()
        t0 = time.perf_counter()
        result = run(feeds)
        times.append(time.perf_counter() - t0)
        peaks.append(meter.stop())
        losses.append(_scalar(result[loss_name], loss_name))
        for out, inp in state.items():
            if out not in aliased:  # an in-place update already is in feeds[inp]
                # With the arena on, ORT's own buffer would pin an arena region into the
                # next step; a copy keeps the arena as CUDA leaves it (outputs copied out).
                feeds[inp] = np.array(result[out]) if arena else result[out]
        del result
    return {
        "losses": losses,
        "step_times_s": times,
        "measured_per_step": peaks,
        "method": meter.method,
        "order": order.to_json(),
    }


def _run(session, outputs: list[str], feeds: Mapping[str, np.ndarray], run_options
         ) -> dict[str, np.ndarray]:
    try:
        values = session.run(outputs, dict(feeds), run_options)
    except Exception as exc:  # pybind raises ORT's own exception types
        raise RuntimeFailure(f"ONNX Runtime failed while running the step: {exc}") from exc
    return dict(zip(outputs, values, strict=True))


def _run_in_place(session, outputs: list[str], feeds: dict[str, np.ndarray],
                  aliased: Mapping[str, str], run_options) -> dict[str, np.ndarray]:
    """One step with IOBinding: each aliased output is written into its input's array
    (``feeds`` is updated in place); the other outputs come back as new arrays."""
    import onnxruntime as ort

    binding = session.io_binding()
    values = {}
    for name, arr in feeds.items():
        values[name] = ort.OrtValue.ortvalue_from_numpy(arr)  # shares the array's memory
        binding.bind_ortvalue_input(name, values[name])
    for out in outputs:
        if out in aliased:
            binding.bind_ortvalue_output(out, values[aliased[out]])
        else:
            binding.bind_output(out, "cpu")
    try:
        session.run_with_iobinding(binding, run_options)
    except Exception as exc:  # pybind raises ORT's own exception types
        raise RuntimeFailure(f"ONNX Runtime failed while running the step: {exc}") from exc
    result = {out: feeds[aliased[out]] for out in outputs if out in aliased}
    for out, value in zip(outputs, binding.get_outputs(), strict=True):
        if out not in aliased:
            result[out] = value.numpy()
    return result


def run_options(*, arena: bool = False):
    """The CPU runner's options: with the arena, its unused regions are returned after
    each step (every step starts level, as ``passes.analysis.arena.cpu_arena_peak`` models)."""
    import onnxruntime as ort

    ro = ort.RunOptions()
    if arena:
        ro.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return ro


def _scalar(value: np.ndarray, name: str) -> float:
    arr = np.asarray(value)
    if arr.size != 1:
        raise RuntimeFailure(f"the loss output '{name}' has shape {list(arr.shape)}, not a scalar")
    return float(arr.reshape(-1)[0])
