"""Time the def-use index against onnx-graphsurgeon and onnx_ir on a ~5,000-node step.

Usage: ``python docs/planning_core_bench.py`` (from the repository root; 1 to 2 minutes).
Builds a GPT-2 training step (28 layers, width 128: 5,097 nodes), then prints the median of
several runs for each way of getting producer / reader links, and for the lowering with
each level of checks. onnx_graphsurgeon is not a dependency: install it to include it.
Numbers and what they decided are in docs/PLANNING_CORE.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.graph import DefUse, Graph, topological_problems  # noqa: E402
from memcc.passes.lowering.lower import lower  # noqa: E402
from memcc.passes.plan import Plan, StepStructure  # noqa: E402
from models import build_model  # noqa: E402


def median_ms(fn, runs: int = 5) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    forward = build_model("gpt2", depth=28, width=128, heads=4, batch=2, seq_len=64,
                          vocab_size=1000)
    graph = build_training_step(load_graph(forward), BuildOptions())
    model = graph.to_model()
    print(f"GPT-2 step: {len(graph.nodes)} nodes")
    rows = [
        ("memcc Graph.from_model (ModelProto -> Graph)", lambda: Graph.from_model(model)),
        ("memcc DefUse.build (producer + readers)", lambda: DefUse.build(graph.nodes)),
        ("memcc producers() + consumers() (two maps)",
         lambda: (graph.producers(), graph.consumers())),
        ("memcc topological_problems", lambda: topological_problems(graph)),
    ]
    try:
        import onnx_graphsurgeon as gs
        imported = gs.import_onnx(model)
        rows += [
            ("onnx_graphsurgeon import_onnx (links as it imports)",
             lambda: gs.import_onnx(model)),
            ("onnx_graphsurgeon copy + toposort", lambda: imported.copy().toposort()),
            ("onnx_graphsurgeon copy + cleanup", lambda: imported.copy().cleanup()),
        ]
    except ImportError:
        print("(onnx_graphsurgeon not installed: skipped)")
    try:
        import onnx_ir as ir
        rows += [("onnx_ir from_proto (producer() / uses() per value)",
                  lambda: ir.from_proto(model))]
    except ImportError:
        print("(onnx_ir not installed: skipped)")
    st = StepStructure.of(graph)
    plan = Plan(frozenset(sorted(st.recomputable)[::3]))
    for check in ("off", "fast", "full"):
        rows.append((f"lower, every 3rd forward node recomputed, check={check}",
                     lambda c=check: lower(graph, plan, st, check=c)))
    for label, fn in rows:
        fn()  # warm
        print(f"{label:58s} {median_ms(fn):8.1f} ms")


if __name__ == "__main__":
    main()
