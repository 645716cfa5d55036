"""The nodes of a built step by op type and by origin, and what the fewest-node BatchNorm
backward (memcc/frontend/gradients/batchnorm_backward.py) or the grouped updates of the
vector parameters (memcc/frontend/update_groups.py) change on the CPU (issue 30).

Origins: ``forward`` (the model's own nodes), ``forward: BatchNorm expanded`` (what the CUDA
provider's rewrite puts in place of a training-mode BatchNorm, ``passes/providers/
batchnorm_for_cuda.py``, running statistics included), ``backward: <op>`` (by the forward
op whose gradient rule emitted the node), ``update: optimizer``. ``kernels`` leaves out
Constant nodes (ONNX Runtime turns them into initializers when it loads the file).

"before" is the step built with the general BatchNorm rule (``gradients/nn.py``, what
every step used before; ``--against batchnorm-rule``) or with an update per parameter
(``--against apart-updates``, ``BuildOptions(grouped_updates=False)``, and for CUDA an
update per running statistic) or with the BatchNorm backward's projection
``gy - xhat * sum(gy * xhat) / n`` as a Mul, a Reshape, a Mul and an Add instead of one more
inference-mode BatchNormalization (``--against projection-by-view``) or with the 1x1
convolutions' weight gradients viewing their operands through shape constants with the
layer's sizes, one per size, as they did before sharing them (``--against sized-views``,
``gradients/nn.py`` ``_pointwise_weight_grad``) or with the BatchNorm backward's ``xhat``
and batch variance from reductions instead of one training-mode BatchNormalization
(``--against statistics-by-reductions``). With ``--time`` both
are run under memcc's execution contract, paired round by round (``benchmarks/stats.py``);
printed: the largest difference of any output both steps have over its largest magnitude,
the median step times and the ratio new / before with its 95% interval, and the planner's
predicted peak of each step as built.

    python benchmarks/node_counts.py [--models resnet50,gpt2]
        [--against apart-updates|projection-by-view|sized-views|statistics-by-reductions]
        [--optimizer sgd|adamw] [--time] [--rounds 15] [--threads 2] [--clock wall|cpu]
        [--out FILE.json]

Sizes: the zoo's ResNet-50 at batch 8, 64 px and GPT-2 width 256, depth 4, batch 8 x 128
(``benchmarks/fusions.py``'s); node counts do not depend on them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.fusions import ZOO, _session  # noqa: E402
from benchmarks.stats import interleaved_times, ratio_interval  # noqa: E402
from memcc.backend.runner import synthetic_feeds  # noqa: E402
from memcc.frontend import update_groups  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.gradients import batchnorm_backward, nn  # noqa: E402
from memcc.frontend.gradients.shape_ops import slice_values  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.frontend.update_groups import MAX_GROUP  # noqa: E402
from memcc.graph import Graph  # noqa: E402
from memcc.passes.providers.provider_step import for_provider  # noqa: E402
from memcc.step import GRAD_OF_PROP, ROLE_PROP, Role, TrainingStep, node_props  # noqa: E402


def origins(step: Graph) -> collections.Counter:
    """Nodes per (origin, op type)."""
    roles = TrainingStep.of(step).roles
    op_of = {n.name: n.op_type for n in step.nodes}
    out: collections.Counter = collections.Counter()
    for n in step.nodes:
        props = node_props(n) if n.metadata_props else {}
        role = roles[n.name]
        if role is Role.UPDATE:
            where = "update: optimizer"
        elif role is Role.FORWARD:
            expanded = props.get(ROLE_PROP) == Role.FORWARD.value
            where = "forward: BatchNorm expanded" if expanded else "forward"
        else:
            src = props.get(GRAD_OF_PROP)
            where = f"backward: {op_of.get(src, 'loss')}"
        out[(where, n.op_type)] += 1
    return out


def count(step: Graph) -> dict:
    by = origins(step)
    per_origin: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for (where, op), k in sorted(by.items(), key=lambda kv: -kv[1]):
        per_origin[where][op] = k
    ops = collections.Counter()
    for (_, op), k in by.items():
        ops[op] += k
    return {"nodes": sum(by.values()), "kernels": sum(by.values()) - ops["Constant"],
            "by_op": dict(ops.most_common()), "by_origin": dict(per_origin)}


@contextlib.contextmanager
def _sized_views():
    """The 1x1 weight-gradient rule with every view spelled with the layer's sizes."""
    def sized(emit, x, shape, _spelled=None):
        return emit.reshape(x, shape)

    def flat(emit, x, axis):
        shape = emit.info(x).shape
        return emit.reshape(x, [int(np.prod(shape[:axis])), int(np.prod(shape[axis:]))])

    def strided(emit, x, strides):
        nd = len(strides)
        return slice_values(emit, x, [0] * nd, list(emit.info(x).shape[2:]),
                            list(range(2, nd + 2)), list(strides))

    with mock.patch.object(nn, "_shared_view", sized), \
            mock.patch.object(nn, "_flat_view", flat), \
            mock.patch.object(nn, "_every_stride", strided):
        yield


def statistics_by_reductions(ctx, x, zeros, eps):
    """The float32 BatchNorm backward's ``xhat`` and variance as it made them before one
    training-mode BatchNormalization did: ReduceMean, Sub, Mul, ReduceMean and an
    inference-mode BatchNormalization of the centred input."""
    emit = ctx.emit
    info = ctx.info(x)
    axes = [0] + list(range(2, len(info.shape)))
    centred = emit.sub(x, emit.reduce_mean(x, axes, keepdims=True))
    var = emit.reduce_mean(emit.mul(centred, centred), axes, keepdims=False)
    ones = emit.const(np.ones(int(info.shape[1])), info.dtype, name="ones")
    xhat = emit.op("BatchNormalization", [centred, ones, zeros, zeros, var], epsilon=eps,
                   info=info)
    return xhat, var


def _builds(name: str, against: str, optimizer: str) -> dict[str, Graph]:
    zoo, opts = ZOO[f"zoo-{name}"]
    from models import build_model

    fwd = load_graph(build_model(zoo, **opts))
    new = build_training_step(fwd, BuildOptions(optimizer=optimizer))
    if against == "projection-by-view":
        with mock.patch.object(batchnorm_backward, "_count_root_is_exact", lambda _: False):
            return {"before": build_training_step(fwd, BuildOptions(optimizer=optimizer)),
                    "new": new}
    if against == "statistics-by-reductions":
        with mock.patch.object(batchnorm_backward, "_normalised", statistics_by_reductions):
            return {"before": build_training_step(fwd, BuildOptions(optimizer=optimizer)),
                    "new": new}
    if against == "sized-views":
        with _sized_views():
            return {"before": build_training_step(fwd, BuildOptions(optimizer=optimizer)),
                    "new": new}
    if against == "apart-updates":
        return {"before": build_training_step(fwd, BuildOptions(optimizer=optimizer,
                                                                grouped_updates=False)),
                "new": new}
    with mock.patch.object(batchnorm_backward, "applies", lambda *_: False):
        before = build_training_step(fwd, BuildOptions(optimizer=optimizer))
    return {"before": before, "new": new}


def timed(steps: dict[str, Graph], rounds: int, threads: int, clock: str = "wall") -> dict:
    from memcc.passes.analysis.liveness import analyze_liveness

    batch = synthetic_feeds(steps["before"], 0)
    runs, outputs = {}, {}
    for label, step in steps.items():
        sess, values = _session(step, threads)
        feeds = {**values, **batch}
        names = list(step.outputs)
        outputs[label] = dict(zip(names, sess.run(names, feeds), strict=True))
        runs[label] = (lambda s=sess, n=names, f=feeds: s.run(n, f))
    worst = 0.0
    for k, a in outputs["before"].items():
        if k not in outputs["new"]:  # the per-parameter optimizer state (grouped: joined)
            continue
        a64, b64 = a.astype(np.float64), outputs["new"][k].astype(np.float64)
        worst = max(worst, float(np.max(np.abs(a64 - b64)))
                    / max(float(np.max(np.abs(a64))), 1e-30))
    times = interleaved_times(runs, rounds=rounds, warmup=1,
                              clock=time.process_time if clock == "cpu" else time.perf_counter)
    ratio = ratio_interval(times["before"], times["new"])
    return {"largest_relative_difference": worst, "threads": threads, "clock": clock,
            "ratio": ratio.to_json(), "before_median_s": ratio.a_median_s,
            "new_median_s": ratio.b_median_s,
            "predicted_peak_bytes": {k: int(analyze_liveness(s).peak_bytes)
                                     for k, s in steps.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--against", choices=("batchnorm-rule", "apart-updates",
                                          "projection-by-view", "sized-views",
                                          "statistics-by-reductions"),
                    default="batchnorm-rule")
    ap.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time per step (time.process_time), which a "
                         "busy machine's waits for a core do not inflate")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        if f"zoo-{name}" not in ZOO:
            ap.error(f"unknown model {name!r}; choose from "
                     f"{sorted(k.removeprefix('zoo-') for k in ZOO)}")
        steps = _builds(name, args.against, args.optimizer)
        row = {"model": name}
        for label, step in steps.items():
            # apart-updates: the CUDA build's running statistics apart too (one group each)
            apart = args.against == "apart-updates" and label == "before"
            with mock.patch.object(update_groups, "MAX_GROUP", 1 if apart else MAX_GROUP):
                cuda = for_provider(step, "cuda")[0]
            row[label] = {"cpu": count(step), "cuda": count(cuda)}
            print(f"{name} {label}: {row[label]['cpu']['nodes']} nodes on the CPU, "
                  f"{row[label]['cuda']['nodes']} for CUDA "
                  f"({row[label]['cpu']['kernels']} / {row[label]['cuda']['kernels']} kernels)")
        if args.time:
            row["time"] = timed(steps, args.rounds, args.threads, args.clock)
            t = row["time"]
            print(f"  CPU step ({args.clock} clock), {args.threads} threads, {args.rounds} "
                  f"rounds: before "
                  f"{1e3 * t['before_median_s']:.1f} ms, new {1e3 * t['new_median_s']:.1f} ms, "
                  f"{t['ratio']['verdict']}; largest difference "
                  f"{t['largest_relative_difference']:.2g}; predicted peak "
                  f"{t['predicted_peak_bytes']}")
        rows.append(row)
    print(json.dumps(rows, indent=1) if not args.out else "")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
