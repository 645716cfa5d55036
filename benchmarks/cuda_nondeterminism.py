"""Which gradients of the zoo GPT-2 step differ between runs of the same batch on a provider?

The step is built with ``--optimizer none`` (outputs: the loss and every gradient) and run
twice in each of two fresh sessions with the same feeds; every output that differs in any
run is listed with its largest difference. Then again with the Gather gradient written as a
one-hot MatMul (memcc's rule before opset 16) instead of ``ScatterElements(reduction="add")``,
which ORT's CUDA provider runs with atomic adds. One JSON object on stdout.

    python benchmarks/cuda_nondeterminism.py cuda     # the GPU machine (benchmarks/gpu_setup.sh)
    python benchmarks/cuda_nondeterminism.py cpu
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from memcc.backend.runner import session_graph, synthetic_feeds  # noqa: E402
from memcc.backend.session import make_session  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.gradients import shape_ops  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from models import build_model  # noqa: E402

DIMS = dict(batch=8, seq_len=256, vocab_size=2048, width=256, depth=4, heads=4)


def differing_outputs(provider: str, sessions: int = 2, runs: int = 2) -> dict:
    """Build the step with the current Gather rule and run it ``sessions`` x ``runs`` times."""
    g = build_training_step(load_graph(build_model("gpt2", **DIMS)),
                            BuildOptions(optimizer="none"))
    sg, values = session_graph(g)
    feeds = {**{k: np.asarray(v) for k, v in values.items()}, **synthetic_feeds(g, seed=0)}
    feeds = {k: v for k, v in feeds.items() if k in sg.inputs}
    names = list(sg.outputs)
    results, times = [], []
    for _ in range(sessions):
        sess = make_session(sg.to_model(), provider)
        for _ in range(runs):
            t0 = time.perf_counter()
            results.append(dict(zip(names, sess.run(names, feeds), strict=True)))
            times.append(time.perf_counter() - t0)
    diff = {}
    for k in names:
        m = max(float(np.max(np.abs(results[0][k].astype(np.float64) - r[k])))
                for r in results[1:])
        if m > 0:
            diff[k] = m
    return {"outputs": len(names), "differing": diff,
            "scatter_nodes": sum(n.op_type == "ScatterElements" for n in g.nodes),
            "ms_median": 1000 * float(np.median(times[1:]))}


def main() -> None:
    provider = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    out: dict = {"provider": provider, "dims": DIMS}
    scatter = shape_ops._scatter_rows
    try:
        out["scatter"] = differing_outputs(provider)
        shape_ops._scatter_rows = shape_ops._onehot_rows
        out["onehot"] = differing_outputs(provider)
    finally:
        shape_ops._scatter_rows = scatter
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
