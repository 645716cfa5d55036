"""Measure the real peak memory of training steps, the way that matched analysis exactly.

CPU (ORT_NOTES.md §3). glibc serves large requests from its heap and keeps freed heap
memory resident, so the resident-set peak would count memory ORT already freed. With
``MALLOC_MMAP_THRESHOLD_=4096`` every allocation of 4 KiB or more is its own ``mmap`` (whole
pages, which ``passes.analysis.liveness.allocation_bytes`` models) and goes back to the kernel at
``free``, and ``MALLOC_ARENA_MAX=1`` keeps ORT's threads on one heap; since glibc reads these
variables once at start-up, the
measured steps run in a fresh child process started with it (``python -m
memcc.backend.runner --child``, see ``run_child``). In that process:

- the baseline is the resident size after the session is created and a warm-up step has
  run (thread pools, kernel caches, MLAS packing buffers exist), and after every array of
  that warm-up was freed and ``malloc_trim`` returned free heap pages;
- then the step's inputs are created afresh (initial state read again from the file, the
  batch made again), so the baseline holds no tensor of the step;
- before each step the high-water mark is reset (``5`` to ``/proc/self/clear_refs``) and
  after it ``VmHWM - baseline`` is that step's measured peak.

So the measured figure counts what ``passes.analysis.liveness`` predicts: parameters, optimizer
state
and batch (held by the runner and fed as inputs), every activation and gradient ORT
allocates, and the step's outputs, with kernel scratch on top. It does not count the
session itself (graph, kernels, threads), which is not part of any plan. What it counts
beyond the prediction is allocator overhead: page rounding of each large buffer and the
glibc heap holding the small ones (< 64 KiB); measured on the model zoo this was 1-2 MB on
graphs with hundreds of small tensors, within 0.5 % on MLP and GPT-2 steps.

CUDA: ``NvmlPeakMeter`` samples the device's used memory from a thread while a step runs.
The arena is not shrunk between steps (``backend.device_step``), so a step's figure is the
device memory used at its worst moment over ``device_baseline``: the reading once this
process has a CUDA context, before the step's session exists. It counts the step's state,
batch and outputs, its arena, the stored values ORT placed on the device, and the CUDA
provider's own handles and workspaces (not in any plan). It needs ``pynvml``; without it
the measured peak is ``None`` and the method says why.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from memcc import errors
from memcc.passes.analysis.liveness import CPU_MMAP_THRESHOLD

MMAP_THRESHOLD = CPU_MMAP_THRESHOLD
# One malloc arena: ORT's worker threads would otherwise each grow a heap of their own,
# whose fragmentation the high-water mark sees and no model of the graph can predict.
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_ARENA_MAX": "1"}
CHILD_FLAG = "MEMCC_MEASURE_CHILD"
RESULT_TAG = "MEMCC_RESULT "
ERROR_TAG = "MEMCC_ERROR "

CPU_METHOD = ("cpu-vmhwm: VmHWM - baseline RSS in a fresh process with "
              f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} MALLOC_ARENA_MAX=1")
CPU_METHOD_APPROX = "cpu-vmhwm-approximate: in-process, glibc may keep freed memory resident"


# ---------------------------------------------------------------------------- /proc access
def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise errors.RuntimeFailure(f"/proc/self/status has no {key}: cannot measure memory here")


def rss_bytes() -> int:
    """Resident set size of this process now."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    """Highest resident set size since start or since the last ``reset_peak_rss``."""
    return _status_bytes("VmHWM")


def reset_peak_rss() -> None:
    """Set the high-water mark to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def trim_heap() -> None:
    """Give free glibc heap pages back to the kernel so they do not count as resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: nothing to trim
        pass


M_MMAP_THRESHOLD = -3           # mallopt's parameter number (glibc's malloc.h)
GLIBC_MMAP_THRESHOLD = 128 * 1024  # glibc's starting threshold


def fix_mmap_threshold(nbytes: int = GLIBC_MMAP_THRESHOLD) -> bool:
    """Stop glibc from raising its mmap threshold (the CPU arena's training process).

    glibc raises the threshold to the size of each mmapped block freed (up to 32 MiB): once
    the CPU arena has given back its regions at the end of a step, a kernel's heap buffer
    of a few MiB (ScatterElements' copy of its indices) comes from the heap, and its pages
    stay resident after it is freed until the heap is trimmed, unless a later arena region
    reuses them. Measured on the zoo's ResNet-18 (16 x 128 px) trained with ``--arena``:
    3 steps of 5 held that 4 MiB copy to the step's peak, none with the threshold fixed.
    A process started with ``MALLOC_MMAP_THRESHOLD_`` (the measuring child) keeps its own.
    Returns whether the threshold was set."""
    return _mallopt({M_MMAP_THRESHOLD: int(nbytes)})


def _mallopt(settings: dict[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value), unless the process was started with
    ``MALLOC_MMAP_THRESHOLD_`` (the measuring child's exact allocator, which must stay as
    started); whether every setting was made (False where libc is not glibc)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return all([bool(libc.mallopt(k, v)) for k, v in settings.items()])
    except (OSError, AttributeError):  # not glibc
        return False


M_TRIM_THRESHOLD = -1           # and the trim threshold's
# glibc's largest dynamic mmap threshold on 64-bit: larger buffers stay mmaps of their own.
HEAP_SERVES_UP_TO = 32 * 1024 * 1024
# Free memory at the heap's top glibc keeps before it hands it back.
HEAP_KEEPS_FREE = 256 * 1024 * 1024


def keep_heap_between_steps() -> bool:
    """Let glibc serve a step's buffers of up to 32 MiB from its heap and keep freed heap
    memory between steps (a data-parallel CPU rank, which runs the gradient and update
    steps as two sessions and allocates straight from malloc).

    At glibc's defaults such a rank gave back the heap's top after each step and faulted
    its pages in again the next: on the zoo GPT-2 that ``benchmarks/data_parallel.py``
    trains, 18-20% of a rank's CPU time was the kernel's (27,000-30,000 page faults a step)
    against 4-5% for ``memcc.Trainer``'s fused step; kept, under 1% and 0.40-0.42 s a step
    instead of 0.50-0.51 (``benchmarks/data_parallel_costs.py --part heap``). This changes
    when freed memory returns to the kernel, not how much a step holds at once: the peak
    resident size was the same (757 MB both ways) and ``trim_heap`` still returns the free
    heap at the end.
    A process started with ``MALLOC_MMAP_THRESHOLD_`` (``--measure-memory``'s exact
    measurement) keeps its own. Returns whether the settings were made."""
    return _mallopt({M_MMAP_THRESHOLD: HEAP_SERVES_UP_TO, M_TRIM_THRESHOLD: HEAP_KEEPS_FREE})


def exact_cpu_measurement() -> bool:
    """True in a process that glibc started with the mmap threshold memcc measures under."""
    return os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(MMAP_THRESHOLD)


class CpuPeakMeter:
    """Peak resident memory of one step over a fixed baseline (see the module docstring)."""

    def __init__(self) -> None:
        self.baseline: int | None = None

    @property
    def method(self) -> str:
        return CPU_METHOD if exact_cpu_measurement() else CPU_METHOD_APPROX

    def set_baseline(self) -> int:
        trim_heap()
        self.baseline = rss_bytes()
        return self.baseline

    def start(self) -> None:
        trim_heap()
        reset_peak_rss()

    def stop(self) -> int:
        if self.baseline is None:
            raise RuntimeError("CpuPeakMeter.stop before set_baseline")
        return peak_rss_bytes() - self.baseline


# ---------------------------------------------------------------------------- CUDA
class NvmlPeakMeter:
    """Device memory in use, sampled from a thread while a step runs (NVML)."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.0005) -> None:
        self.interval_s = interval_s
        self.baseline: int | None = None
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml  # type: ignore[import-not-found]
        except ImportError:
            self._nvml = None
            self.method = "none: pynvml is not installed, so CUDA memory was not measured"
            return
        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self.method = ("cuda-nvml: device memory used, sampled during the step, minus the "
                       "used memory before the step's session existed")

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def used(self) -> int:
        """The device memory in use now, as NVML reports it."""
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def set_baseline(self) -> int | None:
        if not self.available:
            return None
        self.baseline = self.used()
        return self.baseline

    def start(self) -> None:
        if not self.available:
            return
        self._peak = self.used()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.used())
            time.sleep(self.interval_s)

    def stop(self) -> int | None:
        if not self.available or self._thread is None:
            return None
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self.used())
        return self._peak - (self.baseline or 0)


def device_baseline() -> int | None:
    """NVML's used device memory once this process holds a CUDA context, before a step's
    session is made (None without pynvml). The context is created by a throw-away one-node
    CUDA session, which is gone again when the reading is taken."""
    meter = NvmlPeakMeter()
    if not meter.available:
        return None
    import onnx

    from memcc.backend.session import make_session

    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Add", ["x", "x"], ["y"])], "memcc_context",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = make_session(model, "cuda")
    session.run(None, {"x": np.ones(1, np.float32)})
    del session
    return meter.set_baseline()


# ---------------------------------------------------------------------------- child process
def child_env() -> dict[str, str]:
    """Environment of the measuring child: the mmap threshold and memcc importable."""
    env = dict(os.environ)
    env.update(MMAP_ENV)
    env[CHILD_FLAG] = "1"
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def in_measuring_child() -> bool:
    return os.environ.get(CHILD_FLAG) == "1" and exact_cpu_measurement()


def timing_env() -> dict[str, str]:
    """Environment for a child that only times steps: glibc's own allocator settings.

    In the measuring child every fresh buffer is a new mmap whose pages fault on first
    touch, which slows steps by 1.5-2.5x on CPU and charges recomputation for it; timing in
    a separate process with the default allocator measures what a user's run costs."""
    env = child_env()
    for key in MMAP_ENV:
        env.pop(key, None)
    return env


def run_child(module: str, payload: dict, *, timeout_s: float | None = None,
              measuring: bool = True) -> dict:
    """Run ``python -m module --child -`` under ``child_env`` (or ``timing_env`` when not
    ``measuring``), the JSON payload on its standard input, and return its result. Not on
    the command line: Linux caps one argument at 128 KiB, and a plan's payload (its
    recomputed and variant nodes, by name) passes that on a ResNet-50 ``--budget min``.

    The child prints one ``MEMCC_RESULT {json}`` line, or ``MEMCC_ERROR {json}`` naming a
    ``memcc.errors`` class, which is raised here again so callers see the same errors as
    in-process.
    """
    cmd = [sys.executable, "-m", module, "--child", "-"]
    try:
        proc = subprocess.run(cmd, env=child_env() if measuring else timing_env(),
                              input=json.dumps(payload), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise errors.RuntimeFailure(f"the measuring process timed out after {timeout_s} s") from exc
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
        if line.startswith(ERROR_TAG):
            err = json.loads(line[len(ERROR_TAG):])
            cls = getattr(errors, err.get("type", ""), None)
            if not (isinstance(cls, type) and issubclass(cls, errors.MemccError)):
                cls = errors.RuntimeFailure
            raise cls(err.get("message", "the measuring process failed"))
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
    how = f"was killed by signal {-proc.returncode}" if proc.returncode < 0 else \
        f"exited with status {proc.returncode}"
    hint = " (out of memory?)" if proc.returncode in (-9, 137) else ""
    raise errors.RuntimeFailure(
        f"the measuring process {how}{hint} without a result:\n" + "\n".join(tail)
    )


def measure_in_subprocess(
    model,
    feeds: Mapping[str, np.ndarray],
    *,
    runs: int = 2,
    warmup: bool = True,
    provider: str = "cpu",
    overrides: Mapping[str, object] | None = None,
) -> list[int]:
    """Measured peak of each of ``runs`` runs of one model, in a fresh measuring process.

    The same procedure as the training-step runner (baseline after session creation and an
    optional warm-up run, inputs loaded after the baseline, high-water mark reset per run),
    for any ONNX model and feeds. ``overrides`` sets ``SessionOptions`` attributes on top
    of the execution contract, e.g. ``{"enable_mem_reuse": True}``; enum-valued ones take
    the enum member's name (``{"execution_order": "DEFAULT"}``). Used by the tests that
    pin ORT's allocation behaviour, and to check a prediction on a graph directly.
    """
    return measure_many_in_subprocess({"model": (model, feeds)}, runs=runs, warmup=warmup,
                                      provider=provider, overrides=overrides)["model"]


def measure_many_in_subprocess(
    cases: Mapping[str, tuple[object, Mapping[str, np.ndarray]]],
    *,
    runs: int = 2,
    warmup: bool = True,
    provider: str = "cpu",
    overrides: Mapping[str, object] | None = None,
) -> dict[str, list[int]]:
    """``measure_in_subprocess`` for several models, one child process for all of them."""
    import onnx

    with tempfile.TemporaryDirectory(prefix="memcc-measure-") as tmp:
        jobs = []
        for i, (name, (model, feeds)) in enumerate(cases.items()):
            model_file = Path(tmp) / f"m{i}.onnx"
            feeds_file = Path(tmp) / f"f{i}.npz"
            if isinstance(model, (str, os.PathLike)):
                model_file = Path(model)
            else:
                onnx.save_model(model, str(model_file))
            np.savez(feeds_file, **{k: np.asarray(v) for k, v in feeds.items()})
            jobs.append({"name": name, "model": str(model_file), "feeds": str(feeds_file)})
        payload = {"jobs": jobs, "runs": runs, "warmup": warmup, "provider": provider,
                   "overrides": dict(overrides or {})}
        return run_child("memcc.backend.memory", payload)


def _measure_jobs(payload: Mapping) -> dict[str, list[int]]:
    """Child side of ``measure_many_in_subprocess``."""
    from memcc.backend.session import SessionSettings, make_session

    out: dict[str, list[int]] = {}
    for job in payload["jobs"]:
        session = make_session(job["model"], payload["provider"],
                               SessionSettings(option_overrides=payload["overrides"]))
        meter = CpuPeakMeter()
        if payload["warmup"]:
            feeds = load_npz(job["feeds"])
            session.run(None, feeds)
            del feeds
        meter.set_baseline()
        feeds = load_npz(job["feeds"])
        peaks = []
        for _ in range(int(payload["runs"])):
            meter.start()
            result = session.run(None, feeds)
            peaks.append(meter.stop())
            del result
        out[job["name"]] = peaks
        del feeds, session
    return out


def load_npz(path: str) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file memcc wrote itself (a run's feeds): no checks, unlike
    ``backend.data.read_npz``, which reads a user's ``--data``."""
    with np.load(path, allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def child_main(argv: list[str], handler) -> int:
    """Body of a ``--child`` entry point: run ``handler(payload)``, print the tagged result.
    The payload is the JSON after ``--child``, or standard input where that is ``-``."""
    try:
        arg = argv[argv.index("--child") + 1]
        payload = json.loads(sys.stdin.read() if arg == "-" else arg)
        result = handler(payload)
    except errors.MemccError as exc:
        print(ERROR_TAG + json.dumps({"type": type(exc).__name__, "message": str(exc)}),
              flush=True)
        return 2
    except Exception as exc:  # report, so the parent shows more than "exited with 1"
        print(ERROR_TAG + json.dumps({"type": "RuntimeFailure",
                                      "message": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":  # python -m memcc.backend.memory --child - (JSON on stdin)
    sys.exit(child_main(sys.argv, _measure_jobs))
