"""Cast chains ORT removes at session creation are removed at load, so plans match the run.

ORT's own rule is pinned case by case in ``tests/test_ort_facts.py``; here a step with the
chain a transformers BLOOM export writes (attention probabilities cast float -> float twice)
compiles, and ``--verify`` finds ORT running the planned order.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx_files import write_model
from threads import mismatches, run_once

from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.load import load_graph
from memcc.graph import Graph


def _probs_cast_twice(tmp_path):
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="scores"),
             helper.make_node("Softmax", ["h"], ["p"], axis=-1, name="probs"),
             helper.make_node("Cast", ["p"], ["p32"], to=TensorProto.FLOAT, name="cast_a"),
             helper.make_node("Cast", ["p32"], ["p32b"], to=TensorProto.FLOAT, name="cast_b"),
             helper.make_node("MatMul", ["p32b", "w2"], ["logits"], name="out")]
    return write_model(tmp_path / "casts.onnx", nodes, [("x", [64, 16])],
                       [("logits", [64, 4])], [w1, w2])


def test_load_drops_the_chain_and_compile_verifies_the_order(tmp_path):
    path = _probs_cast_twice(tmp_path)
    graph = load_graph(path)
    assert not [n for n in graph.nodes if n.op_type == "Cast"]
    assert [n.input[0] for n in graph.nodes if n.name == "out"] == ["p"]
    result = compile_model(path, CompileOptions(budget="min", cost="analytic", verify=True),
                           output=tmp_path / "out.onnx")
    v = result.report["verification"]
    assert v["ok"] and v["order_matches_plan"], v


def test_the_loaded_step_gives_the_bits_of_the_file_at_1_2_and_4_threads(tmp_path):
    """What load removes ORT removes too, so the outputs cannot change: bit for bit, at
    every thread count, twice each."""
    path = _probs_cast_twice(tmp_path)
    as_written = Graph.from_model(onnx.shape_inference.infer_shapes(onnx.load(str(path))))
    loaded = load_graph(path)
    feeds = {"x": np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32)}
    for threads in (1, 2, 4):
        for _ in range(2):
            assert not mismatches(run_once(as_written, feeds, threads),
                                  run_once(loaded, feeds, threads))
