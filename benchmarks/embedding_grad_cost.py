"""What the deterministic embedding gradient costs, measured at GPT-2 scale.

The Gather gradient was one ScatterND(reduction='add') with an index per row; ORT's CPU
kernel races on repeated rows at more than one thread (docs/DETERMINISM.md). memcc now emits
ScatterElements, which needs an index per element, chunked so that the expanded indices and
the gradient slice of one chunk stay under ``SCATTER_CHUNK_BYTES``. This script builds the
gradient of ``Gather(table, ids)`` (upstream gradient ``dy`` fed as an input) three ways:

- ``scatternd``: the old rule (racy: its numbers are for comparison only);
- ``elements-1``: ScatterElements with one chunk (indices as large as the gradient);
- ``elements``: ScatterElements chunked as memcc builds it;

and for each prints the measured peak (VmHWM in a fresh child, ``backend/memory.py``), the
predicted peak (``analyze_liveness``), and the step time at ``--threads`` (median and min-max
of ``--repeats`` interleaved runs: variants take turns, so machine noise hits all alike),
and whether every run gave np.add.at's answer within 1e-5 of the largest row.

    python benchmarks/embedding_grad_cost.py                  # GPT-2 small: 50257 x 768, 8 x 1024
    python benchmarks/embedding_grad_cost.py --vocab 2000 --width 256 --batch 8 --seq 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from old_gather_rule import _scatternd_rows  # noqa: E402

import memcc.frontend.gradients.shape_ops as shape_ops  # noqa: E402
from memcc.backend.memory import measure_many_in_subprocess  # noqa: E402
from memcc.backend.session import SessionSettings, make_session  # noqa: E402
from memcc.frontend.autodiff import differentiate  # noqa: E402
from memcc.frontend.emit import Emitter  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.graph import Graph  # noqa: E402
from memcc.passes.analysis.liveness import analyze_liveness  # noqa: E402

F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def gather_gradient(vocab: int, width: int, batch: int, seq: int) -> Graph:
    """``d table`` of ``sum(Gather(table, ids) * dy)``, with the rules in force right now."""
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0),
             helper.make_node("Mul", ["y", "dy"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "embedding", [
        helper.make_tensor_value_info("table", F32, [vocab, width]),
        helper.make_tensor_value_info("ids", I64, [batch, seq]),
        helper.make_tensor_value_info("dy", F32, [batch, seq, width])],
        [helper.make_tensor_value_info("loss", F32, [])])
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    grads = differentiate(graph, "loss", ["table"])
    graph.outputs = [Emitter(graph).unary("Identity", grads["table"])]
    return graph


def build_variants(args) -> dict[str, Graph]:
    shape = (args.vocab, args.width, args.batch, args.seq)
    chunked = gather_gradient(*shape)
    default_chunk = shape_ops.SCATTER_CHUNK_BYTES
    rows = shape_ops._scatter_rows
    try:
        shape_ops.SCATTER_CHUNK_BYTES = 1 << 62
        whole = gather_gradient(*shape)
        shape_ops._scatter_rows = _scatternd_rows
        old = gather_gradient(*shape)
    finally:
        shape_ops.SCATTER_CHUNK_BYTES = default_chunk
        shape_ops._scatter_rows = rows
    return {"scatternd": old, "elements-1": whole, "elements": chunked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    feeds = {"table": rng.standard_normal((args.vocab, args.width)).astype(np.float32),
             "ids": rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64),
             "dy": rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)}
    feeds["ids"][:, ::4] = feeds["ids"][0, 0]  # a frequent token: rows that really repeat
    exact = np.zeros((args.vocab, args.width))
    np.add.at(exact, feeds["ids"].reshape(-1),
              feeds["dy"].reshape(-1, args.width).astype(np.float64))
    scale = float(np.abs(exact).max())

    variants = build_variants(args)
    models = {k: g.to_model() for k, g in variants.items()}
    overrides = {"intra_op_num_threads": args.threads}
    measured = measure_many_in_subprocess({k: (m, feeds) for k, m in models.items()}, runs=2,
                                          overrides=overrides)
    sessions = {k: make_session(m, "cpu", SessionSettings(intra_op_threads=args.threads))
                for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    exact_runs = dict.fromkeys(models, 0)
    for _ in range(args.repeats):
        for k, sess in sessions.items():
            t0 = time.perf_counter()
            (grad,) = sess.run(None, feeds)
            times[k].append(time.perf_counter() - t0)
            exact_runs[k] += float(np.abs(grad - exact).max()) <= 1e-5 * scale

    inputs_mb = sum(v.nbytes for v in feeds.values()) / 1e6
    print(f"embedding gradient: table {args.vocab} x {args.width}, {args.batch} x {args.seq} "
          f"tokens, {args.threads} threads, chunk bound {shape_ops.SCATTER_CHUNK_BYTES >> 20} MiB;"
          f" inputs {inputs_mb:.1f} MB")
    print(f"{'variant':<11} {'scatters':>8} {'measured MB':>12} {'predicted MB':>13} "
          f"{'median ms':>10} {'min-max ms':>14} {'exact runs':>11}")
    for k, g in variants.items():
        n_scatter = sum(n.op_type.startswith("Scatter") for n in g.nodes)
        ms = [t * 1e3 for t in times[k]]
        print(f"{k:<11} {n_scatter:>8} {max(measured[k]) / 1e6:>12.1f} "
              f"{analyze_liveness(g).peak_bytes / 1e6:>13.1f} {statistics.median(ms):>10.1f} "
              f"{min(ms):>6.1f}-{max(ms):<7.1f} {exact_runs[k]:>5}/{args.repeats}")


if __name__ == "__main__":
    main()
