"""Running ORT to time things: per-node times of a step, and this CPU's roofline rates.

These are the only parts of the cost model that execute anything, so they live in
``backend/`` (which may run ORT) and hand plain numbers to ``passes/analysis/cost_model.py`` (which
may not). Both results are cached on disk: profiling a big step takes as long as a few
training steps, and the rates are a property of the machine, not of the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel, DeviceRates

CACHE_DIR = Path(os.environ.get("MEMCC_CACHE", Path.home() / ".cache" / "memcc"))
# Bump when what ``measured_costs`` stores changes meaning.
MEASURED_VERSION = "v5"


def model_hash(model: onnx.ModelProto | bytes) -> str:
    """Cache key of a step: the same bytes give the same measurements (``model``: the
    step, or its bytes as ``SerializeToString(deterministic=True)`` writes them)."""
    data = model if isinstance(model, bytes) else model.SerializeToString(deterministic=True)
    return hashlib.sha256(data).hexdigest()[:24]


# A calibration is made again after this many seconds (a week), or sooner where it was made
# on a loaded machine (``_stale``).
CALIBRATION_MAX_AGE_S = 7 * 24 * 3600.0
# This process's rates, once read or made: every plan of one process is priced alike.
_RATES: list[DeviceRates] = []


def calibrate_cpu_rates(*, use_cache: bool = True) -> DeviceRates:
    """Measure this machine's ORT CPU MatMul rate, memory bandwidth and kernel overhead.

    Each kernel's fastest of several runs: a run another process slowed says nothing of the
    machine. The result is cached with when it was made and the load then; a week later,
    or once the machine is quieter than a loaded calibration's, it is made again: one made
    under load (2.4 GB/s and 33 GFLOP/s where a quiet run of the same machine gives 10.9 and
    281) priced a transformers GPT-2's step at 1,144 ms against 194 ms measured, and was
    kept for every compile after it."""
    cache = CACHE_DIR / "cpu_rates.json"
    if use_cache and _RATES:
        return _RATES[0]   # one process prices every plan alike
    if use_cache and cache.exists():
        try:
            d = json.loads(cache.read_text())
            if not _stale(d):
                _RATES[:] = [DeviceRates(d["flops_per_s"], d["bytes_per_s"], d["overhead_s"],
                                         d["source"])]
                return _RATES[0]
        except (KeyError, ValueError, TypeError):
            pass
    rng = np.random.default_rng(0)
    n = 768
    a = rng.standard_normal((n, n), dtype=np.float32)
    t_mm = _timed(_two_input_model("MatMul", [n, n], [n, n]), {"a": a, "b": a})
    big = rng.standard_normal((4_000_000,), dtype=np.float32)
    t_add = _timed(_two_input_model("Add", [4_000_000], [4_000_000]), {"a": big, "b": big})
    tiny = np.ones((1,), np.float32)
    t_tiny = _timed(_two_input_model("Add", [1], [1]), {"a": tiny, "b": tiny}, reps=50)
    rates = DeviceRates(
        flops_per_s=2.0 * n**3 / t_mm,
        bytes_per_s=3 * big.nbytes / t_add,
        overhead_s=t_tiny,
        source="calibrated on this CPU",
    )
    _RATES[:] = [rates]
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(rates.to_json() | {
            "calibrated_at": time.time(), "load_per_core": _load_per_core()}))
    except OSError:
        pass
    return rates


def _load_per_core() -> float | None:
    """The 1-minute load average per core (None where the OS does not say)."""
    try:
        return os.getloadavg()[0] / max(os.cpu_count() or 1, 1)
    except (OSError, AttributeError):
        return None


def _stale(cached: dict) -> bool:
    """Whether a cached calibration should be made again: older than
    ``CALIBRATION_MAX_AGE_S`` (or of a memcc that did not date it), or made with more than
    one process per core running or waiting where the machine now has less than
    half that load."""
    made = cached.get("calibrated_at")
    if not isinstance(made, (int, float)) or time.time() - made > CALIBRATION_MAX_AGE_S:
        return True
    then, now = cached.get("load_per_core"), _load_per_core()
    return isinstance(then, (int, float)) and now is not None and then > 1.0 \
        and now < then / 2


def _timed(model: onnx.ModelProto, feeds: dict, reps: int = 7) -> float:
    """Fastest wall time of one warmed-up session run over ``reps`` runs."""
    from memcc.backend.session import make_session

    sess = make_session(model, "cpu")
    sess.run(None, feeds)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _two_input_model(op: str, shape_a, shape_b) -> onnx.ModelProto:
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node(op, ["a", "b"], ["y"])], "cal",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape_a),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, shape_b)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _spread_executor_overhead(graph: Graph, seconds: dict[str, float], wall_s: float) -> None:
    """Make the per-node times add up to the measured step (a session without profiling).

    Profiled kernel times are not the step: profiling slows kernels down, and the executor's
    own per-node work (with the arena off: allocating and zero-filling every output) is not
    in them. When the kernels add up to more than the step, scale them down; when to less,
    give every node a share of the rest in proportion to the bytes it allocates, so that a
    recomputed node is charged its allocation too (docs/COST_MODEL.md)."""
    kernel = sum(seconds.values())
    if kernel <= 0 or wall_s <= 0:
        return
    if kernel >= wall_s:
        for name in seconds:
            seconds[name] *= wall_s / kernel
        return
    rest = wall_s - kernel
    weights = {n.name: sum(graph.info[o].nbytes for o in n.output if o in graph.info) + 4096
               for n in graph.nodes if n.op_type != "Constant"}
    total = float(sum(weights.values())) or 1.0
    for name, w in weights.items():
        seconds[name] = seconds.get(name, 0.0) + rest * w / total


def _cache_file(model: onnx.ModelProto | bytes, provider: str) -> Path:
    return CACHE_DIR / "costs" / f"{model_hash(model)}-{provider}-{MEASURED_VERSION}.json"


def _read_cache(cache: Path, provider: str, rates: DeviceRates | None) -> CostModel | None:
    if not cache.exists():
        return None
    try:
        d = json.loads(cache.read_text())
        return CostModel(d["seconds"], "measured", provider, d["kernel_s"], rates=rates)
    except (ValueError, KeyError):
        return None


def cached_costs(graph: Graph, provider: str = "cpu") -> CostModel | None:
    """The node times ``measured_costs`` measured for this very step before, or None."""
    data = graph.to_model().SerializeToString(deterministic=True)
    return _read_cache(_cache_file(data, provider), provider, None)


# Profiled runs ``measured_costs`` takes by default; it runs the step ``measuring_runs``
# times in all.
PROFILED_RUNS = 3


def measuring_runs(runs: int = PROFILED_RUNS) -> int:
    """Steps ``measured_costs`` runs: a warm-up, ``runs`` profiled, ``runs`` timed."""
    return 1 + 2 * runs


def measured_costs(graph: Graph, provider: str = "cpu", *, runs: int = PROFILED_RUNS,
                   use_cache: bool = True, feeds: Mapping[str, np.ndarray] | None = None,
                   rates: DeviceRates | None = None) -> CostModel:
    """Per node: median kernel time over ``runs`` profiled runs of the graph in ORT, plus its
    share of the executor's time (``_spread_executor_overhead``).

    ``rates`` shape the analytic estimate that prices nodes the profile did not see (clones,
    variants, copies; ``CostModel.price``); its scale does not matter, the calibration
    against the measured nodes fixes it."""
    from memcc.backend.runner import synthetic_feeds
    from memcc.backend.session import SessionSettings, make_session, resolve_provider
    from memcc.backend.step_feeds import refuse_bfloat16_feeds

    refuse_bfloat16_feeds(graph, source="the step", doing="measure its node times",
                          instead="--cost analytic estimates them without running it")
    model = graph.to_model()
    # Serialised once, for the key and (on the CPU) the session.
    data = model.SerializeToString(deterministic=True)
    cache = _cache_file(data, provider)
    if use_cache and (known := _read_cache(cache, provider, rates)) is not None:
        return known
    if feeds is None:
        feeds = synthetic_feeds(graph, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "memcc_cost")
        sess = make_session(data if resolve_provider(provider) == "cpu" else model, provider,
                            SessionSettings(profile=True, profile_prefix=prefix))
        sess.run(None, dict(feeds))  # warm-up: first-run allocations are not kernel time
        for _ in range(runs):
            sess.run(None, dict(feeds))
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
        # Profiling slows kernels down: the step's real length comes from runs after it
        # ended, in the same session, already warm (ORT records nothing once profiling
        # ends: tests/test_ort_facts.py), not a second load of the weights and warm-up.
        walls = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, dict(feeds))
            walls.append(time.perf_counter() - t0)
        del sess
    samples: dict[str, list[float]] = {}
    for ev in events:
        if ev.get("cat") != "Node":
            continue
        name = ev.get("name", "")
        if not name.endswith("_kernel_time"):
            continue
        node = name[: -len("_kernel_time")]
        samples.setdefault(node, []).append(float(ev.get("dur", 0)) * 1e-6)
    seconds = {}
    for node in graph.nodes:
        s = samples.get(node.name, [])
        # Drop the warm-up sample when there are more.
        s = s[1:] if len(s) > runs else s
        seconds[node.name] = statistics.median(s) if s else 0.0
    kernel_s = float(sum(seconds.values()))
    _spread_executor_overhead(graph, seconds, statistics.median(walls))
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"seconds": seconds, "kernel_s": kernel_s}))
    except OSError:
        pass
    return CostModel(seconds, "measured", provider, kernel_s, rates=rates)
