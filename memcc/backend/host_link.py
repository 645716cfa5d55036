"""Measure the link swap copies cross: ``MemcpyToHost`` and ``MemcpyFromHost`` timed by ORT's
profiler at several sizes, and a latency + bytes / rate line fitted to each direction.

The planner prices an offload as one copy out and one copy in (``passes/planning/solvers/
offload_terms.py``); a nominal PCIe figure can be off by a factor of two either way (pinned
or pageable host memory, PCIe generation, a shared bus), which moves every swap decision. So
the link is measured once per machine and provider and cached next to the CPU rates
(``backend/profiling.py``). ORT gives ``MemcpyToHost`` a pinned host buffer on CUDA, so
the figure would be the pinned-memory rate the plan will see; but on CUDA the profiler
times the copies' launch (measured on an H100: 3 TB/s), so on CUDA the copies are timed by
the wall clock instead: the probe with its copies against the probe without, interleaved,
half the difference to each direction (not yet run on a GPU). A figure faster than any
host link (``MAX_BYTES_PER_S``) is refused either way, and the compile prices copies at the
nominal rate, with a warning.

On the CPU provider the copies are plain memcpy (ORT >= 1.31 runs them there): memcc never
swaps on CPU, and the CPU measurement only exercises this code where no GPU is present.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from memcc.backend.profiling import CACHE_DIR
from memcc.errors import RuntimeFailure
from memcc.passes.analysis.cost_model import HostLink

# Float32 elements per probe: 256 KiB to 64 MiB, where latency and bandwidth both show.
PROBE_ELEMENTS = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
LINK_VERSION = "v3"  # v1 could cache impossible CUDA figures; v3 times CUDA by the clock
# No host link is this fast (PCIe 5.0 x16 carries about 64 GB/s each way, NVLink-C2C about
# 450 GB/s). On an H100 with onnxruntime-gpu 1.31.1, ORT's profiler timed the CUDA copies'
# launch, not the copies: 3.1 TB/s to the host and 2.1 TB/s back, where a 256 MiB round trip
# took 0.25 s inside a step (BENCHMARKS.md, "CUDA on an H100"). A rate above this bound is
# refused, and the caller prices the copies at the nominal rate instead.
MAX_BYTES_PER_S = 5e11


def _probe_model(elements: int, copies: bool = True) -> onnx.ModelProto:
    """x -> Neg (on the device) -> copy out -> copy in -> Neg -> y: the copies have device
    tensors on both sides, as a planned swap does. ``copies=False``: the same without them,
    what a wall-clock round trip is measured against."""
    h = helper.make_node
    middle = [h("MemcpyToHost", ["a"], ["a_host"], name="to_host"),
              h("MemcpyFromHost", ["a_host"], ["a_back"], name="from_host")] if copies else []
    nodes = [h("Neg", ["x"], ["a"], name="on_device"), *middle,
             h("Neg", ["a_back" if copies else "a"], ["y"], name="back_on_device")]
    g = helper.make_graph(nodes, "host_link" if copies else "host_link_plain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [elements])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [elements])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _fit(points: list[tuple[int, float]], source: str) -> tuple[float, float]:
    """Least-squares latency and rate of seconds = latency + bytes / rate (latency >= 0)."""
    x = np.array([b for b, _ in points], dtype=float)
    y = np.array([s for _, s in points], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise RuntimeFailure(f"{source}: copy times do not grow with size ({points}); the "
                             "link could not be measured")
    return max(float(intercept), 0.0), 1.0 / float(slope)


def _wall_time(sess, feeds: dict) -> float:
    """Wall-clock seconds of one run (``session.run`` returns once the device is done: its
    outputs are on the host)."""
    t0 = time.perf_counter()
    sess.run(None, feeds)
    return time.perf_counter() - t0


def _profiled_points(provider: str, elements: tuple[int, ...], runs: int, tmp: Path
                     ) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """Each direction's copy time per size, from ORT's profiler (the copies' own events)."""
    from memcc.backend.session import SessionSettings, make_session

    out: list[tuple[int, float]] = []
    back: list[tuple[int, float]] = []
    for n in elements:
        x = np.ones(n, dtype=np.float32)
        sess = make_session(_probe_model(n), provider,
                            SessionSettings(profile=True, profile_prefix=tmp / f"link_{n}"))
        for _ in range(runs + 1):
            sess.run(None, {"x": x})
        events = json.loads(Path(sess.end_profiling()).read_text())
        times: dict[str, list[float]] = {"to_host": [], "from_host": []}
        for ev in events:
            name = str(ev.get("name", ""))
            for node in times:
                if ev.get("cat") == "Node" and name == f"{node}_kernel_time":
                    times[node].append(float(ev.get("dur", 0)) * 1e-6)
        for node, series in (("to_host", out), ("from_host", back)):
            samples = times[node][1:]  # the first run allocates
            if not samples:
                raise RuntimeFailure(f"ORT's profile has no time for the {node} copy on "
                                     f"{provider}: the link could not be measured")
            series.append((4 * n, statistics.median(samples)))
    return out, back


def _wall_clock_points(provider: str, elements: tuple[int, ...], runs: int
                       ) -> list[tuple[int, float]]:
    """One direction's copy time per size: half of what the copies add to a step's wall
    clock (the probe with its copies against the probe without, runs interleaved)."""
    from memcc.backend.session import make_session

    points = []
    for n in elements:
        feeds = {"x": np.ones(n, dtype=np.float32)}
        with_copies = make_session(_probe_model(n), provider)
        plain = make_session(_probe_model(n, copies=False), provider)
        for sess in (with_copies, plain):  # the first run allocates
            sess.run(None, feeds)
        a: list[float] = []
        b: list[float] = []
        for _ in range(max(runs, 3)):
            a.append(_wall_time(with_copies, feeds))
            b.append(_wall_time(plain, feeds))
        points.append((4 * n, max(statistics.median(a) - statistics.median(b), 0.0) / 2))
    return points


def default_method(provider: str) -> str:
    """How the link is timed unless asked otherwise: ORT's profiler times the CUDA copies'
    launch, not the copy (3 TB/s on an H100), so CUDA takes the wall clock."""
    return "wall" if provider == "cuda" else "profile"


def measure_host_link(provider: str, *, runs: int = 5, use_cache: bool = True,
                      elements: tuple[int, ...] = PROBE_ELEMENTS,
                      method: str | None = None) -> HostLink:
    """The measured link on ``provider`` (cached per machine and provider). ``method``:
    ``profile`` (ORT's profiler, each direction; the CPU's default) or ``wall`` (the wall
    clock, round trips, split evenly between the directions; CUDA's default, because the
    profiler times the CUDA copies' launch)."""
    import onnxruntime as ort

    method = method or default_method(provider)
    if method not in ("profile", "wall"):
        raise ValueError(f"host link method {method!r}: profile or wall")
    # One file per method: a profiled figure must never answer for a wall-clock one.
    cache = (CACHE_DIR
             / f"host_link-{provider}-{method}-{ort.__version__}-{LINK_VERSION}.json")
    if use_cache and cache.exists():
        try:
            cached = HostLink.from_json(json.loads(cache.read_text()))
            if max(cached.bytes_per_s, cached.from_host_bytes_per_s or 0) <= MAX_BYTES_PER_S:
                return cached
        except (KeyError, ValueError, TypeError):
            pass
    if method == "wall":
        out = back = _wall_clock_points(provider, elements, runs)
        how = "wall-clock round trips"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out, back = _profiled_points(provider, elements, runs, Path(tmp))
        how = "ORT's profiler"
    lat_out, rate_out = _fit(out, "MemcpyToHost")
    # The wall clock times round trips: one fit serves both directions.
    lat_back, rate_back = ((lat_out, rate_out) if method == "wall"
                           else _fit(back, "MemcpyFromHost"))
    for op, rate in (("MemcpyToHost", rate_out), ("MemcpyFromHost", rate_back)):
        if rate > MAX_BYTES_PER_S:
            raise RuntimeFailure(
                f"{op} measured at {rate / 1e9:,.0f} GB/s on {provider} ({how}), faster "
                "than any host link: what was timed is not the copy (ORT's profiler times "
                "the CUDA copies' launch), so the link could not be measured")
    link = HostLink(rate_out, lat_out, f"measured on this machine ({provider}, ORT "
                    f"{ort.__version__}, {how}, {len(elements)} sizes x {runs} runs)",
                    from_host_bytes_per_s=None if method == "wall" else rate_back,
                    from_host_latency_s=None if method == "wall" else lat_back)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(link.to_json()))
    except OSError:
        pass
    return link
