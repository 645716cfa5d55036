"""Time of every node, as the planner sees it: plain numbers, nothing executed here.

The planner only sees numbers (seconds per node). Three sources fill them:
``measured`` (``backend/profiling.py`` profiles the step in ORT and hands the per-node
times over: running ORT belongs to ``backend/``, this module only models); ``analytic``, a
roofline estimate, max(FLOPs / compute rate, bytes / memory bandwidth) plus a per-kernel
overhead, with rates calibrated once per machine (also in ``backend/profiling.py``); and
``unit`` (every node 1), for tests and for comparing strategies independently of timing
noise.

A plan creates nodes nobody measured: recompute clones, a gradient-rule variant's nodes,
copies to and from the host. Pricing them at 0 s would make them look free to every
strategy, so ``CostModel.price`` gives them the analytic estimate scaled by a factor fitted
on the measured nodes (``Calibration``), and a clone the time of the node it repeats.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.frontend.autocast import LOWER  # the ops autocast computes in 16-bit
from memcc.graph import SIXTEEN_BIT_TYPES, Graph, attr

# Ops that only move or reinterpret data: no arithmetic, cost is bytes.
_MOVEMENT = {
    "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose", "Concat", "Split",
    "Slice", "Gather", "GatherElements", "GatherND", "ScatterElements", "ScatterND", "Expand",
    "Tile", "Pad", "Cast", "Shape", "Size", "Constant", "ConstantOfShape", "Where",
    # Copies between memory spaces (swap): bytes at the estimate's bandwidth until a
    # measured transfer model prices them.
    "MemcpyToHost", "MemcpyFromHost",
}
# Ops that alias their input in ORT CPU (no kernel work at all).
_FREE = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Shape", "Size", "Constant"}
# Never executed by ORT (turned into initializers at load).
_NOT_RUN = {"Constant"}
_TRANSCENDENTAL = {"Exp", "Log", "Tanh", "Sigmoid", "Erf", "Pow", "Sqrt", "Softmax",
                   "LogSoftmax", "Gelu", "Softplus", "Elu", "Selu", "Reciprocal", "Div"}


@dataclass(frozen=True)
class DeviceRates:
    """Sustained rates used by the roofline estimate."""

    flops_per_s: float
    bytes_per_s: float
    overhead_s: float
    source: str
    # Matrix products and convolutions computing in bfloat16 / float16 (``--precision``)
    # run at this multiple of ``flops_per_s``: tensor cores' 16-bit rate over the rate the
    # float32 nodes were priced at (TF32 on CUDA, ORT's default: about 2x on an H100/H200
    # by the datasheets). 1 where 16-bit nodes compute in float32 (the CPU provider: the
    # step it runs has them between casts, passes/providers/sixteen_bit.py).
    sixteen_bit_flops: float = 1.0

    def to_json(self) -> dict:
        return {"flops_per_s": self.flops_per_s, "bytes_per_s": self.bytes_per_s,
                "overhead_s": self.overhead_s, "source": self.source,
                "sixteen_bit_flops": self.sixteen_bit_flops}


@dataclass(frozen=True)
class HostLink:
    """The device <-> host link a swap's copies cross: seconds = latency + bytes / rate.
    ``bytes_per_s`` / ``latency_s`` are the device-to-host direction; the host-to-device one
    is the same unless measured apart (``backend/host_link.py``). ORT runs ``MemcpyToHost`` /
    ``MemcpyFromHost`` on the compute stream by default (docs/ORT_NOTES.md), so a copy adds
    its whole time to the step."""

    bytes_per_s: float
    latency_s: float
    source: str
    from_host_bytes_per_s: float | None = None
    from_host_latency_s: float | None = None

    def seconds(self, nbytes: float, op: str = "MemcpyToHost") -> float:
        if op == "MemcpyFromHost" and self.from_host_bytes_per_s:
            latency = self.from_host_latency_s if self.from_host_latency_s is not None \
                else self.latency_s
            return latency + float(nbytes) / self.from_host_bytes_per_s
        return self.latency_s + float(nbytes) / self.bytes_per_s

    def round_trip(self, nbytes: float) -> float:
        """One copy out and one back (an offload)."""
        return self.seconds(nbytes, "MemcpyToHost") + self.seconds(nbytes, "MemcpyFromHost")

    def to_json(self) -> dict:
        out = {"bytes_per_s": self.bytes_per_s, "latency_s": self.latency_s,
               "source": self.source}
        if self.from_host_bytes_per_s is not None:
            out["from_host_bytes_per_s"] = self.from_host_bytes_per_s
            out["from_host_latency_s"] = self.from_host_latency_s
        return out

    @classmethod
    def from_json(cls, d: dict) -> HostLink:
        return cls(float(d["bytes_per_s"]), float(d["latency_s"]), str(d["source"]),
                   d.get("from_host_bytes_per_s"), d.get("from_host_latency_s"))


# Pinned-memory copies over PCIe 4/5 x16 reach 20-25 GB/s each way; not measured here.
PCIE_NOMINAL = HostLink(2.0e10, 1.0e-5, "nominal PCIe pinned-memory rate (unverified)")
COPY_OPS = frozenset({"MemcpyToHost", "MemcpyFromHost"})


def host_link_for(provider: str) -> HostLink | None:
    """The link swap copies cross on ``provider``: none on the CPU provider (host and
    device are one memory, nothing to swap); the nominal PCIe link on CUDA until it is
    measured (issue 11)."""
    return PCIE_NOMINAL if provider == "cuda" else None

# Nominal FP32 rates for the CUDA provider (H100-class, non tensor-core); not measured here.
CUDA_NOMINAL = DeviceRates(4.0e13, 2.5e12, 8e-6, "nominal H100 fp32 rates (unverified)",
                           sixteen_bit_flops=2.0)


# Shapes the estimate for unseen nodes when a measured model has no rates of its own; only
# the ratio of the two rates matters there, the calibration fixes the scale.
NOMINAL_CPU = DeviceRates(1e11, 1e10, 5e-6, "nominal CPU rates (scale fitted on measured nodes)")

# An op type's own factor needs this many measured nodes of the type; fewer (one kernel on a
# busy 2-core machine is noise) fall back to the factor over all measured nodes.
MIN_OP_SAMPLES = 2
# Recompute clones are named ``<node>.rc`` (``passes/lowering/recompute.py``), made unique with
# ``_k``.
_CLONE_NAME = re.compile(r"^(?P<base>.+)\.rc(?:_\d+)?$")


@dataclass(frozen=True)
class Calibration:
    """Measured time / analytic estimate, fitted on the nodes that were measured.

    Per op type, the summed measured time over the summed estimate, so that the calibrated
    estimates of the measured nodes add up to what was measured (op types with fewer than
    ``MIN_OP_SAMPLES`` measured nodes use the same ratio over all nodes). Not the median of
    the per-node ratios: that one fits the typical (small) node and underprices the large
    ones where the time is; measured leave-one-out on a CPU, the median's estimates summed
    to 0.41-0.84 of the measured time, these to 0.98-1.00 (docs/COST_MODEL.md).
    ``by_op_seconds`` is the median measured time of op types the roofline sees no work in
    (aliasing ops), so that they too are priced from what was measured."""

    by_op: Mapping[str, float]
    overall: float
    samples: int
    by_op_seconds: Mapping[str, float] = field(default_factory=dict)

    def factor(self, op_type: str) -> float:
        return float(self.by_op.get(op_type, self.overall))

    @classmethod
    def fit(cls, graph: Graph, seconds: Mapping[str, float],
            rates: DeviceRates) -> Calibration:
        pairs: dict[str, list[tuple[float, float]]] = {}  # op -> (measured, estimate)
        free_times: dict[str, list[float]] = {}
        for node in graph.nodes:
            t = seconds.get(node.name)
            if t is None or t <= 0.0:
                continue
            est = analytic_estimate(graph, node, rates)
            if est > 0.0:
                pairs.setdefault(node.op_type, []).append((t, est))
            else:
                free_times.setdefault(node.op_type, []).append(t)
        every = [p for ps in pairs.values() for p in ps]
        overall = _ratio_of_sums(every) if every else 1.0
        by_op = {op: _ratio_of_sums(ps) for op, ps in pairs.items()
                 if len(ps) >= MIN_OP_SAMPLES}
        by_op_seconds = {op: statistics.median(ts) for op, ts in free_times.items()}
        return cls(by_op, overall, len(every), by_op_seconds)


def _ratio_of_sums(pairs: list[tuple[float, float]]) -> float:
    return sum(t for t, _ in pairs) / sum(e for _, e in pairs)


IDENTITY_CALIBRATION = Calibration({}, 1.0, 0)


@dataclass(frozen=True)
class CostModel:
    """Seconds per node name, plus where the numbers came from.

    ``seconds`` covers the nodes of the step the model was made for. ``price`` also covers
    nodes that a plan adds (see the module docstring); ``of(node)`` without a graph is the
    old lookup (0 for a node it has no number for) and is kept for callers that only ever
    ask about the step's own nodes."""

    seconds: Mapping[str, float]
    source: str  # "measured", "analytic" or "unit"
    provider: str
    kernel_s: float | None = None  # measured only: the profiled kernel time alone
    rates: DeviceRates | None = None  # the roofline that prices unseen nodes
    calibration: Calibration | None = None  # fitted on first use when not given
    link: HostLink | None = None  # prices swap copies on a device provider
    # Prices nodes it has no number for, when the model has its own estimate for them (the
    # CUDA calibration, passes/analysis/cuda_node_times.py) instead of the roofline.
    estimator: Callable[[Graph, onnx.NodeProto], float] | None = None
    # One lazily fitted calibration (a frozen dataclass cannot assign it later).
    _fitted: dict = field(default_factory=dict, compare=False, repr=False)

    def of(self, node: onnx.NodeProto, graph: Graph | None = None) -> float:
        if graph is not None:
            return self.price(node, graph)
        return float(self.seconds.get(node.name, 0.0))

    def total(self, graph: Graph) -> float:
        return float(sum(self.of(n) for n in graph.nodes))

    def price(self, node: onnx.NodeProto, graph: Graph) -> float:
        """Seconds for ``node`` of ``graph``, whether or not it was measured.

        Measured (or estimated) when the model has it; for a recompute clone the time of the
        node it repeats (same kernel, same shapes); otherwise the model's own estimator where
        it has one (the CUDA calibration), else the analytic estimate times the calibration
        factor of its op type. Only aliasing ops (Reshape, Squeeze, Identity...:
        ORT runs no kernel for them) can come out at 0, and only when no node of their op
        type was measured; every other op gets at least the per-kernel overhead."""
        known = self.seconds.get(node.name)
        if known is not None:
            return float(known)
        m = _CLONE_NAME.match(node.name)
        while m is not None:
            base = m.group("base")
            if base in self.seconds:
                return float(self.seconds[base])
            m = _CLONE_NAME.match(base)
        if self.source == "unit":
            return 1.0
        if node.op_type in COPY_OPS and self.link is not None and node.input:
            ti = graph.info.get(node.input[0])
            return self.link.seconds(ti.nbytes if ti is not None else 0, node.op_type)
        if node.op_type in _NOT_RUN:
            return 0.0
        if self.estimator is not None:
            return float(self.estimator(graph, node))
        rates = self.rates or NOMINAL_CPU
        cal = self.calibration_for(graph)
        est = analytic_estimate(graph, node, rates)
        if est <= 0.0:
            return float(cal.by_op_seconds.get(node.op_type, 0.0))
        return est * cal.factor(node.op_type)

    def calibration_for(self, graph: Graph) -> Calibration:
        """The calibration given, or the one fitted on ``graph``'s known nodes the first
        time it is needed. An analytic model that carries its rates needs none (factor 1 by
        construction); one without them is fitted like a measured one."""
        if self.calibration is not None:
            return self.calibration
        if self.source == "unit" or (self.source == "analytic" and self.rates is not None):
            return IDENTITY_CALIBRATION
        if "cal" not in self._fitted:
            self._fitted["cal"] = Calibration.fit(graph, self.seconds,
                                                  self.rates or NOMINAL_CPU)
        return self._fitted["cal"]

    def calibrated(self, graph: Graph) -> CostModel:
        """The same model with its calibration fitted on ``graph`` now, stated explicitly."""
        cal = self.calibration_for(graph)
        return CostModel(self.seconds, self.source, self.provider, self.kernel_s,
                         self.rates, cal, self.link, self.estimator)


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
    if op == "FusedMatMul" and len(ins) == 2:  # com.microsoft: MatMul with transA/transB
        a = ins[0].shape
        k = (a[-2] if attr(node, "transA", 0) and len(a) >= 2 else a[-1]) if a else 1
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




def is_sixteen_bit_product(graph: Graph, node: onnx.NodeProto) -> bool:
    """A matrix product or convolution computing in bfloat16 or float16."""
    info = graph.info.get(node.output[0]) if node.output else None
    return node.op_type in LOWER and info is not None \
        and info.dtype in SIXTEEN_BIT_TYPES


def unit_costs(graph: Graph) -> CostModel:
    return CostModel({n.name: 1.0 for n in graph.nodes}, "unit", "none")


def analytic_estimate(graph: Graph, node: onnx.NodeProto, rates: DeviceRates) -> float:
    """Roofline seconds of one node: 0 for ops that alias their input (no kernel runs)."""
    flops, nbytes = node_flops_bytes(graph, node)
    if flops == 0.0 and nbytes == 0.0:
        return 0.0
    rate = rates.flops_per_s
    if rates.sixteen_bit_flops != 1.0 and is_sixteen_bit_product(graph, node):
        rate *= rates.sixteen_bit_flops
    return max(flops / rate, nbytes / rates.bytes_per_s) + rates.overhead_s


def analytic_costs(graph: Graph, rates: DeviceRates) -> CostModel:
    seconds = {node.name: analytic_estimate(graph, node, rates) for node in graph.nodes}
    return CostModel(seconds, "analytic", rates.source, rates=rates)
