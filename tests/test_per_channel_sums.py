"""Per-channel sums in two stages for CUDA (passes/providers/per_channel_sums.py).

Checked on ORT's CPU provider, which runs both forms: the same sums (in another order: within
RTOL = 1e-5 of the largest magnitude), at 1 and 2 threads, the node's name kept, a valid step
with shapes for every new value, no Transpose of the reduced tensor itself, and reductions
that are not per-channel left alone. Its speed is the H200's figure in the module docstring.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_deterministic_reductions import assert_same_sum
from test_deterministic_scatter import RTOL, _two_steps
from threads import run_at_threads

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import topological_problems
from memcc.passes.providers.batchnorm_for_cuda import expand_training_batchnorm
from memcc.passes.providers.deterministic_reductions import per_channel, to_trailing_axes
from memcc.passes.providers.per_channel_sums import per_channel_two_stage
from memcc.passes.providers.provider_step import for_provider
from models import build_model

F32 = TensorProto.FLOAT


def _one_reduction(op: str, shape: list[int], axes: list[int], keep: int, opset: int):
    out_shape = [1 if a in axes else d for a, d in enumerate(shape)] if keep else \
        [d for a, d in enumerate(shape) if a not in axes]
    inits, inputs = [], ["x"]
    attrs = {"keepdims": keep}
    if opset >= (13 if op == "ReduceSum" else 18):
        inits = [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)]
        inputs.append("axes")
    else:
        attrs["axes"] = axes
    node = helper.make_node(op, inputs, ["y"], name="r", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", F32, shape)],
                          [helper.make_tensor_value_info("y", F32, out_shape)], inits)
    return load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))


@pytest.mark.parametrize("op, shape, axes, keep, opset, rewritten", [
    ("ReduceSum", [4, 6, 5, 5], [0, 2, 3], 1, 18, True),      # a BatchNorm bias gradient
    ("ReduceSum", [4, 6, 5, 5], [0, 2, 3], 0, 18, True),      # already [C]: no Reshape
    ("ReduceMean", [4, 6, 5, 7], [0, 2, 3], 1, 18, True),     # BatchNorm statistics
    ("ReduceMean", [4, 6, 5, 7], [0, 2, 3], 1, 17, True),     # axes as an attribute
    ("ReduceSumSquare", [4, 6, 5, 5], [0, 2, 3], 0, 18, True),
    ("ReduceSumSquare", [4, 6, 1, 1], [0, 2, 3], 1, 18, True),  # H*W of 1: one stage
    ("ReduceSum", [4, 6, 5, 1], [0, 2], 1, 18, True),         # a unit axis left out
    ("ReduceSum", [4, 6, 5, 5], [0, 2], 1, 18, False),        # W kept: not per-channel
    ("ReduceSum", [4, 6, 5, 5], [2, 3], 1, 18, False),        # trailing already
    ("ReduceSum", [1, 6, 5, 5], [0, 2, 3], 1, 18, False),     # no batch to sum
    ("ReduceLogSum", [4, 6, 5, 5], [0, 2, 3], 1, 18, False),  # left to to_trailing_axes
    ("ReduceSum", [4, 6, 3, 5, 5], [0, 2, 3, 4], 0, 18, True),  # BatchNorm3d (video)
    ("ReduceMean", [4, 6, 1, 5, 5], [0, 2, 3, 4], 1, 18, True),  # ... at depth 1
    ("ReduceSumSquare", [4, 6, 7], [0, 2], 0, 18, True),      # BatchNorm1d over a sequence
    ("ReduceSum", [4, 6], [0], 0, 18, False),                 # [N, C]: the Transpose form
    ("ReduceSum", [4, 6, 3, 5, 5], [0, 2, 3], 1, 18, False),  # W kept: not per-channel
])
def test_one_reduction_matches(op, shape, axes, keep, opset, rewritten):
    graph = _one_reduction(op, shape, axes, keep, opset)
    out, report = per_channel_two_stage(graph)
    assert bool(report.rewritten) == rewritten, report.to_json()
    if not rewritten:
        assert out is graph
        return
    assert topological_problems(out) == []
    assert all(o in out.info for n in out.nodes for o in n.output)
    transposed = [out.info[n.input[0]].numel for n in out.nodes if n.op_type == "Transpose"]
    assert transposed == [shape[0] * shape[1]]  # the [N, C] partials only
    assert_same_sum(graph, out, np.random.default_rng(0).standard_normal(shape).astype(
        np.float32) + 0.5)


def test_sixteen_bit_sums_keep_the_one_stage_form():
    """A float16 sum would round its [N, C] partials to float16: left to the Transpose form."""
    graph = _one_reduction("ReduceSum", [4, 6, 5, 5], [0, 2, 3], 0, 18)
    graph.info["x"] = type(graph.info["x"])(TensorProto.FLOAT16, (4, 6, 5, 5))
    assert per_channel_two_stage(graph)[0] is graph


def test_resnet_step_trains_as_the_transpose_form():
    """A zoo ResNet-18 step with its BatchNorms written for CUDA: every per-channel sum in
    two stages (none left to the Transpose form, no Transpose the size of an activation),
    two training steps within RTOL of the Transpose form's, at 1 and 2 threads; and
    ``for_provider`` takes this form on CUDA."""
    step = build_training_step(load_graph(build_model("resnet18", batch=4, resolution=64,
                                                      width=8)), BuildOptions(optimizer="sgd"))
    expanded, _ = expand_training_batchnorm(step)
    two_stage, report = per_channel_two_stage(expanded)
    transposed, _ = to_trailing_axes(expanded, only=per_channel)
    assert len(report.rewritten) >= 4 * 20  # 20 BatchNorms: two statistics, two gradients
    left = to_trailing_axes(two_stage, only=per_channel)[1].rewritten
    assert left == ["ReduceSum node 'grad/ReduceSum_1': axes [0] of [4, 10] -> Transpose "
                    "[1, 0], ReduceSum over the last 1"]  # the classifier's bias: 2-D
    ref = _two_steps(transposed, 1)
    top = max(float(np.abs(v).max()) for v in ref.values())
    for threads in (1, 2):
        got = _two_steps(two_stage, threads)
        for k, v in ref.items():
            scale = max(float(np.abs(v).max()), 1e-3 * top)
            assert float(np.abs(got[k].astype(np.float64) - v).max()) <= RTOL * scale, k
    # The same bits run after run at 2 and 4 threads (``run_at_threads`` fails otherwise).
    feeds = {k: v for k, v in synthetic_feeds(two_stage, 0).items()
             if k not in two_stage.initializers}
    run_at_threads(two_stage, feeds, threads=(2, 4), repeats=2)
    cuda, _ = for_provider(step, "cuda")
    readers = {}
    for n in cuda.nodes:
        for v in n.input:
            readers.setdefault(v, []).append(n.op_type)
    into_sums = [cuda.info[n.input[0]].shape for n in cuda.nodes if n.op_type == "Transpose"
                 and any(op.startswith("Reduce") for op in readers.get(n.output[0], []))]
    assert into_sums and all(len(s) == 2 and s[0] == 4 for s in into_sums)  # [N, C] only


def _conv3d_bn(tmp_path):
    """x [3, 2, 4, 6, 6] -> Conv 3x3x3 -> training BatchNormalization (BatchNorm3d)."""
    from onnx import numpy_helper
    from onnx_files import write_model

    rng = np.random.default_rng(5)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w", 0.3 * rng.standard_normal((5, 2, 3, 3, 3))), ("scale", 1 + 0.1 * rng.random(5)),
        ("bias", 0.1 * rng.standard_normal(5)), ("mean", np.zeros(5)), ("var", np.ones(5)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv3d", pads=[1] * 6),
             helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"],
                              ["y", "mean_out", "var_out"], name="bn3d", training_mode=1)]
    return write_model(tmp_path / "bn3d.onnx", nodes, [("x", [3, 2, 4, 6, 6])],
                       [("y", [3, 5, 4, 6, 6])], inits)


def test_batchnorm3d_sums_leave_no_leading_axis_reduction(tmp_path):
    """A BatchNorm3d step for CUDA (session 42's sweep: torchvision's r3d_18 kept 80 of its
    per-channel sums, over axes 0, 2, 3 and 4, in ORT's atomic leading-axis form): every
    per-channel sum in two stages, none left leading, the step within RTOL of the step as
    built at 1 and 2 threads (docs/CUDA.md's 1e-4 of each output's largest magnitude for the
    whole step; measured 4.0e-7 here)."""
    step = build_training_step(load_graph(_conv3d_bn(tmp_path)), BuildOptions())
    cuda, _ = for_provider(step, "cuda")
    assert to_trailing_axes(cuda, only=per_channel)[1].rewritten == []
    stages = [n for n in cuda.nodes if n.op_type.startswith("Reduce")
              and len(cuda.info[n.input[0]].shape) == 3]
    assert len(stages) >= 4  # mean, mean of squares, the scale's and the bias's gradients
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    ref = run_at_threads(step, feeds, threads=(1,), repeats=1)[1]
    for threads, got in run_at_threads(cuda, feeds, threads=(1, 2), repeats=1).items():
        for k, v in ref.items():
            scale = max(float(np.abs(v).max()), 1e-6)
            assert float(np.abs(got[k].astype(np.float64) - v).max()) <= 1e-4 * scale, (
                threads, k)
