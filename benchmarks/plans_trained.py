"""Do plans train as their step as built does, step after step? (plans that hold when run)

``--verify`` compares one run of a plan with one of the step it came from. A plan that
changed what it was fed (ORT's CPU BatchNorm wrote into the fed running statistics of a
recomputed clone, session 32) passed it and still trained differently from its second step
on. This sweep builds each case of ``tests/exports.py`` (real torch exports, both exporters,
train and eval mode, Dropout where the case has it), compiles it at ``--budget min`` with and
without operator variants (``--no-variants``: every output must then be bit for bit the
step as built's), and trains the plan and the step as built ``--steps`` steps each with
``memcc.Trainer`` (in place, early updates: as ``memcc train`` runs them) on one synthetic
batch, at each of ``--threads``; it prints the largest difference of the state (parameters,
optimizer state, BatchNorm statistics, relative to each tensor's largest entry) after the
last step and whether every byte matched.

    python benchmarks/plans_trained.py [--cases gpt2.dynamo.eval,hf_resnet.torchscript.train]
        [--steps 4] [--threads 1,2] [--time-limit 15] [--work DIR]
    python benchmarks/plans_trained.py --pair STEP.onnx PLAN.onnx [--steps 4] [--threads 1,2]

``--pair``: two step files of the same model (a step as built and a plan of it, or two
builds), trained side by side as above; prints the same row for them.

A case is ``NAME.EXPORTER.MODE`` (``tests/exports.py`` families; ``train`` mode exports with
Dropout 0.1 where the family has it). About 3 minutes for the default cases on 2 cores.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

CASES = ("gpt2.dynamo.eval", "gpt2.torchscript.train", "llama.dynamo.eval",
         "hf_vit.dynamo.train", "mobilenet_block.torchscript.train", "lstm.dynamo.train",
         "moe.dynamo.train", "bert.torchscript.train", "segmenter.dynamo.train",
         "hf_resnet.torchscript.train")
PLANS = {"no-variants": ["--no-variants"], "variants": []}


def memcc(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "memcc", *args], capture_output=True,
                       text=True, cwd=ROOT)
    if r.returncode:
        raise RuntimeError(f"memcc {args[0]} failed: {r.stderr.strip()[-400:]}")


def trained_apart(step: Path, plan: Path, steps: int, threads: int) -> tuple[float, bool]:
    """Both trained ``steps`` steps on one synthetic batch: the largest relative difference
    of their state, and whether every byte matched."""
    from memcc import Trainer
    from memcc.backend.runner import synthetic_feeds

    ours, theirs = Trainer(step, threads=threads), Trainer(plan, threads=threads)
    feeds = synthetic_feeds(ours.graph, 0)
    batch = {n: feeds[n] for n in ours.spec.data_inputs}
    for _ in range(steps):
        ours.step(batch)
        theirs.step(batch)
    a, b = ours.state_dict(), theirs.state_dict()
    worst = 0.0
    for k, x in a.items():
        x, y = np.asarray(x, np.float64), np.asarray(b[k], np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(x).max(), 1e-12)))
    return worst, all(np.array_equal(a[k], b[k]) for k in a)


def case(tag: str, work: Path, args: argparse.Namespace) -> list[str]:
    import exports

    name, exporter, mode = tag.split(".")
    training = mode == "train"
    path, _, _, dims = exports.export(name, exporter, work, training=training,
                                      dropout=0.1 if training else 0.0)
    step = work / f"{tag}.step.onnx"
    memcc("build", str(path), "-o", str(step),
          *[a for k, v in dims.items() for a in ("--dim", f"{k}={v}")])
    rows = []
    for label, flags in PLANS.items():
        plan = work / f"{tag}.{label}.onnx"
        memcc("compile", str(step), "--budget", "min", "--cost", "analytic", "--time-limit",
              str(args.time_limit), "-o", str(plan), *flags)
        for threads in args.threads:
            worst, same = trained_apart(step, plan, args.steps, threads)
            rows.append(f"| {tag} | {label} | {threads} | {worst:.3g} | {same} |")
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=lambda s: [int(t) for t in s.split(",")],
                    default=[1, 2])
    ap.add_argument("--time-limit", type=float, default=15)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--pair", nargs=2, type=Path, metavar=("STEP", "PLAN"), default=None)
    args = ap.parse_args(argv)
    print("| case | plan | threads | largest state difference (relative) | same bytes |")
    print("|---|---|---|---|---|")
    if args.pair is not None:
        for threads in args.threads:
            worst, same = trained_apart(*args.pair, args.steps, threads)
            print(f"| {args.pair[0].name} | {args.pair[1].name} | {threads} | {worst:.3g} "
                  f"| {same} |")
        return 0
    with tempfile.TemporaryDirectory(prefix="memcc-plans-trained-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for tag in args.cases.split(","):
            try:
                rows = case(tag, work, args)
            except Exception as exc:  # one failed case is a row, not the end of the sweep
                rows = [f"| {tag} | failed: {exc} | | | |"]
            print("\n".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
