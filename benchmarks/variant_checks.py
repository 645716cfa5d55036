"""The figures docs/VARIANTS.md and BENCHMARKS.md quote about operator variants, rerunnable.

    python benchmarks/variant_checks.py min-search [--model gpt2:batch=4,seq_len=64]
        ``--budget min`` (strategy ilp) with and without variants: smallest peak and seconds.
        The default model is the planner tests' GPT-2 (tests/test_passes_planner.py).
    python benchmarks/variant_checks.py bn-inverted [--model mobilenetv2:batch=8,resolution=64]
        Each training-mode BatchNorm on its ``inverted`` variant alone: the largest relative
        difference (max |variant - default| / max |default|) over the weight-momentum outputs,
        grouped by how many values each channel normalises over.
    python benchmarks/variant_checks.py bf16 [--cnn-model ...] [--transformer-model ...]
        ``bf16_saved`` on every node of one op family (Conv, BatchNorm, MatMul/Gemm, ...)
        where it applies, family by family, then on all of them at once, on a ResNet-18 and
        a GPT-2 step whose norm scales and biases are random (``randomize_norm_params``):
        the largest and median relative difference (max |variant - default| /
        max |default|) over the loss and every parameter gradient that is not zero up to
        rounding (``ZERO_GRADIENT``).
    python benchmarks/variant_checks.py activations [--model gpt2:batch=8,...] [--rounds 12]
        Every decomposed GELU / SiLU on ``activation_from_input``: the simulated peak and the
        analytic cost model's step time with and without, the largest relative difference
        to the default rules at 1 and 2 threads (gradients not zero up to rounding), and
        the measured step time ratio (median of interleaved rounds, 95% bootstrap interval).
    python benchmarks/variant_checks.py pointwise-conv [--model resnet50:...] [--rounds 12]
        The step as built with 1x1 convolutions' weight gradients as a MatMul (the rule
        today) against the Conv over transposed copies (the rule before): simulated and
        measured peak, the largest relative difference at 1 and 2 threads, and the measured
        step time ratio; then each distinct 1x1 layer shape alone (its weight gradient under
        each rule, timed in interleaved rounds).
    python benchmarks/variant_checks.py row-chunks [--model gpt2:...] [--attention-chunks 8]
            [--mlp-chunks 1] [--fractions 0.5p 0.33p min] [--rounds 10]
        Whole regions against ``memcc build --attention-chunks K --mlp-chunks M``: the
        largest relative difference at 1 and 2 threads and the as-built step time ratio;
        then each step as built and compiled (``auto``, analytic costs) at each budget
        (``0.33p``: that share of the whole-attention step's peak; ``min``), with the
        predicted and measured peak, and every step's measured time against the whole
        step as built (interleaved in one child, median ratio and 95% interval).

Planner results depend on the time limit when the search hits it (``solver.limit_hit``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.steps import parse_model  # noqa: E402
from memcc.backend.runner import synthetic_feeds  # noqa: E402
from memcc.backend.verify import step_outputs  # noqa: E402
from memcc.frontend.build import BuildOptions, build_training_step  # noqa: E402
from memcc.frontend.load import load_graph  # noqa: E402
from memcc.passes.analysis.cost_model import DeviceRates, analytic_costs  # noqa: E402
from memcc.passes.lowering.lower import lower  # noqa: E402
from memcc.passes.lowering.variant_substitution import applicable_variants, rule_nodes  # noqa: E402
from memcc.passes.plan import Plan, StepStructure  # noqa: E402
from memcc.passes.planning.planner import choose_plan  # noqa: E402
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest  # noqa: E402
from memcc.passes.planning.simulate import simulate  # noqa: E402
from memcc.step import TrainingStep  # noqa: E402
from models import build_model  # noqa: E402

# The planner tests' rates (tests/test_passes_planner.py), so the figures match that setup.
RATES = DeviceRates(5e10, 1e10, 5e-6, "fixed test rates")


def _step(spec: str, optimizer: str | None = None):
    name, opts = parse_model(spec)
    build = BuildOptions() if optimizer is None else BuildOptions(optimizer=optimizer)
    return build_training_step(load_graph(build_model(name, **opts)), build)


def min_search(args: argparse.Namespace) -> None:
    g = _step(args.model)
    costs = analytic_costs(g, RATES)
    base = simulate(g, Plan(), costs)
    print(f"{args.model}: {len(g.nodes)} nodes, baseline {base.peak_bytes:,} B")
    for variants in (True, False):
        t0 = time.perf_counter()
        out = choose_plan(g, costs, PlanRequest(Budget.MIN, strategy="ilp",
                                                time_limit=args.time_limit,
                                                kinds=DecisionKinds(variants=variants)),
                          baseline=base)
        print(f"  variants={variants}: smallest peak {out.best.peak_bytes:,} B in "
              f"{time.perf_counter() - t0:.1f} s (limit hit: {out.solver.get('limit_hit')})")


def bn_inverted(args: argparse.Namespace) -> None:
    g = _step(args.model, optimizer="sgd")
    st, rules = StepStructure.of(g), rule_nodes(g)
    feeds = synthetic_feeds(g, seed=0)
    ref = step_outputs(g, feeds, "cpu")
    worst: dict[int, float] = defaultdict(float)
    # The model's BatchNorms, as a plan offers them the variant: the backward's own
    # BatchNormalization nodes are no forward nodes and lowering refuses them.
    offered = [n for n in g.nodes if n.op_type == "BatchNormalization" and n.name in st.forward
               and any(v.name == "inverted" for v in applicable_variants(g, n, rules))]
    for node in offered:
        shape = g.info[node.input[0]].shape
        per_channel = int(shape[0] * np.prod(shape[2:]))
        new = step_outputs(lower(g, Plan(variants={node.name: "inverted"}), st).graph,
                           feeds, "cpu")
        for k, a in ref.items():
            if "weight.momentum" in k:
                scale = float(np.max(np.abs(a))) or 1e-30
                worst[per_channel] = max(worst[per_channel],
                                         float(np.max(np.abs(a - new[k]))) / scale)
    print(f"{args.model}: values per channel -> largest relative difference")
    for n, err in sorted(worst.items()):
        print(f"  {n:6d}  {err:.2e}")


# bf16_saved's op families, as the docs report them.
BF16_FAMILIES: dict[str, tuple[str, ...]] = {
    "Conv/ConvTranspose": ("Conv", "ConvTranspose"),
    "MatMul/Gemm": ("MatMul", "Gemm"),
    "BatchNorm": ("BatchNormalization",),
    "LayerNorm": ("LayerNormalization",),
    "Softmax": ("Softmax",),
    "LogSoftmax": ("LogSoftmax",),
    "Tanh/Sigmoid/Exp": ("Tanh", "Sigmoid", "Exp"),
    "Mul/Div/Pow": ("Mul", "Div", "Pow"),
    "Erf/Gelu": ("Erf", "Gelu"),
}
# A gradient whose largest entry is below this fraction of the step's largest is left out.
ZERO_GRADIENT = 1e-5


def randomize_norm_params(model: onnx.ModelProto, op: str, seed: int = 1) -> onnx.ModelProto:
    """Give every ``op`` node's scale and bias initializer trained-looking random values
    (scale ~ N(1, 0.3), bias ~ N(0, 0.3)): at the zoo's scale 1 and bias 0 a norm's
    backward errors are those of one special case."""
    rng = np.random.default_rng(seed)
    roles = {}
    for n in model.graph.node:
        if n.op_type == op:
            roles[n.input[1]] = 1.0
            if len(n.input) > 2 and n.input[2]:
                roles[n.input[2]] = 0.0
    for t in model.graph.initializer:
        if t.name in roles:
            a = numpy_helper.to_array(t)
            v = rng.normal(roles[t.name], 0.3, a.shape).astype(a.dtype)
            t.CopyFrom(numpy_helper.from_array(v, t.name))
    return model


def _bf16_step(spec: str):
    """The SGD step of ``spec`` with random norm parameters and every parameter gradient
    as an output; returns it with the gradients' names."""
    name, opts = parse_model(spec)
    model = build_model(name, **opts)
    for op in ("BatchNormalization", "LayerNormalization"):
        randomize_norm_params(model, op)
    g = build_training_step(load_graph(model), BuildOptions(optimizer="sgd"))
    grads = list(dict.fromkeys(TrainingStep(g).gradients().values()))
    g.outputs = list(g.outputs) + [v for v in grads if v not in g.outputs]
    return g, grads


def _nonzero_gradients(ref: dict[str, np.ndarray], grads: list[str]
                       ) -> tuple[list[str], list[str]]:
    """The loss and the gradients worth a relative error, and those left out: below
    ``ZERO_GRADIENT`` times the largest gradient entry, a gradient is zero up to rounding
    (a bias in front of a batch-statistics BatchNorm, which subtracts it again), and its
    relative error is rounding noise over rounding noise."""
    top = max(float(np.max(np.abs(ref[k]))) for k in grads)
    zero = [k for k in grads if float(np.max(np.abs(ref[k]))) < ZERO_GRADIENT * top]
    return ["loss", *(k for k in grads if k not in zero)], zero


def bf16(args: argparse.Namespace) -> None:
    for spec in (args.cnn_model, args.transformer_model):
        g, grads = _bf16_step(spec)
        st, rules = StepStructure.of(g), rule_nodes(g)
        offered = [n for n in g.nodes if n.name in st.forward
                   and any(v.name == "bf16_saved" for v in applicable_variants(g, n, rules))]
        feeds = synthetic_feeds(g, seed=0)
        ref = step_outputs(g, feeds, "cpu")
        compared, zero = _nonzero_gradients(ref, grads)
        print(f"{spec}: relative difference over the loss and {len(compared) - 1} gradients"
              + (f" ({len(zero)} left out: zero up to rounding)" if zero else ""))
        runs = [(fam, [n.name for n in offered if n.op_type in ops])
                for fam, ops in BF16_FAMILIES.items()]
        runs.append(("all at once", [n.name for n in offered]))
        for fam, names in runs:
            if not names:
                continue
            plan = Plan(variants=dict.fromkeys(names, "bf16_saved"))
            new = step_outputs(lower(g, plan, st).graph, feeds, "cpu")
            errs = [float(np.max(np.abs(ref[k] - new[k])))
                    / (float(np.max(np.abs(ref[k]))) or 1e-30) for k in compared]
            print(f"  {fam:18s} {len(names):3d} nodes: largest {max(errs):.2e}, "
                  f"median {np.median(errs):.2e}")


def activations(args: argparse.Namespace) -> None:
    from memcc.passes.analysis.cost_model import NOMINAL_CPU
    from memcc.passes.lowering.variant_substitution import region_variants

    g = _step(args.model)
    st = StepStructure.of(g)
    chosen = region_variants(g, st)
    print(f"{args.model}: {len(chosen)} decomposed activation(s) on activation_from_input")
    if not chosen:
        return
    low = lower(g, Plan(variants=chosen), st).graph
    costs = analytic_costs(g, NOMINAL_CPU)
    base = simulate(g, Plan(), costs, st)
    var = simulate(g, Plan(variants=chosen), costs, st)
    print(f"  simulated peak {base.peak_bytes / 1e6:.1f} MB -> {var.peak_bytes / 1e6:.1f} MB; "
          f"analytic step time {base.compute_cost_s:.4f} s -> {var.compute_cost_s:.4f} s "
          f"({var.compute_cost_s / base.compute_cost_s - 1:+.1%})")
    _compare_steps(g, low, args.rounds, "the variant", "the default")


def _compare_steps(ref_step, new_step, rounds: int, new_label: str, ref_label: str) -> None:
    """The largest relative difference of ``new_step``'s loss and gradients to
    ``ref_step``'s at 1 and 2 threads (outputs not zero up to rounding), then both steps'
    times in interleaved rounds (median ratio, 95% bootstrap interval)."""
    from benchmarks.stats import interleaved_times, ratio_interval
    from memcc.backend.session import SessionSettings, make_session
    from memcc.backend.verify import session_graph

    feeds = synthetic_feeds(ref_step, seed=0)
    # The loss and each parameter's gradient, under each step's own names.
    ref_grads, new_grads = TrainingStep(ref_step).gradients(), TrainingStep(new_step).gradients()
    pairs = [(ref_step.metadata.get("memcc.loss", "loss"),
              new_step.metadata.get("memcc.loss", "loss")),
             *((ref_grads[p], new_grads[p]) for p in ref_grads if p in new_grads)]
    for graph, names in ((ref_step, [a for a, _ in pairs]), (new_step, [b for _, b in pairs])):
        graph.outputs = list(dict.fromkeys([*graph.outputs, *names]))

    def session(graph, threads: int | None = None):
        sg, values = session_graph(graph)
        sess = make_session(sg.to_model(), "cpu", SessionSettings(intra_op_threads=threads))
        every = {**values, **feeds}
        return lambda: dict(zip(graph.outputs, sess.run(list(graph.outputs), every),
                                strict=True))

    ref = session(ref_step, 1)()
    pairs = [(a, b) for a, b in pairs if a in ref]
    top = max(float(np.max(np.abs(ref[a]))) for a, _ in pairs)
    for threads in (1, 2):
        new = session(new_step, threads)()
        errs = [float(np.max(np.abs(ref[a] - new[b]))) / float(np.max(np.abs(ref[a])))
                for a, b in pairs if float(np.max(np.abs(ref[a]))) >= 1e-5 * top]
        print(f"  {threads} thread(s): largest relative difference {max(errs):.2e} "
              f"over {len(errs)} outputs")
    times = interleaved_times({"ref": session(ref_step), "new": session(new_step)},
                              rounds=rounds, warmup=2)
    ri = ratio_interval(times["ref"], times["new"])
    print(f"  measured step time: {ref_label} {ri.a_median_s:.3f} s, {new_label} "
          f"{ri.b_median_s:.3f} s; ratio {ri.cell()}: {ri.verdict(new_label, ref_label)}")


def pointwise_conv(args: argparse.Namespace) -> None:
    """The step as built with 1x1 weight gradients as a MatMul (today's rule) and as a Conv
    over transposed copies (the rule before it, ``_is_pointwise`` off): simulated and
    measured peak, difference and step time."""
    import tempfile
    from unittest import mock

    from memcc.backend.runner import RunRequest, run_steps
    from memcc.frontend.gradients import nn
    from memcc.passes.analysis.cost_model import NOMINAL_CPU

    with mock.patch.object(nn, "_is_pointwise", lambda *a: False):
        old = _step(args.model, args.optimizer)
    new = _step(args.model, args.optimizer)
    pointwise = sum(1 for n in new.nodes if n.op_type == "MatMul"
                    and n.output[0].startswith("grad/"))
    print(f"{args.model}: {len(old.nodes)} -> {len(new.nodes)} nodes, "
          f"{pointwise} weight-gradient MatMul(s)")
    st_old, st_new = StepStructure.of(old), StepStructure.of(new)
    sims = [simulate(g, Plan(), analytic_costs(g, NOMINAL_CPU), st)
            for g, st in ((old, st_old), (new, st_new))]
    with tempfile.TemporaryDirectory() as tmp:
        measured = []
        for name, g in (("old", old), ("new", new)):
            path = Path(tmp) / f"{name}.onnx"
            onnx.save(g.to_model(), str(path))
            measured.append(run_steps(path, RunRequest(steps=2, separate_timing=False))
                            .measured_peak_bytes)
    print(f"  peak: Conv rule {sims[0].peak_bytes / 1e6:.1f} MB simulated, "
          f"{measured[0] / 1e6:.1f} MB measured; MatMul rule {sims[1].peak_bytes / 1e6:.1f} MB "
          f"simulated, {measured[1] / 1e6:.1f} MB measured")
    _compare_steps(old, new, args.rounds, "the MatMul rule", "the Conv rule")
    _pointwise_layers(new, args.rounds)


def _pointwise_layers(step, rounds: int) -> None:
    """Each distinct 1x1 convolution of ``step`` alone: a one-node model, its weight
    gradient (and nothing else) under each rule, timed in interleaved rounds."""
    from unittest import mock

    from onnx import helper

    from benchmarks.stats import interleaved_times, ratio_interval
    from memcc.backend.session import make_session
    from memcc.frontend.autodiff import differentiate
    from memcc.frontend.emit import Emitter
    from memcc.frontend.gradients import nn
    from memcc.graph import attr

    shapes = {}
    for node in step.nodes:
        if node.op_type == "Conv" and node.input[1] in step.initializers:
            w = step.info[node.input[1]].shape
            if all(k == 1 for k in w[2:]):
                strides = tuple(attr(node, "strides", [1] * (len(w) - 2)))
                shapes.setdefault((step.info[node.input[0]].shape, w, strides), node.name)
    print(f"  {len(shapes)} distinct 1x1 layer shapes, weight gradient alone:")
    rng = np.random.default_rng(0)
    for (x_shape, w_shape, strides), name in shapes.items():
        feeds = {"x": rng.standard_normal(x_shape).astype(np.float32),
                 "w": rng.standard_normal(w_shape).astype(np.float32)}

        def session(pointwise: bool, feeds=feeds, x_shape=x_shape, w_shape=w_shape,
                    strides=strides):
            conv = helper.make_node("Conv", ["x", "w"], ["y"], strides=list(strides))
            graph = load_graph(helper.make_model(helper.make_graph(
                [conv], "layer",
                [helper.make_tensor_value_info(k, onnx.TensorProto.FLOAT, list(v.shape))
                 for k, v in feeds.items()],
                [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)]),
                opset_imports=[helper.make_opsetid("", 17)]))
            loss = Emitter(graph).reduce_sum("y", None, keepdims=False)
            with mock.patch.object(nn, "_is_pointwise",
                                   nn._is_pointwise if pointwise else lambda *a: False):
                graph.outputs = [differentiate(graph, loss, ["w"])["w"]]
            sess = make_session(graph.to_model(), "cpu")
            return lambda: sess.run(None, feeds)

        times = interleaved_times({"conv": session(False), "matmul": session(True)},
                                  rounds=rounds, warmup=1)
        ri = ratio_interval(times["conv"], times["matmul"])
        print(f"    {name}: x {list(x_shape)}, w {list(w_shape)}, strides {list(strides)}: "
              f"Conv rule {ri.a_median_s * 1e3:.1f} ms, MatMul rule {ri.b_median_s * 1e3:.1f} ms,"
              f" ratio {ri.cell()}")


def row_chunks(args: argparse.Namespace) -> None:
    """Whole attentions and MLPs against row chunks: as built, then planned at the same
    budgets, every peak measured and every step timed against the whole step."""
    import statistics
    import tempfile

    from benchmarks.pareto import (
        _fraction_label,
        compile_plans,
        measure_peak,
        prepare_timing_job,
        time_against_first,
    )
    from benchmarks.stats import ratio_interval
    from memcc.backend.onnx_file import save_graph
    from memcc.passes.analysis.cost_model import NOMINAL_CPU
    from memcc.passes.analysis.liveness import analyze_liveness

    name, opts = parse_model(args.model)
    forward = build_model(name, **opts)
    whole = build_training_step(load_graph(forward), BuildOptions())
    chunked = build_training_step(load_graph(forward), BuildOptions(
        attention_chunks=args.attention_chunks, mlp_chunks=args.mlp_chunks))
    split = chunked.metadata.get("memcc.row_chunks")
    cost = [analytic_costs(g, NOMINAL_CPU).total(g) for g in (whole, chunked)]
    print(f"{args.model}: {len(whole.nodes)} -> {len(chunked.nodes)} nodes ({split}); "
          f"analytic step time {cost[1] / cost[0] - 1:+.1%}")
    _compare_steps(whole, chunked, args.rounds, "the chunked step", "the whole step")
    live = analyze_liveness(whole)
    act = live.breakdown["activations"] + live.breakdown["scratch"]
    fixed = live.peak_bytes - act
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        rows: list[dict] = []
        label_chunked = f"chunks {args.attention_chunks}/{args.mlp_chunks}"
        for label, step in (("whole", whole), (label_chunked, chunked)):
            where = tmp / ("whole" if step is whole else "chunked")
            where.mkdir()
            path = where / "step.onnx"
            save_graph(step, path)
            rows.append({"label": f"{label}, as built", "path": str(path),
                         "predicted_peak_bytes": analyze_liveness(step).peak_bytes,
                         "predicted_overhead": 0.0})
            for r in compile_plans(path, args.fractions, ["auto"], fixed, act, "analytic",
                                   args.time_limit, where, print):
                r["label"] = f"{label}, {_fraction_label(r['fraction'])}"
                rows.append(r)
        ok = [r for r in rows if "error" not in r]
        for r in ok:
            r.update(measure_peak(Path(r["path"]), 2))
        jobs = [prepare_timing_job(f"v{i}", Path(r["path"]), tmp) for i, r in enumerate(ok)]
        timed = {a: time_against_first(jobs, args.rounds, 1, 0, None, args.timing_seconds,
                                       100, allocator=a) for a in args.timing_allocators}
    heads = " | ".join(f"measured time / whole as built, {a}" for a in timed)
    print("\n| step | budget (MB) | predicted peak (MB) | measured peak (MB) | predicted "
          f"overhead (own step) | {heads} |\n|---|---|---|---|---|" + "---|" * len(timed))
    for i, r in enumerate(ok):
        cells = []
        for times in timed.values():
            base, t = times[f"v{i}"]
            ratio = "1" if i == 0 else ratio_interval(base, t).cell()
            cells.append(f"{ratio} (median {statistics.median(t):.3f} s)")
        budget = f"{r['budget_bytes'] / 1e6:.1f}" if r.get("budget_bytes") else "-"
        print(f"| {r['label']} | {budget} | "
              f"{r['predicted_peak_bytes'] / 1e6:.1f} | {r['measured_peak_bytes'] / 1e6:.1f} | "
              f"{r['predicted_overhead']:+.1%} | {' | '.join(cells)} |")
    for r in rows:
        if "error" in r:
            print(f"| {r['label']} | | {r['error']} | | |" + " |" * len(timed))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    m = sub.add_parser("min-search")
    m.add_argument("--model", default="gpt2:batch=4,seq_len=64")
    m.add_argument("--time-limit", type=float, default=300.0)
    b = sub.add_parser("bn-inverted")
    b.add_argument("--model", default="mobilenetv2:batch=8,resolution=64")
    h = sub.add_parser("bf16")
    h.add_argument("--cnn-model", default="resnet18:batch=8,resolution=32,width=8")
    h.add_argument("--transformer-model",
                   default="gpt2:batch=2,seq_len=32,width=64,depth=2,heads=4,vocab_size=128")
    a = sub.add_parser("activations")
    a.add_argument("--model", default="gpt2:batch=8,seq_len=256,width=256,depth=6,heads=4")
    a.add_argument("--rounds", type=int, default=12)
    c = sub.add_parser("pointwise-conv")
    c.add_argument("--model", default="resnet50:batch=32,resolution=128")
    c.add_argument("--optimizer", default=None)
    c.add_argument("--rounds", type=int, default=12)
    t = sub.add_parser("row-chunks")
    t.add_argument("--model", default="gpt2:batch=2,seq_len=1024,width=256,depth=4,heads=4")
    t.add_argument("--attention-chunks", type=int, default=8)
    t.add_argument("--mlp-chunks", type=int, default=1)
    t.add_argument("--fractions", nargs="+", default=["0.5p", "0.33p", "min"])
    t.add_argument("--time-limit", type=float, default=60.0)
    t.add_argument("--rounds", type=int, default=10)
    t.add_argument("--timing-seconds", type=float, default=0.0)
    t.add_argument("--timing-allocator", dest="timing_allocators", nargs="+",
                   choices=["glibc", "arena"], default=["glibc", "arena"],
                   help="time under glibc's default allocator, ORT's CPU arena, or both "
                        "(benchmarks/pareto.py says why both)")
    args = ap.parse_args(argv)
    {"min-search": min_search, "bn-inverted": bn_inverted, "bf16": bf16,
     "activations": activations, "pointwise-conv": pointwise_conv,
     "row-chunks": row_chunks}[args.what](args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
