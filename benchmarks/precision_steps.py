"""Mixed precision on the CPU (issue 34): the peak and the time of fp32, bf16 and fp16 steps.

The question: does a step built with ``memcc build --precision bf16`` (or fp16) hold less
memory than the fp32 step where activations dominate, as mixed precision promises: the
issue's CPU target is a bf16 peak of at most 60% of the fp32 peak on GPT-2 and a ResNet;
and what does it cost in step time, on a provider (ORT CPU) that has almost no 16-bit
kernels, so that ``passes.providers.sixteen_bit`` computes most ops in float32 between
16-bit casts?

Models (zoo, ``models/``): GPT-2 4 layers, width 256, 4 heads, vocabulary 2000, batch
8 x 256 tokens (activations 91% of the fp32 peak); resnet18 width 64 at 64 px, batch 32
(activations only 37%: its 11.7M parameters, their momentum and gradients are the rest, so
no precision can take it near 60%); ``--models resnet18:width=32,resolution=128,batch=16``
is a ResNet whose activations dominate. Each is built three times with
``build_training_step(load_graph(m), BuildOptions(precision=p))`` (cross-entropy, SGD with
momentum), saved, and then, per precision:

- measured peak: ``memcc.api.run_steps(path, RunRequest(steps=...))``, what ``memcc run
  --json`` runs (a fresh measuring child, every buffer its own mmap, updates in place as
  ``memcc.Trainer`` does); its ``measured_peak_bytes`` (the largest step after the first)
  and ``predicted_peak_bytes`` (the liveness prediction of the arrangement that ran). The
  run is repeated ``--peak-runs`` times, interleaved over the precisions, and the ratios
  bf16/fp32 and fp16/fp32 are taken per repetition: median, min and max;
- ``memcc analyze``'s prediction (``memcc.analyze.analyze`` without the smallest-peak
  search): the peak as built, its node, and what is live there by category and element
  type, the float32 working copies that ``sixteen_bit`` added (``f32/...``) apart;
- step time: a ``memcc.Trainer`` per precision (``--threads`` intra-op threads, default
  2), ``--rounds`` interleaved rounds in a random order per round after a warm-up
  (``benchmarks.stats.interleaved_times``): median and quartiles of each, and the
  per-round ratio to fp32 with its 95% bootstrap interval;
- node counts: as built, and as the CPU provider runs it.

And a training curve (``--curve-steps``, default 200): the BERT export of tests/exports.py
trained by memcc's bf16 and fp32 steps and by the torch module in fp32 and under autocast,
SGD lr 0.01 over 8 fixed batches; the largest relative difference of the loss curves
(test_autocast_numerics runs 20 steps of it).

    python benchmarks/precision_steps.py [--models gpt2+resnet18:width=32,resolution=128]
        [--rounds 5]
        [--peak-runs 2] [--steps 3] [--threads 2] [--tiny] [--curve-steps 200]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "tests"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402
from benchmarks.steps import parse_model  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")
SIZES = {
    "gpt2": dict(width=256, depth=4, heads=4, vocab_size=2000, batch=8, seq_len=256),
    "resnet18": dict(width=64, resolution=64, batch=32),
}
TINY = {
    "gpt2": dict(width=32, depth=2, heads=2, vocab_size=100, batch=2, seq_len=16),
    "resnet18": dict(width=8, resolution=32, batch=2),
}
TARGET = 0.60  # the CPU target: bf16 peak / fp32 peak


def build_steps(name: str, sizes: dict, out: Path) -> dict[str, Path]:
    """The step of zoo ``name`` at ``sizes`` in every precision, saved under ``out``."""
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    model = build_model(name, **sizes)
    paths = {}
    for p in PRECISIONS:
        paths[p] = out / f"{name}-{p}.onnx"
        save_graph(build_training_step(load_graph(model), BuildOptions(precision=p)),
                   paths[p])
    return paths


def analyzed(path: Path) -> dict:
    """``memcc analyze``'s prediction (``memcc.analyze.analyze`` without the smallest-peak
    search: the step as the CPU provider runs it, updates in place and early, as ``memcc
    train`` runs it), and what its peak holds: bytes live at the peak node by category and
    element type, the float32 working copies ``sixteen_bit`` added (``f32/...``) apart."""
    from onnx import TensorProto

    from memcc.analyze import analyze
    from memcc.compiler.costing import node_costs
    from memcc.compiler.loading import load_step
    from memcc.compiler.options import CompileOptions
    from memcc.compiler.planning import as_trained
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.liveness import categorize
    from memcc.passes.plan import Plan, StepStructure
    from memcc.passes.planning.planner import PlanOutcome
    from memcc.passes.planning.simulate import SimulationRules, simulate

    options = CompileOptions()
    a = analyze(path, options, smallest=False)
    # The simulation analyze reports, again, for its live set (analyze keeps only totals).
    graph, _ = load_step(path, str(path), options)
    structure = StepStructure.of(graph)
    costs, _ = node_costs(graph, options, lambda _m: None, False)
    base = simulate(graph, Plan(), costs, structure, SimulationRules(options.device))
    sim = as_trained(graph, PlanOutcome(base, base, "none", {}), costs, options,
                     structure).best
    kinds = categorize(sim.graph)
    parts: Counter[str] = Counter()
    for name in sim.liveness.live_at_peak:
        info = sim.graph.info.get(name)
        if info is None:
            continue
        dtype = TensorProto.DataType.Name(info.dtype).lower()
        origin = " (sixteen_bit f32 copy)" if name.startswith("f32/") else ""
        parts[f"{kinds.get(name, 'other')} {dtype}{origin}"] += int(info.nbytes)
    return {"peak_bytes": a.peak_bytes, "peak_node": a.peak_node,
            "nodes_built": len(load_graph(path).nodes), "nodes_for_cpu": a.nodes,
            "breakdown_at_peak": a.breakdown_at_peak,
            "live_at_peak_bytes": int(sim.liveness.peak_bytes),
            "live_at_peak_by_kind": dict(parts.most_common())}


def measured_peaks(paths: dict[str, Path], runs: int, steps: int) -> dict[str, list[dict]]:
    """``run_steps`` (``memcc run --json``) ``runs`` times per precision, interleaved."""
    from memcc.api import RunRequest, run_steps

    out: dict[str, list[dict]] = {p: [] for p in paths}
    for r in range(runs):
        order = list(paths)[r % len(paths):] + list(paths)[:r % len(paths)]
        for p in order:
            res = run_steps(paths[p], RunRequest(steps=steps)).to_json()
            out[p].append({k: res[k] for k in ("measured_peak_bytes", "predicted_peak_bytes",
                                               "measured_peak_bytes_per_step",
                                               "step_time_s", "losses")})
    return out


def step_times(paths: dict[str, Path], rounds: int, threads: int) -> dict[str, list[float]]:
    """Interleaved step times of a ``memcc.Trainer`` per precision, on one batch."""
    import memcc
    from memcc.backend.runner import synthetic_feeds

    trainers = {p: memcc.Trainer(path, threads=threads) for p, path in paths.items()}
    batch = {k: v for k, v in synthetic_feeds(trainers["fp32"].graph, 0).items()
             if k in {i.name for i in trainers["fp32"].inputs}}
    return interleaved_times({p: (lambda t=t: t.step(batch)) for p, t in trainers.items()},
                             rounds=rounds, warmup=1)


def _ratios(values: dict[str, list[float]], key: str) -> dict[str, dict]:
    """Per repetition ratio of each precision to fp32: median, min, max."""
    base = np.array(values["fp32"], dtype=float)
    out = {}
    for p in PRECISIONS[1:]:
        r = np.array(values[p], dtype=float) / base
        out[f"{p}/fp32"] = {"median": float(np.median(r)), "min": float(r.min()),
                            "max": float(r.max()), "of": key}
    return out


def bench_model(name: str, sizes: dict, args: argparse.Namespace, tmp: Path) -> dict:
    """Every figure of the module docstring for zoo ``name`` at ``sizes``."""
    paths = build_steps(name, sizes, tmp)
    row: dict = {"model": name, "sizes": sizes, "precisions": {}}
    peaks = measured_peaks(paths, args.peak_runs, args.steps)
    times = step_times(paths, args.rounds, args.threads)
    for p, path in paths.items():
        a = analyzed(path)
        measured = [r["measured_peak_bytes"] for r in peaks[p]]
        t = np.array(times[p])
        row["precisions"][p] = {
            "measured_peak_bytes": measured, "run_predicted_peak_bytes":
                [r["predicted_peak_bytes"] for r in peaks[p]],
            "analyze": a,
            "step_time_s": {"median": float(np.median(t)), "q1": float(np.quantile(t, .25)),
                            "q3": float(np.quantile(t, .75)), "all": t.tolist()},
            "first_loss": peaks[p][0]["losses"][0],
        }
    row["peak_ratio"] = _ratios({p: [r["measured_peak_bytes"] for r in peaks[p]]
                                 for p in PRECISIONS}, "measured_peak_bytes")
    row["predicted_ratio"] = _ratios({p: [r["predicted_peak_bytes"] for r in peaks[p]]
                                      for p in PRECISIONS}, "run_predicted_peak_bytes")
    row["time_ratio"] = {f"{p}/fp32": dataclasses.asdict(ratio_interval(times["fp32"], times[p]))
                         for p in PRECISIONS[1:]}
    row["bf16_meets_target"] = row["peak_ratio"]["bf16/fp32"]["max"] <= TARGET
    return row


def training_curves(steps: int, batches: int, lr: float, seed: int = 0) -> dict:
    """``steps`` SGD steps (momentum 0.9) of the BERT export (tests/exports.py, torchscript)
    cycling over ``batches`` fixed batches with fixed random labels: memcc's step through
    ``memcc.Trainer`` and the torch module with ``torch.optim.SGD``, each in fp32 and in
    bf16 (torch under ``torch.autocast("cpu", torch.bfloat16)``); the curves' largest
    relative difference step by step (``test_autocast_numerics.curve_gap``)."""
    import torch
    from exports import export, make_inputs
    from test_autocast_numerics import curve_gap, memcc_sgd_curve, torch_sgd_curve

    torch.set_num_threads(1)  # test_autocast_numerics._one_torch_thread says why
    path, module, _, dims = export("bert", "torchscript")
    rng = np.random.default_rng(seed)
    data = [{**{k: v.numpy() for k, v in make_inputs("bert", seed=seed * batches + k).items()},
             "labels": rng.integers(0, 3, size=(2,)).astype(np.int64)} for k in range(batches)]
    order = [data[k % batches] for k in range(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        curves = {"torch fp32": torch_sgd_curve(module, order, 3, lr, None),
                  "torch bf16": torch_sgd_curve(module, order, 3, lr, "bf16"),
                  "memcc fp32": memcc_sgd_curve(str(path), dims, order, lr, "fp32", Path(tmp)),
                  "memcc bf16": memcc_sgd_curve(str(path), dims, order, lr, "bf16", Path(tmp))}
    pairs = {"memcc bf16 vs torch bf16": ("memcc bf16", "torch bf16"),
             "torch bf16 vs torch fp32": ("torch bf16", "torch fp32"),
             "memcc bf16 vs torch fp32": ("memcc bf16", "torch fp32")}
    # Near a memorised batch's loss of ~0 a relative difference explodes; this one does not.
    scaled = {k: float(np.max(np.abs(np.subtract(curves[a], curves[b])))
                       / np.mean(np.abs(curves[b]))) for k, (a, b) in pairs.items()}
    return {"steps": steps, "batches": batches, "lr": lr, "seed": seed, "curves": curves,
            "max_difference_over_mean_loss": scaled, "gaps": {
        "memcc bf16 vs torch bf16": curve_gap(curves["memcc bf16"], curves["torch bf16"]),
        "torch bf16 vs torch fp32": curve_gap(curves["torch bf16"], curves["torch fp32"]),
        "memcc bf16 vs torch fp32": curve_gap(curves["memcc bf16"], curves["torch fp32"]),
        "memcc fp32 vs torch fp32": curve_gap(curves["memcc fp32"], curves["torch fp32"])}}


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def report(row: dict) -> list[str]:
    lines = [f"{row['model']} {row['sizes']}"]
    for p, r in row["precisions"].items():
        st = r["step_time_s"]
        lines.append(
            f"  {p}: measured peak {', '.join(_mb(m) for m in r['measured_peak_bytes'])} MB; "
            f"run predicted {_mb(r['run_predicted_peak_bytes'][0])} MB; analyze "
            f"{_mb(r['analyze']['peak_bytes'])} MB at {r['analyze']['peak_node']}; "
            f"step {st['median'] * 1e3:,.0f} ms [{st['q1'] * 1e3:,.0f}, "
            f"{st['q3'] * 1e3:,.0f}]; nodes {r['analyze']['nodes_built']} built, "
            f"{r['analyze']['nodes_for_cpu']} for CPU; first loss {r['first_loss']:.4f}")
        top = list(r["analyze"]["live_at_peak_by_kind"].items())[:6]
        lines.append("      live at analyze's peak: "
                     + "; ".join(f"{k} {_mb(v)}" for k, v in top))
    for key in ("peak_ratio", "predicted_ratio"):
        lines.append(f"  {key}: " + "; ".join(
            f"{k} {v['median']:.3f} [{v['min']:.3f}, {v['max']:.3f}]"
            for k, v in row[key].items()))
    lines.append("  time ratio: " + "; ".join(
        f"{k} {v['ratio']:.2f} [{v['low']:.2f}, {v['high']:.2f}]"
        for k, v in row["time_ratio"].items()))
    lines.append(f"  bf16 peak <= {TARGET:.0%} of fp32: {row['bf16_meets_target']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2+resnet18",
                    help="'+'-separated zoo models, each NAME or NAME:key=value,... "
                         "(default sizes: SIZES)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--peak-runs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--curve-steps", type=int, default=200,
                    help="SGD steps of the training-curve comparison (0: none)")
    ap.add_argument("--curve-seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows: list[dict] = []
    if args.curve_steps:
        c = training_curves(args.curve_steps, batches=8, lr=0.01, seed=args.curve_seed)
        rows.append({"training_curves": c})
        every = max(1, args.curve_steps // 10)
        print(f"training curves, BERT export, {c['steps']} SGD steps over {c['batches']} "
              f"batches, lr {c['lr']}:")
        for side, losses in c["curves"].items():
            print(f"  {side}: " + " ".join(f"{x:.4f}" for x in losses[::every]))
        print("  largest relative difference: " + "; ".join(
            f"{k} {v:.2e}" for k, v in c["gaps"].items()))
        print("  largest difference / mean loss: " + "; ".join(
            f"{k} {v:.2e}" for k, v in c["max_difference_over_mean_loss"].items()), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for spec in filter(None, args.models.split("+")):
            name, given = parse_model(spec)
            sizes = given or (TINY if args.tiny else SIZES)[name]
            row = bench_model(name, sizes, args, Path(tmp))
            rows.append(row)
            print("\n".join(report(row)), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
