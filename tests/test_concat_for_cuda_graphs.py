"""Concats of more than 32 inputs nested for CUDA graph capture
(passes/providers/concat_for_cuda_graphs.py).

ORT's CUDA Concat refuses more than 32 inputs while a CUDA graph is captured, which stopped
ResNet-50's step on an H200 (its 7x7 stem's weight gradient as patches concatenates 49
views). Concat only moves data, so the nested form must give the same bits: checked on the
CPU provider at 1 and 2 threads. That the CUDA provider captures it needs a GPU
(``benchmarks/gpu_session.sh``, phase ``peers``).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx_files import write_model
from test_conv_weight_grad_cuda import _conv_step
from threads import mismatches, run_once

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.load import load_graph
from memcc.graph import topological_problems
from memcc.passes.providers.concat_for_cuda_graphs import MAX_INPUTS, split_wide_concats
from memcc.passes.providers.conv_weight_grad_cuda import conv_weight_grads_as_patches
from memcc.passes.providers.provider_step import for_provider


def _widest(graph) -> int:
    return max((len(n.input) for n in graph.nodes if n.op_type == "Concat"), default=0)


@pytest.mark.parametrize("count, axis, inner", [
    (49, 0, 1),     # the stem's taps: 18 gathered, then 1 + 31
    (33, -1, 1),    # one over: 2 gathered
    (100, 1, 3),    # past 2 x 32: inner Concats nest in turn
    (32, 0, 0),     # at the limit: left alone
])
def test_wide_concat_gives_the_same_bits(tmp_path, count, axis, inner):
    nodes = [helper.make_node("Concat", [f"x{i}" for i in range(count)], ["y"], name="cat",
                              axis=axis)]
    shape = [2, 3, 4]
    out = list(shape)
    out[axis] *= count
    graph = load_graph(write_model(tmp_path / "cat.onnx", nodes,
                                   [(f"x{i}", shape) for i in range(count)], [("y", out)]))
    split, summary = split_wide_concats(graph)
    assert summary["concats_split"] == (1 if inner else 0)
    assert sum(n.op_type == "Concat" for n in split.nodes) == 1 + inner
    assert _widest(split) <= MAX_INPUTS
    assert not topological_problems(split)
    assert all(o in split.info and split.info[o].shape for n in split.nodes for o in n.output)
    feeds = synthetic_feeds(graph, 0)
    for threads in (1, 2):
        assert not mismatches(run_once(graph, feeds, threads), run_once(split, feeds, threads))


def test_stem_patches_for_cuda_have_no_concat_over_the_limit(tmp_path):
    """The case the GPU found: a 7x7 stem's weight gradient as patches (49 taps), through
    the provider step as compile, run and train make it; the step's outputs bit for bit as
    the patches form before nesting, at 1 and 2 threads."""
    step = _conv_step(tmp_path, 3, (30, 30), 8, 7, 2, 3)  # 3@30x30, 7x7 s2 p3: 49 taps
    patched, _ = conv_weight_grads_as_patches(step, min_pixels=1)
    assert _widest(patched) == 49
    cuda, summary = for_provider(step, "cuda")
    assert summary["concats_split"] == 1 and _widest(cuda) <= MAX_INPUTS
    nested, _ = split_wide_concats(patched)
    feeds = {k: v for k, v in synthetic_feeds(step, 0).items() if k not in step.initializers}
    for threads in (1, 2):
        a, b = run_once(patched, feeds, threads), run_once(nested, feeds, threads)
        assert not mismatches(a, b)
        assert np.isfinite(sum(float(np.sum(v)) for v in b.values()))
    cpu, cpu_summary = for_provider(step, "cpu")
    assert "concats_split" not in cpu_summary

