"""Recompute benchmark: memcc's plans at fractions of the baseline activation memory.

For each model: build the training step (SGD, cross-entropy), run it in ORT (measured peak,
median step time), then for each budget fraction and strategy compile it, run the rewritten
step in the same process run, and report the measured peak and the step-time ratio
rewritten/original. Budgets are ``non-activation bytes at the baseline peak + fraction *
activation bytes at the baseline peak`` (activations = everything but parameters, optimizer
state, gradients, inputs). Optionally the PyTorch peer (eager, with and without
``torch.utils.checkpoint`` per residual block) runs on the same architecture.

    python benchmarks/recompute_benchmark.py --out BENCHMARKS.md

Numbers are measured (OS high-water mark, wall clock); nothing is copied from a plan.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.steps import build_step, mb, parse_model  # noqa: E402
from memcc.backend.runner import RunRequest, run_steps  # noqa: E402
from memcc.compiler import CompileOptions, compile_model  # noqa: E402
from memcc.passes.planning.planner import BudgetError  # noqa: E402

DEFAULT_MODELS = [
    "resnet50:batch=8,resolution=128",
    "gpt2:batch=8,seq_len=256,width=256,depth=6,heads=4",
]


def bench_model(name: str, opts: dict, fractions, strategies, steps: int, time_limit: float,
                torch_peer: bool, tmp: Path, log) -> list[dict]:
    step_path = tmp / f"{name}.step.onnx"
    step, live, act, fixed = build_step(name, opts, step_path, log)
    base = run_steps(step_path, RunRequest(steps=steps))
    base_times = [base.step_time_s]
    rows = [{
        "model": name, "options": opts, "strategy": "original", "fraction": 1.0,
        "budget_bytes": None, "predicted_peak_bytes": base.predicted_peak_bytes,
        "measured_peak_bytes": base.measured_peak_bytes, "step_time_s": base.step_time_s,
        "compile_time_s": 0.0, "order_matches_plan": base.order_matches_plan,
        "nodes": len(step.nodes),
    }]
    log(f"  original: measured {mb(base.measured_peak_bytes)} MB, {base.step_time_s:.3f} s")
    for frac in fractions:
        budget = int(fixed + frac * act)
        for strategy in strategies:
            out = tmp / f"{name}.{strategy}.{frac}.onnx"
            t0 = time.perf_counter()
            try:
                res = compile_model(step_path, CompileOptions(
                    budget=budget, strategy=strategy, time_limit=time_limit, cost="measured"),
                    output=out)
            except BudgetError as exc:
                rows.append({"model": name, "options": opts, "strategy": strategy,
                             "fraction": frac, "budget_bytes": budget,
                             "compile_time_s": time.perf_counter() - t0,
                             "error": f"does not fit (smallest {mb(exc.smallest)} MB)"})
                log(f"  {strategy} @ {frac}: does not fit (smallest {mb(exc.smallest)} MB)")
                continue
            compile_s = time.perf_counter() - t0
            run = run_steps(out, RunRequest(steps=steps))
            rows.append({
                "model": name, "options": opts, "strategy": strategy, "fraction": frac,
                "budget_bytes": budget, "predicted_peak_bytes": res.report["plan"]["peak_bytes"],
                "measured_peak_bytes": run.measured_peak_bytes, "step_time_s": run.step_time_s,
                "compile_time_s": compile_s, "order_matches_plan": run.order_matches_plan,
                "predicted_overhead": res.report["plan"]["overhead"],
                "solver": res.report["solver"], "chosen": res.report["plan"]["strategy"],
                "nodes": len(res.graph.nodes),
            })
            log(f"  {strategy} @ {frac}: budget {mb(budget)} MB, measured "
                f"{mb(run.measured_peak_bytes)} MB, {run.step_time_s:.3f} s, compile "
                f"{compile_s:.1f} s")
    again = run_steps(step_path, RunRequest(steps=steps))
    base_times.append(again.step_time_s)
    t_base = statistics.mean(base_times)
    for r in rows:
        if r.get("step_time_s"):
            r["time_ratio"] = r["step_time_s"] / t_base
    if torch_peer:
        rows += torch_rows(name, opts, steps, t_base, log)
    return rows


def torch_rows(name: str, opts: dict, steps: int, t_base: float, log) -> list[dict]:
    try:
        from benchmarks.torch_peer import measure_torch
    except ImportError as exc:  # torch is a test/benchmark dependency only
        log(f"  torch peer unavailable: {exc}")
        return []
    rows = []
    for ck in ("none", "per-block"):
        r = measure_torch(name, opts, checkpoint=ck, steps=steps)
        rows.append({"model": name, "options": opts, "strategy": f"torch eager ({ck})",
                     "fraction": None, "measured_peak_bytes": r["peak_bytes"],
                     "step_time_s": r["step_time_s"], "time_ratio_vs_ort": r["step_time_s"]
                     / t_base})
        log(f"  torch {ck}: {mb(r['peak_bytes'])} MB, {r['step_time_s']:.3f} s")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | strategy | budget (MB) | measured peak (MB) | predicted (MB) | "
             "measured step time ratio | predicted overhead | compile (s) | order ok |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        frac = r.get("fraction")
        strat = r["strategy"] + (f" @ {frac:.0%} act" if frac not in (None, 1.0) else "")
        if "error" in r:
            lines.append(f"| {r['model']} | {strat} | {mb(r['budget_bytes'])} | "
                         f"{r['error']} | | | | {r['compile_time_s']:.1f} | |")
            continue
        ratio = r.get("time_ratio", r.get("time_ratio_vs_ort"))
        predicted = r.get("predicted_overhead")
        pred = "" if predicted is None else f"{predicted:.1%}"
        lines.append(
            f"| {r['model']} | {strat} | {mb(r.get('budget_bytes'))} | "
            f"{mb(r.get('measured_peak_bytes'))} | {mb(r.get('predicted_peak_bytes'))} | "
            f"{'' if ratio is None else f'{ratio:.3f}'} | "
            f"{pred} | "
            f"{r.get('compile_time_s', 0.0):.1f} | {r.get('order_matches_plan', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS,
                    help="NAME:key=value,... (zoo builder options)")
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5, 0.33, 0.25])
    ap.add_argument("--strategies", nargs="+", default=["ilp", "sqrtn", "auto"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--torch-peer", action="store_true",
                    help="also run PyTorch eager with/without torch.utils.checkpoint")
    ap.add_argument("--json", type=Path, help="write all rows as JSON here")
    ap.add_argument("--out", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="memcc-bench-") as tmp:
        for spec in args.models:
            name, opts = parse_model(spec)
            rows += bench_model(name, opts, args.fractions, args.strategies, args.steps,
                                args.time_limit, args.torch_peer, Path(tmp), log)
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))
    if args.out:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
