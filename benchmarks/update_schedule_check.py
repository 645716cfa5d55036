"""``schedule_updates_early`` against an earlier version of itself: the same order of nodes
on each given step, and the time of each (BENCHMARKS.md, "Fifty timm architectures").

    git show 0e0a6bf:memcc/passes/analysis/update_schedule.py > /tmp/old_update_schedule.py
    python benchmarks/update_schedule_check.py /tmp/old_update_schedule.py STEP.onnx ...
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]

from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.analysis import update_schedule as new  # noqa: E402


def main() -> None:
    spec = importlib.util.spec_from_file_location("old_update_schedule", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old   # its dataclasses look their module up
    spec.loader.exec_module(old)
    for path in sys.argv[2:]:
        graph = load_graph(path)
        t0 = time.perf_counter()
        a = old.schedule_updates_early(graph)
        t1 = time.perf_counter()
        b = new.schedule_updates_early(graph)
        t2 = time.perf_counter()
        same = [n.name for n in a.nodes] == [n.name for n in b.nodes] and a.moved == b.moved
        print(f"{path}: {len(graph.nodes)} nodes, {'same order' if same else 'DIFFERENT'}, "
              f"old {t1 - t0:.2f} s, new {t2 - t1:.2f} s", flush=True)


if __name__ == "__main__":
    main()
