"""Gradients of shape and selection ops against torch autograd, one op per graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gradcheck import (
    FLOAT,
    INT64,
    check_against_torch,
    grad_graph,
    make_model,
    onnx_grads,
)
from onnx import TensorProto, helper

from memcc.errors import GradientError
from memcc.frontend.gradients.shape_ops import slice_range

RNG = np.random.default_rng(0)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def ints(name: str, values) -> helper.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name, TensorProto.INT64, [len(values)], list(values)))


check = check_against_torch


def test_reshape_transpose_squeeze_unsqueeze_flatten():
    nodes = [
        ints("shape", [3, 8]),
        helper.make_node("Reshape", ["x", "shape"], ["a"]),
        helper.make_node("Transpose", ["a"], ["b"], perm=[1, 0]),
        ints("ax", [1]),
        helper.make_node("Unsqueeze", ["b", "ax"], ["c"]),
        helper.make_node("Squeeze", ["c", "ax"], ["d"]),
        helper.make_node("Flatten", ["d"], ["y"], axis=1),
    ]
    m = make_model(nodes, [("x", FLOAT, [2, 3, 4])], [("y", FLOAT, [8, 3])])
    check(m, {"x": rand(2, 3, 4)}, lambda x: x.reshape(3, 8).T, ["x"])


def test_unsqueeze_axes_attribute_opset11():
    nodes = [helper.make_node("Unsqueeze", ["x"], ["y"], axes=[0, 3])]
    m = make_model(nodes, [("x", FLOAT, [2, 3])], [("y", FLOAT, [1, 2, 3, 1])], opset=11)
    check(m, {"x": rand(2, 3)}, lambda x: x[None, :, :, None], ["x"])


def test_concat_three_inputs():
    nodes = [helper.make_node("Concat", ["a", "b", "c"], ["y"], axis=-1)]
    m = make_model(nodes, [("a", FLOAT, [2, 1]), ("b", FLOAT, [2, 3]), ("c", FLOAT, [2, 2])],
                   [("y", FLOAT, [2, 6])])
    feeds = {"a": rand(2, 1), "b": rand(2, 3), "c": rand(2, 2)}
    check(m, feeds, lambda a, b, c: torch.cat([a, b, c], -1), ["a", "b", "c"])


@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split_unequal_sizes_with_unused_output(opset):
    if opset >= 13:
        nodes = [ints("sizes", [1, 3, 2]),
                 helper.make_node("Split", ["x", "sizes"], ["p", "q", "r"], axis=1)]
    else:
        nodes = [helper.make_node("Split", ["x"], ["p", "q", "r"], axis=1, split=[1, 3, 2])]
    nodes.append(helper.make_node("Mul", ["p", "r"], ["pr"]))  # broadcast [2,1]*[2,2]
    nodes.append(helper.make_node("Concat", ["pr", "p"], ["y"], axis=1))
    m = make_model(nodes, [("x", FLOAT, [2, 6])], [("y", FLOAT, [2, 3])], opset=opset)

    def fn(x):
        p, _, r = torch.split(x, [1, 3, 2], 1)
        return torch.cat([p * r, p], 1)

    check(m, {"x": rand(2, 6)}, fn, ["x"])


def test_split_num_outputs_opset18():
    nodes = [helper.make_node("Split", ["x"], ["p", "q"], axis=0, num_outputs=2),
             helper.make_node("Concat", ["q", "q"], ["y"], axis=0)]
    m = make_model(nodes, [("x", FLOAT, [4, 3])], [("y", FLOAT, [4, 3])], opset=18)
    check(m, {"x": rand(4, 3)}, lambda x: torch.cat([x[2:], x[2:]], 0), ["x"])


def _torch_slice(x, starts, ends, axes, steps):
    for s, e, a, k in zip(starts, ends, axes, steps, strict=True):
        a = a % x.dim()
        idx = torch.tensor(list(slice_range(s, e, k, x.shape[a])), dtype=torch.long)
        x = torch.index_select(x, a, idx)
    return x


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [4], [1], [1]),
    ([0, 5], [3, 0], [0, 2], [1, -2]),
    ([-1, 1], [-100, 6], [1, -1], [-1, 2]),
    ([1, 2, 0], [100, -1, 9], [0, 1, 2], [3, 2, 4]),
    ([4], [-100], [2], [-3]),
])
def test_slice_steps_and_clamping(starts, ends, axes, steps):
    x = rand(4, 5, 7)
    probe = _torch_slice(torch.tensor(x), starts, ends, axes, steps)
    nodes = [ints("st", starts), ints("en", ends), ints("ax", axes), ints("sp", steps),
             helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])]
    m = make_model(nodes, [("x", FLOAT, [4, 5, 7])], [("y", FLOAT, list(probe.shape))])
    check(m, {"x": x}, lambda x: _torch_slice(x, starts, ends, axes, steps), ["x"])


def test_slice_bounds_from_shape_arithmetic():
    """Exporters compute slice ends from Shape: the rule folds them at compile time."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        ints("i1", [1]),
        helper.make_node("Gather", ["shp", "i1"], ["n"], axis=0),
        ints("one", [1]),
        helper.make_node("Sub", ["n", "one"], ["end"]),
        helper.make_node("Slice", ["x", "one", "end", "one"], ["y"]),
    ]
    m = make_model(nodes, [("x", FLOAT, [2, 6])], [("y", FLOAT, [2, 4])])
    check(m, {"x": rand(2, 6)}, lambda x: x[:, 1:5], ["x"])


@pytest.mark.parametrize("opset", [13, 17])
def test_gather_embedding_with_repeats(opset):
    idx = np.array([[1, 3, 1], [0, 9, 1]], dtype=np.int64)
    nodes = [helper.make_node("Gather", ["table", "idx"], ["y"], axis=0)]
    m = make_model(nodes, [("table", FLOAT, [10, 4]), ("idx", INT64, [2, 3])],
                   [("y", FLOAT, [2, 3, 4])], opset=opset)
    feeds = {"table": rand(10, 4), "idx": idx}
    check(m, feeds, lambda table, idx: F.embedding(idx, table), ["table"])


@pytest.mark.parametrize("opset", [13, 17])
def test_gather_negative_indices_inner_axis(opset):
    idx = np.array([[-1, 0], [2, -1], [1, -3]], dtype=np.int64)
    nodes = [helper.make_node("Gather", ["x", "idx"], ["y"], axis=1)]
    m = make_model(nodes, [("x", FLOAT, [2, 3, 4]), ("idx", INT64, [3, 2])],
                   [("y", FLOAT, [2, 3, 2, 4])], opset=opset)
    pos = torch.tensor(idx % 3)
    check(m, {"x": rand(2, 3, 4), "idx": idx}, lambda x, idx: x[:, pos], ["x"])


def test_gather_scalar_constant_index():
    nodes = [helper.make_node("Constant", [], ["i"], value=helper.make_tensor(
                 "i", TensorProto.INT64, [], [-2])),
             helper.make_node("Gather", ["x", "i"], ["y"], axis=1)]
    m = make_model(nodes, [("x", FLOAT, [3, 4])], [("y", FLOAT, [3])])
    check(m, {"x": rand(3, 4)}, lambda x: x[:, -2], ["x"])


def test_gather_elements_with_repeats():
    idx = np.array([[0, 0, 2], [1, -1, 1]], dtype=np.int64)
    nodes = [helper.make_node("GatherElements", ["x", "idx"], ["y"], axis=1)]
    m = make_model(nodes, [("x", FLOAT, [2, 3]), ("idx", INT64, [2, 3])],
                   [("y", FLOAT, [2, 3])])
    pos = torch.tensor(idx % 3)
    check(m, {"x": rand(2, 3), "idx": idx}, lambda x, idx: torch.gather(x, 1, pos), ["x"])


def test_gather_elements_needs_opset16():
    nodes = [helper.make_node("GatherElements", ["x", "idx"], ["y"], axis=0)]
    m = make_model(nodes, [("x", FLOAT, [2, 3]), ("idx", INT64, [2, 3])],
                   [("y", FLOAT, [2, 3])], opset=13)
    with pytest.raises(GradientError, match="opset 16"):
        onnx_grads(m, {"x": rand(2, 3), "idx": np.zeros((2, 3), np.int64)}, ["x"])


def test_expand_and_tile():
    nodes = [ints("shape", [2, 3, 4]),
             helper.make_node("Expand", ["x", "shape"], ["e"]),
             ints("reps", [1, 2, 3]),
             helper.make_node("Tile", ["e", "reps"], ["y"])]
    m = make_model(nodes, [("x", FLOAT, [3, 1])], [("y", FLOAT, [2, 6, 12])])
    check(m, {"x": rand(3, 1)}, lambda x: x.expand(2, 3, 4).repeat(1, 2, 3), ["x"])


def test_pad_constant_with_computed_pads():
    """Pads built the way the TorchScript exporter spells them (Concat of Shape pieces)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shp"]),
        helper.make_node("Size", ["shp"], ["rank"]),
        ints("zero", [0]),
        ints("two", [2]),
        helper.make_node("Unsqueeze", ["rank", "zero"], ["rank1"]),
        helper.make_node("Sub", ["rank1", "two"], ["one"]),  # [1]
        helper.make_node("Concat", ["zero", "one", "two", "zero", "zero", "one"], ["pads"],
                         axis=0),
        helper.make_node("Pad", ["x", "pads"], ["y"], mode="constant"),
    ]
    m = make_model(nodes, [("x", FLOAT, [1, 2, 3])], [("y", FLOAT, [1, 3, 6])])
    check(m, {"x": rand(1, 2, 3)}, lambda x: F.pad(x, (2, 1, 1, 0)), ["x"])


def test_pad_negative_pads_and_value_input():
    nodes = [ints("pads", [0, -1, 2, 1]),
             helper.make_node("Pad", ["x", "pads", "v"], ["y"], mode="constant")]
    m = make_model(nodes, [("x", FLOAT, [2, 4]), ("v", FLOAT, [])], [("y", FLOAT, [4, 4])])
    feeds = {"x": rand(2, 4), "v": np.asarray(0.5, np.float32)}

    def fn(x, v):
        inner = F.pad(x[:, 1:], (0, 1, 0, 2))
        mask = F.pad(torch.ones(2, 3), (0, 1, 0, 2))
        return inner + v * (1 - mask)

    check(m, feeds, fn, ["x", "v"])


@pytest.mark.parametrize("mode", ["reflect", "edge", "wrap"])
def test_pad_reflect_edge_wrap(mode):
    nodes = [ints("pads", [0, 0, 2, 1, 0, 0, 1, 2]),
             helper.make_node("Pad", ["x", "pads"], ["y"], mode=mode)]
    m = make_model(nodes, [("x", FLOAT, [1, 2, 4, 5])], [("y", FLOAT, [1, 2, 7, 8])], opset=19)
    torch_mode = {"reflect": "reflect", "edge": "replicate", "wrap": "circular"}[mode]
    check(m, {"x": rand(1, 2, 4, 5)}, lambda x: F.pad(x, (1, 2, 2, 1), mode=torch_mode), ["x"])


@pytest.mark.parametrize("op,mode", [("DepthToSpace", "DCR"), ("DepthToSpace", "CRD"),
                                     ("SpaceToDepth", None)])
def test_depth_space_rearrangements(op, mode):
    x = rand(2, 8, 2, 3) if op == "DepthToSpace" else rand(2, 2, 4, 6)
    attrs = {"blocksize": 2} | ({"mode": mode} if mode else {})
    node = helper.make_node(op, ["x"], ["y"], **attrs)
    y_shape = [2, 2, 4, 6] if op == "DepthToSpace" else [2, 8, 2, 3]
    m = make_model([node], [("x", FLOAT, list(x.shape))], [("y", FLOAT, y_shape)])
    def fn(x):
        n, c, h, w = x.shape
        if op == "SpaceToDepth":
            t = x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)
            return t.reshape(n, c * 4, h // 2, w // 2)
        if mode == "CRD":
            return F.pixel_shuffle(x, 2)
        t = x.reshape(n, 2, 2, c // 4, h, w).permute(0, 3, 4, 1, 5, 2)
        return t.reshape(n, c // 4, h * 2, w * 2)

    check(m, {"x": x}, fn, ["x"])


def test_trilu_lower_with_k():
    nodes = [helper.make_node("Constant", [], ["k"], value=helper.make_tensor(
                 "k", TensorProto.INT64, [], [1])),
             helper.make_node("Trilu", ["x", "k"], ["y"], upper=0)]
    m = make_model(nodes, [("x", FLOAT, [2, 4, 4])], [("y", FLOAT, [2, 4, 4])], opset=14)
    check(m, {"x": rand(2, 4, 4)}, lambda x: torch.tril(x, 1), ["x"])


# ---------------------------------------------------------------------------- scatters, cumsum
@pytest.mark.parametrize("reduction", ["none", "add"])
def test_scatter_elements_data_and_updates(reduction):
    idx = np.asarray([[0, 2], [1, 0], [2, 1]], np.int64)  # unique per column
    nodes = [helper.make_node("Constant", [], ["idx"], value=helper.make_tensor(
                 "idx", INT64, list(idx.shape), idx.reshape(-1).tolist())),
             helper.make_node("ScatterElements", ["x", "idx", "u"], ["y"], axis=0,
                              reduction=reduction)]
    feeds = {"x": rand(3, 2), "u": rand(3, 2)}
    m = make_model(nodes, [("x", FLOAT, [3, 2]), ("u", FLOAT, [3, 2])], [("y", FLOAT, [3, 2])],
                   opset=18)
    ti = torch.from_numpy(idx)
    if reduction == "add":
        fn = lambda x, u: x.scatter_add(0, ti, u)  # noqa: E731
    else:
        fn = lambda x, u: x.scatter(0, ti, u)  # noqa: E731
    check(m, feeds, fn, ["x", "u"])


def test_scatter_nd_writes_rows():
    idx = np.asarray([[2], [0]], np.int64)
    nodes = [helper.make_node("Constant", [], ["idx"], value=helper.make_tensor(
                 "idx", INT64, [2, 1], idx.reshape(-1).tolist())),
             helper.make_node("ScatterND", ["x", "idx", "u"], ["y"])]
    feeds = {"x": rand(4, 3), "u": rand(2, 3)}
    m = make_model(nodes, [("x", FLOAT, [4, 3]), ("u", FLOAT, [2, 3])], [("y", FLOAT, [4, 3])])

    def fn(x, u):
        y = x.clone()
        y[torch.tensor([2, 0])] = u
        return y

    check(m, feeds, fn, ["x", "u"])


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(exclusive, reverse):
    nodes = [helper.make_node("Constant", [], ["ax"], value=helper.make_tensor(
                 "ax", INT64, [], [1])),
             helper.make_node("CumSum", ["x", "ax"], ["y"], exclusive=exclusive,
                              reverse=reverse)]
    feeds = {"x": rand(2, 5)}
    m = make_model(nodes, [("x", FLOAT, [2, 5])], [("y", FLOAT, [2, 5])])

    def fn(x):
        z = x.flip(1) if reverse else x
        c = z.cumsum(1)
        if exclusive:
            c = c - z
        return c.flip(1) if reverse else c

    check(m, feeds, fn, ["x"])


def test_float_mod():
    # ONNX Mod on floats requires fmod=1 (torch.fmod); both operands get gradients
    feeds = {"a": rand(3, 4) * 5, "b": np.abs(rand(4)) + 0.5}
    nodes = [helper.make_node("Mod", ["a", "b"], ["y"], fmod=1)]
    m = make_model(nodes, [("a", FLOAT, [3, 4]), ("b", FLOAT, [4])], [("y", FLOAT, [3, 4])])
    check(m, feeds, lambda a, b: torch.fmod(a, b), ["a", "b"])


def _topk_model(axis: int, largest: int):
    nodes = [helper.make_node("Constant", [], ["k"], value=helper.make_tensor(
                 "k", INT64, [1], [3])),
             helper.make_node("TopK", ["x", "k"], ["y", "idx"], axis=axis, largest=largest)]
    out_shape = [4, 3] if axis == -1 else [3, 6]
    return make_model(nodes, [("x", FLOAT, [4, 6])], [("y", FLOAT, out_shape)])


@pytest.mark.parametrize("axis,largest", [(-1, 1), (0, 0)])
def test_topk_values(axis, largest):
    """A mixture of experts' router: the top-k values carry the gradient back to the
    positions they came from; the rest get zero. The same bits at 1, 2 and 4 threads."""
    from threads import run_at_threads

    feeds = {"x": rand(4, 6)}
    m = _topk_model(axis, largest)
    check(m, feeds, lambda x: torch.topk(x, 3, dim=axis, largest=bool(largest)).values,
          ["x"])
    runs = run_at_threads(grad_graph(m, ["x"], None, 123), feeds, threads=(1, 2, 4))
    for n, out in runs.items():
        for name, value in out.items():
            np.testing.assert_array_equal(value, runs[1][name], err_msg=f"{name}, {n} threads")
