"""Where a step's kernel time goes, by op type, from ONNX Runtime's own profiler (issue 30).

Issue 30's table (ResNet-50 at batch 184 on an H200: Conv 55 ms, Mul 38 ms over 1,014 nodes,
ReduceSumSquare 36 ms, ...) came from one profile of one step; this script makes that
figure rerunnable for any step, so each change to the emitted kernels can be set against it:

    python benchmarks/cuda_profile.py resnet50=STEP.onnx[.xz] gpt2=STEP --runs 3 \
        [--deterministic] [--provider cuda] [--out FILE.json]

Each step is rewritten for the provider as ``memcc run`` rewrites it
(``backend.device_step.step_for_provider``: training-mode BatchNorm in standard ops on CUDA,
the ``--deterministic`` rewrites when asked), given one fixed synthetic batch
(``backend.step_feeds.synthetic_feeds``) and its stored state, and run ``1 + --runs`` times
in one session made by ``backend.session.make_session`` (memcc's execution contract, ORT's
profiler on). The first run is a warm-up (cuDNN's algorithm choice, the arena's growth) and
is left out. Per op type: milliseconds of kernel time per step (ORT's ``*_kernel_time``
events, summed, divided by the runs), the number of nodes, and the share of the step's
kernel time; per step: the kernel total, the wall time of each profiled run
(``model_run`` events; host feeds and fetches included, so above the kernel total), and
the nodes that ran on another provider than the one asked for.

On CUDA, ORT's node events time the host: a kernel launched asynchronously counts the time
to enqueue it, not to run it (measured on an H200: ResNet-50's fp32 step at batch 184
showed 107 ms of "kernels" against 377 ms with launches blocking, Conv 168 ms of them). So on
CUDA the script sets ``CUDA_LAUNCH_BLOCKING=1`` before the session exists (every kernel
waits for the last: its event is its device time plus a launch), unless ``--async``.

Feeds go through ``InferenceSession.run`` from host arrays: the copies show as their own
events (``MemcpyFromHost``, not counted as op types of the step) and do not change the
kernel times. ``--provider cpu`` runs the same code here (tests/test_benchmarks_cuda_profile.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_peers import _decompress  # noqa: E402  (the steps it prepares)
from memcc.backend.device_step import step_for_provider  # noqa: E402
from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.session import SessionSettings, make_session  # noqa: E402
from memcc.backend.step_feeds import synthetic_feeds  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402

PROVIDER_NAMES = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}
# The nodes that took longest, with their shapes: which of GPT-2's nine ScatterElements made
# their 14.6 ms (eighteenth session) the op-type table cannot say.
SLOWEST_NODES = 30


def kernel_events(profile: Path) -> tuple[list[dict], list[dict]]:
    """ORT's profile as (node kernel events, ``model_run`` events), in time order."""
    events = json.loads(profile.read_text())
    nodes = [e for e in events if e.get("cat") == "Node"
             and e.get("name", "").endswith("_kernel_time")]
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    return sorted(nodes, key=lambda e: e["ts"]), sorted(runs, key=lambda e: e["ts"])


def by_op_type(nodes: list[dict], runs: list[dict], skip_runs: int = 1) -> dict:
    """Kernel time per op type over the runs after the first ``skip_runs``, per step, and
    the ``SLOWEST_NODES`` slowest nodes with their shapes."""
    kept = runs[skip_runs:]
    if not kept:
        raise ValueError("the profile has no run after the warm-up")
    start = kept[0]["ts"]
    per_op: dict[str, float] = defaultdict(float)
    names: dict[str, set[str]] = defaultdict(set)
    providers: dict[str, str] = {}
    for e in nodes:
        if e["ts"] < start:
            continue
        op = e.get("args", {}).get("op_name", "?")
        per_op[op] += e["dur"]
        names[op].add(e["name"])
        providers[e["name"].removesuffix("_kernel_time")] = e.get("args", {}).get(
            "provider", "")
    n = len(kept)
    total_us = sum(per_op.values())
    per_node: dict[str, float] = defaultdict(float)
    shapes: dict[str, dict] = {}
    for e in nodes:
        if e["ts"] >= start:
            name = e["name"].removesuffix("_kernel_time")
            per_node[name] += e["dur"]
            a = e.get("args", {})
            shapes[name] = {"op_type": a.get("op_name", "?"),
                            "inputs": a.get("input_type_shape"),
                            "outputs": a.get("output_type_shape")}
    slowest = sorted(per_node, key=lambda k: -per_node[k])[:SLOWEST_NODES]
    rows = sorted(({"op_type": op, "ms_per_step": us / n / 1e3, "nodes": len(names[op]),
                    "share": us / total_us if total_us else 0.0}
                   for op, us in per_op.items()), key=lambda r: -r["ms_per_step"])
    return {"runs": n, "kernel_ms_per_step": total_us / n / 1e3,
            "run_wall_ms": [r["dur"] / 1e3 for r in kept], "op_types": rows,
            "slowest_nodes": [{"node": k, "ms_per_step": per_node[k] / n / 1e3, **shapes[k]}
                              for k in slowest],
            "providers": providers}


def profile_step(name: str, path: Path, provider: str, runs: int, deterministic: bool,
                 tmp: Path) -> dict:
    """One step's profile (see the module docstring)."""
    graph = load_graph(_decompress(path, tmp / path.name.removesuffix(".xz")))
    graph, _ = step_for_provider(graph, provider, deterministic=deterministic)
    step_file = save_graph(graph, tmp / f"{name}.run.onnx")
    feeds = synthetic_feeds(graph)
    t0 = time.perf_counter()
    sess = make_session(step_file, provider, SessionSettings(
        profile=True, profile_prefix=str(tmp / f"{name}_profile")))
    setup_s = time.perf_counter() - t0
    wanted = {i.name for i in sess.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in wanted}
    losses = []
    for _ in range(1 + runs):
        out = sess.run(None, feeds)
        losses.append(float(out[0].reshape(-1)[0]) if out and out[0].size else None)
    nodes, run_events = kernel_events(Path(sess.end_profiling()))
    summary = by_op_type(nodes, run_events)
    asked = PROVIDER_NAMES[provider]
    elsewhere = sorted(n for n, p in summary.pop("providers").items() if p and p != asked)
    return {"name": name, "step": str(path), "provider": provider,
            "deterministic": deterministic, "graph_nodes": len(graph.nodes),
            "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING") == "1",
            "setup_s": setup_s, "first_output": losses, "not_on_provider": elsewhere,
            **summary}


def table(row: dict, top: int = 15) -> str:
    lines = [f"### {row['name']} ({row['provider']}"
             f"{', deterministic' if row['deterministic'] else ''}): "
             f"{row['kernel_ms_per_step']:.1f} ms of kernels per step, "
             f"{row['graph_nodes']:,} nodes; runs "
             + ", ".join(f"{w:.1f}" for w in row["run_wall_ms"]) + " ms wall",
             "", "| op type | ms per step | nodes | share |", "|---|---|---|---|"]
    for r in row["op_types"][:top]:
        lines.append(f"| {r['op_type']} | {r['ms_per_step']:.2f} | {r['nodes']:,} | "
                     f"{100 * r['share']:.1f}% |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", metavar="NAME=PATH",
                    help="step files (memcc build / compile output; .xz read as is)")
    ap.add_argument("--provider", choices=sorted(PROVIDER_NAMES), default="cuda")
    ap.add_argument("--runs", type=int, default=3, help="profiled runs after the warm-up")
    ap.add_argument("--deterministic", action="store_true",
                    help="the --deterministic rewrites, as memcc run --deterministic")
    ap.add_argument("--async", dest="asynchronous", action="store_true",
                    help="CUDA: leave launches asynchronous (node events then time the host)")
    ap.add_argument("--out", type=Path, help="JSON of every step's profile")
    args = ap.parse_args(argv)
    if args.provider == "cuda" and not args.asynchronous:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # read when CUDA starts: the first session
    if args.runs < 1:
        ap.error(f"--runs must be at least 1, not {args.runs}")
    specs = []
    for spec in args.steps:
        name, sep, path = spec.partition("=")
        if not sep or not Path(path).is_file():
            ap.error(f"{spec}: expected NAME=PATH of an existing step file")
        specs.append((name, Path(path)))
    rows = []
    with tempfile.TemporaryDirectory(prefix="memcc-profile-") as tmp:
        for name, path in specs:
            try:
                row = profile_step(name, path, args.provider, args.runs, args.deterministic,
                                   Path(tmp))
                print(table(row), flush=True)
            except Exception as exc:  # one failing step must not hide the others
                row = {"name": name, "step": str(path), "error": f"{type(exc).__name__}: "
                       f"{str(exc)[-600:]}"}
                print(f"{name}: {row['error']}", flush=True)
            rows.append(row)
            if args.out:
                args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
