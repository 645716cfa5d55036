"""Load-time rewrites of what exporters write (memcc/frontend/canonicalize.py).

Each case builds the exporter's spelling by hand (the dynamo exporter's ``SplitToSequence``
+ ``SequenceAt`` for ``torch.split``, ``CastLike`` for promoted scalars, ``If`` on a shape,
``GatherND`` on the differentiable path), checks that no sequence / ``CastLike`` / ``If`` is
left after ``load_graph``, that the loaded graph computes what the original computes in ORT,
and that gradients match torch autograd.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gradcheck import FLOAT, INT64, check_against_torch, make_model
from onnx import TensorProto, helper

from memcc.errors import InputError, ShapeError
from memcc.frontend.load import load_graph

RNG = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def const(name: str, value, dtype=TensorProto.INT64) -> onnx.NodeProto:
    arr = np.asarray(value)
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, dtype, list(arr.shape), arr.reshape(-1).tolist()))


def run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def assert_same_as_original(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    graph = load_graph(model)
    left = {n.op_type for n in graph.nodes} & {
        "SplitToSequence", "SequenceAt", "SequenceConstruct", "ConcatFromSequence",
        "SequenceLength", "CastLike", "If", "GatherND"}
    assert not left, f"left after load: {left}"
    for a, b in zip(run(model, feeds), run(graph.to_model(), feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_split_to_sequence_with_scalar_split_feeds_sequence_at():
    # torch.split(x, 2, dim=1) as the dynamo exporter writes it (the last chunk is smaller)
    nodes = [
        const("two", 2), const("p0", 0), const("p1", 1), const("plast", -1),
        helper.make_node("SplitToSequence", ["x", "two"], ["seq"], axis=1),
        helper.make_node("SequenceAt", ["seq", "p0"], ["a"]),
        helper.make_node("SequenceAt", ["seq", "p1"], ["b"]),
        helper.make_node("SequenceAt", ["seq", "plast"], ["c"]),
        helper.make_node("Mul", ["a", "b"], ["ab"]),
        helper.make_node("ReduceSum", ["c"], ["cs"], keepdims=1),
        helper.make_node("Add", ["ab", "cs"], ["y"]),
    ]
    model = make_model(nodes, [("x", FLOAT, [3, 5])], [("y", FLOAT, [3, 2])])
    feeds = {"x": rand(3, 5)}
    assert_same_as_original(model, feeds)

    def fn(x):
        a, b, c = torch.split(x, 2, dim=1)
        return a * b + c.sum()

    check_against_torch(model, feeds, fn, ["x"])


def test_split_to_sequence_without_split_drops_the_axis_and_stacks_back():
    # torch.unbind + torch.stack: SplitToSequence(keepdims=0) -> ConcatFromSequence(new_axis)
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0, keepdims=0),
        helper.make_node("SequenceLength", ["seq"], ["n"]),
        helper.make_node("ConcatFromSequence", ["seq"], ["stacked"], axis=-1, new_axis=1),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["stacked", "nf"], ["y"]),
    ]
    model = make_model(nodes, [("x", FLOAT, [3, 4])], [("y", FLOAT, [4, 3])])
    feeds = {"x": rand(3, 4)}
    assert_same_as_original(model, feeds)
    check_against_torch(model, feeds, lambda x: torch.stack(torch.unbind(x, 0), -1) * 3.0,
                        ["x"])


def test_sequence_construct_and_concat():
    nodes = [
        helper.make_node("SequenceConstruct", ["x", "w"], ["seq"]),
        helper.make_node("ConcatFromSequence", ["seq"], ["y"], axis=0),
    ]
    model = make_model(nodes, [("x", FLOAT, [2, 3]), ("w", FLOAT, [1, 3])],
                       [("y", FLOAT, [3, 3])])
    feeds = {"x": rand(2, 3), "w": rand(1, 3)}
    assert_same_as_original(model, feeds)
    check_against_torch(model, feeds, lambda x, w: torch.cat([x, w], 0), ["x", "w"])


def test_castlike_becomes_cast_and_has_a_gradient():
    nodes = [
        const("half", [0.5], TensorProto.DOUBLE),
        helper.make_node("CastLike", ["half", "x"], ["h"]),
        helper.make_node("CastLike", ["x", "x"], ["x2"]),
        helper.make_node("Mul", ["x2", "h"], ["y"]),
    ]
    model = make_model(nodes, [("x", FLOAT, [4])], [("y", FLOAT, [4])])
    feeds = {"x": rand(4)}
    assert_same_as_original(model, feeds)
    check_against_torch(model, feeds, lambda x: x * 0.5, ["x"])


def _if_on(cond_nodes: list[onnx.NodeProto]) -> onnx.ModelProto:
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", FLOAT, None)])
    nodes = cond_nodes + [helper.make_node("If", ["cond"], ["y"], then_branch=then_g,
                                           else_branch=else_g)]
    m = make_model(nodes, [("x", FLOAT, ["batch", 3])], [("y", FLOAT, ["batch", 3])])
    m.ir_version = 8
    return m


@pytest.mark.parametrize("batch,branch", [(2, "then"), (5, "else")])
def test_if_on_a_bound_dimension_is_folded(batch, branch):
    # if x.shape[0] < 4: x * x else: -x  -- fixed once --dim batch=... is bound
    model = _if_on([
        helper.make_node("Shape", ["x"], ["s"]), const("zero", 0), const("four", 4),
        helper.make_node("Gather", ["s", "zero"], ["b"]),
        helper.make_node("Less", ["b", "four"], ["cond"]),
    ])
    graph = load_graph(model, {"batch": batch})
    assert "If" not in {n.op_type for n in graph.nodes}
    x = rand(batch, 3)
    (y,) = run(graph.to_model(), {"x": x})
    np.testing.assert_array_equal(y, x * x if branch == "then" else -x)


def test_if_on_data_is_refused_without_blaming_dims():
    model = _if_on([
        helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
        const("zero", 0.0, TensorProto.FLOAT),
        helper.make_node("Less", ["s", "zero"], ["cond"]),
    ])
    with pytest.raises(InputError, match="condition depends on the input data") as e:
        load_graph(model, {"batch": 2})
    assert "--dim" not in str(e.value)


def test_sequence_position_from_data_is_refused_without_blaming_dims():
    nodes = [
        helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0),
        helper.make_node("ArgMax", ["i"], ["pos"], keepdims=0),
        helper.make_node("SequenceAt", ["seq", "pos"], ["y"]),
    ]
    model = make_model(nodes, [("x", FLOAT, [3, 4]), ("i", FLOAT, [3])],
                       [("y", FLOAT, [1, 4])])
    with pytest.raises((InputError, ShapeError), match="only known at run time") as e:
        load_graph(model)
    assert "--dim" not in " ".join(str(e.value).split()).replace(
        "--dim makes them so only where the bound sizes", "")


@pytest.mark.parametrize("indices", [[[1, 0], [0, 2], [1, 0]], [[-1], [0]]])
def test_gathernd_on_the_gradient_path_repeated_and_negative_indices(indices):
    idx = np.asarray(indices, np.int64)
    nodes = [const("idx", idx), helper.make_node("GatherND", ["x", "idx"], ["y"])]
    k = idx.shape[-1]
    out_shape = [idx.shape[0]] + [2, 3, 4][k:]
    model = make_model(nodes, [("x", FLOAT, [2, 3, 4])], [("y", FLOAT, out_shape)])
    feeds = {"x": rand(2, 3, 4)}
    assert_same_as_original(model, feeds)
    ti = torch.from_numpy(idx)
    check_against_torch(model, feeds, lambda x: x[tuple(ti[:, j] for j in range(k))], ["x"])


def test_gathernd_on_integer_data_is_left_alone():
    nodes = [const("idx", [[1], [0]]), helper.make_node("GatherND", ["m", "idx"], ["y"])]
    model = make_model(nodes, [("m", INT64, [2, 3])], [("y", INT64, [2, 3])])
    graph = load_graph(model)
    assert [n.op_type for n in graph.nodes if n.op_type != "Constant"] == ["GatherND"]


def test_model_local_function_is_inlined_and_differentiated():
    # onnxscript exports keep functions unless inlined: y = scaled_tanh(x) as a local function
    fn = helper.make_function(
        "custom.fns", "scaled_tanh", ["a"], ["b"],
        [helper.make_node("Tanh", ["a"], ["t"]), const("two", 2.0, TensorProto.FLOAT),
         helper.make_node("Mul", ["t", "two"], ["b"])],
        [helper.make_opsetid("", 17)])
    g = helper.make_graph([helper.make_node("scaled_tanh", ["x"], ["y"], domain="custom.fns")],
                          "t", [helper.make_tensor_value_info("x", FLOAT, [3, 2])],
                          [helper.make_tensor_value_info("y", FLOAT, [3, 2])])
    model = helper.make_model(g, functions=[fn], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("custom.fns", 1)])
    model.ir_version = 8
    feeds = {"x": rand(3, 2)}
    assert {n.op_type for n in load_graph(model).nodes} >= {"Tanh", "Mul"}
    check_against_torch(model, feeds, lambda x: torch.tanh(x) * 2.0, ["x"])


@pytest.mark.parametrize("op,opset,fn", [
    ("HardSwish", 17, torch.nn.functional.hardswish),
    ("Mish", 18, torch.nn.functional.mish),
])
def test_ops_without_an_ort_kernel_are_expanded_as_ort_would(op, opset, fn):
    # ORT runs these as their ONNX function body, inlined at session creation under new
    # names after everything else (frontend.ort_kernels): memcc expands them itself, so the
    # graph it plans is the one ORT runs, with the same arithmetic.
    model = make_model([helper.make_node(op, ["x"], ["y"])], [("x", FLOAT, [3, 4])],
                       [("y", FLOAT, [3, 4])], opset=opset)
    graph = load_graph(model)
    assert op not in {n.op_type for n in graph.nodes}
    feeds = {"x": rand(3, 4) * 4}
    for a, b in zip(run(model, feeds), run(graph.to_model(), feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    check_against_torch(model, feeds, lambda x: fn(x), ["x"])


def test_every_dropout_gets_a_fixed_seed_of_its_own():
    # Unseeded, ORT's Dropout draws another mask in every session (test_ort_facts.py), so a
    # step with dropout never gave the same loss twice and --verify could not pass.
    nodes = [const("ratio", 0.5, FLOAT), const("train", True, TensorProto.BOOL),
             helper.make_node("Dropout", ["x", "ratio", "train"], ["a"], name="first"),
             helper.make_node("Dropout", ["a", "ratio", "train"], ["y"], name="second")]
    model = make_model(nodes, [("x", FLOAT, [64])], [("y", FLOAT, [64])])
    graph = load_graph(model)
    seeds = {n.name: [a.i for a in n.attribute if a.name == "seed"]
             for n in graph.nodes if n.op_type == "Dropout"}
    assert all(len(s) == 1 for s in seeds.values()), seeds
    assert seeds["first"] != seeds["second"]
    feeds = {"x": np.ones(64, np.float32)}
    first, again = run(graph.to_model(), feeds), run(graph.to_model(), feeds)
    np.testing.assert_array_equal(first[0], again[0])
    assert 0 < np.count_nonzero(first[0]) < 64
