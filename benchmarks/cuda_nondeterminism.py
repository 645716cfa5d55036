"""Which gradients of the zoo GPT-2 step differ between runs of the same batch on a provider?

The step is built with ``--optimizer none`` (outputs: the loss and every gradient) and run
twice in each of two fresh sessions with the same feeds; every output that differs in any
run is listed with its largest difference. Then again with the Gather gradient written as a
one-hot MatMul (memcc's rule before opset 16) instead of ``ScatterElements(reduction="add")``,
which ORT's CUDA provider runs with atomic adds. One JSON object on stdout.

    python benchmarks/cuda_nondeterminism.py cuda     # the GPU machine (benchmarks/gpu_setup.sh)
    python benchmarks/cuda_nondeterminism.py cpu
"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np
from memcc.backend.runner import session_graph, synthetic_feeds
from memcc.backend.session import make_session
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.gradients import shape_ops
from models import build_model

provider = sys.argv[1] if len(sys.argv) > 1 else "cuda"
dims = dict(batch=8, seq_len=256, vocab_size=2048, width=256, depth=4, heads=4)
out = {"provider": provider}
orig = shape_ops._scatter_rows
for rule in ("scatter", "onehot"):
    shape_ops._scatter_rows = orig if rule == "scatter" else shape_ops._onehot_rows
    g = build_training_step(load_graph(build_model("gpt2", **dims)), BuildOptions(optimizer="none"))
    sg, values = session_graph(g)
    feeds = {**{k: np.asarray(v) for k, v in values.items()}, **synthetic_feeds(g, seed=0)}
    feeds = {k: v for k, v in feeds.items() if k in sg.inputs}
    names = list(sg.outputs)
    runs = []
    t = []
    for s in range(2):
        sess = make_session(sg.to_model(), provider)
        for r in range(2):
            t0 = time.perf_counter(); res = sess.run(names, feeds); t.append(time.perf_counter() - t0)
            runs.append(dict(zip(names, res)))
    diff = {}
    for k in names:
        m = max(float(np.max(np.abs(runs[0][k].astype(np.float64) - x[k]))) for x in runs[1:])
        if m > 0:
            diff[k] = m
    out[rule] = {"outputs": len(names), "differing": diff, "scatter_nodes": sum(n.op_type == "ScatterElements" for n in g.nodes),
                 "ms_median": 1000 * float(np.median(t[1:]))}
shape_ops._scatter_rows = orig
print(json.dumps(out, indent=1))
