"""The CUDA device-memory model against NVML figures measured earlier on a GPU, without one.

``benchmarks/cuda_check.py --phases truth`` records, per zoo step, the device peak NVML
measured. Device time is scarce (no session may have a GPU), but the model that predicts
it (``memcc/passes/arena.py``'s replay) runs anywhere: this script rebuilds each recorded
step at the recorded sizes, predicts its peak with today's model, exactly as
``memcc run --provider cuda`` does, and prints measured / predicted next to the ratio
recorded when it ran.

    python benchmarks/cuda_repredict.py benchmarks/cuda_h100/*.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_check import build_step  # noqa: E402
from memcc.backend.runner import arena_prediction, read_step_spec  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.batchnorm_for_cuda import for_provider  # noqa: E402
from memcc.passes.liveness import analyze_liveness  # noqa: E402


def predicted_bytes(name: str, dims: dict, tmp: Path, steps: int = 3) -> int:
    """What ``memcc run --provider cuda --steps N`` predicts for the zoo step today."""
    graph, _ = for_provider(load_graph(build_step(name, dims, tmp)), "cuda")
    spec = read_step_spec(graph, source=name)
    _, peak = arena_prediction(graph, analyze_liveness(graph), spec, steps=steps,
                               provider="cuda")
    return int(peak)


def repredict(summaries: Sequence[Path]) -> list[dict]:
    rows = []
    cache: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="memcc-repredict-") as d:
        for path in summaries:
            data = json.loads(Path(path).read_text())
            for r in data.get("truth", []):
                if "measured_bytes" not in r or not r.get("measured_bytes"):
                    continue
                key = json.dumps([r["model"], r["dims"]], sort_keys=True)
                if key not in cache:
                    cache[key] = predicted_bytes(r["model"], r["dims"], Path(d))
                now = cache[key]
                rows.append({"summary": Path(path).name, "model": r["model"],
                             "measured_bytes": r["measured_bytes"],
                             "then": r["measured_bytes"] / r["predicted_bytes"],
                             "now": r["measured_bytes"] / now, "predicted_now": now})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="+", type=Path, help="cuda_check summary.json files")
    args = ap.parse_args(argv)
    rows = repredict(args.summaries)
    print("\n| summary | model | measured MB | measured / predicted then | now |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['summary']} | {r['model']} | {r['measured_bytes'] / 1e6:,.1f} | "
              f"{r['then']:.3f} | {r['now']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
