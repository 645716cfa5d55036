"""Is a zoo training step the same bits run to run on CUDA, and what does that cost, per op?

For each zoo step (built here at moderate sizes; ``--small`` for tiny ones) and each of
``use_deterministic_compute`` {on, off} x the scatter rewrite of
``memcc/passes/providers/deterministic_scatter.py`` {on, off}, and with the setting off also the
scatter rewrite plus ``memcc/passes/providers/deterministic_reductions.py`` (leading-axis sums as
trailing-axis ones), this opens ``--sessions`` fresh sessions
(``memcc.backend.session.make_session``) and runs the same batch ``--runs`` times in each,
with every input bound once as an OrtValue on the device (only outputs come back, after the
timed runs). It reports

- whether the loss and every output (new parameters, momenta = gradients from the zero
  state) are bit-identical across all runs and sessions, and which differ, by how much;
- the median step time (every run but each session's first);
- ORT's profile of the last session, per op type, in ms per step (runs after the first),
  with the nodes that ran on another provider than the one asked for;
- how far the rewritten step's outputs are from the step as built (same setting): the
  rewrite changes the order of sums, so within a tolerance, not bit for bit;

and, unless ``--no-embedding``, the embedding gradient alone at GPT-2's full size
(50257 x 768 table, 8 x 1024 tokens; ``--small``: 2000 x 64, 4 x 256), the scatter as memcc
emits it against the rewrite; unless ``--no-reductions``, single reductions of the forms the
steps hold (bias gradients, LayerNorm and BatchNorm statistics, at GPT-2 / ResNet sizes) with
the setting on and off, and two alternative forms of the leading-axis sum, to see which
reductions the setting makes slow and which are nondeterministic without it. Everything
goes to ``OUT/summary.json``; a short table to stdout. No network; a time budget
(``--budget-s``) skips what does not fit, and says so.

    python benchmarks/cuda_determinism.py --out /tmp/det                  # GPU machine
    python benchmarks/cuda_determinism.py --out /tmp/det --provider cpu --small
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from memcc.backend.runner import session_graph, synthetic_feeds  # noqa: E402
from memcc.backend.session import SessionSettings, make_session  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.graph import Graph  # noqa: E402
from memcc.passes.providers.deterministic_reductions import to_trailing_axes  # noqa: E402
from memcc.passes.providers.deterministic_scatter import for_cuda_determinism  # noqa: E402
from memcc.passes.providers.provider_step import for_provider  # noqa: E402
from models import build_model  # noqa: E402

SIZES = {
    "gpt2": dict(batch=8, seq_len=512, vocab_size=16384, width=512, depth=4, heads=8),
    "bert": dict(batch=8, seq_len=256, vocab_size=8192, width=512, depth=4, heads=8),
    "resnet18": dict(batch=32, resolution=128, width=64),
}
SMALL = {
    "gpt2": dict(batch=2, seq_len=32, vocab_size=64, width=32, depth=1, heads=2),
    "bert": dict(batch=2, seq_len=16, vocab_size=64, width=32, depth=1, heads=2),
    "resnet18": dict(batch=2, resolution=32, width=8),
}
EMBEDDING = dict(vocab=50257, width=768, batch=8, seq=1024)
EMBEDDING_SMALL = dict(vocab=2000, width=64, batch=4, seq=256)
# (deterministic compute, rewrite): rewrite "off", "on" (the scatters), "on+reductions"
# (also passes/providers/deterministic_reductions.py: leading-axis sums as trailing-axis ones, which
# matters only with the setting off, where the leading-axis fast path uses atomics).
CONFIGS = [(True, "off"), (True, "on"), (False, "off"), (False, "on"),
           (False, "on+reductions")]
DEVICE = {"cuda": "cuda", "cpu": "cpu"}


def config_name(det: bool, rewrite: str) -> str:
    return f"deterministic={'on' if det else 'off'},rewrite={rewrite}"


def open_session(model, provider: str, det: bool, *, profile: bool = False,
                 prefix: str | None = None) -> ort.InferenceSession:
    """``make_session`` with the setting: its ``deterministic`` keyword where it has one,
    else the SessionOptions override (the CPU provider ignores the setting)."""
    return make_session(model, provider, SessionSettings(profile=profile,
                                                         profile_prefix=prefix,
                                                         deterministic=det))


class BoundStep:
    """A session with every input bound once, outputs left on the device. Inputs live on
    the device, except small integer tensors (shapes, axes, TopK's k), which the CUDA
    provider reads on the host: bound there, they cost no device-to-host copy per run."""

    def __init__(self, sess: ort.InferenceSession, feeds: dict[str, np.ndarray],
                 provider: str) -> None:
        self.sess = sess
        self.names = [o.name for o in sess.get_outputs()]
        device = DEVICE[provider]
        self.binding = sess.io_binding()
        self.values = {k: ort.OrtValue.ortvalue_from_numpy(
            v, "cpu" if v.dtype == np.int64 and v.size <= 8 else device, 0)
            for k, v in feeds.items()}
        for k, v in self.values.items():
            self.binding.bind_ortvalue_input(k, v)
        self.device = device

    def run(self) -> float:
        """One step; its wall time (outputs stay on the device)."""
        for name in self.names:
            self.binding.bind_output(name, self.device, 0)
        t0 = time.perf_counter()
        self.sess.run_with_iobinding(self.binding)
        self.binding.synchronize_outputs()
        return time.perf_counter() - t0

    def outputs(self) -> dict[str, np.ndarray]:
        return dict(zip(self.names, self.binding.copy_outputs_to_cpu(), strict=True))


def profile_by_op(path: str, provider: str, skip_runs: int = 1) -> dict:
    """ms per step per op type from ORT's profile, runs after the first ``skip_runs``."""
    events = json.loads(Path(path).read_text())
    runs = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")
    kept = runs[skip_runs:] or runs
    per_op: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    elsewhere: dict[str, str] = {}
    wanted = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}[provider]
    for e in events:
        if e.get("cat") != "Node" or not str(e.get("name", "")).endswith("_kernel_time"):
            continue
        ts = float(e["ts"])
        if not any(lo <= ts <= hi for lo, hi in kept):
            continue
        args = e.get("args", {})
        op = str(args.get("op_name", "?"))
        per_op[op] += float(e["dur"]) / 1000.0
        count[op] += 1
        prov = str(args.get("provider", wanted))
        if prov != wanted:
            elsewhere[e["name"][: -len("_kernel_time")]] = prov
    n = max(len(kept), 1)
    ops = sorted(((op, ms / n, count[op] // n) for op, ms in per_op.items()),
                 key=lambda t: -t[1])
    return {"runs_profiled": n, "total_ms_per_step": sum(ms for _, ms, _ in ops),
            "by_op_type": {op: {"ms": round(ms, 4), "nodes": c} for op, ms, c in ops},
            "nodes_on_other_provider": elsewhere}


def differing(runs: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """Outputs that are not the same bits in every run, with the largest difference."""
    out = {}
    for k, first in runs[0].items():
        worst = 0.0
        same = True
        for r in runs[1:]:
            if not np.array_equal(first, r[k], equal_nan=True):
                same = False
                worst = max(worst, float(np.max(np.abs(first.astype(np.float64) - r[k]))))
        if not same:
            out[k] = worst
    return out


def relative_gap(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict:
    """Largest |a - b| over the largest |a| per output; the worst output and its value."""
    top = max(float(np.abs(v).max()) for v in a.values() if v.size)
    worst, name = 0.0, None
    for k, v in a.items():
        if not v.size or not np.issubdtype(v.dtype, np.floating):
            continue
        scale = max(float(np.abs(v).max()), 1e-3 * top)
        gap = float(np.abs(v.astype(np.float64) - b[k]).max()) / scale
        if gap > worst:
            worst, name = gap, k
    return {"max_relative": worst, "output": name}


def measure(graph: Graph, feeds: dict[str, np.ndarray], provider: str, det: bool,
            sessions: int, runs: int, tmp: str, profile: bool = True) -> dict:
    """``sessions`` fresh sessions, ``runs`` runs each; the last session is profiled (its
    times are kept apart: the profiler adds to every node)."""
    model = graph.to_model()
    results: list[dict[str, np.ndarray]] = []
    times: list[float] = []
    profiled_times: list[float] = []
    prof = None
    for s in range(sessions):
        profiled = profile and s == sessions - 1
        prefix = str(Path(tmp) / f"prof_{time.monotonic_ns()}")
        sess = open_session(model, provider, det, profile=profiled, prefix=prefix)
        step = BoundStep(sess, feeds, provider)
        for r in range(runs):
            dt = step.run()
            if r:
                (profiled_times if profiled else times).append(dt)
            results.append(step.outputs())
        if profiled:
            prof = profile_by_op(sess.end_profiling(), provider)
        del step, sess
    diff = differing(results)
    loss = next(iter(results[0]))
    timed = times or profiled_times
    return {"bit_identical": not diff, "loss_identical": loss not in diff,
            "loss": float(np.asarray(results[0][loss]).reshape(-1)[0]),
            "differing_outputs": dict(sorted(diff.items(), key=lambda t: -t[1])),
            "outputs": len(results[0]), "ms_median": 1000 * statistics.median(timed),
            "ms_all": [round(1000 * t, 3) for t in timed],
            "ms_median_profiled": (1000 * statistics.median(profiled_times)
                                   if profiled_times else None),
            "profile": prof, "_first": results[0]}


def step_for(name: str, dims: dict, provider: str) -> Graph:
    step = build_training_step(load_graph(build_model(name, **dims)),
                               BuildOptions(optimizer="sgd"))
    step, _ = for_provider(step, provider)  # training BatchNorm as the CUDA provider runs it
    return step


def run_model(name: str, dims: dict, args, deadline: float, tmp: str) -> dict:
    step = step_for(name, dims, args.provider)
    rewritten, report = for_cuda_determinism(step)
    both, reductions_report = to_trailing_axes(rewritten)
    graphs = {"off": step, "on": rewritten, "on+reductions": both}
    feeds0 = synthetic_feeds(step, seed=0)
    row: dict = {"dims": dims, "nodes": len(step.nodes), "nodes_rewritten": len(rewritten.nodes),
                 "rewrite": report.to_json(),
                 "reductions_rewritten": len(reductions_report.rewritten),
                 "reductions_left": reductions_report.left, "configs": {}, "skipped": []}
    firsts: dict[tuple[bool, str], dict] = {}
    for det, rw in CONFIGS:
        key = config_name(det, rw)
        if time.monotonic() > deadline:
            row["skipped"].append(key)
            continue
        g, values = session_graph(graphs[rw])
        f = {k: v for k, v in {**values, **feeds0}.items() if k in set(g.inputs)}
        try:
            res = measure(g, f, args.provider, det, args.sessions, args.runs, tmp)
        except Exception as exc:  # a kernel the provider lacks: say so, go on
            row["configs"][key] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            continue
        firsts[(det, rw)] = res.pop("_first")
        row["configs"][key] = res
        print(f"{name:9s} {key:40s} identical={res['bit_identical']!s:5s} "
              f"loss_identical={res['loss_identical']!s:5s} "
              f"differing={len(res['differing_outputs']):3d} {res['ms_median']:8.2f} ms",
              flush=True)
    for det, rw in CONFIGS:
        if rw != "off" and (det, "off") in firsts and (det, rw) in firsts:
            row["configs"][config_name(det, rw)]["vs_rewrite_off"] = relative_gap(
                firsts[(det, "off")], firsts[(det, rw)])
    on, off = (row["configs"].get(config_name(True, "off"), {}),
               row["configs"].get(config_name(False, "off"), {}))
    if on.get("profile") and off.get("profile"):
        a, b = on["profile"]["by_op_type"], off["profile"]["by_op_type"]
        cost = {op: round(a.get(op, {}).get("ms", 0.0) - b.get(op, {}).get("ms", 0.0), 4)
                for op in set(a) | set(b)}
        row["deterministic_cost_by_op_ms"] = dict(sorted(cost.items(), key=lambda t: -t[1]))
    return row


def embedding_gradient(args, deadline: float) -> dict:
    """The embedding gradient alone: memcc's chunked scatter-add against the rewrite."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from embedding_grad_cost import gather_gradient

    e = EMBEDDING_SMALL if args.small else EMBEDDING
    graph = gather_gradient(e["vocab"], e["width"], e["batch"], e["seq"])
    rewritten, report = for_cuda_determinism(graph)
    rng = np.random.default_rng(0)
    feeds = {"table": rng.standard_normal((e["vocab"], e["width"])).astype(np.float32),
             "ids": rng.integers(0, e["vocab"], (e["batch"], e["seq"])).astype(np.int64),
             "dy": rng.standard_normal((e["batch"], e["seq"], e["width"])).astype(np.float32)}
    feeds["ids"][:, ::4] = 13  # a frequent token: many updates of one row
    out: dict = {"dims": e, "rewrite": report.to_json()}
    for label, g in (("scatter", graph), ("rewritten", rewritten)):
        if time.monotonic() > deadline:
            out[label] = "skipped (time budget)"
            continue
        f = {k: v for k, v in feeds.items() if k in g.inputs}
        res = measure(g, f, args.provider, True, 2, args.runs, "", profile=False)
        res.pop("_first")
        res.pop("profile")
        out[label] = res
        print(f"embedding {label:10s} identical={res['bit_identical']!s:5s} "
              f"{res['ms_median']:8.3f} ms", flush=True)
    return out


# Reductions as memcc's steps have them, GPT-2 / ResNet sizes (small: for the CPU test):
# name -> (op, input shape, axes, keepdims). With deterministic compute off, ORT's CUDA
# ReduceSum/ReduceMean take a fast path whose leading-axis form adds block partials with
# atomics (docs/DETERMINISM.md); with it on, they go to cuDNN. "_t" is the same sum over
# the last axis of the transposed input (the fast path's column form has no atomics), "_tt"
# the same with the Transpose in the graph; "_mm" is a MatMul with a ones vector (cuBLAS;
# TF32 where ORT allows it).
REDUCTIONS = {
    "bias_grad_sum01": ("ReduceSum", (8, 1024, 768), (0, 1), 0),
    "bias_grad_sum01_t": ("ReduceSum", (768, 8192), (1,), 0),
    "bias_grad_sum01_tt": ("TransposeReduceSum", (8192, 768), (1,), 0),
    "bias_grad_sum01_mm": ("MatMulOnes", (8192, 768), (0,), 0),
    "mlp_bias_grad_sum0": ("ReduceSum", (8192, 3072), (0,), 0),
    "layernorm_mean_last": ("ReduceMean", (8192, 768), (1,), 1),
    "bn_mean_023": ("ReduceMean", (32, 64, 56, 56), (0, 2, 3), 1),
    "bn_sumsq_023": ("ReduceSumSquare", (32, 64, 56, 56), (0, 2, 3), 0),
}
REDUCTIONS_SMALL = {k: (op, tuple(max(1, d // 16) for d in shape), axes, keep)
                    for k, (op, shape, axes, keep) in REDUCTIONS.items()}


def reduction_graph(op: str, shape: tuple[int, ...], axes: tuple[int, ...], keep: int):
    """One reduction node (opset 18: axes as an input) as a model."""
    from onnx import TensorProto, helper, numpy_helper

    inits = []
    if op == "MatMulOnes":
        rows = shape[0]
        inits.append(numpy_helper.from_array(np.ones((1, rows), np.float32), "ones"))
        nodes = [helper.make_node("MatMul", ["ones", "x"], ["y"])]
    elif op == "TransposeReduceSum":
        inits.append(numpy_helper.from_array(np.asarray(axes, np.int64), "axes"))
        nodes = [helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
                 helper.make_node("ReduceSum", ["xt", "axes"], ["y"], keepdims=keep)]
    else:
        inits.append(numpy_helper.from_array(np.asarray(axes, np.int64), "axes"))
        nodes = [helper.make_node(op, ["x", "axes"], ["y"], keepdims=keep)]
    g = helper.make_graph(nodes, "r", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     list(shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def reductions(args, deadline: float) -> dict:
    """Each reduction form with deterministic compute on and off: bits across 2 sessions x
    ``runs``, and the median time of one run (input bound on the device once)."""
    out: dict = {}
    rng = np.random.default_rng(0)
    for name, (op, shape, axes, keep) in (REDUCTIONS_SMALL if args.small
                                          else REDUCTIONS).items():
        model = reduction_graph(op, shape, axes, keep)
        x = rng.standard_normal(shape, dtype=np.float32)
        row: dict = {"op": op, "shape": list(shape), "axes": list(axes)}
        for det in (True, False):
            key = "deterministic=on" if det else "deterministic=off"
            if time.monotonic() > deadline:
                row[key] = "skipped (time budget)"
                continue
            results, times = [], []
            try:
                for _ in range(2):
                    step = BoundStep(open_session(model, args.provider, det), {"x": x},
                                     args.provider)
                    for r in range(max(args.runs, 5)):
                        dt = step.run()
                        if r:
                            times.append(dt)
                        results.append(step.outputs())
            except Exception as exc:
                row[key] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                continue
            diff = differing(results)
            row[key] = {"bit_identical": not diff, "max_abs_diff": diff.get("y", 0.0),
                        "ms_median": 1000 * statistics.median(times)}
        out[name] = row
        print(f"reduction {name:22s} " + " ".join(
            f"{k}: {v['bit_identical']!s:5s} {v['ms_median']:7.3f} ms" if isinstance(v, dict)
            else f"{k}: {v}" for k, v in row.items() if k.startswith("det")), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", default="gpt2,bert,resnet18")
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU test)")
    ap.add_argument("--sessions", type=int, default=2)
    ap.add_argument("--runs", type=int, default=4, help="per session; the first is warm-up "
                    "for the times but is compared for bits")
    ap.add_argument("--budget-s", type=float, default=75.0, help="start nothing new after "
                    "this many seconds")
    ap.add_argument("--no-embedding", dest="embedding", action="store_false")
    ap.add_argument("--no-reductions", dest="reductions", action="store_false")
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in SIZES]
    if unknown:
        print(f"--models: unknown {unknown}; known: {sorted(SIZES)}", file=sys.stderr)
        return 2
    start = time.monotonic()
    deadline = start + args.budget_s
    summary: dict = {"provider": args.provider, "onnxruntime": ort.__version__,
                     "device": ort.get_device(), "sessions": args.sessions, "runs": args.runs,
                     "small": args.small, "models": {}}
    # The two single-op sections keep the budget's last 15 s: they take a few seconds.
    models_deadline = deadline - 15.0
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            if time.monotonic() > models_deadline:
                summary["models"][name] = {"skipped": "time budget"}
                continue
            dims = (SMALL if args.small else SIZES)[name]
            summary["models"][name] = run_model(name, dims, args, models_deadline, tmp)
    if args.embedding:
        summary["embedding_gradient"] = embedding_gradient(args, deadline)
    if args.reductions:
        summary["reductions"] = reductions(args, deadline)
    summary["wall_s"] = round(time.monotonic() - start, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'summary.json'} in {summary['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
