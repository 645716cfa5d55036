"""Time of every node: measured in ORT on the target provider, or estimated from FLOPs/bytes.

The planner only sees numbers (seconds per node). Two sources fill them:
``measured`` profiles the step in ORT under the execution contract and takes the median
kernel time per node over a few runs (cached on disk by model hash and provider, because
profiling a big step takes as long as a few training steps); ``analytic`` is a roofline
estimate, max(FLOPs / compute rate, bytes / memory bandwidth) plus a per-kernel overhead,
with rates calibrated once per machine on small ORT kernels. Unit costs (every node 1) exist
for tests and for comparing strategies independently of timing noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from memcc.graph import Graph, attr

CACHE_DIR = Path(os.environ.get("MEMCC_CACHE", Path.home() / ".cache" / "memcc"))

# Ops that only move or reinterpret data: no arithmetic, cost is bytes.
_MOVEMENT = {
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Concat", "Split",
    "Slice", "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Expand",
    "Tile", "Pad", "Cast", "Shape", "Size", "Constant", "ConstantOfShape", "Where",
}
# Ops that alias their input in ORT CPU (no kernel work at all).
_FREE = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Size", "Constant"}
_TRANSCENDENTAL = {"Exp", "Log", "Tanh", "Sigmoid", "Erf", "Pow", "Sqrt", "Softmax",
                   "LogSoftmax", "Gelu", "Softplus", "Elu", "Selu", "Reciprocal", "Div"}


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates used by the roofline estimate."""

    flops_per_s: float
    bytes_per_s: float
    overhead_s: float
    source: str

    def to_json(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s,
                "overhead_s": self.overhead_s, "source": self.source}


# Nominal FP32 rates for the CUDA provider (H100-class, non tensor-core); not measured here.
CUDA_NOMINAL = DeviceRates(4.0e13, 2.5e12, 8e-6, "nominal H100 fp32 rates (unverified)")


@dataclass(frozen=True)
class CostModel:
    """Seconds per node name, plus where the numbers came from."""

    seconds: Mapping[str, float]
    source: str  # "measured", "analytic" or "unit"
    provider: str
    kernel_s: float | None = None  # measured only: the profiled kernel time alone

    def of(self, node: onnx.NodeProto) -> float:
        return float(self.seconds.get(node.name, 0.0))

    def total(self, graph: Graph) -> float:
        return float(sum(self.of(n) for n in graph.nodes))


def node_flops_bytes(graph: Graph, node: onnx.NodeProto) -> tuple[float, float]:
    """Arithmetic operations and bytes touched by one node, from static shapes."""
    info = graph.info
    ins = [info[i] for i in node.input if i and i in info]
    outs = [info[o] for o in node.output if o and o in info]
    nbytes = float(sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs))
    out_numel = float(sum(t.numel for t in outs))
    op = node.op_type
    if op in _FREE:
        return 0.0, 0.0
    if op in _MOVEMENT:
        return 0.0, nbytes
    if op == "MatMul" and len(ins) == 2:
        k = ins[0].shape[-1] if ins[0].shape else 1
        return 2.0 * out_numel * k, nbytes
    if op == "Gemm" and len(ins) >= 2:
        a = ins[0].shape
        k = a[0] if attr(node, "transA", 0) else a[-1]
        return 2.0 * out_numel * k, nbytes
    if op == "Conv" and len(ins) >= 2:
        w = ins[1].shape  # [C_out, C_in/group, k...]
        return 2.0 * out_numel * float(np.prod(w[1:])), nbytes
    if op == "ConvTranspose" and len(ins) >= 2:
        w = ins[1].shape  # [C_in, C_out/group, k...]
        return 2.0 * ins[0].numel * float(np.prod(w[1:])), nbytes
    in_numel = float(sum(t.numel for t in ins))
    factor = 8.0 if op in _TRANSCENDENTAL else 1.0
    if op.startswith("Reduce") or op in ("BatchNormalization", "LayerNormalization",
                                         "MaxPool", "AveragePool", "GlobalAveragePool"):
        if op in ("MaxPool", "AveragePool"):
            k = attr(node, "kernel_shape", [1])
            return out_numel * float(np.prod(k)), nbytes
        return 4.0 * in_numel, nbytes
    return factor * max(out_numel, in_numel), nbytes


def unit_costs(graph: Graph) -> CostModel:
    return CostModel({n.name: 1.0 for n in graph.nodes}, "unit", "none")


def analytic_costs(graph: Graph, rates: DeviceRates) -> CostModel:
    seconds = {}
    for node in graph.nodes:
        flops, nbytes = node_flops_bytes(graph, node)
        if flops == 0.0 and nbytes == 0.0:
            seconds[node.name] = 0.0
            continue
        seconds[node.name] = max(flops / rates.flops_per_s, nbytes / rates.bytes_per_s) \
            + rates.overhead_s
    return CostModel(seconds, "analytic", rates.source)


def calibrate_cpu_rates(*, use_cache: bool = True) -> DeviceRates:
    """Measure this machine's ORT CPU MatMul rate, memory bandwidth and kernel overhead."""
    cache = CACHE_DIR / "cpu_rates.json"
    if use_cache and cache.exists():
        try:
            d = json.loads(cache.read_text())
            return DeviceRates(d["flops_per_s"], d["bytes_per_s"], d["overhead_s"], d["source"])
        except (KeyError, ValueError):
            pass
    from onnx import TensorProto, helper

    from memcc.backend.session import make_session

    def timed(model: onnx.ModelProto, feeds: dict, reps: int = 5) -> float:
        sess = make_session(model, "cpu")
        sess.run(None, feeds)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sess.run(None, feeds)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def model_of(op: str, shape_a, shape_b) -> onnx.ModelProto:
        g = helper.make_graph(
            [helper.make_node(op, ["a", "b"], ["y"])], "cal",
            [helper.make_tensor_value_info("a", TensorProto.FLOAT, shape_a),
             helper.make_tensor_value_info("b", TensorProto.FLOAT, shape_b)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        return m

    rng = np.random.default_rng(0)
    n = 768
    a = rng.standard_normal((n, n), dtype=np.float32)
    t_mm = timed(model_of("MatMul", [n, n], [n, n]), {"a": a, "b": a})
    big = rng.standard_normal((4_000_000,), dtype=np.float32)
    t_add = timed(model_of("Add", [4_000_000], [4_000_000]), {"a": big, "b": big})
    tiny = np.ones((1,), np.float32)
    t_tiny = timed(model_of("Add", [1], [1]), {"a": tiny, "b": tiny}, reps=50)
    rates = DeviceRates(
        flops_per_s=2.0 * n**3 / t_mm,
        bytes_per_s=3 * big.nbytes / t_add,
        overhead_s=t_tiny,
        source="calibrated on this CPU",
    )
    try:
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(rates.to_json()))
    except OSError:
        pass
    return rates


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


def model_hash(model: onnx.ModelProto) -> str:
    return hashlib.sha256(model.SerializeToString(deterministic=True)).hexdigest()[:24]


def measured_costs(graph: Graph, provider: str = "cpu", *, runs: int = 3,
                   use_cache: bool = True, feeds: Mapping[str, np.ndarray] | None = None
                   ) -> CostModel:
    """Per node: median kernel time over ``runs`` profiled runs of the graph in ORT, plus its
    share of the executor's time (``_spread_executor_overhead``)."""
    from memcc.backend.runner import synthetic_feeds
    from memcc.backend.session import make_session

    model = graph.to_model()
    key = f"{model_hash(model)}-{provider}-v4"
    cache = CACHE_DIR / "costs" / f"{key}.json"
    if use_cache and cache.exists():
        try:
            d = json.loads(cache.read_text())
            return CostModel(d["seconds"], "measured", provider, d["kernel_s"])
        except (ValueError, KeyError):
            pass
    if feeds is None:
        feeds = synthetic_feeds(graph, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = str(Path(tmp) / "memcc_cost")
        sess = make_session(model, provider, profile=True, profile_prefix=prefix)
        sess.run(None, dict(feeds))  # warm-up: first-run allocations are not kernel time
        for _ in range(runs):
            sess.run(None, dict(feeds))
        path = sess.end_profiling()
        events = json.loads(Path(path).read_text())
        del sess
        # Profiling slows kernels down; the step's real length comes from a plain session.
        plain = make_session(model, provider)
        plain.run(None, dict(feeds))
        walls = []
        for _ in range(runs):
            t0 = time.perf_counter()
            plain.run(None, dict(feeds))
            walls.append(time.perf_counter() - t0)
        del plain
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
    return CostModel(seconds, "measured", provider, kernel_s)
