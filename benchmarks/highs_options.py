"""Planner quality and CPU time with extra HiGHS options, on zoo steps.

Compiles each zoo step at ``--budget min`` and at 50% and 70% of its baseline peak with
``memcc``'s HiGHS options plus the ones given (JSON), and prints one JSON line per compile:
the peak, added time and strategy picked, and the CPU and wall seconds it took. Run it
twice, with and without an option, to see what the option changes (BENCHMARKS.md,
"Branching in the smallest-peak search"):

    python benchmarks/highs_options.py '{}' gpt2,bert,resnet18,unet
    python benchmarks/highs_options.py '{"mip_pscost_minreliable": 8}' gpt2,bert,resnet18,unet
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memcc.compiler import CompileOptions, compile_model  # noqa: E402
from memcc.frontend.build import BuildOptions  # noqa: E402
from memcc.passes.planning.solvers import ilp  # noqa: E402
from models import build_model  # noqa: E402

WHOLE = BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1)
CASES = {"gpt2": {"batch": 8, "seq_len": 128}, "resnet18": {"batch": 4, "resolution": 64},
         "bert": {}, "unet": {}, "mlp": {}}


def _cpu() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def run(name: str, extra: dict, time_limit: float) -> None:
    model = build_model(name, **CASES.get(name, {}))
    base = None
    for frac in ("min", 0.5, 0.7):
        c0, t0 = _cpu(), time.perf_counter()
        budget = "min" if frac == "min" else int(base * frac)
        try:
            r = compile_model(model, CompileOptions(budget=budget, cost="analytic",
                                                    time_limit=time_limit, build=WHOLE)).report
            res = {"peak": r["plan"]["peak_bytes"], "added": round(r["plan"]["overhead"], 4),
                   "label": r["plan"]["strategy_label"], "budget": r["budget_bytes"]}
            base = base or r["baseline"]["peak_bytes"]
        except Exception as exc:  # noqa: BLE001 - a refusal is a result here
            res = {"error": str(exc)[:100]}
        res.update(model=name, frac=frac, cpu=round(_cpu() - c0, 1),
                   wall=round(time.perf_counter() - t0, 1), opts=extra)
        print(json.dumps(res), flush=True)
        if base is None:
            return


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("options", help="extra HiGHS options as a JSON object, e.g. '{}'")
    ap.add_argument("models", help="comma-separated zoo models")
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args(argv)
    extra = json.loads(args.options)
    own = ilp._release_options
    ilp._release_options = lambda: tuple(dict([*own(), *extra.items()]).items())
    for name in args.models.split(","):
        run(name, extra, args.time_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
