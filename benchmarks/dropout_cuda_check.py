"""Dropout on a provider: exact resumption, the generator's kernels, and what it costs.

memcc draws Dropout masks from (seed, step counter, element) in standard ONNX integer ops
(``memcc/frontend/dropout_masks.py``). This script checks, on one provider, the three
things that can only be seen there:

- ``identical``: a small model with Dropout trained N steps uninterrupted, and N/2 steps,
  checkpointed, resumed in a new ``Trainer`` for N/2 more, ends with every carried tensor
  equal bit for bit (``max_abs_diff`` is the largest difference, 0.0 when identical).
- ``masks_match_reference`` / ``generator_on_provider``: a lone rewritten Dropout run on the
  provider draws the numpy reference's masks, and a session that forbids falling back to
  the CPU can be created (every op of the generator has a kernel for its dtype there).
- ``ms_per_step`` against ``ms_per_step_ort_dropout``: the same step with ORT's own Dropout
  kernel (the form before counters), timed interleaved, ``repeats`` rounds (``cost``: the
  median of the rounds' ratios, minus 1; ``cpu_*``: process CPU time); ``peak_bytes``
  against ``peak_bytes_ort_dropout``: the liveness prediction of each as the trainer runs it.

    python benchmarks/dropout_cuda_check.py                       # CUDA (the GPU machine)
    python benchmarks/dropout_cuda_check.py --provider cpu --model gpt2:batch=4,seq_len=128

It prints one JSON object. Without CUDA it prints ``{"error": ...}`` and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

# Where each zoo model gets its Dropouts: after every ReLU of the MLP; GPT-2 as transformers
# places them (embeddings, attention probabilities, both residual projections).
AFTER: dict[str, Callable[[onnx.NodeProto], bool]] = {
    "mlp": lambda n: n.op_type == "Relu",
    "gpt2": lambda n: n.op_type == "Softmax" or n.name == "embed" or n.name.endswith(".c_proj"),
}
DEFAULT_MODEL = {"mlp": dict(batch=64, in_features=256, width=1024, depth=3),
                 "gpt2": dict(batch=4, seq_len=128, vocab_size=2048, width=256, depth=4,
                              heads=4)}


def with_dropout(model: onnx.ModelProto, ratio: float = 0.1,
                 after: Callable[[onnx.NodeProto], bool] = AFTER["mlp"]) -> onnx.ModelProto:
    """``model`` with a training-mode Dropout after every node ``after`` picks, as a PyTorch
    ``nn.Dropout(ratio)`` in train mode exports (constant ratio and mode)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    g.initializer.extend([helper.make_tensor("dropout.ratio", TensorProto.FLOAT, [], [ratio]),
                          helper.make_tensor("dropout.train", TensorProto.BOOL, [], [True])])
    nodes = []
    for n in g.node:
        nodes.append(n)
        if after(n):
            y = n.output[0]
            n.output[0] = f"{y}.pre_dropout"
            nodes.append(helper.make_node("Dropout", [n.output[0], "dropout.ratio",
                                                     "dropout.train"], [y],
                                          name=f"{n.name}.dropout"))
    del g.node[:]
    g.node.extend(nodes)
    return out


@contextmanager
def ort_dropout() -> Iterator[None]:
    """Build and load steps as memcc did before counters: ORT's Dropout kernel stays."""
    import memcc.frontend.build as build
    import memcc.frontend.load as load

    saved = build.counter_dropouts, load.upgrade_step
    build.counter_dropouts, load.upgrade_step = (lambda graph: []), (lambda graph: 0)
    try:
        yield
    finally:
        build.counter_dropouts, load.upgrade_step = saved


def _step_files(name: str, options: dict, ratio: float, d: Path):
    """(counter step path, ORT-Dropout step path, its loaded Graph)."""
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    forward = with_dropout(build_model(name, **options), ratio, AFTER[name])
    opts = BuildOptions(optimizer="adamw")
    new = save_graph(build_training_step(load_graph(forward), opts), d / "counter.onnx")
    with ort_dropout():
        old = save_graph(build_training_step(load_graph(forward), opts), d / "ort.onnx")
        old_graph = load_graph(old)
    return new, old, old_graph


def _resume_check(path: Path, provider: str, steps: int, threads: int | None, d: Path
                  ) -> dict:
    from memcc import Trainer
    from memcc.backend.runner import synthetic_feeds

    straight = Trainer(path, provider=provider, threads=threads)
    feeds = synthetic_feeds(straight.graph, seed=0)
    losses = [straight.step(feeds) for _ in range(steps)]
    want = straight.state_dict()
    del straight
    half = Trainer(path, provider=provider, threads=threads)
    for _ in range(steps // 2):
        half.step(feeds)
    half.save(d / "ck")
    del half
    resumed = Trainer.resume(d / "ck", path, provider=provider, threads=threads)
    resumed_losses = [resumed.step(feeds) for _ in range(steps - steps // 2)]
    got = resumed.state_dict()
    diffs = {n: float(np.max(np.abs(got[n].astype(np.float64) - want[n].astype(np.float64)),
                              initial=0.0)) for n in want}
    differing = sorted(n for n in want if not np.array_equal(got[n], want[n]))
    return {"identical": not differing and resumed_losses == losses[steps // 2:],
            "max_abs_diff": max(diffs.values(), default=0.0),
            "tensors_differing": len(differing), "tensors": len(want),
            "counter": int(got.get("dropout.step", -1)), "final_loss": losses[-1]}


def _generator_check(provider: str) -> dict:
    """A lone rewritten Dropout on ``provider`` against the numpy reference, with CPU
    fallback forbidden (every node must have a kernel on the provider)."""
    import onnxruntime as ort

    from memcc.backend.session import provider_options
    from memcc.frontend.dropout_masks import COUNTER, counter_dropouts, dropout_mask
    from memcc.frontend.load import load_graph
    from memcc.graph import attr

    shape = (3, 50, 257)
    g = helper.make_graph(
        [helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], name="drop")], "lone",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape)),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, list(shape))],
        [helper.make_tensor("r", TensorProto.FLOAT, [], [0.1]),
         helper.make_tensor("t", TensorProto.BOOL, [], [True])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 10
    graph = load_graph(m)
    seed = attr(graph.nodes[0], "seed")
    counter_dropouts(graph)
    graph.inputs = [*graph.inputs, COUNTER]
    model = graph.to_model().SerializeToString()
    on_provider: bool | str = True
    if provider != "cpu":   # the provider alone, CPU fallback refused
        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        try:
            ort.InferenceSession(model, so, providers=provider_options(provider)[:1])
        except Exception as exc:  # noqa: BLE001 - ORT names the node without a kernel
            on_provider = str(exc).splitlines()[0][:300]
    sess = ort.InferenceSession(model, providers=provider_options(provider))
    x = np.ones(shape, np.float32)
    match = True
    for step in (0, 1, 123456):
        _, mask = sess.run(None, {"x": x, COUNTER: np.asarray(step, np.int64)})
        match = match and bool(np.array_equal(mask, dropout_mask(seed, step, shape, 0.1)))
    return {"masks_match_reference": match, "generator_on_provider": on_provider}


def _time(path: Path, provider: str, threads: int | None, steps: int, graph=None
          ) -> tuple[float, float, int]:
    """(wall ms and process CPU ms per step after a warm-up step, the step's predicted
    peak bytes). CPU time is what a loaded machine disturbs least."""
    from memcc import Trainer
    from memcc.backend.runner import synthetic_feeds

    t = Trainer(path, provider=provider, threads=threads, graph=graph)
    feeds = synthetic_feeds(t.graph, seed=0)
    t.step(feeds)   # warm-up (allocations, kernel choices)
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        t.step(feeds)
    return ((time.perf_counter() - start) / steps * 1e3,
            (time.process_time() - cpu) / steps * 1e3, t.predicted_peak_bytes)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--provider", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="mlp",
                    help="mlp or gpt2, with options as name:key=value,... (zoo builders)")
    ap.add_argument("--ratio", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=20, help="steps of the resume check")
    ap.add_argument("--time-steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    from benchmarks.steps import parse_model
    from memcc.backend.session import cuda_unavailable_reason

    reason = cuda_unavailable_reason() if args.provider == "cuda" else None
    if reason is not None:
        print(json.dumps({"provider": "cuda", "onnxruntime": ort.__version__,
                          "error": f"CUDA is not available: {reason}; run on a machine "
                                   "with onnxruntime-gpu and a GPU, or pass --provider cpu"}))
        return 2
    name, options = parse_model(args.model)
    if name not in AFTER:
        print(json.dumps({"error": f"--model {name}: choose one of {', '.join(AFTER)}"}))
        return 2
    options = {**DEFAULT_MODEL[name], **options}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        new, old, old_graph = _step_files(name, options, args.ratio, d)
        result = {"provider": args.provider, "onnxruntime": ort.__version__,
                  "model": name, "options": options, "ratio": args.ratio,
                  "steps": args.steps}
        result.update(_resume_check(new, args.provider, args.steps, args.threads, d))
        result.update(_generator_check(args.provider))
        rounds: dict[str, list[float]] = {"counter": [], "ort": []}
        cpu: dict[str, list[float]] = {"counter": [], "ort": []}
        peaks: dict[str, int] = {}
        for _ in range(args.repeats):   # interleaved: drift hits both alike
            # (a Trainer takes the carried values out of the graph it is given: a copy)
            for form, path, graph in (("ort", old, old_graph.copy()), ("counter", new, None)):
                ms, cpu_ms, peaks[form] = _time(path, args.provider, args.threads,
                                                args.time_steps, graph=graph)
                rounds[form].append(ms)
                cpu[form].append(cpu_ms)
        result["peak_bytes"] = peaks["counter"]
        result["peak_bytes_ort_dropout"] = peaks["ort"]
        result["ms_per_step"] = statistics.median(rounds["counter"])
        result["ms_per_step_ort_dropout"] = statistics.median(rounds["ort"])
        result["ms_rounds"] = rounds
        result["cpu_ms_per_step"] = statistics.median(cpu["counter"])
        result["cpu_ms_per_step_ort_dropout"] = statistics.median(cpu["ort"])
        # Each round's pair was timed back to back: the median of their ratios.
        result["cost"] = statistics.median(c / o for c, o in zip(
            rounds["counter"], rounds["ort"], strict=True)) - 1.0
        result["cpu_cost"] = statistics.median(c / o for c, o in zip(
            cpu["counter"], cpu["ort"], strict=True)) - 1.0
    print(json.dumps(result))
    return 0 if result["identical"] and result["masks_match_reference"] else 1


if __name__ == "__main__":
    sys.exit(main())
