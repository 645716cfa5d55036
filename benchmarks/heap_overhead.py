"""What tiny tensors cost beyond their size on CPU, where the liveness model counts nothing.

Small steps with thousands of tiny tensors (per-channel statistics, scalars, bias gradients)
measure above their predicted peaks (BENCHMARKS.md, "First use on torchvision and timm
exports"). Two probes, each measured the way ``--verify`` measures (one buffer per mmap,
buffers under 4 KiB from glibc's heap, a fresh process):

    python benchmarks/heap_overhead.py tiny              # chains and held values of N Adds
    python benchmarks/heap_overhead.py prefix STEP.onnx --points 1000 2000 4000
    python benchmarks/heap_overhead.py steps PLAN.onnx ... --steps 4 [--in-place]

``tiny``: N ``Add`` nodes on K floats, either a chain whose every value is freed at once
(``chain``) or N values held until one ``Concat`` reads them all (``held``). Prints
predicted and measured peaks and the extra bytes per node.

``steps``: whole compiled steps run as ``memcc run`` runs them (``--in-place``: as ``memcc
train`` does), several steps in one process: the worst step's excess over the prediction per
small buffer (``passes.analysis.liveness.small_buffers``), against the heap allowance that compile
keeps free for them (``HEAP_BYTES_PER_SMALL_BUFFER``), and whether the worst step stays
within the budget ``--budget min`` would have given the plan (margin and slack included).

``prefix``: the first k nodes of a step, every value a later node still needs kept as an
output, so that each prefix's peak is the step's live memory up to node k: where along the
step the measured peak leaves the predicted one.

"extra per node" is the excess of the smallest measured run over the prediction for
``tiny`` (the steady state), and of the largest for ``prefix`` (``--verify`` takes the larger
of its steps), divided by the number of nodes.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

from memcc.backend.memory import measure_many_in_subprocess
from memcc.graph import Graph
from memcc.passes.analysis.liveness import analyze_liveness


def _add_model(nodes: list[onnx.NodeProto], k: int, output: str) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                        [k])],
                          [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def tiny_cases(n: int, sizes: list[int]) -> dict[str, onnx.ModelProto]:
    cases = {}
    for k in sizes:
        chain = [helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "x"], [f"t{i}"],
                                  name=f"c{i}") for i in range(n)]
        cases[f"chain {k}"] = _add_model(chain, k, f"t{n - 1}")
        held = [helper.make_node("Add", ["x", "x"], [f"y{i}"], name=f"h{i}") for i in range(n)]
        held += [helper.make_node("Concat", [f"y{i}" for i in range(n)], ["all"], axis=0),
                 helper.make_node("ReduceSum", ["all"], ["s"], keepdims=0)]
        cases[f"held {k}"] = _add_model(held, k, "s")
    return cases


def tiny(n: int, sizes: list[int], runs: int) -> list[dict]:
    cases = tiny_cases(n, sizes)
    feeds = {name: {"x": np.ones(int(name.split()[1]), np.float32)} for name in cases}
    measured = measure_many_in_subprocess(
        {name: (m, feeds[name]) for name, m in cases.items()}, runs=runs)
    rows = []
    for name, m in cases.items():
        predicted = analyze_liveness(Graph.from_model(m)).peak_bytes
        least = min(measured[name])
        rows.append({"case": name, "nodes": n, "predicted": predicted,
                     "measured": measured[name], "extra_per_node": (least - predicted) / n})
    return rows


def prefix(path: str, points: list[int], runs: int) -> list[dict]:
    from memcc.backend.runner import session_graph, synthetic_feeds
    from memcc.frontend.load import load_graph

    step = load_graph(path)
    graph, values = session_graph(step)
    feeds = {**values, **synthetic_feeds(step, 0)}
    model = graph.to_model()
    nodes = list(model.graph.node)
    cases, predicted = {}, {}
    for k in points:
        head = nodes[:k]
        produced = {o for n in head for o in n.output if o}
        needed = {i for n in nodes[k:] for i in n.input} | {o.name for o in model.graph.output}
        outputs = sorted(produced & needed) or [head[-1].output[0]]
        m = onnx.ModelProto()
        m.CopyFrom(model)
        del m.graph.node[:], m.graph.output[:]
        m.graph.node.extend(head)
        for o in outputs:
            info = graph.info[o]
            m.graph.output.append(helper.make_tensor_value_info(o, info.dtype, list(info.shape)))
        read = {i for n in head for i in n.input}
        inputs = [i for i in m.graph.input if i.name in read]
        del m.graph.input[:]
        m.graph.input.extend(inputs)
        predicted[k] = analyze_liveness(Graph.from_model(m)).peak_bytes
        cases[str(k)] = (m, {i.name: feeds[i.name] for i in inputs})
    measured = measure_many_in_subprocess(cases, runs=runs)
    return [{"case": f"first {k} of {len(nodes)} nodes", "nodes": k, "predicted": predicted[k],
             "measured": measured[str(k)],
             "extra_per_node": (max(measured[str(k)]) - predicted[k]) / k} for k in points]


def steps(paths: list[str], steps: int, in_place: bool) -> list[dict]:
    from memcc.backend.runner import RunRequest, run_steps
    from memcc.compiler import CompileOptions, user_budget
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.liveness import small_buffers

    options = CompileOptions()
    rows = []
    for path in paths:
        graph = load_graph(path)
        run = run_steps(path, RunRequest(steps=steps, in_place=in_place, separate_timing=False))
        predicted = run.predicted_peak_bytes
        worst = max(run.measured_peak_bytes_per_step)
        small = small_buffers(graph)
        rows.append({"case": path.rsplit("/", 1)[-1], "small_buffers": small,
                     "predicted": predicted, "measured": run.measured_peak_bytes_per_step,
                     "extra_per_small_buffer": (worst - predicted) / max(small, 1),
                     # what compile --budget min gives this plan (its prediction without
                     # the in-place arrangement)
                     "budget": user_budget(analyze_liveness(graph).peak_bytes, options,
                                            options.slack_for(graph))})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="probe", required=True)
    t = sub.add_parser("tiny", help="chains and held values of N Adds on K floats")
    t.add_argument("--nodes", type=int, default=2000)
    t.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 64, 256, 1000])
    p = sub.add_parser("prefix", help="prefixes of a step: where the measured peak drifts")
    p.add_argument("step")
    p.add_argument("--points", type=int, nargs="+", required=True)
    for s in (t, p):
        s.add_argument("--runs", type=int, default=3)
    w = sub.add_parser("steps", help="whole steps, several in one process, against the "
                                     "heap allowance")
    w.add_argument("plans", nargs="+")
    w.add_argument("--steps", type=int, default=4)
    w.add_argument("--in-place", action="store_true", help="run as memcc train does")
    args = ap.parse_args(argv)
    if args.probe == "steps":
        rows = steps(args.plans, args.steps, args.in_place)
        print("| step | small buffers | predicted (MB) | measured per step (MB) | "
              "extra per small buffer (B) | budget at min (MB) | worst step within |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            runs = ", ".join(f"{v / 1e6:.2f}" for v in r["measured"])
            print(f"| {r['case']} | {r['small_buffers']:,} | {r['predicted'] / 1e6:.2f} | "
                  f"{runs} | {r['extra_per_small_buffer']:.0f} | {r['budget'] / 1e6:.2f} | "
                  f"{'yes' if max(r['measured']) <= r['budget'] else 'NO'} |")
        return 0
    rows = (tiny(args.nodes, args.sizes, args.runs) if args.probe == "tiny"
            else prefix(args.step, args.points, args.runs))
    print("| case | predicted (MB) | measured per run (MB) | extra per node (B) |")
    print("|---|---|---|---|")
    for r in rows:
        runs = ", ".join(f"{v / 1e6:.3f}" for v in r["measured"])
        print(f"| {r['case']} | {r['predicted'] / 1e6:.3f} | {runs} | "
              f"{r['extra_per_node']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
