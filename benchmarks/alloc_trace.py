"""Which allocations make a CPU step's measured peak differ from its predicted one.

The CPU meter (``memcc/backend/memory.py``) reports one number per step, the resident
high-water mark over a baseline. Where it is above the prediction, this runs the step as
``memcc run`` does, with an allocation log preloaded into the measuring process
(``benchmarks/alloc_trace/preload.c``, built here with the system C compiler), and splits the
first measured step's traced peak into:

- tensors: buffers from ORT's CPU allocator (aligned ``operator new``), set against the
  values the prediction holds live at its peak node (page-rounded, as the meter counts);
- ORT's other buffers of 4 KiB or more (per-run bookkeeping, kernel scratch), with the
  library frames that took them and how long they lived, as a share of the step;
- the runner's own Python buffers of 4 KiB or more;
- glibc heap bytes (buffers under 4 KiB): live at the traced peak, and the heap top's growth.

    python benchmarks/alloc_trace.py STEP.onnx [--arena] [--keep-log LOG]

The traced peak counts bytes as the meter would; it is not the meter's figure (the log's
own memory and page faults are not in it), which is printed beside it. Linux and glibc only.
ORT's frames are offsets in a stripped library: compare them between runs and versions, do
not expect names.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MMAP_BYTES = 4096
LOG_ENV = "MEMCC_ALLOC_TRACE_LOG"


# ---------------------------------------------------------------------------- the child
def _as_child() -> int:
    """The measuring child with the log armed at the baseline and dumped after step 1."""
    from memcc.backend import memory
    from memcc.backend.cpu_child import execute

    lib = ctypes.CDLL(None)
    meter = memory.CpuPeakMeter
    base, start, stop = meter.set_baseline, meter.start, meter.stop
    steps = {"n": 0}

    def set_baseline(self):
        got = base(self)
        lib.trace_arm()
        return got

    def start_step(self):
        start(self)
        lib.trace_mark(ctypes.c_long(1))

    def stop_step(self):
        got = stop(self)
        lib.trace_mark(ctypes.c_long(2))
        steps["n"] += 1
        if steps["n"] == 1:
            lib.trace_dump(os.environ[LOG_ENV].encode())
        return got

    meter.set_baseline, meter.start, meter.stop = set_baseline, start_step, stop_step
    return memory.child_main(sys.argv, execute)


# ---------------------------------------------------------------------------- the parent
def _build(out: Path) -> Path:
    lib = out / "preload.so"
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(lib),
                    str(HERE / "alloc_trace" / "preload.c"), "-ldl"], check=True)
    return lib


def _traced_run(step: Path, arena: bool, lib: Path, log: Path):
    """``memcc run``'s measurement with the measuring child replaced by ``_as_child`` (its
    meter figures include the log's own pages; ``report`` takes them from an untraced run)."""
    from memcc.backend import memory
    from memcc.backend.runner import RunRequest, run_steps

    real = memory.run_child

    def run_child(module: str, payload: dict, **kw) -> dict:
        if module != "memcc.backend.runner" or not kw.get("measuring", True):
            return real(module, payload, **kw)
        env = {**memory.child_env(), "LD_PRELOAD": str(lib), LOG_ENV: str(log),
               "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, __file__, "--as-child", "--child", "-"],
                              env=env, input=json.dumps(payload), capture_output=True,
                              text=True, check=False)
        for line in proc.stdout.splitlines():
            if line.startswith(memory.RESULT_TAG):
                return json.loads(line[len(memory.RESULT_TAG):])
        raise SystemExit(f"the traced child failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    memory.run_child = run_child
    try:
        return run_steps(step, RunRequest(steps=2, arena=arena, separate_timing=False))
    finally:
        memory.run_child = real


@dataclass
class _Alloc:
    bytes: int
    frames: tuple[str, ...]
    at: int
    end: int | None = None


@dataclass
class _Step:
    """The first measured step of the log: its allocations and its traced peak."""

    start_bytes: int = 0
    peak_bytes: int = 0
    peak_live: dict[str, _Alloc] = field(default_factory=dict)
    allocs: list[_Alloc] = field(default_factory=list)
    events: int = 1


def _read_log(log: Path) -> _Step:
    live: dict[str, _Alloc] = {}
    total, step, inside, first = 0, _Step(), False, 0
    for i, line in enumerate(log.read_text().splitlines()):
        ptr, nbytes, *frames = line.split(" ")
        n = int(nbytes)
        if ptr == "0":
            if frames == ["mark:1"]:
                inside, first, step.start_bytes = True, i, total
                before = set(live)
            elif frames == ["mark:2"] and inside:
                step.events = i - first
                break
            continue
        if n > 0:
            live[ptr] = a = _Alloc(n, tuple(frames), i)
            total += n
            if inside:
                step.allocs.append(a)
        elif ptr in live:
            a = live.pop(ptr)
            a.end = i
            total -= a.bytes
        if inside and n > 0 and total > step.peak_bytes:
            step.peak_bytes = total
            step.peak_live = {k: v for k, v in live.items() if k not in before}
    for a in step.allocs:
        a.at -= first
        a.end = step.events if a.end is None else a.end - first
    return step


def _kind(a: _Alloc) -> str:
    if a.bytes < MMAP_BYTES:
        return "heap"
    top = a.frames[0] if a.frames else ""
    if "align_val_t" in top or "posix_memalign" in top:
        return "tensor"
    if any("onnxruntime" in f for f in a.frames):
        return "ort"
    return "python"


def _predicted_tensors(step: Path) -> tuple[collections.Counter, int, str]:
    from memcc.backend.runner import _arranged
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.liveness import allocation_bytes

    graph, pred, _ = _arranged(step, load_graph(step), True)
    before = set(graph.inputs) | set(graph.initializers)
    sizes = collections.Counter(
        allocation_bytes(graph.info[v].nbytes) for v in pred.live_at_peak
        if v not in before and v in graph.info)
    return sizes, pred.peak_bytes - pred.start_bytes, str(pred.peak_node)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def report(step: Path, plain, traced: _Step) -> None:
    by_kind: dict[str, list[_Alloc]] = collections.defaultdict(list)
    for a in traced.peak_live.values():
        by_kind[_kind(a)].append(a)
    predicted, pred_growth, node = _predicted_tensors(step)
    measured = [b for b in plain.measured_peak_bytes_per_step if b is not None]
    print(f"{step.name}: meter {', '.join(_mib(b) for b in measured)} (untraced steps), "
          f"predicted {_mib(plain.predicted_peak_bytes)}, measured/predicted "
          f"{max(measured) / plain.predicted_peak_bytes:.4f} (worst step)")
    grew = traced.peak_bytes - traced.start_bytes
    print(f"step 1 traced: growth over the step's start {_mib(grew)}"
          f" (predicted growth {_mib(pred_growth)}, peak node {node})")
    got = collections.Counter(a.bytes for a in by_kind["tensor"])
    large = collections.Counter({b: k for b, k in predicted.items() if b >= MMAP_BYTES})
    print(f"  tensors of 4 KiB or more live at the traced peak: {_mib(sum(got.elements()))}; "
          f"at the predicted peak node {_mib(sum(large.elements()))}; bytes x count traced "
          f"but not predicted {sorted((got - large).items())}, predicted but not traced "
          f"{sorted((large - got).items())}")
    small = sum(b for b in predicted.elements() if b < MMAP_BYTES)
    print(f"  tensors under 4 KiB at the predicted peak node: {_mib(small)}")
    for kind in ("ort", "python"):
        allocs = by_kind[kind]
        print(f"  {kind} buffers of 4 KiB or more live there: {_mib(sum(a.bytes for a in allocs))}")
        for a in sorted(allocs, key=lambda a: -a.bytes):
            print(f"    {a.bytes:>8} B  from {a.at / traced.events:.2f} to "
                  f"{a.end / traced.events:.2f} of the step  "
                  f"{' | '.join(f.split(':', 1)[-1] for f in a.frames[:4])}")
    heap = by_kind["heap"]
    print(f"  heap buffers under 4 KiB live there (allocated in the step): "
          f"{_mib(sum(a.bytes for a in heap))} in {len(heap)} buffers")


def main() -> None:
    if "--as-child" in sys.argv:
        sys.argv.remove("--as-child")
        sys.exit(_as_child())
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("step", type=Path)
    ap.add_argument("--arena", action="store_true", help="run through ORT's CPU arena")
    ap.add_argument("--keep-log", type=Path, help="write the allocation log here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        lib = _build(Path(tmp))
        log = a.keep_log or Path(tmp) / "alloc.log"
        from memcc.backend.runner import RunRequest, run_steps

        plain = run_steps(a.step, RunRequest(steps=4, arena=a.arena, separate_timing=False))
        _traced_run(a.step, a.arena, lib, log)
        report(a.step, plain, _read_log(log))


if __name__ == "__main__":
    main()
