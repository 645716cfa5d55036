"""Collect per-node CUDA times on a GPU, and fit the estimate memcc uses without one.

``--provider cuda --cost auto`` on a machine without a GPU prices nodes with a calibration
fitted on times measured on a GPU (``memcc/passes/analysis/cuda_node_times.py``). This script makes
that calibration in two steps:

    # on the GPU machine: profile the zoo's training steps, write DIR/records.json
    python benchmarks/cuda_node_times.py --collect --out DIR
    # anywhere: fit, print the fit's quality, write the calibration memcc ships
    python benchmarks/cuda_node_times.py --fit DIR/records.json \
        --write memcc/data/cuda_node_times_h200.json --gpu "NVIDIA H200"

How a node's time is measured. ORT's profiler times a node's ``Compute`` call on the host;
on CUDA that call only launches the kernels, so the profile says how long launching took,
not how long the GPU ran. The profiled runs therefore happen in a child process with
``CUDA_LAUNCH_BLOCKING=1``, where every launch returns when its kernel is done: a node's
profiled time is then its launch plus its kernels. The step's own time comes from a plain
session in this process (no profiling, launches asynchronous, the arena never shrunk,
state bound once on the device), as ``memcc.Trainer`` runs it; what the step took beyond
its summed node times is the executor's host work, which the fit spreads over the nodes.

Every session is made by ``memcc.backend.session.make_session`` (memcc's execution
contract, the CUDA settings memcc runs with), on steps built by ``memcc build`` and
rewritten for the provider as ``memcc compile`` plans them. ``--provider cpu`` runs the
same code on tiny sizes (``tests/test_benchmarks_cuda_node_times.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from memcc.errors import InputError  # noqa: E402

if TYPE_CHECKING:  # --collect needs only what memcc had before this script: it can be
    from memcc.passes.analysis import cuda_node_times as cnt  # copied alone to a GPU machine

# Sizes where kernels are as large as in real training (label -> zoo model, options), in
# the order they are measured (a run cut short by --budget-s keeps the first ones).
GPU_CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(batch=8, seq_len=256, width=256, depth=6, heads=4)),
    "resnet50": ("resnet50", dict(batch=32, resolution=224)),
    "gpt2_wide": ("gpt2", dict(batch=8, seq_len=512, width=768, depth=2, heads=12,
                               vocab_size=50257)),
    "bert": ("bert", dict(batch=8, seq_len=256, width=256, depth=6, heads=4)),
    "mlp": ("mlp", dict(batch=8192, width=1024, depth=8)),
    "mobilenetv2": ("mobilenetv2", dict(batch=32, resolution=128, width_mult=1.0)),
    "unet": ("unet", dict(batch=8, resolution=128, width=32)),
    "vgg16": ("vgg16", dict(batch=16, resolution=224, width=32)),
}
# --provider cpu: the code path on sizes a 2-core machine runs in seconds.
SMALL_CASES: dict[str, tuple[str, dict]] = {
    "gpt2": ("gpt2", dict(batch=2, seq_len=32, width=32, depth=1, heads=2)),
    "resnet50": ("resnet50", dict(batch=2, resolution=32)),
    "gpt2_wide": ("gpt2", dict(batch=2, seq_len=64, width=64, depth=1, heads=2)),
    "bert": ("bert", dict(batch=2, seq_len=32, width=32, depth=1, heads=2)),
    "mlp": ("mlp", dict(batch=256, width=128, depth=2)),
    "mobilenetv2": ("mobilenetv2", dict(batch=2, resolution=32, width_mult=0.5)),
    "unet": ("unet", dict(batch=2, resolution=32, width=8)),
    "vgg16": ("vgg16", dict(batch=2, resolution=32, width=8)),
}


def log(msg: str) -> None:
    print(f"[cuda_node_times {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def device_name(provider: str) -> str:
    """The GPU's name as NVML (or nvidia-smi) gives it; the CPU's on --provider cpu."""
    if provider != "cuda":
        import platform

        return f"cpu ({platform.processor() or platform.machine()})"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no NVML bindings: ask nvidia-smi
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            return out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown GPU"
        except (OSError, subprocess.SubprocessError):
            return "unknown GPU"


# ----------------------------------------------------------------------------- collect
def build_case(label: str, model: str, dims: dict, provider: str, tmp: Path) -> dict:
    """Build the zoo step as ``memcc build`` does and rewrite it for the provider as
    ``memcc compile`` plans it; save it with one synthetic batch; describe its nodes."""
    from memcc.backend.onnx_file import save_graph
    from memcc.backend.runner import synthetic_feeds
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.cost_model import node_flops_bytes
    from memcc.passes.providers.provider_step import for_provider
    from models import build_model

    graph = build_training_step(load_graph(build_model(model, **dims)), BuildOptions())
    graph, _ = for_provider(graph, provider)
    path = save_graph(graph, tmp / f"{label}.onnx")
    feeds = synthetic_feeds(graph, seed=0)
    np.savez(tmp / f"{label}_feeds.npz", **feeds)
    info = graph.info
    nodes = []
    for n in graph.nodes:
        flops, _ = node_flops_bytes(graph, n)
        nodes.append({
            "node": n.name, "op_type": n.op_type,
            "in_bytes": int(sum(info[v].nbytes for v in n.input if v and v in info)),
            "out_bytes": int(sum(info[v].nbytes for v in n.output if v and v in info)),
            "flops": float(flops)})
    return {"label": label, "model": model, "dims": dims, "path": str(path),
            "feeds": str(tmp / f"{label}_feeds.npz"), "graph_nodes": len(nodes),
            "records": nodes}


def bound_runner(sess, feeds: dict, provider: str):
    """One step as memcc runs it on a device: the batch bound once on the device, outputs
    left there (no host copies inside the timed step)."""
    import onnxruntime as ort

    device = "cuda" if provider == "cuda" else "cpu"
    io = sess.io_binding()
    keep = []
    for i in sess.get_inputs():
        if i.name in feeds:
            v = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feeds[i.name]), device, 0)
            keep.append(v)
            io.bind_ortvalue_input(i.name, v)
    for o in sess.get_outputs():
        io.bind_output(o.name, device)

    def step() -> None:
        sess.run_with_iobinding(io)
        io.synchronize_outputs()

    step.keep = keep  # type: ignore[attr-defined]  (the bound inputs outlive the binding)
    return step


def profile_cases(manifest: Path, result: Path, provider: str, runs: int) -> None:
    """Child process (``CUDA_LAUNCH_BLOCKING=1`` on CUDA): per node, the median of its
    profiled times over ``runs`` runs after one warm-up, for every step in the manifest;
    the result file is rewritten after each step, so a run cut short keeps what it has."""
    from memcc.backend.session import SessionSettings, make_session

    out: dict[str, dict] = {}
    for case in json.loads(manifest.read_text()):
        label = case["label"]
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as d:
                sess = make_session(case["path"], provider, SessionSettings(
                    profile=True, profile_prefix=str(Path(d) / "prof")))
                made = time.perf_counter() - t0
                with np.load(case["feeds"]) as z:
                    feeds = {k: z[k] for k in z.files}
                step = bound_runner(sess, feeds, provider)
                for _ in range(runs + 1):
                    step()
                deterministic = bool(sess.get_session_options().use_deterministic_compute)
                events = json.loads(Path(sess.end_profiling()).read_text())
                del step, sess
            samples: dict[str, list[float]] = {}
            where: dict[str, str] = {}
            for ev in events:
                name = ev.get("name", "")
                if ev.get("cat") != "Node" or not name.endswith("_kernel_time"):
                    continue
                node = name[: -len("_kernel_time")]
                samples.setdefault(node, []).append(float(ev.get("dur", 0)))
                where[node] = str((ev.get("args") or {}).get("provider", ""))
            out[label] = {
                "us": {k: statistics.median(v[1:] if len(v) > runs else v)
                       for k, v in samples.items()},
                "provider": where, "session_s": made,
                "use_deterministic_compute": deterministic,
                "profile_s": time.perf_counter() - t0}
            log(f"profiled {label}: {len(samples)} nodes in {time.perf_counter() - t0:.1f} s")
        except Exception as exc:  # one step failing must not lose the others
            out[label] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            log(f"profiling {label} failed: {out[label]['error']}")
        result.write_text(json.dumps(out))


def wall_time(case: dict, provider: str, runs: int) -> dict:
    """The step's median wall time in a plain session (no profiling), after two warm-ups
    (the first run grows the arena, which is never shrunk between steps)."""
    from memcc.backend.session import make_session

    t0 = time.perf_counter()
    sess = make_session(case["path"], provider)
    made = time.perf_counter() - t0
    with np.load(case["feeds"]) as z:
        feeds = {k: z[k] for k in z.files}
    step = bound_runner(sess, feeds, provider)
    step()
    step()
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t)
    del step, sess
    return {"wall_s": statistics.median(walls), "wall_samples_s": walls, "session_s": made}


def collect(out: Path, labels: Sequence[str], provider: str, small: bool, runs: int,
            budget_s: float) -> dict:
    """Build, profile (child process) and time every case; write ``out/records.json``
    after every phase and step."""
    import onnxruntime as ort

    start = time.perf_counter()
    # The step times need asynchronous launches: only the profiling child blocks.
    inherited_blocking = os.environ.pop("CUDA_LAUNCH_BLOCKING", None)
    cases = SMALL_CASES if small else GPU_CASES
    unknown = [x for x in labels if x not in cases]
    if unknown:
        raise InputError(f"--models {' '.join(unknown)}: unknown; choose from "
                         f"{', '.join(cases)}")
    out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, object] = {"runs": runs, "small": small,
                                   "inherited_cuda_launch_blocking": inherited_blocking,
                                   "profile_env": {"CUDA_LAUNCH_BLOCKING": "1"}
                                   if provider == "cuda" else {}}
    if provider == "cuda":
        from memcc.backend.session import cudnn_conv_algo_search

        settings["cudnn_conv_algo_search"] = cudnn_conv_algo_search()
    data: dict[str, object] = {
        "what": "per-node times of memcc training steps (benchmarks/cuda_node_times.py): "
                "us = median profiled Compute time over the runs, with launches blocking "
                "on CUDA; wall_s = median step time of a plain session",
        "gpu": device_name(provider), "onnxruntime": ort.__version__, "provider": provider,
        "date": time.strftime("%Y-%m-%d"), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": settings, "steps": [], "errors": []}
    path = out / "records.json"

    def write() -> None:
        data["elapsed_s"] = round(time.perf_counter() - start, 1)
        path.write_text(json.dumps(data, separators=(",", ":")))  # ~2 MB on the GPU sizes

    with tempfile.TemporaryDirectory(prefix="memcc-cnt-") as d:
        tmp = Path(d)
        built = []
        for label in labels:
            model, dims = cases[label]
            t0 = time.perf_counter()
            try:
                built.append(build_case(label, model, dims, provider, tmp))
                log(f"built {label} {dims}: {built[-1]['graph_nodes']} nodes in "
                    f"{time.perf_counter() - t0:.1f} s")
            except Exception as exc:
                data["errors"].append({"label": label, "phase": "build",
                                       "error": f"{type(exc).__name__}: {exc}"[:500]})
                log(f"building {label} failed: {exc}")
        manifest = tmp / "manifest.json"
        manifest.write_text(json.dumps([{k: c[k] for k in ("label", "path", "feeds")}
                                        for c in built]))
        result = tmp / "profile.json"
        env = dict(os.environ)
        if provider == "cuda":
            env["CUDA_LAUNCH_BLOCKING"] = "1"
        # The profiled runs and the timed ones cost about the same: a little over half of
        # what is left goes to the profiles.
        left = max(5.0, (budget_s - (time.perf_counter() - start)) * 0.55)
        log(f"profiling {len(built)} steps in a child process (at most {left:.0f} s)")
        try:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--_profile",
                            str(manifest), "--_result", str(result), "--provider", provider,
                            "--runs", str(runs)], env=env, timeout=left, check=False)
        except subprocess.TimeoutExpired:
            data["errors"].append({"phase": "profile", "error": f"timed out after {left:.0f} s"})
            log("profiling timed out: keeping the steps it finished")
        profiled = json.loads(result.read_text()) if result.exists() else {}
        for case in built:
            label = case["label"]
            prof = profiled.get(label)
            if prof is None or "error" in prof:
                data["errors"].append({"label": label, "phase": "profile",
                                       "error": (prof or {}).get("error", "not profiled")})
                continue
            if time.perf_counter() - start > budget_s:
                data["errors"].append({"label": label, "phase": "wall",
                                       "error": f"skipped: past --budget-s {budget_s:.0f}"})
                log(f"skipping {label}: past the budget")
                continue
            try:
                wall = wall_time(case, provider, max(runs, 5))
            except Exception as exc:
                data["errors"].append({"label": label, "phase": "wall",
                                       "error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            names = {r["node"] for r in case["records"]}
            # Nodes ORT added (copies to and from the CPU around nodes it placed there).
            added = {k: v for k, v in prof["us"].items() if k not in names}
            recs = []
            for r in case["records"]:
                us = prof["us"].get(r["node"])
                recs.append({**r, "us": us, "provider": prof["provider"].get(r["node"])})
            measured = [r for r in recs if r["us"] is not None]
            step = {"label": label, "model": case["model"], "dims": case["dims"],
                    "graph_nodes": case["graph_nodes"], "nodes": len(measured),
                    "kernel_s": sum(r["us"] for r in measured) * 1e-6,
                    "use_deterministic_compute": prof.get("use_deterministic_compute"),
                    "profile_session_s": prof.get("session_s"),
                    "ort_added_nodes": len(added), "ort_added_s": sum(added.values()) * 1e-6,
                    **wall, "records": recs}
            data["steps"].append(step)
            log(f"{label}: wall {step['wall_s'] * 1e3:.2f} ms, profiled nodes "
                f"{step['kernel_s'] * 1e3:.2f} ms over {step['nodes']} nodes")
            write()
    write()
    log(f"wrote {path} ({len(data['steps'])} steps) in {time.perf_counter() - start:.1f} s")
    return data


# --------------------------------------------------------------------------------- fit
def read_records(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        steps = data["steps"]
        for st in steps:
            float(st["wall_s"])
            for r in st["records"]:
                r["op_type"], r["in_bytes"], r["out_bytes"], r["flops"]  # noqa: B018
    except OSError as exc:
        raise InputError(f"{path}: cannot read the records: {exc.strerror or exc}. Give the "
                         "records.json that --collect wrote.") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{path}: not records from benchmarks/cuda_node_times.py --collect "
                         f"({type(exc).__name__}: {exc}); collect them again.") from None
    if not steps:
        raise InputError(f"{path}: no step was collected (errors: "
                         f"{data.get('errors')}); nothing to fit.")
    return data


def fit_records(data: dict, gpu: str) -> tuple[cnt.CudaNodeTimes, dict]:
    """The calibration fitted on every step, and its quality: per op type, per step, and
    per step with that model's steps left out of the fit (how it prices a model it never
    saw)."""
    from memcc.passes.analysis import cuda_node_times as cnt

    steps = data["steps"]
    meta = dict(gpu=gpu, onnxruntime=str(data.get("onnxruntime", "?")),
                date=str(data.get("date", "?")), provider=str(data.get("provider", "cuda")))
    cal = cnt.fit(steps, **meta)
    rows = []
    for st in steps:
        kernel, total = cnt.predict_step(cal, st["records"])
        row = {"label": st["label"], "nodes": st.get("nodes"), "measured_s": st["wall_s"],
               "predicted_s": total, "ratio": total / st["wall_s"],
               "measured_kernel_s": st.get("kernel_s"), "predicted_kernel_s": kernel}
        others = [o for o in steps if o["model"] != st["model"]]
        if others:
            _, held = cnt.predict_step(cnt.fit(others, **meta), st["records"])
            row["held_out_predicted_s"] = held
            row["held_out_ratio"] = held / st["wall_s"]
        rows.append(row)
    quality = {"op_types": cnt.op_quality(cal, steps), "steps": rows}
    return cal, quality


def print_quality(cal: cnt.CudaNodeTimes, quality: dict) -> None:
    print(f"fitted on {cal.fitted_on}; host time per node {cal.host_s_per_node * 1e6:.2f} us")
    print("\nper op type: median |ln(predicted / measured)| of the node times")
    print("(x: exp of it, the typical factor off; sum: predicted over measured, summed over "
          "the type's nodes; ms: measured, summed over all steps)")
    print(f"{'op type':<26}{'nodes':>7}  {'fit':<20}{'med|ln|':>8}{'x':>6}{'sum':>6}"
          f"{'ms':>9}")
    for op, q in sorted(quality["op_types"].items(), key=lambda kv: -kv[1]["measured_s"]):
        m = q["median_abs_log_ratio"]
        print(f"{op:<26}{q['nodes']:>7}  {q['fit']:<20}{m:>8.3f}{np.exp(m):>6.2f}"
              f"{q['sum_ratio']:>6.2f}{q['measured_s'] * 1e3:>9.2f}")
    print("\nper step: predicted (kernels fitted + host per node) against the measured "
          "wall time; held out = fitted without that model's steps")
    print(f"{'step':<14}{'nodes':>7}{'measured ms':>13}{'predicted ms':>14}{'ratio':>7}"
          f"{'held out ms':>13}{'ratio':>7}")
    for r in quality["steps"]:
        held = r.get("held_out_predicted_s")
        print(f"{r['label']:<14}{r['nodes']:>7}{r['measured_s'] * 1e3:>13.2f}"
              f"{r['predicted_s'] * 1e3:>14.2f}{r['ratio']:>7.2f}"
              + (f"{held * 1e3:>13.2f}{r['held_out_ratio']:>7.2f}" if held else ""))


def fit_command(records: Path, write: Path | None, gpu: str | None) -> cnt.CudaNodeTimes:
    from memcc.passes.analysis import cuda_node_times as cnt

    data = read_records(records)
    gpu = gpu or str(data.get("gpu", "unknown GPU"))
    provider = str(data.get("provider", "cuda"))
    target = write.resolve() if write is not None else None
    if target is not None and provider != "cuda" and target.parent == cnt.DATA_DIR.resolve():
        raise InputError(f"{records}: these node times were measured on {provider}, not CUDA; "
                         f"a calibration fitted on them cannot go to {cnt.DATA_DIR}, where "
                         "memcc takes it for a GPU's. Collect on a GPU, or write elsewhere. "
                         "Nothing was written.")
    cal, quality = fit_records(data, gpu)
    cal = cnt.with_extra(cal, settings=data.get("settings", {}),
                         collected=data.get("started"), quality=quality)
    print_quality(cal, quality)
    if write is not None:
        write.parent.mkdir(parents=True, exist_ok=True)
        tmp = write.with_suffix(write.suffix + ".tmp")
        tmp.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
        tmp.replace(write)
        print(f"\nwrote {write}")
    return cal


# -------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collect", action="store_true", help="profile the zoo's steps")
    ap.add_argument("--out", type=Path, help="--collect: write DIR/records.json")
    ap.add_argument("--models", nargs="+", help=f"--collect: steps (default: all of "
                    f"{', '.join(GPU_CASES)})")
    ap.add_argument("--provider", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--small", action="store_true",
                    help="tiny sizes (default with --provider cpu)")
    ap.add_argument("--runs", type=int, default=3, help="profiled runs after one warm-up")
    ap.add_argument("--budget-s", type=float, default=80.0,
                    help="--collect: stop starting new work after this many seconds")
    ap.add_argument("--fit", type=Path, metavar="RECORDS", help="fit records.json")
    ap.add_argument("--write", type=Path, help="--fit: write the calibration here")
    ap.add_argument("--gpu", help="--fit: the GPU the records were measured on, as named "
                    "in the calibration (default: the name the records hold)")
    ap.add_argument("--_profile", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--_result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        if args._profile is not None:
            profile_cases(args._profile, args._result, args.provider, args.runs)
            return 0
        if args.collect == (args.fit is not None):
            raise InputError("give one of --collect --out DIR, or --fit RECORDS")
        if args.collect:
            if args.out is None:
                raise InputError("--collect needs --out DIR (records.json goes there)")
            small = args.small or args.provider == "cpu"
            labels = args.models or list(SMALL_CASES if small else GPU_CASES)
            data = collect(args.out, labels, args.provider, small, args.runs, args.budget_s)
            return 0 if data["steps"] else 1
        fit_command(args.fit, args.write, args.gpu)
        return 0
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
