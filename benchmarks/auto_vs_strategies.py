"""Issue 31's target "``auto`` <= min(ilp, sqrtn) on every benchmark row": at each budget,
the plan ``--strategy auto`` returns is no dearer (predicted step time) than the one
``--strategy ilp`` or ``--strategy sqrtn`` returns alone, and it fits wherever either fits.

    python benchmarks/auto_vs_strategies.py [--models gpt2,resnet18,mobilenetv2,
        hf-gpt2:dynamo,hf-gpt2:torchscript,PATH.onnx] [--budgets 50%,70%,85%]
        [--time-limit 10] [--out FILE.json]

Models: the zoo's by name (small sizes, ``SIZES``), ``hf-gpt2:FORM``: a transformers GPT-2
exported by torch.onnx (``HF_GPT2``; torch and transformers needed), and ONNX files by path
(the first-use sweep's: ``benchmarks/first_use_models.py``). Every compile is
``compile_model(model, CompileOptions(budget=B, strategy=S, cost="analytic",
time_limit=T))``, the same options for the three strategies, in one process, one after the
other. The figures are the planner's predictions (analytic costs, so the same on any
machine but for where a time limit stops a search): nothing is run.

A row reads ``ok`` where auto's predicted step time is at most the cheaper of the others'
times (1 + ``TOLERANCE``), and ``AUTO DEARER`` or ``AUTO REFUSED`` where not.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from memcc.compiler import CompileOptions, compile_model  # noqa: E402
from memcc.errors import MemccError  # noqa: E402

STRATEGIES = ("auto", "ilp", "sqrtn")
SIZES = {
    "gpt2": dict(batch=4, seq_len=128, width=128, depth=3, heads=4),
    "resnet18": dict(batch=8, resolution=96, width=16),
    "mobilenetv2": dict(batch=8, resolution=64),
    "unet": dict(batch=2, resolution=64),
}
# Analytic step times are sums of priced nodes; plans equal to the last node agree to
# rounding only.
TOLERANCE = 1e-6


# A transformers GPT-2 (``as_built_vs_eager.export``: seeded config, no download), small
# enough for a 10 s limit.
HF_GPT2 = dict(batch=4, seq_len=128, vocab=8192, width=128, depth=2, heads=4)


def model_source(spec: str, tmp: Path) -> tuple[Path, dict[str, int]]:
    """The ONNX file (and its ``--dim`` values) a spec names: a zoo model, ``hf-gpt2:FORM``
    (FORM: dynamo, dynamo-noopt, torchscript) or a path to an ``.onnx`` file."""
    import onnx

    if spec.endswith(".onnx"):
        return Path(spec), {}
    if spec.startswith("hf-gpt2:"):
        from benchmarks.as_built_vs_eager import export

        path = tmp / f"{spec.replace(':', '-')}.onnx"
        export(HF_GPT2, spec.split(":", 1)[1], path)
        return path, {}
    from models import build_model

    path = tmp / f"{spec}.onnx"
    onnx.save(build_model(spec, **SIZES.get(spec, {})), str(path))
    return path, {}


def plan_once(path: Path, dims: dict[str, int], budget: str, strategy: str,
              limit: float) -> dict:
    """One compile's predicted outcome (or its refusal)."""
    t0 = time.perf_counter()
    try:
        report = compile_model(path, CompileOptions(
            budget=budget, strategy=strategy, cost="analytic", time_limit=limit,
            dims=dims)).report
    except MemccError as exc:
        smallest = getattr(exc, "smallest", None)
        return {"refused": True, "smallest_bytes": smallest,
                "seconds": round(time.perf_counter() - t0, 1)}
    plan = report["plan"]
    return {"refused": False, "step_time_s": plan["compute_cost_s"],
            "peak_bytes": plan["peak_bytes"], "picked": plan["strategy_label"],
            "row_chunks": report.get("row_chunks", {}).get("chosen"),
            "seconds": round(time.perf_counter() - t0, 1)}


def verdict(row: dict[str, dict]) -> str:
    auto = row["auto"]
    others = [row[s] for s in STRATEGIES[1:] if not row[s]["refused"]]
    if not others:
        return "ok (none of the others fits)"
    if auto["refused"]:
        return "AUTO REFUSED"
    best = min(o["step_time_s"] for o in others)
    return "ok" if auto["step_time_s"] <= best * (1 + TOLERANCE) else "AUTO DEARER"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="gpt2,resnet18,mobilenetv2,hf-gpt2:dynamo,"
                    "hf-gpt2:torchscript")
    ap.add_argument("--budgets", default="50%,70%,85%")
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    print("| model | budget | auto | ilp | sqrtn | auto / min(ilp, sqrtn) | verdict |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="memcc-auto-") as tmp:
        for spec in args.models.split(","):
            path, dims = model_source(spec, Path(tmp))
            for budget in args.budgets.split(","):
                row = {s: plan_once(path, dims, budget, s, args.time_limit)
                       for s in STRATEGIES}
                row.update(model=spec, budget=budget, verdict=verdict(row))
                rows.append(row)
                print(_line(row), flush=True)
    bad = [r for r in rows if not r["verdict"].startswith("ok")]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} rows: auto no dearer than the others")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


def _cell(r: dict) -> str:
    if r["refused"]:
        smallest = r.get("smallest_bytes")
        return "refused" + (f" (min {smallest / 1e6:.2f} MB)" if smallest else "")
    return f"{r['step_time_s'] * 1e3:.2f} ms, {r['peak_bytes'] / 1e6:.2f} MB, {r['seconds']} s"


def _line(row: dict) -> str:
    fits = [row[s]["step_time_s"] for s in STRATEGIES[1:] if not row[s]["refused"]]
    ratio = (f"{row['auto']['step_time_s'] / min(fits):.4f}"
             if fits and not row["auto"]["refused"] else "-")
    return (f"| {row['model']} | {row['budget']} | "
            + " | ".join(_cell(row[s]) for s in STRATEGIES)
            + f" | {ratio} | {row['verdict']} |")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
