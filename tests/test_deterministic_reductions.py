"""Leading-axis reductions as trailing-axis ones (passes/providers/deterministic_reductions.py).

Checked on ORT's CPU provider: the rewrite computes the same sums (in another order: held to
RTOL = 1e-5 of the largest magnitude, as the scatter rewrite), keeps a valid step with
shapes for every new value, and leaves trailing-axis reductions alone. Whether ORT's CUDA
column form is deterministic is for benchmarks/cuda_determinism.py to measure.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from test_deterministic_scatter import RTOL, _two_steps
from threads import run_once

from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import topological_problems
from memcc.passes.providers.deterministic_reductions import to_trailing_axes
from models import build_model

F32 = TensorProto.FLOAT


@pytest.mark.parametrize("op,shape,axes,keep,rewritten", [
    ("ReduceSum", [8, 16, 24], [0, 1], 0, True),        # a bias gradient
    ("ReduceSum", [8, 16, 24], [0, 1], 1, True),
    ("ReduceMean", [4, 6, 5, 5], [0, 2, 3], 1, True),   # BatchNorm statistics
    ("ReduceSumSquare", [4, 6, 5, 5], [0, 2, 3], 0, True),
    ("ReduceSum", [1, 16, 24], [1], 1, True),           # size-1 axes do not count
    ("ReduceMean", [8, 16, 24], [2], 1, False),         # LayerNorm: trailing already
    ("ReduceSum", [8, 1, 24], [0, 1], 0, True),
    ("ReduceSum", [8, 16, 1], [1, 2], 1, False),
])
def test_rewrite_matches(op, shape, axes, keep, rewritten):
    opset = 18
    nodes = [helper.make_node(op, ["x", "axes"], ["y"], keepdims=keep, name="r")]
    out_shape = [1 if a in axes else d for a, d in enumerate(shape)] if keep else \
        [d for a, d in enumerate(shape) if a not in axes]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, shape)],
                          [helper.make_tensor_value_info("y", F32, out_shape)],
                          [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)])
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]))
    out, report = to_trailing_axes(graph)
    assert bool(report.rewritten) == rewritten, report.to_json()
    assert (out is graph) == (not rewritten)
    assert topological_problems(out) == []
    assert all(o in out.info for n in out.nodes for o in n.output)
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    ref, got = run_once(graph, {"x": x}, 1)["y"], run_once(out, {"x": x}, 2)["y"]
    assert got.shape == ref.shape
    assert float(np.abs(got.astype(np.float64) - ref).max()) <= RTOL * float(np.abs(ref).max())
    if rewritten:
        assert [n.name for n in out.nodes if n.name == "r"] == ["r"]  # the name stays


def test_gpt2_step():
    """Every bias gradient of a zoo GPT-2 step is a leading-axis ReduceSum; the rewritten
    step trains the same within RTOL over two steps."""
    step = build_training_step(load_graph(build_model(
        "gpt2", batch=2, seq_len=32, vocab_size=64, width=32, depth=1, heads=2)),
        BuildOptions(optimizer="sgd"))
    out, report = to_trailing_axes(step)
    assert len(report.rewritten) >= 6 and report.left == []
    ref, got = _two_steps(step, 1), _two_steps(out, 1)
    top = max(float(np.abs(v).max()) for v in ref.values())
    for k, v in ref.items():
        scale = max(float(np.abs(v).max()), 1e-3 * top)
        assert float(np.abs(got[k].astype(np.float64) - v).max()) <= RTOL * scale, k


@pytest.mark.parametrize("op,shape,axes,keep,rewritten", [
    ("ReduceSum", [4, 6, 5, 5], [0, 2, 3], 1, True),    # a BatchNorm bias gradient
    ("ReduceMean", [4, 6, 5, 5], [0, 2, 3], 1, True),   # BatchNorm statistics
    ("ReduceSum", [4, 6, 1, 1], [0, 2, 3], 0, True),    # H*W of 1: one MatMul
    ("ReduceSumSquare", [4, 6, 5, 5], [0, 2, 3], 1, False),  # left to the transpose form
    ("ReduceSum", [4, 6, 5, 5], [0, 2], 1, False),      # not every axis but the channels
])
def test_per_channel_sums_by_matmul_match(op, shape, axes, keep, rewritten):
    """The per-channel sums CUDA runs as MatMuls by ones compute the same sums (in another
    order: within RTOL), at one and two threads, and keep the node's name."""
    from memcc.passes.providers.deterministic_reductions import per_channel_by_matmul

    nodes = [helper.make_node(op, ["x", "axes"], ["y"], keepdims=keep, name="r")]
    out_shape = [1 if a in axes else d for a, d in enumerate(shape)] if keep else \
        [d for a, d in enumerate(shape) if a not in axes]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F32, shape)],
                          [helper.make_tensor_value_info("y", F32, out_shape)],
                          [helper.make_tensor("axes", TensorProto.INT64, [len(axes)], axes)])
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    out, report = per_channel_by_matmul(graph)
    assert bool(report.rewritten) == rewritten, report.to_json()
    if not rewritten:
        assert out is graph
        return
    assert "MatMul" in [n.op_type for n in out.nodes]
    assert "Transpose" not in [n.op_type for n in out.nodes]
    assert topological_problems(out) == []
    assert_same_sum(graph, out, np.random.default_rng(0).standard_normal(shape).astype(
        np.float32))


def assert_same_sum(graph, out, x: np.ndarray) -> None:
    """``out``'s ``y`` within RTOL of ``graph``'s (at 1 thread) at 1 and 2 threads, and the
    rewritten node's name (``r``) kept."""
    ref = run_once(graph, {"x": x}, 1)["y"]
    for threads in (1, 2):
        got = run_once(out, {"x": x}, threads)["y"]
        assert got.shape == ref.shape
        assert float(np.abs(got.astype(np.float64) - ref).max()) <= RTOL * float(
            np.abs(ref).max())
    assert [n.name for n in out.nodes if n.name == "r"] == ["r"]
