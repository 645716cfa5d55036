"""Node times on CUDA without a GPU: an estimate fitted on node times measured on one.

On a machine without a GPU, ``--provider cuda`` cannot measure node times, and a roofline
with nominal rates ranks plans badly: on a GPU a small kernel costs its launch and the
executor's host work whatever it computes, and an op's speed depends on the op (a scatter
with atomics, a cuDNN convolution, a MatMul on tensor cores) far more than the roofline
says. So the estimate here is fitted on per-node times that ORT's CUDA provider measured
(``benchmarks/cuda_node_times.py --collect`` on a GPU, ``--fit`` writes the calibration):

    seconds(node) = fixed + bytes * s_per_byte + flops * s_per_flop   (per op type)
                    + host_s_per_node                                  (every node alike)

``bytes`` are the node's inputs and outputs, ``flops`` as ``cost_model.node_flops_bytes``
counts them. The coefficients are non-negative (a tiny exact NNLS, ``nnls``), fitted per
op type where enough nodes of it were measured, else per family of op types, else over
all nodes (``FAMILIES``). ``host_s_per_node`` is what the step took beyond its kernels
(wall time minus summed kernel times), per node: on a GPU the executor's own work per node
is a large part of a training step.

The calibration is a data file, ``memcc/data/cuda_node_times_<gpu>.json`` (the GPU, ORT's
version, the date and what it was fitted on inside), or the file ``$MEMCC_CUDA_NODE_TIMES``
names. No file, no estimate: callers fall back to the nominal roofline and say so. Pure
numbers: nothing here runs ORT (``backend/`` does).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnx

from memcc.errors import InputError
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import (
    _FREE,
    _NOT_RUN,
    CUDA_NOMINAL,
    CostModel,
    is_sixteen_bit_product,
    node_flops_bytes,
)

SOURCE = "cuda-calibrated"  # CostModel.source and the report's cost source
DATA_DIR = Path(__file__).resolve().parents[2] / "data"
ENV = "MEMCC_CUDA_NODE_TIMES"
FORMAT = 1
# An op type gets coefficients of its own from this many measured nodes on; fewer use its
# family's (three coefficients need more points than that to mean anything).
MIN_OP_NODES = 4

FAMILIES: dict[str, frozenset[str]] = {
    "matmul": frozenset({"MatMul", "Gemm", "FusedMatMul", "MatMulInteger"}),
    "conv": frozenset({"Conv", "ConvTranspose"}),
    "index": frozenset({"Gather", "GatherElements", "GatherND", "ScatterElements",
                        "ScatterND"}),
    "reduce": frozenset({"Softmax", "LogSoftmax", "BatchNormalization",
                         "LayerNormalization", "InstanceNormalization", "MaxPool",
                         "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "ArgMax",
                         "ArgMin", "CumSum", "TopK", "SoftmaxCrossEntropyLoss"}),
    "alias": frozenset(_FREE),
}


def family(op_type: str) -> str:
    """The group of op types whose fit prices an op type measured too rarely (or never)."""
    if op_type.startswith("Reduce"):
        return "reduce"
    for name, ops in FAMILIES.items():
        if op_type in ops:
            return name
    return "elementwise"


def node_features(graph: Graph, node: onnx.NodeProto) -> tuple[float, float]:
    """(bytes, flops) of a node: every input and output it touches, and the FLOPs the
    roofline counts. Bytes are counted for aliasing ops too (the roofline prices those at
    0): on CUDA they still cost a launch-sized host step."""
    info = graph.info
    nbytes = float(sum(info[v].nbytes for v in (*node.input, *node.output)
                       if v and v in info))
    flops, _ = node_flops_bytes(graph, node)
    if is_sixteen_bit_product(graph, node):  # fitted on TF32 products: tensor cores' 16-bit
        flops /= CUDA_NOMINAL.sixteen_bit_flops  # rate, by the datasheets (not measured)
    return nbytes, float(flops)


@dataclass(frozen=True)
class OpFit:
    """seconds = fixed_s + bytes * s_per_byte + flops * s_per_flop, and how well that fit
    the nodes it was fitted on (median |ln(predicted / measured)|)."""

    fixed_s: float
    s_per_byte: float
    s_per_flop: float
    nodes: int
    median_abs_log_ratio: float | None = None

    def seconds(self, nbytes: float, flops: float) -> float:
        return self.fixed_s + nbytes * self.s_per_byte + flops * self.s_per_flop

    def to_json(self) -> dict:
        return {"fixed_s": self.fixed_s, "s_per_byte": self.s_per_byte,
                "s_per_flop": self.s_per_flop, "nodes": self.nodes,
                "median_abs_log_ratio": self.median_abs_log_ratio}

    @classmethod
    def from_json(cls, d: Mapping) -> OpFit:
        values = [float(d[k]) for k in ("fixed_s", "s_per_byte", "s_per_flop")]
        if not all(math.isfinite(v) and v >= 0.0 for v in values):
            raise ValueError(f"coefficients must be finite and >= 0, got {values}")
        mal = d.get("median_abs_log_ratio")
        return cls(*values, int(d.get("nodes", 0)), None if mal is None else float(mal))


@dataclass(frozen=True)
class CudaNodeTimes:
    """A calibration: per-op-type fits, the per-node host cost, and what they came from."""

    gpu: str
    onnxruntime: str
    date: str
    host_s_per_node: float
    by_op: Mapping[str, OpFit]
    by_family: Mapping[str, OpFit]
    overall: OpFit
    fitted_on: Mapping[str, object] = field(default_factory=dict)
    provider: str = "cuda"
    path: str | None = None
    extra: Mapping[str, object] = field(default_factory=dict)  # settings, quality: kept

    def fit_for(self, op_type: str) -> OpFit:
        return self.by_op.get(op_type) or self.by_family.get(family(op_type)) or self.overall

    def kernel_seconds(self, op_type: str, nbytes: float, flops: float) -> float:
        return self.fit_for(op_type).seconds(nbytes, flops)

    def seconds(self, graph: Graph, node: onnx.NodeProto) -> float:
        """The node's estimated time in a step: its kernel plus the host's share."""
        if node.op_type in _NOT_RUN:  # folded into initializers at load: never runs
            return 0.0
        nbytes, flops = node_features(graph, node)
        return self.kernel_seconds(node.op_type, nbytes, flops) + self.host_s_per_node

    def costs(self, graph: Graph) -> CostModel:
        """Every node of ``graph`` priced, and nodes a plan adds priced the same way."""
        seconds = {n.name: self.seconds(graph, n) for n in graph.nodes}
        return CostModel(seconds, SOURCE, "cuda", estimator=self.seconds)

    def describe(self) -> dict:
        """What the report says about the calibration the times came from."""
        return {"gpu": self.gpu, "onnxruntime": self.onnxruntime, "date": self.date,
                "file": self.path, "host_s_per_node": self.host_s_per_node,
                "fitted_on": dict(self.fitted_on)}

    def to_json(self) -> dict:
        return {
            "format": FORMAT, "what": "per-node CUDA times fitted on ORT profiles "
            "(memcc/passes/analysis/cuda_node_times.py; benchmarks/cuda_node_times.py wrote this)",
            "gpu": self.gpu, "onnxruntime": self.onnxruntime, "date": self.date,
            "provider": self.provider, "fitted_on": dict(self.fitted_on),
            "host_s_per_node": self.host_s_per_node,
            "overall": self.overall.to_json(),
            "by_family": {k: v.to_json() for k, v in sorted(self.by_family.items())},
            "by_op": {k: v.to_json() for k, v in sorted(self.by_op.items())},
            **dict(self.extra)}

    @classmethod
    def from_json(cls, d: Mapping, path: str | None = None) -> CudaNodeTimes:
        known = {"format", "what", "gpu", "onnxruntime", "date", "provider", "fitted_on",
                 "host_s_per_node", "overall", "by_family", "by_op"}
        host = float(d["host_s_per_node"])
        if not (math.isfinite(host) and host >= 0.0):
            raise ValueError(f"host_s_per_node must be finite and >= 0, got {host}")
        return cls(
            gpu=str(d["gpu"]), onnxruntime=str(d["onnxruntime"]), date=str(d["date"]),
            host_s_per_node=host,
            by_op={k: OpFit.from_json(v) for k, v in d["by_op"].items()},
            by_family={k: OpFit.from_json(v) for k, v in d["by_family"].items()},
            overall=OpFit.from_json(d["overall"]), fitted_on=dict(d.get("fitted_on", {})),
            provider=str(d.get("provider", "cuda")), path=path,
            extra={k: v for k, v in d.items() if k not in known})


# ----------------------------------------------------------------------------- loading
def read_calibration(path: str | os.PathLike) -> CudaNodeTimes:
    """One calibration file, or an InputError naming it and what is wrong."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
        cal = CudaNodeTimes.from_json(data, str(p))
    except OSError as exc:
        raise InputError(f"{p}: cannot read the CUDA node-time calibration: "
                         f"{exc.strerror or exc}. Point ${ENV} at a file written by "
                         "benchmarks/cuda_node_times.py --fit, or unset it.") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InputError(f"{p}: not a CUDA node-time calibration ({type(exc).__name__}: "
                         f"{exc}). Write one with benchmarks/cuda_node_times.py --fit, or "
                         f"unset ${ENV}.") from None
    if cal.provider != "cuda":
        raise InputError(f"{p}: this calibration was fitted on {cal.provider} node times, "
                         "not CUDA ones; fit one on records collected with --provider cuda "
                         "on a GPU (benchmarks/cuda_node_times.py).")
    return cal


def default_calibration() -> CudaNodeTimes | None:
    """``$MEMCC_CUDA_NODE_TIMES`` if set, else the newest (by date) of the calibrations
    shipped in ``memcc/data``; None when there is none."""
    chosen = os.environ.get(ENV)
    if chosen:
        return read_calibration(chosen)
    found = [read_calibration(p) for p in sorted(DATA_DIR.glob("cuda_node_times_*.json"))]
    return max(found, key=lambda c: c.date) if found else None


# ----------------------------------------------------------------------------- fitting
def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0, exactly, for the few columns used here: the optimum
    is the least-squares solution on its own support, so try every support and keep the
    best non-negative one (2^k - 1 small solves; k is 3 here)."""
    k = a.shape[1]
    best = np.zeros(k)
    best_res = float(np.sum(y * y))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, y, rcond=None)
            if np.any(x < 0.0):
                continue
            res = float(np.sum((sub @ x - y) ** 2))
            if res < best_res * (1.0 - 1e-12):
                best_res = res
                best = np.zeros(k)
                best[list(cols)] = x
    return best


def fit_op(samples: list[tuple[float, float, float]]) -> OpFit:
    """Fit (bytes, flops, seconds) samples, minimising the relative error of each node
    (rows weighted by 1 / measured): node times span five decades, and an absolute fit
    would leave every launch-sized node to the largest few."""
    x = np.array([(1.0, b, f) for b, f, _ in samples], dtype=np.float64)
    t = np.array([s for *_, s in samples], dtype=np.float64)
    w = 1.0 / np.maximum(t, 1e-9)
    a = x * w[:, None]
    colmax = np.abs(a).max(axis=0)
    unseen = colmax == 0.0  # e.g. no FLOPs in any node: that rate is not measured, so 0
    scale = np.where(unseen, 1.0, colmax)  # columns to ~1: conditioning
    coef = nnls(a / scale, t * w) / scale
    coef[unseen] = 0.0
    pred = x @ coef
    ok = (pred > 0) & (t > 0)
    mal = float(np.median(np.abs(np.log(pred[ok] / t[ok])))) if ok.any() else None
    return OpFit(float(coef[0]), float(coef[1]), float(coef[2]), len(samples), mal)


def measured_s(us: object) -> float:
    """A profiled time in seconds. ORT's profile counts whole microseconds, so a 0 is a node
    that took under one: half a microsecond, not nothing (it is fitted like the others)."""
    return max(float(us), 0.5) * 1e-6  # type: ignore[arg-type]


def fit(steps: Iterable[Mapping], *, gpu: str, onnxruntime: str, date: str,
        provider: str = "cuda", min_op_nodes: int = MIN_OP_NODES) -> CudaNodeTimes:
    """Fit a calibration on collected steps (``benchmarks/cuda_node_times.py`` records).

    Each step: ``wall_s`` (its measured time), ``records`` with ``op_type``, ``in_bytes``,
    ``out_bytes``, ``flops`` and ``us`` (the node's measured kernel time, microseconds).
    The host cost per node is the pooled time the steps took beyond their kernels, over
    all their nodes."""
    steps = list(steps)
    by_op: dict[str, list[tuple[float, float, float]]] = {}
    beyond = 0.0
    nodes = 0
    models = []
    for st in steps:
        recs = [r for r in st["records"] if r.get("us") is not None]
        kernel = sum(float(r["us"]) for r in recs) * 1e-6
        beyond += max(0.0, float(st["wall_s"]) - kernel)
        nodes += len(recs)
        models.append(str(st.get("label", st.get("model", "?"))))
        for r in recs:
            by_op.setdefault(str(r["op_type"]), []).append(
                (float(r["in_bytes"]) + float(r["out_bytes"]), float(r["flops"]),
                 measured_s(r["us"])))
    if not by_op:
        raise InputError("no measured node times in the records: nothing to fit. Collect "
                         "them with benchmarks/cuda_node_times.py --collect.")
    fams: dict[str, list[tuple[float, float, float]]] = {}
    for op, s in by_op.items():
        fams.setdefault(family(op), []).extend(s)
    fitted_ops = {op: fit_op(s) for op, s in by_op.items() if len(s) >= min_op_nodes}
    fitted_fams = {f: fit_op(s) for f, s in fams.items() if len(s) >= min_op_nodes}
    overall = fit_op([x for s in by_op.values() for x in s])
    return CudaNodeTimes(
        gpu=gpu, onnxruntime=onnxruntime, date=date,
        host_s_per_node=beyond / nodes if nodes else 0.0,
        by_op=fitted_ops, by_family=fitted_fams, overall=overall, provider=provider,
        fitted_on={"steps": len(steps), "models": models, "nodes": nodes,
                   "op_types": len(by_op), "op_types_fitted_alone": len(fitted_ops)})


def predict_step(cal: CudaNodeTimes, records: Iterable[Mapping]) -> tuple[float, float]:
    """(kernel seconds, step seconds) the calibration predicts for a collected step."""
    recs = [r for r in records if r.get("us") is not None]
    kernel = sum(cal.kernel_seconds(str(r["op_type"]),
                                    float(r["in_bytes"]) + float(r["out_bytes"]),
                                    float(r["flops"])) for r in recs)
    return kernel, kernel + cal.host_s_per_node * len(recs)


def op_quality(cal: CudaNodeTimes, steps: Iterable[Mapping]) -> dict[str, dict]:
    """Per op type: nodes, which fit priced them, the median |ln(predicted / measured)|
    over every collected node of the type, and the type's predicted time summed over its
    measured time summed (the per-node fit is relative; this says what it does to
    totals)."""
    logs: dict[str, list[float]] = {}
    sums: dict[str, list[float]] = {}
    for st in steps:
        for r in st["records"]:
            if r.get("us") is None:
                continue
            t = measured_s(r["us"])
            p = cal.kernel_seconds(str(r["op_type"]),
                                   float(r["in_bytes"]) + float(r["out_bytes"]),
                                   float(r["flops"]))
            if p > 0.0:
                logs.setdefault(str(r["op_type"]), []).append(abs(math.log(p / t)))
                pm = sums.setdefault(str(r["op_type"]), [0.0, 0.0])
                pm[0] += p
                pm[1] += t
    out = {}
    for op, ls in sorted(logs.items()):
        used = "op" if op in cal.by_op else ("family:" + family(op)
                                             if family(op) in cal.by_family else "overall")
        out[op] = {"nodes": len(ls), "fit": used,
                   "median_abs_log_ratio": statistics.median(ls),
                   "sum_ratio": sums[op][0] / sums[op][1], "measured_s": sums[op][1]}
    return out


def with_extra(cal: CudaNodeTimes, **extra: object) -> CudaNodeTimes:
    return replace(cal, extra={**dict(cal.extra), **extra})
