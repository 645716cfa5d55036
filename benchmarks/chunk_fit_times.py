"""Compile wall time before and after compile screens row chunks for a step that fits
(issue 31 item 2): ``memcc compile --budget X`` by the CLI, X a share of the step as
built's peak (where the plan as built recomputes), each model compiled by two memcc
trees in turn (``--before``: a checkout of the older memcc; this tree after), ``--rounds``
times, one JSON line per compile with its wall and CPU time, predicted added time and the
report's ``row_chunks``.

    python benchmarks/chunk_fit_times.py --before /tmp/before [--fraction 0.65]
        [--rounds 3] [--cost analytic] [--models resnet50,gpt2,hf-gpt2]

Models: ``resnet50`` (``python -m models resnet50 --batch 32 --resolution 128``), ``gpt2``
(``python -m models gpt2`` with ``--zoo-gpt2``'s flags), ``hf-gpt2`` (transformers GPT-2
exported with dynamo as ``chunk_choice_target.py`` does; ``--hf`` sets its size).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def _write_model(name: str, d: Path, hf: dict, zoo_gpt2: list[str]) -> Path:
    path = d / f"{name}.onnx"
    if name == "hf-gpt2":
        from benchmarks.as_built_vs_eager import export

        export(hf, "dynamo", path)
        return path
    args = {"resnet50": ["--batch", "32", "--resolution", "128"], "gpt2": zoo_gpt2}[name]
    subprocess.run([sys.executable, "-m", "models", name, "-o", str(path), *args],
                   check=True, cwd=ROOT, capture_output=True)
    return path


def _compile(tree: Path, model: Path, budget: str, cost: str, out: Path,
             extra: list[str]) -> tuple[float, float, dict, str]:
    """Wall and CPU seconds (the child's user + system: less sensitive to other jobs on a
    shared machine), the report, and the error's tail where it failed."""
    c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "memcc.cli", "compile", str(model), "--budget",
                        budget, "-o", str(out), "--cost", cost, *extra],
                       capture_output=True, text=True, cwd=tree,
                       env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin",
                            "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - t0
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime
    if r.returncode != 0:
        return took, cpu, {}, (r.stdout + r.stderr)[-600:]
    return took, cpu, json.loads(out.with_name(out.stem + ".report.json").read_text()), ""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--fraction", type=float, default=0.65)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cost", default="analytic")
    ap.add_argument("--models", default="resnet50,gpt2,hf-gpt2")
    ap.add_argument("--hf", default="batch=8,seq_len=256,vocab=50257,width=256,depth=4,"
                    "heads=4")
    ap.add_argument("--zoo-gpt2", default="--batch 8 --seq-len 128 --width 128 --depth 2 "
                    "--heads 4 --vocab-size 8192", help="python -m models gpt2's flags")
    ap.add_argument("--extra", default="", help="more compile flags, space-separated")
    args = ap.parse_args(argv)
    hf = {k: int(v) for k, v in (x.split("=") for x in args.hf.split(","))}
    extra = args.extra.split()
    with tempfile.TemporaryDirectory(prefix="memcc-chunkfit-") as tmp:
        d = Path(tmp)
        for name in args.models.split(","):
            model = _write_model(name, d, hf, args.zoo_gpt2.split())
            _, _, full, err = _compile(ROOT, model, "1TB", args.cost, d / "full.onnx", extra)
            if err:
                print(err)
                return 1
            need = full["baseline"]["peak_bytes"]
            budget = str(int(need * args.fraction))
            print(json.dumps({"model": name, "as_built_peak_bytes": need,
                              "budget_bytes": int(budget)}), flush=True)
            for r in range(args.rounds):
                for label, tree in (("before", args.before), ("after", ROOT)):
                    took, cpu, rep, err = _compile(tree, model, budget, args.cost,
                                              d / f"{label}.onnx", extra)
                    rc = rep.get("row_chunks") or {}
                    print(json.dumps({"model": name, "tree": label, "round": r,
                                      "compile_s": round(took, 2),
                                      "cpu_s": round(cpu, 2),
                                      "overhead": (rep.get("plan") or {}).get("overhead"),
                                      "chosen": rc.get("chosen"), "why": rc.get("why"),
                                      "screened": rc.get("screened"), "error": err or None}),
                          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
