"""Pareto benchmark: memory against time for memcc's plans and PyTorch's, on one noisy machine.

Why it is built this way:

- A plan's cost is a few percent of step time, and on the project's 2-core machine two
  timings of the same step differ by up to 35%. So each distinct plan is timed with the
  original step in ONE process, interleaved in a fresh random order each round
  (``benchmarks.stats``; one process per plan, ``time_against_first``), and each plan's
  ratio is the median of its per-round ratios to the original with a 95% bootstrap
  interval. Where the interval spans 1.0 the table marks it
  ``~`` and the verdict says "cannot tell from noise", with the interval.
- Plans are compiled with ``--cost analytic`` by default, so which plan a budget gets does
  not depend on how busy the machine was while profiling (``--cost measured`` is allowed).
- Peaks are measured, never copied from a plan: memcc's steps by ``memcc.backend.runner``
  (high-water mark in a fresh child with the measuring allocator), PyTorch's by
  ``benchmarks.torch_peer`` the same way. Timing runs in separate children
  (``--timing-allocator``): with glibc's default allocator, as ``memcc run`` does
  (``memory.timing_env``), and with ORT's CPU arena. The two answer different questions.
  Under glibc's default the freed heap goes back to the kernel and every step faults its
  pages in again, which costs the step as built more than a leaner plan (BENCHMARKS.md,
  "Allocators"), and the process holds far more than the plan's peak. Under the arena
  nothing faults and the process holds close to the plan's peak, so its ratio is the one
  whose memory holds. ``held_*`` is what the timing process held: its high-water mark
  over its resident size before the first step, for each step in a child of its own.
- Plans that rewrite the step to the same node list (``auto`` often picks the ``ilp`` plan;
  a budget above the peak needs no rewrite) are measured once and the other rows say
  "same step as ...", so the interleaved rounds stay short enough to repeat.
- PyTorch peers on the same architecture, weights and batch: eager without and with
  per-block ``torch.utils.checkpoint``, and ``torch.compile`` with
  ``activation_memory_budget`` (min-cut + knapsack partitioner). Their ratios are against
  PyTorch eager without checkpointing, timed interleaved in one torch process; absolute
  medians are printed too, but ORT and torch run in different processes, so the
  cross-framework comparison is unpaired. torch.compile runs at budgets 1.0 and 0.0 and at
  some of memcc's own fractions (its peak is not monotonic in the budget, see
  ``_matched_compiles``); the matched-memory table pairs each memcc plan with the nearest
  measured PyTorch peak and prints both, whatever they turned out to be.

    python benchmarks/pareto.py --quick
    python benchmarks/pareto.py --out pareto.md --json pareto.json

The default run takes about half an hour on the 2-core machine, most of it torch.compile
(2-3 minutes per budget for ResNet-50 while inductor's on-disk cache is cold, seconds once
it is warm); ``--quick`` takes 5-8 minutes. It never runs in CI.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.stats import RatioInterval, interleaved_times, ratio_interval  # noqa: E402
from benchmarks.steps import build_step, mb, parse_model  # noqa: E402
from memcc.backend import memory  # noqa: E402

DEFAULT_MODELS = [
    "gpt2:batch=8,seq_len=256,width=256,depth=6,heads=4",
    "resnet50:batch=8,resolution=128",
]
QUICK_MODELS = [
    "gpt2:batch=4,seq_len=128,width=128,depth=3,heads=4",
    "resnet18:batch=8,resolution=96,width=16",
]
DEFAULT_FRACTIONS = ["1.0", "0.7", "0.5", "0.4", "0.33", "min"]
QUICK_FRACTIONS = ["0.5", "min"]
STRATEGIES = ["ilp", "sqrtn", "auto"]
TORCH_FAMILIES = ("resnet18", "resnet50", "gpt2", "mlp")

Log = Callable[[str], None]


# ---------------------------------------------------------------------------- helpers
def _fraction_label(frac: str) -> str:
    if frac == "min":
        return "min"
    if frac.endswith("p"):
        return f"{float(frac[:-1]):.0%} peak"
    return f"{float(frac):.0%} act"


def _budget(frac: str, fixed: int, act: int) -> int | str:
    """``min``; ``0.33``: the fixed part plus that share of the activations; ``0.33p``: that
    share of the whole baseline peak (MONeT's convention)."""
    if frac == "min":
        return "min"
    if frac.endswith("p"):
        return int(float(frac[:-1]) * (fixed + act))
    return int(fixed + float(frac) * act)


def graph_signature(graph) -> str:
    """What ORT would run, ignoring metadata: equal signatures are the same step."""
    h = hashlib.sha1()
    for n in graph.nodes:
        h.update(n.op_type.encode())
        h.update(("|".join(n.input) + ">" + "|".join(n.output) + ";").encode())
        h.update(b"".join(a.SerializeToString() for a in n.attribute))
    return h.hexdigest()


# ---------------------------------------------------------------------------- memcc side
def compile_plans(step_path: Path, fractions: Sequence[str], strategies: Sequence[str],
                  fixed: int, act: int, cost: str, time_limit: float, tmp: Path,
                  log: Log) -> list[dict]:
    """Compile every (fraction, strategy); a row per compile, with the error if it failed."""
    from memcc.compiler import CompileOptions, compile_model
    from memcc.errors import MemccError

    rows = []
    for frac in fractions:
        budget = _budget(frac, fixed, act)
        for spec in strategies:
            # "auto/novar": the same strategy with the default gradient rules only;
            # "auto/arena": planned for ORT's CPU arena (compile --arena), and measured
            # through it (the step is marked, and memcc run follows the mark).
            strategy, _, tag = spec.partition("/")
            out = tmp / f"{strategy}.{tag or 'var'}.{frac}.onnx"
            row: dict = {"framework": "memcc", "variant": spec, "fraction": frac,
                         "budget_bytes": None if budget == "min" else budget}
            t0 = time.perf_counter()
            try:
                res = compile_model(step_path, CompileOptions(
                    budget=budget, strategy=strategy, time_limit=time_limit, cost=cost,
                    variants=tag != "novar", arena=tag == "arena"), output=out)
            except MemccError as exc:
                row["compile_s"] = time.perf_counter() - t0
                smallest = getattr(exc, "smallest", None)
                row["error"] = (f"does not fit (smallest {mb(smallest)} MB)"
                                if smallest else f"{type(exc).__name__}: {exc}")
                log(f"  {spec} @ {frac}: {row['error']}")
                rows.append(row)
                continue
            except Exception as exc:  # a planner mid-edit elsewhere: report, keep going
                row["compile_s"] = time.perf_counter() - t0
                row["error"] = f"compile crashed: {type(exc).__name__}: {exc}"
                log(f"  {spec} @ {frac}: {row['error']}")
                rows.append(row)
                continue
            plan = res.report["plan"]
            row.update({
                "compile_s": time.perf_counter() - t0, "path": str(out),
                "budget_bytes": res.report["budget_bytes"],
                "predicted_peak_bytes": plan["peak_bytes"],
                "predicted_overhead": plan["overhead"],
                "chosen": plan.get("strategy_label") or plan.get("picked_strategy"),
                "fits": plan.get("fits"),
                "signature": graph_signature(res.graph) + (":arena" if tag == "arena" else ""),
                "recomputed_nodes": len(plan.get("recomputed_nodes", [])),
            })
            kinds = (plan.get("variants") or {}).get("by_kind", {})
            row["variants"] = {k: v["nodes"] for k, v in kinds.items()}
            log(f"  {spec} @ {frac}: predicted {mb(plan['peak_bytes'])} MB, overhead "
                f"{plan['overhead']:.1%}, {len(plan.get('recomputed_nodes', []))} recomputed "
                f"nodes, variants {row['variants'] or 'none'}, compile "
                f"{row['compile_s']:.1f} s")
            rows.append(row)
    return rows


def prepare_timing_job(name: str, path: Path, tmp: Path) -> dict:
    """Session graph and feeds exactly as ``memcc run`` prepares them (runner.prepare_run)."""
    from memcc.backend.runner import prepare_run, read_step_spec, synthetic_feeds
    from memcc.frontend.load import load_graph

    graph = load_graph(path)
    spec = read_step_spec(graph, source=str(path))
    where = tmp / f"timing-{name}"
    where.mkdir(parents=True, exist_ok=True)
    payload = prepare_run(graph, spec, synthetic_feeds(graph, 0), where, steps=1,
                          provider="cpu")
    return {"name": name, "session_model": payload["session_model"],
            "feeds": payload["feeds"], "outputs": payload["outputs"]}


ALLOCATORS = ("glibc", "arena")
SUFFIX = {"glibc": "", "arena": "_arena"}   # row keys: ratio, ratio_arena, ...


def time_ort(jobs: list[dict], rounds: int, warmup: int, seed: int, timeout_s: float | None,
             min_seconds: float = 0.0, max_rounds: int | None = None,
             allocator: str = "glibc") -> dict:
    """Interleaved rounds of every step in one child: with glibc's default allocator, or
    (``allocator="arena"``) through ORT's CPU arena, the one ``memcc run --arena`` uses."""
    payload = {"jobs": jobs, "rounds": rounds, "warmup": warmup, "order": "random",
               "seed": seed, "min_seconds": min_seconds, "max_rounds": max_rounds,
               "allocator": allocator}
    return memory.run_child("benchmarks.pareto", payload, timeout_s=timeout_s,
                            measuring=False)


def time_against_first(jobs: list[dict], rounds: int, warmup: int, seed: int,
                       timeout_s: float | None, min_seconds: float = 0.0,
                       max_rounds: int | None = None, allocator: str = "glibc"
                       ) -> dict[str, tuple[list[float], list[float]]]:
    """Each step after the first timed against the first (the original) in a child of its
    own, interleaved: name -> (the first's times, its times); the first maps to its own
    times twice (from the first pair, or alone).

    Pairs, not all steps in one child: steps in one process share its allocator, and
    through ORT's CPU arena (one per process) a third step's requests changed the others'
    times (ResNet-50's original step took 0.81 s next to two plans, 0.38 s next to one,
    0.35 s alone)."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for job in jobs[1:] or jobs[:1]:
        pair = [jobs[0]] if job is jobs[0] else [jobs[0], job]
        times = time_ort(pair, rounds, warmup, seed, timeout_s, min_seconds, max_rounds,
                         allocator)["times"]
        first = times[jobs[0]["name"]]
        out.setdefault(jobs[0]["name"], (first, first))
        out[job["name"]] = (first, times[job["name"]])
    return out


def held_bytes(job: dict, allocator: str, steps: int, timeout_s: float | None) -> int:
    """What a process running ``job`` holds: its resident high-water mark over ``steps``
    steps, over its resident size once the session and feeds are ready. ``allocator``:
    ``exact`` (the measuring child's mmap per buffer), ``glibc`` or ``arena`` (as timed)."""
    payload = {"held": True, "jobs": [job], "steps": steps,
               "allocator": "glibc" if allocator == "exact" else allocator}
    out = memory.run_child("benchmarks.pareto", payload, timeout_s=timeout_s,
                           measuring=allocator == "exact")
    return int(out["held_bytes"])


def _time_child(payload: dict) -> dict:
    """Child side of ``time_ort``.

    Every step runs from the same initial state each round (outputs dropped): the work per
    step is identical, and identical arrays (parameters, momentum, batch are the same in
    every variant) are shared, so twenty sessions fit where twenty copies of the state
    would not. Sessions come from ``make_session``: the execution contract memcc runs under.
    """
    from memcc.backend.session import SessionSettings, make_session

    arena = payload.get("allocator", "glibc") == "arena"
    if payload.get("held"):
        return _held_child(payload, arena)
    shared: dict[tuple, np.ndarray] = {}

    def load(path: str) -> dict[str, np.ndarray]:
        out = {}
        with np.load(path, allow_pickle=False) as npz:
            for k in npz.files:
                a = npz[k]
                key = (k, a.shape, a.dtype.str, hashlib.sha1(a.tobytes()).hexdigest())
                out[k] = shared.setdefault(key, a)
        return out

    fns = {}
    for job in payload["jobs"]:
        session = make_session(job["session_model"], "cpu", SessionSettings(cpu_arena=arena))
        feeds = load(job["feeds"])
        outputs = list(job["outputs"])
        fns[job["name"]] = (lambda s=session, f=feeds, o=outputs: s.run(o, f))
    times = interleaved_times(fns, rounds=int(payload["rounds"]),
                              warmup=int(payload["warmup"]), order=payload["order"],
                              seed=int(payload["seed"]),
                              min_seconds=float(payload.get("min_seconds") or 0.0),
                              max_rounds=payload.get("max_rounds"))
    allocator = "ORT's CPU arena" if arena else "glibc's default allocator"
    return {"times": times, "method": f"interleaved rounds in one process, {allocator}"}


def _held_child(payload: dict, arena: bool) -> dict:
    """Child side of ``held_bytes``: one step's session, run ``steps`` times."""
    from memcc.backend.session import SessionSettings, make_session

    job = payload["jobs"][0]
    session = make_session(job["session_model"], "cpu", SessionSettings(cpu_arena=arena))
    with np.load(job["feeds"], allow_pickle=False) as npz:
        feeds = {k: npz[k] for k in npz.files}
    outputs = list(job["outputs"])
    meter = memory.CpuPeakMeter()
    meter.set_baseline()
    meter.start()
    for _ in range(int(payload["steps"])):
        session.run(outputs, feeds)
    return {"held_bytes": meter.stop()}


def measure_peak(path: Path, steps: int) -> dict:
    from memcc.backend.runner import RunRequest, run_steps

    r = run_steps(path, RunRequest(steps=steps, separate_timing=False))
    return {"measured_peak_bytes": r.measured_peak_bytes,
            "order_matches_plan": r.order_matches_plan}


def memcc_section(name: str, opts: dict, args: argparse.Namespace, tmp: Path, log: Log
                  ) -> tuple[list[dict], dict]:
    step_path = tmp / "step.onnx"
    step, live, act, fixed = build_step(name, opts, step_path, log)
    original = {"framework": "memcc", "variant": "original (ORT)", "fraction": None,
                "budget_bytes": None, "predicted_peak_bytes": live.peak_bytes,
                "predicted_overhead": 0.0, "compile_s": 0.0, "path": str(step_path),
                "signature": graph_signature(step)}
    rows = [original] + compile_plans(step_path, args.fractions, args.strategies, fixed, act,
                                      args.cost, args.time_limit, tmp, log)
    # one measurement per distinct step
    first: dict[str, dict] = {}
    for r in rows:
        if "error" in r:
            continue
        if r["signature"] in first:
            twin = first[r["signature"]]
            r["same_as"] = _row_label(twin)
            continue
        first[r["signature"]] = r
        try:
            r.update(measure_peak(Path(r["path"]), args.peak_steps))
        except Exception as exc:
            r["error"] = f"measuring failed: {type(exc).__name__}: {exc}"
        log(f"  peak {_row_label(r)}: {mb(r.get('measured_peak_bytes'))} MB")
    distinct = [r for r in first.values() if "error" not in r]
    meta = {"fixed": fixed, "act": act, "baseline_s": None}
    if "error" in original:
        return rows, meta
    jobs = []
    for allocator in args.timing_allocators:
        suffix = SUFFIX[allocator]
        try:
            jobs = jobs or [prepare_timing_job(f"v{i}", Path(r["path"]), tmp)
                            for i, r in enumerate(distinct)]
            log(f"  timing {len(jobs)} distinct steps x {args.rounds} rounds, each against "
                f"the original, interleaved, {allocator} ...")
            t0 = time.perf_counter()
            timed = time_against_first(jobs, args.rounds, args.warmup, args.seed,
                                       args.timeout, args.timing_seconds, args.max_rounds,
                                       allocator)
            log(f"  timed in {time.perf_counter() - t0:.0f} s")
        except Exception as exc:
            for r in distinct:
                r["note"] = f"timing ({allocator}) failed: {type(exc).__name__}: {exc}"
            continue
        meta["baseline_s" + suffix] = statistics.median(timed["v0"][0])
        for i, r in enumerate(distinct):
            base, t = timed[f"v{i}"]
            r["step_times_s" + suffix] = t
            r["median_step_s" + suffix] = statistics.median(t)
            r["rounds" + suffix] = len(t)
            if i:
                r["ratio" + suffix] = ratio_interval(base, t, seed=args.seed)
    for i, r in enumerate(distinct if jobs else []):
        for allocator in ("exact", *args.timing_allocators):
            try:
                r[f"held_{allocator}"] = held_bytes(jobs[i], allocator, args.peak_steps + 1,
                                                    args.timeout)
            except Exception as exc:
                r["note"] = f"held memory ({allocator}) failed: {type(exc).__name__}: {exc}"
        log(f"  held {_row_label(r)}: " + ", ".join(
            f"{a} {mb(r.get(f'held_{a}'))} MB" for a in ("exact", *args.timing_allocators)))
    for r in rows:  # twins share their measurement
        if "same_as" in r:
            twin = next(d for d in first.values() if _row_label(d) == r["same_as"])
            for k, v in twin.items():
                if k in ("measured_peak_bytes", "order_matches_plan") or k.startswith(
                        ("median_step_s", "ratio", "held_")):
                    r[k] = v
    return rows, meta


# ---------------------------------------------------------------------------- torch side
def torch_section(name: str, opts: dict, memcc_rows: list[dict], args: argparse.Namespace,
                  log: Log) -> list[dict]:
    """PyTorch peers; every failure becomes a row that says what failed."""
    if name not in TORCH_FAMILIES:
        return [{"framework": "torch", "variant": "-", "error": f"no torch peer for {name}"}]
    try:
        from benchmarks import torch_peer
    except ImportError as exc:
        return [{"framework": "torch", "variant": "-", "error": f"torch peer: {exc}"}]
    topts = {k: v for k, v in opts.items() if k != "dynamic_batch"}
    rows: list[dict] = []

    def measure(variant: str, checkpoint: str, budget: float | None) -> dict:
        row = {"framework": "torch", "variant": variant, "checkpoint": checkpoint,
               "compile_budget": budget, "fraction": None if budget is None else budget}
        t0 = time.perf_counter()
        try:
            r = torch_peer.measure_torch(name, topts, checkpoint=checkpoint,
                                         steps=args.peak_steps, compile_budget=budget,
                                         timeout_s=args.timeout)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}".strip()
            log(f"  torch {variant}: FAILED: {row['error']}")
            return row
        row.update({"measured_peak_bytes": r["peak_bytes"],
                    "compile_s": r.get("compile_s", 0.0),
                    "recompiles": r.get("graphs_compiled_during_steps", 0)})
        log(f"  torch {variant}: peak {mb(r['peak_bytes'])} MB "
            f"({time.perf_counter() - t0:.0f} s)")
        return row

    rows.append(measure("eager", "none", None))
    rows.append(measure("eager + checkpoint per block", "per-block", None))
    if args.torch_compile:
        budgets = [1.0, 0.0] if args.torch_budgets is None else list(args.torch_budgets)
        for b in budgets:
            rows.append(measure(f"compile, budget {b:g}", "none", b))
        if args.torch_budgets is None:
            rows += _matched_compiles(rows, memcc_rows, args.torch_matches, measure, log)
    ok = [r for r in rows if "error" not in r]
    if not ok or ok[0]["variant"] != "eager":
        return rows
    variants = [{"name": f"t{i}", "checkpoint": r["checkpoint"],
                 "compile_budget": r["compile_budget"]} for i, r in enumerate(ok)]
    log(f"  timing {len(variants)} torch variants x {args.rounds} rounds, interleaved ...")
    t0 = time.perf_counter()
    try:
        timed = torch_peer.time_torch(name, topts, variants, rounds=args.rounds,
                                      warmup=args.warmup, seed=args.seed,
                                      timeout_s=args.timeout,
                                      min_seconds=args.timing_seconds,
                                      max_rounds=args.max_rounds)
    except Exception as exc:
        for r in ok:
            r["note"] = f"timing failed: {type(exc).__name__}: {exc}"
        return rows
    log(f"  timed in {time.perf_counter() - t0:.0f} s")
    base = timed["times"]["t0"]
    for i, r in enumerate(ok):
        t = timed["times"][f"t{i}"]
        r["step_times_s"] = t
        r["median_step_s"] = statistics.median(t)
        if i:
            r["ratio"] = ratio_interval(base, t, seed=args.seed)
    if timed.get("graphs_compiled_during_rounds"):
        for r in ok:
            r["note"] = (f"{timed['graphs_compiled_during_rounds']} recompile(s) during the "
                         "timed rounds")
    return rows


def _matched_compiles(rows: list[dict], memcc_rows: list[dict], k: int, measure, log: Log
                      ) -> list[dict]:
    """torch.compile at ``k`` of memcc's own budget fractions, spread over the list.

    Not interpolated from the two ends: measured on GPT-2 (batch 8, 256 tokens) the
    partitioner's peak is not monotonic in the budget (1.0: 307 MB, 0.7: 243 MB, 0.0:
    356 MB; at 0.0 inductor computes the recomputed values early in the backward), so the
    only honest way to get near a memcc peak is to sample budgets and print what each one
    measured; the matched-memory table then pairs every plan with the nearest peak.
    """
    done = {r.get("compile_budget") for r in rows}
    fracs = sorted({float(str(r["fraction"]).removesuffix("p")) for r in memcc_rows
                    if r.get("fraction") not in (None, "min")
                    and 0.0 < float(str(r["fraction"]).removesuffix("p")) < 1.0},
                   reverse=True)
    if not fracs or k < 1:
        return []
    picks = [fracs[round(i * (len(fracs) - 1) / max(k - 1, 1))] for i in range(min(k, len(fracs)))]
    budgets = [b for b in dict.fromkeys(picks) if b not in done]
    ends = {r["compile_budget"]: r.get("measured_peak_bytes") for r in rows
            if r.get("compile_budget") in (0.0, 1.0) and "error" not in r}
    log(f"  torch.compile: budgets 1.0 and 0.0 peak at {mb(ends.get(1.0))} and "
        f"{mb(ends.get(0.0))} MB; also trying memcc's fractions {budgets}")
    return [measure(f"compile, budget {b:g}", "none", b) for b in budgets]


# ---------------------------------------------------------------------------- report
def _row_label(r: dict) -> str:
    if r["framework"] == "torch":
        return f"torch {r['variant']}"
    if r.get("fraction") is None:
        return r["variant"]
    return f"{r['variant']} @ {_fraction_label(r['fraction'])}"


def mark_pareto(rows: list[dict]) -> None:
    """Mark rows no other row beats on both measured peak and median time ratio.

    Within one framework only: ratios are against each framework's own baseline."""
    for fw in ("memcc", "torch"):
        pts = [r for r in rows if r["framework"] == fw and "error" not in r
               and "same_as" not in r and r.get("measured_peak_bytes") is not None
               and r.get("median_step_s") is not None]
        for r in pts:
            ratio = r["ratio"].ratio if r.get("ratio") else 1.0
            r["pareto"] = not any(
                (o["measured_peak_bytes"] <= r["measured_peak_bytes"]
                 and (o["ratio"].ratio if o.get("ratio") else 1.0) <= ratio)
                and (o["measured_peak_bytes"] < r["measured_peak_bytes"]
                     or (o["ratio"].ratio if o.get("ratio") else 1.0) < ratio)
                for o in pts if o is not r)


def markdown(model: str, rows: list[dict], meta: dict) -> str:
    lines = [f"### {model}", "",
             f"Baseline: ORT original step {_fmt_s(meta.get('baseline_s'))} s median with "
             f"glibc's default allocator, {_fmt_s(meta.get('baseline_s_arena'))} s with ORT's "
             "CPU arena; memcc ratios "
             "are rewritten/original, torch ratios are against torch eager without "
             "checkpointing, both paired per round (median, 95% bootstrap CI; `~`: the "
             "interval spans 1.0, cannot tell from noise). * = on the Pareto front of its "
             "framework (measured peak vs median glibc ratio). Held: the timing process's "
             "high-water mark over its resident size before the first step, with one buffer "
             "per mmap (exact), glibc's default allocator, and ORT's CPU arena.", "",
             "| strategy | budget | predicted peak (MB) | measured peak (MB) | predicted "
             "overhead | time ratio, glibc (95% CI) | time ratio, arena (95% CI) | "
             "held: exact / glibc / arena (MB) | median step (s) | compile (s) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["framework"] == "torch":
            strat = f"torch {r['variant']}"
            budget = "-"
        else:
            strat = r["variant"]
            budget = "-" if r.get("fraction") is None else (
                f"{_fraction_label(r['fraction'])} ({mb(r.get('budget_bytes'))} MB)"
                if r.get("budget_bytes") else _fraction_label(r["fraction"]))
        if r.get("pareto"):
            strat = f"**{strat}** *"
        if "error" in r:
            lines.append(f"| {strat} | {budget} | | | | | | | | {r.get('compile_s', 0):.1f} | "
                         f"{_cell(r['error'])} |")
            continue
        pred = r.get("predicted_overhead")
        note = []
        if r.get("same_as"):
            note.append(f"same step as {r['same_as']}")
        if r.get("chosen") and r["variant"] == "auto":
            note.append(f"picked {r['chosen']}")
        if r.get("order_matches_plan") is False:
            note.append("ORT order differs from plan")
        if r.get("recompiles"):
            note.append(f"{r['recompiles']} recompile(s) in measured steps")
        if r.get("note"):
            note.append(r["note"])
        cells = [_ratio_cell(r, suffix) for suffix in SUFFIX.values()]
        held = " / ".join(mb(r.get(f"held_{a}")) for a in ("exact", *ALLOCATORS))
        lines.append(
            f"| {strat} | {budget} | {mb(r.get('predicted_peak_bytes'))} | "
            f"{mb(r.get('measured_peak_bytes'))} | "
            f"{'-' if pred is None else f'{pred:.1%}'} | {' | '.join(cells)} | "
            f"{held if r['framework'] == 'memcc' else '-'} | "
            f"{_fmt_s(r.get('median_step_s'))} | {r.get('compile_s', 0.0):.1f} | "
            f"{_cell('; '.join(note))} |")
    lines += ["", "Verdicts:", ""]
    for r in rows:
        for suffix, how in (("", ""), ("_arena", " (ORT's CPU arena)")):
            if isinstance(r.get("ratio" + suffix), RatioInterval) and not r.get("same_as"):
                base = "torch eager" if r["framework"] == "torch" else "the original step"
                lines.append(f"- {_row_label(r)}{how}: "
                             f"{r['ratio' + suffix].verdict(b='it', a=base)}")
    lines += ["", matched_table(rows)]
    return "\n".join(lines)


def _ratio_cell(r: dict, suffix: str) -> str:
    ratio = r.get("ratio" + suffix)
    if isinstance(ratio, RatioInterval):
        return ratio.cell()
    if r.get("same_as"):
        return "1 (same step)"
    return "1 (baseline)" if r.get("median_step_s" + suffix) is not None else "-"


def matched_table(rows: list[dict]) -> str:
    """Each memcc plan beside the PyTorch peer whose measured peak is nearest."""
    torch_rows = [r for r in rows if r["framework"] == "torch" and "error" not in r
                  and r.get("measured_peak_bytes")]
    mem = [r for r in rows if r["framework"] == "memcc" and "error" not in r
           and "same_as" not in r and r.get("fraction") is not None
           and r.get("measured_peak_bytes")]
    if not torch_rows or not mem:
        return "(no matched-memory comparison: a side has no measured peak)"
    lines = ["Matched memory (nearest PyTorch peak to each distinct memcc plan):", "",
             "| memcc plan | memcc peak (MB) | memcc ratio | nearest torch peer | torch peak "
             "(MB) | peak difference | torch ratio vs eager |",
             "|---|---|---|---|---|---|---|"]
    for r in mem:
        near = min(torch_rows, key=lambda t: abs(t["measured_peak_bytes"]
                                                  - r["measured_peak_bytes"]))
        diff = near["measured_peak_bytes"] / r["measured_peak_bytes"] - 1.0
        rr, tr = r.get("ratio"), near.get("ratio")
        lines.append(
            f"| {_row_label(r)} | {mb(r['measured_peak_bytes'])} | "
            f"{rr.cell() if rr else '-'} | {near['variant']} | "
            f"{mb(near['measured_peak_bytes'])} | {diff:+.1%} | "
            f"{tr.cell() if tr else ('1 (baseline)' if near['variant'] == 'eager' else '-')} |")
    return "\n".join(lines)


def _fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:300]


def _jsonable(rows: list[dict]) -> list[dict]:
    return [{k: (v.to_json() if isinstance(v, RatioInterval) else v) for k, v in r.items()}
            for r in rows]


# ---------------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--child" in argv:
        return memory.child_main(argv, _time_child)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", help="NAME:key=value,... (zoo builder options); "
                    f"default {' '.join(DEFAULT_MODELS)}")
    ap.add_argument("--fractions", nargs="+", help="fractions of the baseline's activation "
                    "memory (0.33), of its whole peak (0.33p), or min; default "
                    f"{' '.join(DEFAULT_FRACTIONS)}")
    ap.add_argument("--strategies", nargs="+", default=STRATEGIES,
                    help="strategies to compile with; NAME/novar plans with the default "
                         "gradient rules only (no operator variants), NAME/arena for ORT's "
                         "CPU arena (compile --arena, measured through it), e.g. auto "
                         "auto/novar auto/arena")
    ap.add_argument("--cost", choices=["analytic", "measured", "auto"], default="analytic")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="memcc's solver time limit (s); default 20, quick 15 (memcc's own "
                         "default is 60: at 60 the two default models spend ~15 min compiling "
                         "with auto and ilp, which the run-time target cannot afford)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="interleaved timing rounds at least; default 10, quick 8")
    ap.add_argument("--timing-seconds", type=float, default=None,
                    help="keep adding rounds until each timing child spent this long; "
                         "default 60, quick 30")
    ap.add_argument("--max-rounds", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--peak-steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing-allocator", dest="timing_allocators", nargs="+",
                    choices=ALLOCATORS, default=list(ALLOCATORS),
                    help="time under glibc's default allocator (as memcc run; PyTorch's "
                         "peers are timed so too), ORT's CPU arena (memcc run --arena), or "
                         "both (default); glibc's gives the ratio column that is compared "
                         "with PyTorch's, the arena's its own column")
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    ap.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    ap.add_argument("--torch-budgets", nargs="+", type=float, default=None,
                    help="explicit activation_memory_budget values (default: 1.0, 0.0 and "
                         "--torch-matches of memcc's fractions)")
    ap.add_argument("--torch-matches", type=int, default=None,
                    help="how many of memcc's fractions torch.compile also runs at; "
                         "default 2, quick 1")
    ap.add_argument("--timeout", type=float, default=1200.0, help="per child process (s)")
    ap.add_argument("--quick", action="store_true", help="smaller models, fewer budgets")
    ap.add_argument("--out", type=Path, help="write the Markdown here")
    ap.add_argument("--json", type=Path, help="write every row as JSON here")
    args = ap.parse_args(argv)
    q = args.quick
    args.models = args.models or (QUICK_MODELS if q else DEFAULT_MODELS)
    args.fractions = args.fractions or (QUICK_FRACTIONS if q else DEFAULT_FRACTIONS)
    for f in args.fractions:
        if f != "min":
            float(f.removesuffix("p"))
    args.time_limit = args.time_limit or (15.0 if q else 20.0)
    args.rounds = args.rounds or (8 if q else 10)
    if args.timing_seconds is None:
        args.timing_seconds = 30.0 if q else 60.0
    if args.torch_matches is None:
        args.torch_matches = 1 if q else 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    parts, all_rows = [], []
    for spec in args.models:
        name, opts = parse_model(spec)
        with tempfile.TemporaryDirectory(prefix="memcc-pareto-") as tmp:
            rows, meta = memcc_section(name, opts, args, Path(tmp), log)
        if args.torch:
            rows += torch_section(name, opts, rows, args, log)
        mark_pareto(rows)
        parts.append(markdown(spec, rows, meta))
        all_rows += [{"model": spec} | r for r in rows]
    elapsed = time.perf_counter() - t_start
    header = (f"Pareto benchmark ({os.cpu_count()} CPUs; at least {args.rounds} interleaved "
              f"rounds or {args.timing_seconds:g} s per timing process; --time-limit "
              f"{args.time_limit:g}; "
              f"--cost {args.cost}; total {elapsed / 60:.1f} min)\n\n"
              f"    python benchmarks/pareto.py {' '.join(argv)}\n")
    text = header + "\n" + "\n\n".join(parts) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(_jsonable(all_rows), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
