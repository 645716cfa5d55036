"""The measuring child's baseline through ORT's CPU arena after one warm-up run and after
two (session 43: after its first run the arena can hold more than between later steps).

    python benchmarks/arena_warmups.py [--model rn_16_b16_96] [--budget min] [--steps 4]
    python benchmarks/arena_warmups.py --plan PLAN.onnx     # a compiled plan of your own

Exports a transformers convnet in train mode as ``benchmarks/conv_floors.py`` does (its
models, and ``rn_16_b16_96``: the ResNet a session-43 helper found it on), builds it,
compiles it with ``--arena --budget B`` (and ``--compile-args``, default ``--cost
analytic``), then measures the plan as
``memcc run`` does (``backend.cpu_child``: the in-place binding, the arena shrunk after each
run, the heap trimmed and the high-water mark reset before each step, the baseline taken
once before the measured steps) in fresh processes under the measuring child's allocator
(``MALLOC_MMAP_THRESHOLD_=4096 MALLOC_ARENA_MAX=1``), with 1 and 2 warm-up runs before the
baseline, through the arena and from malloc. Prints each step's bytes and the predictions.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from benchmarks.conv_floors import MODELS, RESNET, export  # noqa: E402

MODELS.setdefault("rn_16_b16_96", (RESNET, dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128],
                                                depths=[1, 1, 1, 1]), 16, 96))
MMAP_ENV = {"MALLOC_MMAP_THRESHOLD_": "4096", "MALLOC_ARENA_MAX": "1"}


def measure(plan: str, warmups: int, arena: bool, steps: int) -> list[int]:
    """One fresh-process measurement's bytes per step (run in the child, below)."""
    from memcc.backend.cpu_child import _run_in_place, run_options
    from memcc.backend.memory import load_npz, peak_rss_bytes, reset_peak_rss, rss_bytes, trim_heap
    from memcc.backend.runner import _arranged, prepare_run, synthetic_feeds
    from memcc.backend.session import SessionSettings, make_session
    from memcc.frontend.load import load_graph
    from memcc.step import TrainingStep

    graph = load_graph(plan)
    spec = TrainingStep.of(graph)
    arranged, _, aliased = _arranged(Path(plan), graph, True)
    with tempfile.TemporaryDirectory() as tmp:
        payload = prepare_run(arranged, spec, synthetic_feeds(arranged, 0), Path(tmp),
                              steps=steps, provider="cpu")
        sess = make_session(payload["session_model"], "cpu", SessionSettings(cpu_arena=arena))
        options, outputs = run_options(arena=arena), payload["outputs"]
        feeds = load_npz(payload["feeds"])
        for _ in range(warmups):
            _run_in_place(sess, outputs, feeds, aliased, options)
        del feeds
        trim_heap()
        baseline = rss_bytes()
        feeds = load_npz(payload["feeds"])
        per_step = []
        for _ in range(steps):
            trim_heap()
            reset_peak_rss()
            result = _run_in_place(sess, outputs, feeds, aliased, options)
            per_step.append(peak_rss_bytes() - baseline)
            for out, inp in spec.state.items():
                if out not in aliased:
                    feeds[inp] = result[out].copy()
            del result
    return per_step


def _compiled(args: argparse.Namespace, tmp: Path) -> Path:
    """``args.model`` exported, compiled with ``--arena --budget args.budget``; says the
    plan's figures."""
    model, plan = tmp / "model.onnx", tmp / "plan.onnx"
    export(args.model, model)
    subprocess.run([sys.executable, "-m", "memcc", "compile", str(model), "--arena",
                    "--budget", args.budget, *args.compile_args.split(), "-o", str(plan)],
                   check=True, cwd=ROOT, capture_output=True)
    report = json.loads(plan.with_suffix(".report.json").read_text())
    arena = report["plan"].get("device_arena") or {}
    print(f"{args.model}, --budget {args.budget} --arena: budget {report['budget_bytes']:,}, "
          f"plan peak {report['plan']['peak_bytes']:,} (regions kept from the step before "
          f"{arena.get('start_reserved_bytes')}), live bytes "
          f"{report['plan'].get('live_peak_bytes')}")
    return plan


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="rn_16_b16_96", choices=sorted(MODELS))
    ap.add_argument("--budget", default="min")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--plan", type=Path, help="measure this compiled plan instead")
    ap.add_argument("--compile-args", default="--cost analytic",
                    help="more options of memcc compile (default: %(default)s)")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        plan, warmups, arena, steps = args.child
        print(json.dumps(measure(plan, int(warmups), arena == "1", int(steps))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        plan = args.plan or _compiled(args, Path(tmp))
        for through in ("1", "0"):
            for warmups in (1, 2):
                out = subprocess.run(
                    [sys.executable, __file__, "--child", str(plan), str(warmups), through,
                     str(args.steps)], check=True, cwd=ROOT, capture_output=True, text=True,
                    env={**os.environ, **MMAP_ENV})
                per_step = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"  {'arena' if through == '1' else 'malloc'}, {warmups} warm-up "
                      f"run(s): {', '.join(f'{b:,}' for b in per_step)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
