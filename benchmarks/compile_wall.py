"""Wall time of ``memcc compile`` as a user runs it, stage by stage, against another checkout.

    python benchmarks/compile_wall.py --export DIR            # GPT-2 124M, ResNet-50 (below)
    git worktree add /tmp/base REV
    python benchmarks/compile_wall.py DIR/gpt2.onnx DIR/resnet50.onnx [--base /tmp/base]
        [--budgets min,50%] [--time-limit 60] [--rounds 1] [--warm-cache] [--out FILE.jsonl]
        [--cost auto|measured|analytic] [--rates ~/.cache/memcc/cpu_rates.json]

Each compile is the command line (``memcc compile MODEL --budget B --time-limit T``, the
default ``--cost auto``) in a fresh process with the side's source first on ``PYTHONPATH``,
the sides interleaved round by round, so a change in the machine's load falls on both. Each
run gets an empty ``MEMCC_CACHE`` (node times measured anew, as on a first compile) unless
``--warm-cache``, where each side keeps one cache across its runs; ``--rates`` copies one CPU
calibration into every run's cache (with ``--cost analytic`` the two sides then price every
plan alike, and should write the same plans). Printed per run: the wall
time, how long each stage took (from the progress lines: load, cost_model, budget, plan,
rewrite, of every row-chunk setting planned; a compile that ends within 3 s prints no
progress lines, so none), and the outcome line (or the refusal's first
words).

``--export DIR`` writes the two full-size models this was first run on: transformers
GPT-2 (12 layers, width 768, vocabulary 50,257) at batch 2 x 128 tokens and ResNet-50
(``ResNetConfig`` bottleneck 3-4-6-3) at batch 8 x 224 px, random seeded weights, train
mode, dropout 0, ``torch.onnx.export(dynamo=True, optimize=False)``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The child's first line names the memcc it runs (``PYTHONPATH`` must win over the install).
SAY_WHERE = "import sys, memcc; print(memcc.__file__, flush=True); "
STAGE = re.compile(r"^(?:compiling: (\S+) .*\(at ([0-9.]+) s\)|row chunks: planning (.*))$")


def export(out: Path) -> None:
    import torch
    import transformers

    class Logits(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(x).logits

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(n_layer=12, n_embd=768, n_head=12, vocab_size=50257,
                                   resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    resnet = transformers.ResNetConfig(layer_type="bottleneck", depths=[3, 4, 6, 3],
                                       hidden_sizes=[256, 512, 1024, 2048], embedding_size=64,
                                       num_labels=1000)
    for name, module, x in (
            ("gpt2", transformers.GPT2LMHeadModel(gpt2), torch.randint(0, 50257, (2, 128))),
            ("resnet50", transformers.ResNetForImageClassification(resnet),
             torch.randn(8, 3, 224, 224))):
        torch.onnx.export(Logits(module).train(), (x,), out / f"{name}.onnx", dynamo=True,
                          optimize=False, input_names=["x"], external_data=True)
        print(f"wrote {out / name}.onnx")


def stages(log: str) -> list[tuple[str, float]]:
    """(stage, seconds it took) in order, from the progress lines; a row-chunk setting's
    stages are prefixed with its chunks."""
    marks: list[tuple[str, float]] = []
    setting = ""
    for line in log.splitlines():
        m = STAGE.match(line.strip())
        if m and m.group(3):
            setting = m.group(3).split(" (")[0] + ": "
        elif m:
            marks.append((setting + m.group(1), float(m.group(2))))
    pairs = zip(marks, marks[1:], strict=False)
    return [(name, round(nxt - at, 1)) for (name, at), (_, nxt) in pairs]


def one(side: Path, model: str, budget: str, limit: float, cache: str,
        cost: str = "auto") -> dict:
    env = {**os.environ, "PYTHONPATH": str(side), "MEMCC_CACHE": cache}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-c", SAY_WHERE + "from memcc.cli import main; main()", "compile",
               str(Path(model).resolve()), "--budget", budget, "--time-limit", str(limit),
               "--cost", cost, "-o", f"{tmp}/out.onnx"]
        t0 = time.perf_counter()
        # Run from elsewhere: from the checkout, ``python -c`` imports its memcc first.
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tmp)
        wall = time.perf_counter() - t0
    log = done.stdout + done.stderr
    used = log.splitlines()[0] if log else ""
    if not used.startswith(str(side)):
        raise RuntimeError(f"the compile imported memcc from {used!r}, not from {side}")
    outcome = next((ln for ln in log.splitlines() if ln.startswith(("strategy", "error"))), "")
    return {"side": str(side), "model": model, "budget": budget, "time_limit": limit,
            "wall_s": round(wall, 1), "rc": done.returncode, "stages": stages(log),
            "outcome": outcome[:160]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--export", type=Path)
    ap.add_argument("--base", type=Path, help="another checkout (git worktree) to compare")
    ap.add_argument("--budgets", default="min,50%")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warm-cache", action="store_true")
    ap.add_argument("--cost", default="auto", choices=("auto", "measured", "analytic"))
    ap.add_argument("--rates", type=Path, help="a cpu_rates.json every run's cache starts "
                    "with (--cost analytic: both sides price with the same calibration)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.export:
        export(args.export)
    sides = [ROOT] + ([args.base.resolve()] if args.base else [])
    caches = {s: tempfile.mkdtemp(prefix="memcc-cache-") for s in sides}
    for r in range(args.rounds):
        for model in args.models:
            for budget in args.budgets.split(","):
                for side in (sides if r % 2 == 0 else sides[::-1]):
                    cache = caches[side] if args.warm_cache else tempfile.mkdtemp()
                    if args.rates:
                        shutil.copyfile(args.rates, Path(cache) / "cpu_rates.json")
                    row = one(side, model, budget, args.time_limit, cache, args.cost) \
                        | {"round": r, "cost": args.cost}
                    print(json.dumps(row), flush=True)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
