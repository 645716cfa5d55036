"""Accumulating scatters rewritten for CUDA determinism (passes/providers/deterministic_scatter.py).

The rewrite cannot be run on CUDA here; what can be checked on ORT's CPU provider is that it
computes the same thing, that it is a valid step (execution order, unique names, static
shapes for every new value, no accumulating scatter with repeated targets left), and that
its own result is the same bits at every thread count. Each gradient form memcc emits is
built with many repeated indices: the Gather gradient of a [V, D] table (chunked, with
negative ids), the MaxPool gradient of ResNet's 3x3 stride-2 pool, GatherElements along
either axis, a ScatterND row scatter and constant row ids.

Tolerance: the rewrite adds the updates of one element in another order (a doubling scan,
or window phases, instead of index order), so results differ in the last bits: every
output is held to ``RTOL`` = 1e-5 of its largest magnitude (measured: about 1e-7).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from threads import run_once

import memcc.frontend.gradients.shape_ops as shape_ops
from memcc.backend.runner import synthetic_feeds
from memcc.frontend.autodiff import differentiate
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.emit import Emitter
from memcc.frontend.load import load_graph
from memcc.graph import Graph, topological_problems
from memcc.passes.analysis.liveness import analyze_liveness
from memcc.passes.providers import scatter_emission
from memcc.passes.providers.deterministic_scatter import (
    for_cuda_determinism,
    is_accumulating_scatter,
)
from memcc.step import GRAD_OF_PROP, TrainingStep, node_props
from models import build_model

RTOL = 1e-5
F32, I64 = TensorProto.FLOAT, TensorProto.INT64


def _gradient_graph(nodes, inputs, wrt: str) -> Graph:
    """d ``wrt`` of ``loss`` (ReduceSum of ``y * dy``) as the only output."""
    nodes = [*nodes, helper.make_node("Mul", ["y", "dy"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, t, s)
                                       for n, t, s in inputs],
                          [helper.make_tensor_value_info("loss", F32, [])])
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    grads = differentiate(graph, "loss", [wrt])
    graph.outputs = [Emitter(graph).unary("Identity", grads[wrt])]
    return graph


def _check(graph: Graph, feeds: dict[str, np.ndarray], expect: np.ndarray | None = None
           ) -> tuple[Graph, dict]:
    """Rewrite ``graph``; hold the result to the original (and ``expect``) within RTOL, to
    itself bit for bit at 1 and 2 threads, run twice each; return the rewrite and report."""
    rewritten, report = for_cuda_determinism(graph)
    assert topological_problems(rewritten) == []
    names = [o for n in rewritten.nodes for o in n.output if o]
    assert len(names) == len(set(names))
    node_names = [n.name for n in rewritten.nodes if n.name]
    assert len(node_names) == len(set(node_names))
    for name in names:
        assert name in rewritten.info, f"no static shape for new value {name}"
    left = [n for n in rewritten.nodes if is_accumulating_scatter(n)]
    named = " ".join(report.already + report.left)
    for n in left:  # what the report names as left, and phase scatters (unique targets)
        assert f"'{n.name}'" in named or "phases" in " ".join(report.rewritten), n.name
    original = run_once(graph, feeds, 1)
    first = None
    for threads in (1, 2):
        for _ in range(2):
            got = run_once(rewritten, feeds, threads)
            if first is None:
                first = got
            for k, v in got.items():
                assert np.array_equal(v, first[k]), (threads, k)
    for k, v in original.items():
        scale = float(np.abs(v).max())
        assert float(np.abs(first[k].astype(np.float64) - v).max()) <= RTOL * scale, k
        if expect is not None:
            assert float(np.abs(first[k] - expect).max()) <= RTOL * scale, k
    return rewritten, report


@pytest.mark.parametrize("index_tables", ["constant", "computed", "per_step"])
def test_gather_gradient_chunks_merge_into_one_sorted_scan(monkeypatch, index_tables):
    """The embedding gradient memcc emits (chunked ScatterElements, int32 rows expanded
    along the row), many repeats of one token and negative ids: one rewrite for all chunks,
    equal to np.add.at. The scan's index tables are constants for small steps, computed in
    the graph for large ones, one step at a time for huge ones: all three forms here."""
    monkeypatch.setattr(shape_ops, "SCATTER_CHUNK_BYTES", 4096)
    if index_tables != "constant":
        monkeypatch.setattr(scatter_emission, "_CONST_INDEX_MAX", 8)
    if index_tables == "per_step":
        monkeypatch.setattr(scatter_emission, "_BATCHED_SCAN_BYTES", 8)
    vocab, width, batch, seq = 50, 16, 4, 64
    graph = _gradient_graph([helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)],
                            [("table", F32, [vocab, width]), ("ids", I64, [batch, seq]),
                             ("dy", F32, [batch, seq, width])], "table")
    chunks = sum(is_accumulating_scatter(n) for n in graph.nodes)
    assert chunks > 4
    rng = np.random.default_rng(0)
    ids = rng.integers(-vocab, vocab, (batch, seq))
    ids[:, ::4] = 7
    feeds = {"table": rng.standard_normal((vocab, width)).astype(np.float32),
             "ids": ids.astype(np.int64),
             "dy": rng.standard_normal((batch, seq, width)).astype(np.float32)}
    exact = np.zeros((vocab, width))
    np.add.at(exact, np.mod(ids.reshape(-1), vocab), feeds["dy"].reshape(-1, width))
    rewritten, report = _check(graph, feeds, exact)
    assert len(report.rewritten) == 1 and report.left == []
    assert f"{chunks} chunks merged" in report.rewritten[0]
    assert "256 updates of width 16 into 50" in report.rewritten[0]
    assert not [n for n in rewritten.nodes if is_accumulating_scatter(n)]
    ops = [n.op_type for n in rewritten.nodes]
    assert ("Split" in ops) == (index_tables != "per_step")
    assert ("Range" in ops) == (index_tables != "constant")
    # The chunks' slices and expanded indices are gone with them.
    assert not [n for n in rewritten.nodes if n.op_type == "Expand"
                and rewritten.info[n.output[0]].dtype == TensorProto.INT32]
    # Rewritten nodes keep the provenance of the scatter they replace.
    scatter = next(n for n in graph.nodes if is_accumulating_scatter(n))
    topk = next(n for n in rewritten.nodes if n.op_type == "TopK")
    assert node_props(topk)[GRAD_OF_PROP] == node_props(scatter)[GRAD_OF_PROP]
    # No [tokens, vocabulary] temporary: the predicted peak stays near the original's.
    assert analyze_liveness(rewritten).peak_bytes < 2 * analyze_liveness(graph).peak_bytes


@pytest.mark.parametrize("pool", [(3, 2, 1), (2, 2, 0)], ids=["3x3s2", "2x2s2"])
def test_maxpool_gradient_by_window_phases(pool):
    """ResNet's stem pool (3x3, stride 2, pad 1) on an odd size: 4 phase scatters with
    unique targets. Non-overlapping windows (2x2 stride 2) are left alone."""
    k, s, p = pool
    x_shape = [2, 3, 9, 11]
    pool_node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[k, k], strides=[s, s],
                                 pads=[p] * 4)
    out_hw = [(d + 2 * p - k) // s + 1 for d in x_shape[2:]]
    graph = _gradient_graph([pool_node], [("x", F32, x_shape),
                                          ("dy", F32, x_shape[:2] + out_hw)], "x")
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, x_shape).astype(np.float32)  # ties: argmax picks among equals
    feeds = {"x": x, "dy": rng.standard_normal(x_shape[:2] + out_hw).astype(np.float32)}
    rewritten, report = _check(graph, feeds)
    if k > s:
        assert len(report.rewritten) == 1 and "MaxPool phases 2x2: 4 scatters" in \
            report.rewritten[0]
        assert sum(is_accumulating_scatter(n) for n in rewritten.nodes) == 4
    else:
        assert report.rewritten == [] and "do not overlap" in report.already[0]
        assert rewritten is graph


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_elements_gradient_flat(axis):
    """GatherElements with repeated indices along the axis: flat offsets, rows of width 1."""
    data_shape, idx_shape = [6, 5], ([20, 5] if axis == 0 else [6, 12])
    graph = _gradient_graph([helper.make_node("GatherElements", ["data", "idx"], ["y"],
                                              axis=axis)],
                            [("data", F32, data_shape), ("idx", I64, idx_shape),
                             ("dy", F32, idx_shape)], "data")
    rng = np.random.default_rng(2)
    idx = rng.integers(-data_shape[axis], data_shape[axis], idx_shape)
    feeds = {"data": rng.standard_normal(data_shape).astype(np.float32),
             "idx": idx.astype(np.int64),
             "dy": rng.standard_normal(idx_shape).astype(np.float32)}
    exact = np.zeros(data_shape)
    grid = list(np.indices(idx_shape))
    grid[axis] = np.mod(idx, data_shape[axis])
    np.add.at(exact, tuple(grid), feeds["dy"])
    _, report = _check(graph, feeds, exact)
    assert len(report.rewritten) == 1 and report.rewritten[0].split(": ")[1] == "flat"


def test_scatternd_rows_and_constant_rows():
    """A model's own ScatterND(add) with one index per row, and a scatter whose row ids are
    constants (the plan is then computed at rewrite time: no TopK)."""
    vocab, width, m = 7, 3, 40
    rng = np.random.default_rng(3)
    const_rows = rng.integers(0, vocab, (m, 1)).astype(np.int64)
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
             helper.make_node("ScatterND", ["zeros", "rows", "upd"], ["a"], reduction="add"),
             helper.make_node("Expand", ["crow", "ushape"], ["cidx"]),
             helper.make_node("ScatterElements", ["zeros", "cidx", "upd"], ["b"], axis=0,
                              reduction="add"),
             helper.make_node("Add", ["a", "b"], ["out"])]
    inits = [helper.make_tensor("shape", I64, [2], [vocab, width]),
             helper.make_tensor("ushape", I64, [2], [m, width]),
             helper.make_tensor("crow", I64, [m, 1], const_rows.ravel().tolist())]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("rows", I64, [m, 1]),
                                       helper.make_tensor_value_info("upd", F32, [m, width])],
                          [helper.make_tensor_value_info("out", F32, [vocab, width])], inits)
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    rows = rng.integers(0, vocab, (m, 1)).astype(np.int64)
    upd = rng.standard_normal((m, width)).astype(np.float32)
    exact = np.zeros((vocab, width))
    np.add.at(exact, rows.ravel(), upd)
    np.add.at(exact, const_rows.ravel(), upd)
    rewritten, report = _check(graph, {"rows": rows, "upd": upd}, exact)
    assert len(report.rewritten) == 2, report.rewritten
    assert "constant rows" in report.rewritten[1]
    assert sum(n.op_type == "TopK" for n in rewritten.nodes) == 1


def test_what_is_left_alone_is_named():
    """One update per element (the loss's GatherElements gradient), max, and mul: the
    first two are deterministic as they are; mul is reported as still nondeterministic."""
    nodes = [helper.make_node("ScatterElements", ["d", "i1", "u1"], ["a"], axis=1,
                              reduction="add", name="one_per_row"),
             helper.make_node("ScatterElements", ["a", "i", "u"], ["b"], axis=0,
                              reduction="max", name="maxed"),
             helper.make_node("ScatterElements", ["b", "i", "u"], ["c"], axis=0,
                              reduction="mul", name="multiplied")]
    g = helper.make_graph(nodes, "g", [
        helper.make_tensor_value_info("d", F32, [4, 5]),
        helper.make_tensor_value_info("i1", I64, [4, 1]),
        helper.make_tensor_value_info("u1", F32, [4, 1]),
        helper.make_tensor_value_info("i", I64, [6, 5]),
        helper.make_tensor_value_info("u", F32, [6, 5])],
        [helper.make_tensor_value_info("c", F32, [4, 5])])
    graph = load_graph(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
    rewritten, report = for_cuda_determinism(graph)
    assert rewritten is graph and report.rewritten == []
    assert [line.split("'")[1] for line in report.already] == ["one_per_row", "maxed"]
    assert len(report.left) == 1 and "'multiplied'" in report.left[0] and "mul" in \
        report.left[0]
    assert report.to_json()["left"] == report.left


def _two_steps(graph: Graph, threads: int) -> dict[str, np.ndarray]:
    """Two training steps from the initial state, the second fed the first's new state."""
    feeds = synthetic_feeds(graph, seed=0)
    state = TrainingStep.of(graph).state
    first = run_once(graph, feeds, threads)
    carried = {inp: first[out] for out, inp in state.items()}
    second = run_once(graph, {**feeds, **carried}, threads)
    return {**{f"step1/{k}": v for k, v in first.items()},
            **{f"step2/{k}": v for k, v in second.items()}}


@pytest.mark.parametrize("name,dims,expect", [
    ("gpt2", dict(batch=2, seq_len=32, vocab_size=64, width=32, depth=1, heads=2), "rows"),
    ("resnet18", dict(batch=4, resolution=64, width=8), "MaxPool phases"),
])
def test_zoo_steps_train_the_same(name, dims, expect):
    """Built zoo steps (SGD with momentum): two steps of the rewritten step stay within RTOL
    of the step as built (measured: 2e-6 at most, on a ResNet-18 BatchNorm bias's momentum
    in the second step), and are the same bits at 1 and 2 threads. ResNet-18 at batch 4 and
    64 px: at batch 2 and 32 px its last BatchNorms normalize 2 values per channel, which
    turns the first step's 1e-7 differences into 3e-4 in the second step's gradients."""
    step = build_training_step(load_graph(build_model(name, **dims)),
                               BuildOptions(optimizer="sgd"))
    rewritten, report = for_cuda_determinism(step)
    assert len(report.rewritten) == 1 and expect in report.rewritten[0], report.to_json()
    assert report.left == []
    assert any("extent 1" in line for line in report.already)  # the loss's gradient
    assert topological_problems(rewritten) == []
    ref = _two_steps(step, 1)
    one, two = _two_steps(rewritten, 1), _two_steps(rewritten, 2)
    top = max(float(np.abs(v).max()) for v in ref.values())
    for k, v in ref.items():
        assert np.array_equal(one[k], two[k]), k
        scale = max(float(np.abs(v).max()), 1e-3 * top)
        assert float(np.abs(one[k].astype(np.float64) - v).max()) <= RTOL * scale, k
