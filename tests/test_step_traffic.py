"""``passes.analysis.step_traffic``: kernels and bytes moved per step (issue 30, item 5), and the
compile report's counts of them for the step as built and the plan's rewritten step."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper

from memcc.compiler import CompileOptions, compile_model
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.step_traffic import step_traffic
from models import build_model

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _graph(nodes: list[onnx.NodeProto], outputs: list[str]) -> Graph:
    """x [2, 3] float -> ...; every value typed by hand (24 bytes a float [2, 3] / [6])."""
    info = {"x": TensorInfo(F, (2, 3)), "a": TensorInfo(F, (2, 3)), "shp": TensorInfo(I64, (1,)),
            "r": TensorInfo(F, (6,)), "w": TensorInfo(F, (6,)), "y": TensorInfo(F, (6,)),
            "s": TensorInfo(I64, (2,))}
    return Graph(nodes=nodes, inputs=["x", "w"], outputs=outputs, initializers={}, info=info)


def _shape_const() -> onnx.NodeProto:
    return helper.make_node("Constant", [], ["shp"],
                            value=helper.make_tensor("v", I64, [1], [6]))


def test_bytes_of_a_hand_made_step_are_the_hand_sum():
    g = _graph([_shape_const(),
                helper.make_node("Neg", ["x"], ["a"]),             # 24 read + 24 written
                helper.make_node("Reshape", ["a", "shp"], ["r"]),  # aliases a: 0
                helper.make_node("Mul", ["r", "w"], ["y"])],       # 24 + 24 read, 24 written
               ["y"])
    t = step_traffic(g)
    assert t.kernels == 3  # the Constant never runs
    assert t.bytes_moved == 48 + 0 + 72
    assert t.by_op["Reshape"].kernels == 1 and t.by_op["Reshape"].bytes_moved == 0
    assert t.by_op["Mul"].bytes_moved == 72 and list(t.by_op)[0] == "Mul"  # most bytes first
    assert t.unsized_values == 0
    assert t.to_json()["by_op"]["Neg"] == {"kernels": 1, "bytes_moved": 48}
    # A node list with the graph's types gives the same answer.
    assert step_traffic(g.nodes, info=g.info, outputs=g.outputs) == t


def test_a_view_into_a_graph_output_copies_and_shape_reads_no_data():
    g = _graph([_shape_const(),
                helper.make_node("Reshape", ["x", "shp"], ["r"]),  # graph output: a copy
                helper.make_node("Shape", ["x"], ["s"])],          # 16 bytes written only
               ["r", "s"])
    t = step_traffic(g)
    assert (t.kernels, t.bytes_moved) == (2, 24 + 24 + 16)
    assert t.by_op["Reshape"].bytes_moved == 48 and t.by_op["Shape"].bytes_moved == 16


def test_an_untyped_value_is_counted_as_unsized():
    g = _graph([helper.make_node("Neg", ["x"], ["mystery"])], ["mystery"])
    t = step_traffic(g)
    assert (t.kernels, t.bytes_moved, t.unsized_values) == (1, 24, 1)
    with pytest.raises(TypeError, match="info="):
        step_traffic(g.nodes)


def test_a_zoo_step_counts_every_node_but_constants():
    g = build_training_step(load_graph(build_model("mlp", batch=4, depth=2)), BuildOptions())
    t = step_traffic(g)
    constants = sum(n.op_type == "Constant" for n in g.nodes)
    assert constants > 0 and t.kernels == len(g.nodes) - constants
    assert sum(o.kernels for o in t.by_op.values()) == t.kernels
    assert sum(o.bytes_moved for o in t.by_op.values()) == t.bytes_moved
    # At least every Gemm's weight is read once: bytes are of the step's tensors.
    weights = sum(g.info[n.input[1]].nbytes for n in g.nodes if n.op_type == "Gemm")
    assert t.bytes_moved > weights > 0
    assert t.unsized_values == 0


def test_a_plan_that_recomputes_launches_more_kernels(tmp_path):
    """Recompute clones are kernels too: the report's plan counts exceed its baseline's, and
    both are the analysis of the steps compile judged (the rewritten one is written)."""
    path = tmp_path / "mlp.onnx"
    onnx.save(build_model("mlp", batch=512, depth=4, width=64, in_features=32), str(path))
    result = compile_model(path, CompileOptions(budget="min", cost="analytic"))
    base, plan = result.report["baseline"], result.report["plan"]
    assert plan["recomputed_nodes"], "the smallest plan of this MLP recomputes"
    assert plan["kernels"] > base["kernels"]
    assert plan["bytes_moved"] > base["bytes_moved"]
    written = step_traffic(result.graph)
    assert (plan["kernels"], plan["bytes_moved"]) == (written.kernels, written.bytes_moved)
    built = result.outcome.baseline.graph
    assert base["kernels"] == sum(n.op_type != "Constant" for n in built.nodes)
    assert base["bytes_moved"] == step_traffic(built).bytes_moved
    assert plan["kernels"] == sum(n.op_type != "Constant" for n in result.graph.nodes)


def test_swap_copies_are_kernels_that_move_their_value_twice():
    """An offloaded value gets a copy out and a copy back: two more kernels, each reading
    and writing the value (``passes/lowering/swap.py``)."""
    from memcc.passes.lowering.lower import lower
    from memcc.passes.plan import Offload, Plan, StepStructure

    g = build_training_step(load_graph(build_model("mlp", batch=4, depth=2)), BuildOptions())
    st = StepStructure.of(g)
    value = sorted(st.saved)[0]
    swapped = lower(g, Plan(offload={value: Offload()}), st).graph
    before, after = step_traffic(g), step_traffic(swapped)
    assert after.kernels == before.kernels + 2
    assert after.bytes_moved == before.bytes_moved + 4 * g.info[value].nbytes
    assert after.by_op["MemcpyToHost"].kernels == after.by_op["MemcpyFromHost"].kernels == 1
