"""Everything a session with a GPU should run, in one command that writes one summary.

Device time is scarce (30 minutes a session, a few minutes per call), so the CUDA checks of
issue 11 are one script with phases, each writing its rows as soon as they exist:

- ``env``: the GPU (NVML), ONNX Runtime's version and providers.
- ``truth``: memory truth on the zoo. Each step is run with ``memcc run`` semantics, and
  the device peak predicted by the arena model (``memcc/passes/analysis/arena.py``) is set against
  the one NVML measured. The step is then run again with ``gpu_mem_limit`` at the
  predicted reserved peak: if ORT completes it, the prediction was enough, and
  ``same_losses_twice`` says whether the two runs gave the same losses.
- ``link``: the host link, measured both ways (``memcc/backend/host_link.py``).
- ``overlap``: whether a copy to the host and back overlaps compute. A chain of MatMuls
  and an independent copy round trip are timed alone and together, with ORT's copies on
  the compute stream (``do_copy_in_default_stream=1``, the default) and on their own
  (``0``). ``overlap`` is the share of the shorter of the two that disappears when they
  run together: what the planner would model if it is large (today it assumes none).
- ``arena_log``: where the device memory goes. Each step runs once more with ORT's verbose
  log on, which names every region the arena adds; the regions of the last run are set
  against the replay's (``memcc/passes/analysis/arena.py``), and their device pages against NVML.
  This is how the tenth session found the page rule and the stream tags; what is left in
  ``in_ort_not_replay`` is what the model still misses. (On CPU it reads the CPU arena's
  log, the code path only.)
- ``plans``: ``memcc compile --verify`` at fractions of the baseline peak, with and without
  swap. Each row has the measured peak and the step-time ratio against the step as built,
  timed interleaved (baseline, plan, baseline, ...).

    python benchmarks/cuda_check.py --out $OUT                      # on the GPU machine
    python benchmarks/cuda_check.py --provider cpu --small --out /tmp/x  # the code path, here

Nothing here has run on a GPU yet (no session has had one); ``--provider cpu`` runs the same
code on CPU (no swap there), which is what ``tests/test_benchmarks_cuda_check.py`` checks.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.memory_truth import SIZES  # noqa: E402  (the CPU table's sizes)
from memcc.backend.onnx_file import save_graph  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from models import build_model  # noqa: E402

# Tiny sizes for --small (a smoke test of the code path).
SMALL = {
    "mlp": dict(batch=512, width=256, depth=2),
    "resnet18": dict(batch=4, resolution=32, width=8),
    "resnet50": dict(batch=2, resolution=32),
    "vgg16": dict(batch=2, resolution=32, width=8),
    "mobilenetv2": dict(batch=2, resolution=32, width_mult=0.5),
    "unet": dict(batch=2, resolution=32, width=8),
    "gpt2": dict(batch=8, seq_len=128, width=64, depth=2, heads=2),
    "bert": dict(batch=8, seq_len=128, width=64, depth=2, heads=2),
}
PHASES = ("env", "truth", "arena_log", "link", "overlap", "plans")


class Summary:
    """Rows per phase, rewritten to ``summary.json`` and ``summary.md`` after every row, so
    a call cut short by its time limit still returns what it measured."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.data: dict[str, object] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
        out.mkdir(parents=True, exist_ok=True)

    def add(self, phase: str, row: dict) -> None:
        rows = self.data.setdefault(phase, [])
        assert isinstance(rows, list)
        rows.append(row)
        print(f"[{phase}] {json.dumps(row, default=str)}", flush=True)
        self.write()

    def write(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.data, indent=1, default=str))
        (self.out / "summary.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    lines = [f"# cuda_check ({data.get('started')})", ""]
    for phase, rows in data.items():
        if not isinstance(rows, list) or not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r if not isinstance(r[k], dict)))
        lines += [f"## {phase}", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "/") if v is not None else ""


def env_phase(summary: Summary, provider: str) -> None:
    import onnxruntime as ort

    row: dict[str, object] = {"onnxruntime": ort.__version__, "provider": provider,
                              "providers": ",".join(ort.get_available_providers())}
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        row["gpu"] = name.decode() if isinstance(name, bytes) else name
        row["gpu_memory_bytes"] = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception as exc:  # no NVML here: say why, the other phases still run
        row["gpu"] = f"none ({type(exc).__name__}: {exc})"
    summary.add("env", row)


def build_step(name: str, dims: dict, tmp: Path) -> Path:
    step = build_training_step(load_graph(build_model(name, **dims)), BuildOptions())
    return save_graph(step, tmp / f"{name}_step.onnx")


def truth_phase(summary: Summary, provider: str, models: Sequence[str], sizes: dict,
                tmp: Path, steps: int) -> None:
    for name in models:
        try:
            path = build_step(name, sizes[name], tmp)
            run = run_steps(path, RunRequest(steps=steps, provider=provider))
            device = run.prediction.get("device") or {}
            arena = device.get("arena") or run.prediction.get("arena") or {}
            row = {"model": name, "dims": sizes[name],
                   "predicted_bytes": run.predicted_peak_bytes,
                   "measured_bytes": run.measured_peak_bytes,
                   "measured_over_predicted": (run.measured_peak_bytes
                                               / run.predicted_peak_bytes)
                   if run.measured_peak_bytes else None,
                   "live_bytes": run.prediction.get("liveness_peak_bytes",
                                                    run.prediction.get("peak_bytes")),
                   "reserved_bytes": arena.get("peak_reserved_bytes"),
                   "device_bytes": arena.get("peak_device_bytes"),
                   "order_matches_plan": run.order_matches_plan,
                   "first_step_measured_bytes": run.first_step_measured_bytes,
                   "first_step_predicted_bytes": run.first_step_predicted_bytes,
                   "cuda_graph": run.cuda_graph,
                   "step_time_s": run.step_time_s, "method": run.measurement_method}
            if provider == "cuda" and run.predicted_peak_bytes:
                # The whole step (bound buffers and arena) under its steady prediction;
                # the first step may need more than that, so the limit is the larger.
                limit = max(int(run.predicted_peak_bytes),
                            int(run.first_step_predicted_bytes or 0))
                try:
                    again = run_steps(path, RunRequest(steps=2, provider=provider,
                                                       gpu_mem_limit=limit))
                    row["runs_under_predicted_limit"] = True
                    # Same feeds, a fresh session: does the step give the same losses?
                    row["same_losses_twice"] = list(again.losses) == list(run.losses[:2])
                except Exception as exc:  # ORT refused: the prediction was too small
                    row["runs_under_predicted_limit"] = f"no: {exc}"[:300]
            summary.add("truth", row)
        except Exception as exc:
            summary.add("truth", {"model": name, "error": _error(exc)})


_EXTEND = re.compile(r"Extending BFCArena for \w+\. bin_num:\d+ \(requested\) "
                     r"num_bytes: \d+ \(actual\) rounded_bytes:(\d+)")


def ort_arena_runs(log_text: str) -> list[list[int]]:
    """The regions ORT's arena added per run, read from its verbose log (a run's regions
    end at the first shrink line after them)."""
    runs: list[list[int]] = []
    current: list[int] = []
    for line in log_text.splitlines():
        m = _EXTEND.search(line)
        if m:
            current.append(int(m.group(1)))
        elif "shrunk by" in line and current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return runs


def top_sizes(counter, k: int = 6) -> list[list[int]]:
    return [[size, n] for size, n in sorted(counter.items(), key=lambda kv: -kv[0] * kv[1])[:k]]


def arena_log_phase(summary: Summary, provider: str, models: Sequence[str], sizes: dict,
                    tmp: Path, steps: int) -> None:
    import collections
    import os

    import onnxruntime as ort

    from memcc.backend.runner import execute, prepare_run, read_step_spec, synthetic_feeds
    from memcc.passes.analysis.arena import ArenaSetup, cuda_pages_for, replay_steps
    from memcc.passes.analysis.liveness import analyze_liveness
    from memcc.passes.providers.provider_step import for_provider

    cuda = provider == "cuda"
    for name in models:
        try:
            graph, _ = for_provider(load_graph(build_step(name, sizes[name], tmp)), provider)
            spec = read_step_spec(graph, source=name)
            replay = replay_steps(graph, analyze_liveness(graph),
                                  ArenaSetup(feeds_in_arena=cuda, cuda=cuda,
                                             addresses_grow=cuda), steps=steps)
            payload = prepare_run(graph, spec, synthetic_feeds(graph, 0), tmp, steps=steps,
                                  provider=provider)
            payload.update(in_place={}, arena=not cuda, gpu_mem_limit=None)
            log = tmp / f"{name}_arena.log"
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            saved = os.dup(2)
            ort.set_default_logger_severity(0)
            os.dup2(fd, 2)
            try:
                out = execute(payload)
            finally:
                os.dup2(saved, 2)
                os.close(fd)
                os.close(saved)
                ort.set_default_logger_severity(2)
            runs = ort_arena_runs(log.read_text(errors="replace"))
            ort_last = runs[-1] if runs else []
            ours = collections.Counter(replay.last_run_extensions)
            theirs = collections.Counter(ort_last)
            measured = max((b for b in out["measured_per_step"] if b is not None), default=None)
            summary.add("arena_log", {
                "model": name, "dims": sizes[name],
                "ort_regions_per_run": [len(r) for r in runs],
                "replay_regions_last_run": len(replay.last_run_extensions),
                "ort_last_run_bytes": sum(ort_last),
                "replay_last_run_bytes": sum(replay.last_run_extensions),
                "ort_last_run_pages": cuda_pages_for(ort_last),
                "measured_bytes": measured, "predicted_bytes": replay.measured_bytes,
                "in_ort_not_replay": top_sizes(theirs - ours),
                "in_replay_not_ort": top_sizes(ours - theirs)})
        except Exception as exc:
            summary.add("arena_log", {"model": name, "error": _error(exc)})


def link_phase(summary: Summary, provider: str) -> None:
    from memcc.backend.host_link import measure_host_link

    try:
        summary.add("link", measure_host_link(provider, use_cache=False).to_json())
    except Exception as exc:
        summary.add("link", {"error": _error(exc)})


def _overlap_model(n: int, chain: int, elements: int, parts: str):
    """MatMuls on ``a`` (``compute``), a copy of ``b`` out and back (``copy``), or both."""
    from onnx import TensorProto, helper

    h = helper.make_node
    nodes, outs = [], []
    if parts in ("compute", "both"):
        prev = "a"
        for k in range(chain):
            nodes.append(h("MatMul", [prev, "w"], [f"m{k}"], name=f"mm{k}"))
            prev = f"m{k}"
        outs.append((prev, [n, n]))
    if parts in ("copy", "both"):
        nodes += [h("Neg", ["b"], ["bn"], name="neg"),
                  h("MemcpyToHost", ["bn"], ["bh"], name="out"),
                  h("MemcpyFromHost", ["bh"], ["bd"], name="in"),
                  h("Neg", ["bd"], ["c"], name="neg2")]
        outs.append(("c", [elements]))
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, n]),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, [elements])]
    used = {i for nd in nodes for i in nd.input}
    g = helper.make_graph(nodes, "overlap", [i for i in inputs if i.name in used],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, s)
                           for o, s in outs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def overlap_phase(summary: Summary, provider: str, small: bool, rounds: int) -> None:
    import numpy as np

    from memcc.backend.session import SessionSettings, make_session

    n, chain, elements = (64, 4, 1 << 12) if small else (4096, 16, 1 << 26)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((n, n), dtype=np.float32) / n ** 0.5,
             "w": rng.standard_normal((n, n), dtype=np.float32) / n ** 0.5,
             "b": np.ones(elements, np.float32)}
    settings = ("1", "0") if provider == "cuda" else ("cpu",)
    for setting in settings:
        try:
            times = {}
            for parts in ("compute", "copy", "both"):
                model = _overlap_model(n, chain, elements, parts)
                opts = {"do_copy_in_default_stream": setting} if provider == "cuda" else None
                sess = make_session(model, provider, SessionSettings(cuda_options=opts))
                names = {i.name for i in sess.get_inputs()}
                mine = {k: v for k, v in feeds.items() if k in names}
                sess.run(None, mine)
                samples = []
                for _ in range(max(rounds, 3) * 3):
                    t0 = time.perf_counter()
                    sess.run(None, mine)
                    samples.append(time.perf_counter() - t0)
                times[parts] = statistics.median(samples)
            hidden = times["compute"] + times["copy"] - times["both"]
            summary.add("overlap", {
                "do_copy_in_default_stream": setting, "compute_s": times["compute"],
                "copy_s": times["copy"], "both_s": times["both"],
                "overlap": hidden / min(times["compute"], times["copy"])})
        except Exception as exc:
            summary.add("overlap", {"do_copy_in_default_stream": setting,
                                    "error": _error(exc)})


def plans_phase(summary: Summary, provider: str, models: Sequence[str], sizes: dict,
                fractions: Sequence[float], tmp: Path, rounds: int, time_limit: float,
                slack_bytes: int | None) -> None:
    from memcc.compiler import CompileOptions, compile_model
    from memcc.passes.analysis.cost_model import NOMINAL_CPU, analytic_costs
    from memcc.passes.plan import Plan
    from memcc.passes.planning.simulate import SimulationRules, simulate

    for name in models:
        try:
            path = build_step(name, sizes[name], tmp)
            step = load_graph(path)
            # The baseline peak by the provider's allocation rules (node times play no part).
            baseline = simulate(step, Plan(), analytic_costs(step, NOMINAL_CPU),
                                rules=SimulationRules(provider)).peak_bytes
        except Exception as exc:
            summary.add("plans", {"model": name, "error": _error(exc)})
            continue
        for frac in fractions:
            for offload in ((False, True) if provider == "cuda" else (False,)):
                row: dict[str, object] = {"model": name, "fraction": frac, "offload": offload}
                try:
                    out = tmp / f"{name}_{frac}_{int(offload)}.onnx"
                    res = compile_model(path, CompileOptions(
                        budget=int(frac * baseline), provider=provider, cost="measured",
                        verify=True, offload=offload, time_limit=time_limit,
                        **({} if slack_bytes is None else {"slack_bytes": slack_bytes})),
                        output=out)
                    plan, ver = res.report["plan"], res.report["verification"]
                    row.update(baseline_bytes=baseline, plan_bytes=plan["peak_bytes"],
                               predicted_overhead=plan["overhead"],
                               offloaded=len(plan["offloaded_values"]),
                               recomputed=len(plan["recomputed_values"]),
                               measured_bytes=ver["measured_peak_bytes"], verified=ver["ok"])
                    row["step_time_ratio"], row["ratio_spread"] = _time_ratio(
                        path, out, provider, rounds)
                except Exception as exc:
                    row["error"] = _error(exc)
                summary.add("plans", row)


def _time_ratio(base: Path, plan: Path, provider: str, rounds: int
                ) -> tuple[float, list[float]]:
    """Median of per-round plan/baseline step-time ratios, timed interleaved, and the
    smallest and largest round ratio."""
    ratios = []
    for _ in range(rounds):
        request = RunRequest(steps=3, provider=provider, separate_timing=False)
        b = run_steps(base, request).step_time_s
        p = run_steps(plan, request).step_time_s
        ratios.append(p / b)
    return statistics.median(ratios), [min(ratios), max(ratios)]


def _error(exc: BaseException) -> str:
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" (at {Path(where.filename).name}:{where.lineno})" if where else ""
    return f"{type(exc).__name__}: {exc}"[:500] + at


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for summary.json / .md")
    ap.add_argument("--provider", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=PHASES)
    ap.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--plan-models", nargs="+", default=["gpt2", "resnet50"],
                    choices=list(SIZES))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.33, 0.25])
    ap.add_argument("--small", action="store_true", help="tiny sizes (a smoke test)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--slack-bytes", type=int, default=None,
                    help="compile's fixed safety margin (default: compile's)")
    ap.add_argument("--cudnn-search", choices=("EXHAUSTIVE", "HEURISTIC", "DEFAULT"),
                    help="cuDNN's convolution algorithm search (default: memcc's)")
    args = ap.parse_args(argv)
    if args.cudnn_search:
        import os

        from memcc.backend.session import CUDNN_SEARCH_ENV
        os.environ[CUDNN_SEARCH_ENV] = args.cudnn_search  # the measuring children read it
    sizes = SMALL if args.small else SIZES
    summary = Summary(args.out)
    from memcc.backend.session import cudnn_conv_algo_search
    summary.data["cudnn_conv_algo_search"] = cudnn_conv_algo_search()
    with tempfile.TemporaryDirectory(prefix="memcc-cuda-check-") as d:
        tmp = Path(d)
        if "env" in args.phases:
            env_phase(summary, args.provider)
        if "truth" in args.phases:
            truth_phase(summary, args.provider, args.models, sizes, tmp, args.steps)
        if "arena_log" in args.phases:
            arena_log_phase(summary, args.provider, args.models, sizes, tmp, args.steps)
        if "link" in args.phases:
            link_phase(summary, args.provider)
        if "overlap" in args.phases:
            overlap_phase(summary, args.provider, args.small, args.rounds)
        if "plans" in args.phases:
            plans_phase(summary, args.provider, args.plan_models, sizes, args.fractions, tmp,
                        args.rounds, args.time_limit, args.slack_bytes)
    summary.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
