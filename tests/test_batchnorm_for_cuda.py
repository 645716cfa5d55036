"""Training-mode BatchNorm written as the CUDA provider runs it
(passes/providers/batchnorm_for_cuda.py).

ORT's CUDA provider refuses ``BatchNormalization(training_mode=1)`` at opset 14+ (measured on
an H100, BENCHMARKS.md "CUDA"). The rewrite has to compute what ORT's CPU kernel computes:
checked here on the CPU provider, which runs both forms, against the step as built, at 1, 2
and 4 intra-op threads, twice each.

Tolerance: the batch statistics are summed in another order (ReduceMean and ReduceSumSquare
instead of the kernel's own loop), so outputs differ in the last bits; every output of the
step stays within 1e-4 of its largest magnitude (measured at most 4e-5 on the zoo ResNet-18)
and the running statistics within 1e-5. Values that are zero in exact arithmetic (the
gradient of a convolution bias in front of BatchNorm, and its momentum) are rounding noise
near 1e-9 in both forms: they are held to 1e-6 absolute.
"""

from __future__ import annotations

import numpy as np
import pytest
from exports import export
from onnx_files import write_model
from threads import run_once

from memcc.backend.runner import synthetic_feeds
from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.analysis.liveness import categorize
from memcc.passes.providers.batchnorm_for_cuda import (
    expand_training_batchnorm,
    is_model_batchnorm,
    is_training_batchnorm,
)
from memcc.passes.providers.provider_step import for_provider
from memcc.step import Role, TrainingStep
from models import build_model

STEP_RTOL = 1e-4
STATS_RTOL = 1e-5
NOISE_ATOL = 1e-6


def _zoo_step():
    return build_training_step(load_graph(build_model("resnet18", batch=4, resolution=32,
                                                      width=8)), BuildOptions())


def _data(graph):
    feeds = synthetic_feeds(graph, 0)
    return {k: v for k, v in feeds.items() if k not in graph.initializers}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """The largest difference over the largest magnitude, or 0 where both are noise."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = float(np.max(np.abs(a64 - b64)))
    if diff <= NOISE_ATOL and float(np.max(np.abs(a64))) <= NOISE_ATOL:
        return 0.0
    return diff / max(float(np.max(np.abs(a64))), 1e-30)


def _running_stats(graph) -> set[str]:
    return {o for n in graph.nodes if is_model_batchnorm(n, graph.opset)
            for o in n.output[1:3] if o} | {
        out for out, inp in TrainingStep.of(graph).state.items()
        if any(inp in n.input[3:5] for n in graph.nodes if n.op_type == "BatchNormalization")}


@pytest.mark.parametrize("source", ["zoo", "torchscript"])
def test_rewritten_step_matches_the_step_as_built(source, tmp_path):
    if source == "zoo":
        step = _zoo_step()
    else:
        path, _, _, dims = export("conv_bn", source, tmp_path, training=True)
        step = build_training_step(load_graph(path, dims), BuildOptions())
    before = sum(is_model_batchnorm(n, step.opset) for n in step.nodes)
    assert before > 0
    rewritten, report = expand_training_batchnorm(step)
    assert report == {"batchnorm_rewritten": before, "statistics_reused": before,
                      "running_statistics_updates": -(-2 * before // 32)}
    assert not [n for n in rewritten.nodes if is_training_batchnorm(n, rewritten.opset)]
    feeds = _data(step)
    stats = {o for o in step.outputs if o in _running_stats(step)}
    assert stats, "the step carries BatchNorm running statistics"
    for threads in (1, 2, 4):
        built = run_once(step, feeds, threads)
        first = run_once(rewritten, feeds, threads)
        again = run_once(rewritten, feeds, threads)
        for name, value in built.items():
            assert np.array_equal(first[name], again[name]), (threads, name)
            limit = STATS_RTOL if name in stats else STEP_RTOL
            assert _relative(value, first[name]) <= limit, (threads, name)


def test_the_backward_reads_the_forwards_statistics_and_moves_less():
    """Each backward normalises by the forward's batch mean and variance (the ones the
    forward's normalisation used) instead of recomputing them: two activation-sized
    reductions, a Sub and a Mul fewer per BatchNorm, outputs within the stated tolerance of
    the backward that recomputes them, at 1 and 2 threads."""
    from memcc.passes.analysis.step_traffic import step_traffic

    step = _zoo_step()
    n_bn = sum(is_model_batchnorm(n, step.opset) for n in step.nodes)
    again, kept = expand_training_batchnorm(step, reuse_statistics=False)
    reused, report = expand_training_batchnorm(step)
    assert kept["statistics_reused"] == 0 and report["statistics_reused"] == n_bn
    a, b = step_traffic(again), step_traffic(reused)
    assert b.kernels < a.kernels and b.bytes_moved < a.bytes_moved
    for op in ("ReduceMean", "ReduceSumSquare", "Sub"):
        assert a.by_op[op].kernels - b.by_op[op].kernels == n_bn, op
    feeds = _data(step)
    stats = {o for o in step.outputs if o in _running_stats(step)}
    for threads in (1, 2):
        want, got = run_once(again, feeds, threads), run_once(reused, feeds, threads)
        for name, value in want.items():
            limit = STATS_RTOL if name in stats else STEP_RTOL
            assert _relative(value, got[name]) <= limit, (threads, name)


def test_a_dynamo_export_needs_no_rewrite(tmp_path):
    """The dynamo exporter writes no training-mode BatchNorm even in train mode (tests/
    exports.py, DYNAMO_TRAIN_BN_DIVERGES): the CUDA provider runs its step as it is."""
    path, _, _, dims = export("conv_bn", "dynamo", tmp_path, training=True)
    step = build_training_step(load_graph(path, dims), BuildOptions())
    assert not [n for n in step.nodes if is_training_batchnorm(n, step.opset)]
    rewritten, summary = for_provider(step, "cuda")
    assert summary["batchnorm_rewritten"] == 0
    # Only the per-channel sums of its gradient change form
    # (passes/providers/deterministic_reductions):
    # every BatchNormalization stays as it was.
    bn = [x for x in step.nodes if x.op_type == "BatchNormalization"]
    assert [x for x in rewritten.nodes if x.op_type == "BatchNormalization"] == bn


def test_on_cuda_per_channel_sums_run_over_trailing_axes():
    """ResNet-18's BatchNorm scale/bias gradients and statistics (sums over N, H, W) become
    a transpose and a trailing-axis sum on CUDA (the numbers: the tests above compare the
    rewritten step's outputs with the step as built)."""
    from memcc.passes.providers.deterministic_reductions import per_channel, to_trailing_axes

    step = _zoo_step()
    _, before = to_trailing_axes(step, only=per_channel)
    rewritten, _ = for_provider(step, "cuda")
    _, after = to_trailing_axes(rewritten, only=per_channel)
    assert len(before.rewritten) >= 20 and not after.rewritten
    assert for_provider(step, "cpu") == (step, {"batchnorm_rewritten": 0})


def test_rewrite_keeps_names_roles_and_leaves_other_providers_alone():
    step = _zoo_step()
    assert for_provider(step, "cpu") == (step, {"batchnorm_rewritten": 0})
    rewritten, summary = for_provider(step, "cuda")
    n = summary["batchnorm_rewritten"]
    assert n == 20
    bn_names = {node.name for node in step.nodes if is_model_batchnorm(node, step.opset)}
    roles = TrainingStep.of(rewritten).roles
    # (the backward's per-channel affines are inference-mode BatchNorms of their own:
    # gradients/batchnorm_backward.py)
    inference = {node.name for node in rewritten.nodes if node.op_type == "BatchNormalization"
                 and roles[node.name] is Role.FORWARD}
    assert inference == bn_names  # reports and provenance name the node as it was
    producers = rewritten.def_use().producer
    for out in _running_stats(step) & set(rewritten.outputs):
        assert roles[producers[out].name] is Role.FORWARD, out
    # nothing left to rewrite
    assert for_provider(rewritten, "cuda") == (rewritten, {"batchnorm_rewritten": 0})
    # The running statistics stay what the reports call them ("other", not optimizer state).
    kinds, kinds_after = categorize(step), categorize(rewritten)
    state = TrainingStep.of(step).state
    assert {v: kinds[v] for v in state.values()} == {v: kinds_after[v] for v in state.values()}
    assert sum(kinds[v] == "other" for v in state.values()) == 2 * n


def test_compile_for_cuda_plans_the_rewritten_step(tmp_path):
    """Planned, lowered and written for CUDA on a machine without one (costs estimated):
    the file has no training-mode BatchNorm, and the load pass says how many it rewrote."""
    model = tmp_path / "resnet.onnx"
    model.write_bytes(build_model("resnet18", batch=2, resolution=32, width=8)
                      .SerializeToString())
    out = tmp_path / "out.onnx"
    result = compile_model(model, CompileOptions(budget="min", provider="cuda",
                                                 cost="analytic", offload=False,
                                                 time_limit=10), output=out)
    load = next(p for p in result.report["passes"] if p["name"] == "load")
    assert load["summary"]["batchnorm_rewritten"] == 20
    written = load_graph(out)
    assert not [n for n in written.nodes if is_training_batchnorm(n, written.opset)]


def _linear_bn1d(tmp_path):
    """x [16, 6] -> MatMul -> BatchNormalization over [N, C] (BatchNorm1d) in training mode."""
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w", rng.standard_normal((6, 5))), ("scale", 1 + 0.1 * rng.standard_normal(5)),
        ("bias", 0.1 * rng.standard_normal(5)), ("mean", 0.1 * rng.standard_normal(5)),
        ("var", 1 + 0.1 * rng.random(5)))]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"],
                              ["logits", "mean_out", "var_out"], name="bn1d",
                              training_mode=1, momentum=0.8, epsilon=1e-3)]
    return write_model(tmp_path / "bn1d.onnx", nodes, [("x", [16, 6])],
                       [("logits", [16, 5])], inits)


def test_batchnorm_over_two_axes_with_its_own_momentum_and_epsilon(tmp_path):
    """BatchNorm1d ([N, C], statistics over the batch axis alone), a momentum and an epsilon
    other than the defaults: the rewrite keeps all three."""
    step = build_training_step(load_graph(_linear_bn1d(tmp_path)), BuildOptions())
    rewritten, report = expand_training_batchnorm(step)
    assert report == {"batchnorm_rewritten": 1, "statistics_reused": 1,
                      "running_statistics_updates": 1}
    feeds = _data(step)
    stats = {o for o in step.outputs if o in _running_stats(step)}
    assert len(stats) == 2
    for threads in (1, 2):
        built, first = run_once(step, feeds, threads), run_once(rewritten, feeds, threads)
        for name, value in built.items():
            limit = STATS_RTOL if name in stats else STEP_RTOL
            assert _relative(value, first[name]) <= limit, (threads, name)


def test_running_statistics_updated_together_give_the_same_bits(monkeypatch):
    """Up to 32 running statistics updated over their concatenation: per element the same
    Mul, Mul and Add as one statistic alone, so the same bits, in six nodes per group
    instead of three per statistic; every node after what it reads."""
    from memcc.frontend import update_groups
    from memcc.graph import topological_problems

    step = _zoo_step()
    grouped, report = expand_training_batchnorm(step)
    monkeypatch.setattr(update_groups, "MAX_GROUP", 1)
    apart, alone = expand_training_batchnorm(step)
    n_bn = report["batchnorm_rewritten"]
    assert alone["running_statistics_updates"] == 2 * n_bn
    assert report["running_statistics_updates"] == 2
    assert len(apart.nodes) - len(grouped.nodes) == 3 * 2 * n_bn - 2 * 7
    assert topological_problems(grouped) == []
    feeds = _data(step)
    for threads in (1, 2):
        want, got = run_once(apart, feeds, threads), run_once(grouped, feeds, threads)
        for name, value in want.items():
            assert np.array_equal(value, got[name]), (threads, name)
