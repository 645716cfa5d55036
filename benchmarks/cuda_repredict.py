"""The CUDA device-memory model against NVML figures measured earlier on a GPU, without one.

``benchmarks/cuda_check.py --phases truth`` records, per zoo step, the device peak NVML
measured. Device time is scarce (no session may have a GPU), but the model that predicts
it (``memcc/passes/analysis/arena.py``'s replay) runs anywhere: this script rebuilds each recorded
step at the recorded sizes, predicts its peak with today's model, exactly as
``memcc run --provider cuda`` does, and prints measured / predicted next to the ratio
recorded when it ran.

    python benchmarks/cuda_repredict.py benchmarks/cuda_h100/*.json

``--logs FOLDER`` reads instead the arena logs kept from the same GPU
(``benchmarks/cuda_h100/arena_log_*``: every region ORT's arena added, with its address, and
every shrink): per step, how many regions ORT added per run and how many the replay adds (with and
without the stream tags of ORT's CUDA arena),
whether every region over 1 MiB started on a 2 MiB boundary, and the device pages of the
last run's regions (``arena.cuda_pages_for``) against what NVML measured in that run.

    python benchmarks/cuda_repredict.py --logs benchmarks/cuda_h100/arena_log_default
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.cuda_check import build_step, ort_arena_runs, top_sizes  # noqa: E402
from benchmarks.memory_truth import SIZES  # noqa: E402
from memcc.backend.runner import arena_prediction, read_step_spec  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.analysis.arena import (  # noqa: E402
    CUDA_LARGE_REGION_BYTES,
    CUDA_PAGE_BYTES,
    ArenaSetup,
    cuda_pages_for,
    replay_steps,
)
from memcc.passes.analysis.liveness import analyze_liveness  # noqa: E402
from memcc.passes.providers.provider_step import for_provider  # noqa: E402


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


_REGION = re.compile(r"Allocated memory at 0x([0-9a-f]+) to 0x([0-9a-f]+)")


def from_logs(folder: Path) -> list[dict]:
    """Each kept arena log against the replay and against NVML (module docstring)."""
    measured = json.loads((folder / "summary.json").read_text())
    rows = []
    with tempfile.TemporaryDirectory(prefix="memcc-repredict-") as d:
        for log in sorted(folder.glob("*.log.gz")):
            name = log.name.removesuffix(".log.gz")
            text = gzip.decompress(log.read_bytes()).decode()
            runs = ort_arena_runs(text)
            regions = [(int(a, 16), int(b, 16)) for a, b in _REGION.findall(text)]
            large = [a for a, b in regions if b - a > CUDA_LARGE_REGION_BYTES]
            aligned = sum(a % CUDA_PAGE_BYTES == 0 for a in large)
            graph, _ = for_provider(load_graph(build_step(name, SIZES[name], Path(d))), "cuda")
            live = analyze_liveness(graph)
            replay = replay_steps(graph, live, ArenaSetup(cuda=True), steps=3)
            untagged = replay_steps(graph, live, ArenaSetup(cuda=False), steps=3)  # no stream tags
            ours, theirs = Counter(replay.last_run_extensions), Counter(runs[-1])
            nvml = max(measured[name]["measured_per_step"])
            rows.append({
                "model": name, "ort_regions_per_run": [len(r) for r in runs],
                "replay_regions_last_run": len(replay.last_run_extensions),
                "without_stream_tags": len(untagged.last_run_extensions),
                "in_ort_not_replay": top_sizes(theirs - ours),
                "in_replay_not_ort": top_sizes(ours - theirs),
                "large_regions_on_2mib_boundary": f"{aligned}/{len(large)}",
                "ort_last_run_pages": cuda_pages_for(runs[-1]), "nvml_bytes": nvml,
                "nvml_over_pages": nvml / cuda_pages_for(runs[-1])})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("summaries", nargs="*", type=Path, help="cuda_check summary.json files")
    ap.add_argument("--logs", type=Path, help="a folder of kept arena logs instead")
    args = ap.parse_args(argv)
    if args.logs is not None:
        from_logs(args.logs)
        return 0
    if not args.summaries:
        ap.error("give cuda_check summary.json files, or --logs FOLDER")
    rows = repredict(args.summaries)
    print("\n| summary | model | measured MB | measured / predicted then | now |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['summary']} | {r['model']} | {r['measured_bytes'] / 1e6:,.1f} | "
              f"{r['then']:.3f} | {r['now']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
