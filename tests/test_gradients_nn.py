"""Gradients of convolution, pooling, normalization and resize ops against torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gradcheck import FLOAT, check_against_torch, grad_graph, make_model, onnx_grads
from onnx import TensorProto, helper

from memcc.errors import GradientError
from memcc.frontend.load import load_graph
from memcc.step import GRAD_OF_PROP, node_props

RNG = np.random.default_rng(1)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def out_shape(model) -> list[int]:
    graph = load_graph(model)
    return list(graph.info[graph.nodes[-1].output[0]].shape)


def single(op: str, inputs: dict[str, np.ndarray], opset: int = 17, outputs=("y",), **attrs):
    """A one-node model whose output shape comes from ONNX shape inference."""
    node = helper.make_node(op, list(inputs), list(outputs), **attrs)
    ins = [(k, FLOAT, list(v.shape)) for k, v in inputs.items()]
    probe = make_model([node], ins, [(outputs[0], FLOAT, None)], opset=opset)
    return make_model([node], ins, [(outputs[0], FLOAT, out_shape(probe))], opset=opset)


check = check_against_torch


# ---------------------------------------------------------------------------- conv
@pytest.mark.parametrize("cin,cout,group,stride,pad,dil,bias", [
    (3, 4, 1, 1, 0, 1, True),      # plain
    (4, 6, 2, 1, 1, 1, False),     # grouped
    (4, 4, 4, 1, 1, 1, True),      # depthwise
    (3, 5, 1, 2, 1, 1, True),      # stride 2 with padding (floor drops a row)
    (2, 3, 1, 1, 2, 2, False),     # dilation
    (4, 8, 2, 2, 1, 2, True),      # everything at once
])
def test_conv2d(cin, cout, group, stride, pad, dil, bias):
    feeds = {"x": rand(2, cin, 8, 7), "w": rand(cout, cin // group, 3, 3)}
    if bias:
        feeds["b"] = rand(cout)
    opset = 13 if bias else 20  # bias reduction spells its axes per opset
    m = single("Conv", feeds, opset=opset, group=group, strides=[stride] * 2, pads=[pad] * 4,
               dilations=[dil] * 2, kernel_shape=[3, 3])

    def fn(x, w, b=None):
        return F.conv2d(x, w, b, stride=stride, padding=pad, dilation=dil, groups=group)

    check(m, feeds, fn, list(feeds))


def test_conv2d_asymmetric_kernel_and_pads():
    feeds = {"x": rand(1, 2, 6, 9), "w": rand(3, 2, 2, 4)}
    m = single("Conv", feeds, strides=[1, 3], pads=[1, 0, 0, 2])
    fn = lambda x, w: F.conv2d(F.pad(x, (0, 2, 1, 0)), w, stride=(1, 3))  # noqa: E731
    check(m, feeds, fn, ["x", "w"])


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER", "VALID"])
def test_conv2d_auto_pad(auto_pad):
    feeds = {"x": rand(1, 2, 8, 8), "w": rand(3, 2, 3, 3)}
    m = single("Conv", feeds, strides=[2, 2], auto_pad=auto_pad)
    # in 8, k 3, s 2 -> out 4, total pad 1: SAME_UPPER puts it at the end.
    torch_pad = {"SAME_UPPER": (0, 1, 0, 1), "SAME_LOWER": (1, 0, 1, 0), "VALID": (0, 0, 0, 0)}
    fn = lambda x, w: F.conv2d(F.pad(x, torch_pad[auto_pad]), w, stride=2)  # noqa: E731
    check(m, feeds, fn, ["x", "w"])


def test_conv1d_and_conv3d():
    feeds = {"x": rand(2, 4, 9), "w": rand(6, 2, 3), "b": rand(6)}
    m = single("Conv", feeds, group=2, strides=[2], pads=[1, 1])
    fn = lambda x, w, b: F.conv1d(x, w, b, stride=2, padding=1, groups=2)  # noqa: E731
    check(m, feeds, fn, list(feeds))
    feeds = {"x": rand(1, 2, 5, 4, 5), "w": rand(3, 2, 3, 2, 3)}
    m = single("Conv", feeds, strides=[2, 1, 2], pads=[1, 0, 1, 1, 0, 1])
    fn = lambda x, w: F.conv3d(x, w, stride=(2, 1, 2), padding=(1, 0, 1))  # noqa: E731
    check(m, feeds, fn, list(feeds))


@pytest.mark.parametrize("cin,cout,spatial,stride", [
    (3, 8, (6, 5), 1),       # fewer channels than pixels, cin < cout: x transposed
    (8, 3, (6, 5), 1),       # cin > cout: the output gradient transposed
    (16, 12, (3, 3), 1),     # more channels than pixels: both flattened
    (4, 6, (7, 6), 2),       # strided (downsample): every other pixel, odd extent
    (5, 4, (9,), 3),         # 1-D
    (3, 4, (3, 4, 5), 2),    # 3-D
])
def test_pointwise_conv_weight_gradient_is_a_matmul(cin, cout, spatial, stride):
    """1x1 convolutions take the MatMul weight gradient (``_pointwise_weight_grad``) in
    each of its three layouts; the backward holds no Conv."""
    nd = len(spatial)
    feeds = {"x": rand(2, cin, *spatial), "w": rand(cout, cin, *[1] * nd), "b": rand(cout)}
    m = single("Conv", feeds, opset=13, strides=[stride] * nd)
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    check(m, feeds, lambda x, w, b: conv(x, w, b, stride=stride), list(feeds))
    g = grad_graph(m, ["w"], None, 123)
    backward = g.nodes[1:]
    assert "MatMul" in {n.op_type for n in backward}
    assert "Conv" not in {n.op_type for n in backward}
    # Activation-sized copies: the smaller operand alone when batched, one of each when flat.
    n, pixels = 2, int(np.prod(out_shape(m)[2:]))
    x_size, gy_size = n * cin * pixels, n * cout * pixels
    copied = sorted(g.info[t.input[0]].numel for t in backward
                    if t.op_type == "Transpose" and g.info[t.input[0]].numel > cin * cout)
    flat = min(cin, cout) >= pixels
    assert copied == (sorted([x_size, gy_size]) if flat else [min(x_size, gy_size)])


def test_pointwise_conv_weight_gradient_is_the_same_at_1_2_and_4_threads():
    """The MatMul and the sum over the batch split work across threads; each thread count,
    run twice, must give the same bits, and every count the same gradient."""
    from threads import run_at_threads

    feeds = {"x": rand(8, 24, 16, 16), "w": rand(40, 24, 1, 1)}
    m = single("Conv", feeds)
    runs = run_at_threads(grad_graph(m, ["x", "w"], None, 123), feeds, threads=(1, 2, 4))
    for n, out in runs.items():
        for name, value in out.items():
            np.testing.assert_allclose(value, runs[1][name], rtol=1e-5, atol=1e-5,
                                       err_msg=f"{name} at {n} threads")


def _views_with_sizes(graph):
    """``graph`` with every Reshape, Flatten and Slice end of the pointwise rule spelled
    with the sizes it resolves to, as the rule wrote them until issue 30's change."""
    out = graph.copy()
    for node in out.nodes:
        if node.op_type not in ("Reshape", "Flatten", "Slice"):
            continue
        name = f"sized_{node.output[0]}"
        if node.op_type == "Slice":
            out.initializers[name] = np.asarray(out.info[node.input[0]].shape[2:], np.int64)
            node.input[2] = name
            continue
        out.initializers[name] = np.asarray(out.info[node.output[0]].shape, np.int64)
        if node.op_type == "Flatten":
            node.op_type = "Reshape"
            del node.attribute[:]
            node.input.append(name)
        else:
            node.input[1] = name
    return out


def test_pointwise_weight_gradients_share_their_shape_constants_and_keep_the_bits():
    """Two 1x1 convolutions of different sizes in each layout (batched with x or with gy
    transposed, flattened, strided) hold one shape constant per kind of view, not one per
    layer (issue 30), and give the same bits as views spelled with sizes, at 1 and 2
    threads."""
    from threads import run_at_threads

    layers = [(3, 8, 1), (8, 3, 1), (48, 44, 1), (4, 6, 2)]  # (cin, cout, stride)
    nodes, ins, feeds, outs = [], [], {}, []
    for i, (cin, cout, stride) in enumerate(layers):
        for j, size in enumerate((6, 4)):
            tag = f"{i}{j}"
            feeds[f"x{tag}"] = rand(2, cin + j, size, size + 1)
            feeds[f"w{tag}"] = rand(cout + j, cin + j, 1, 1)
            nodes.append(helper.make_node("Conv", [f"x{tag}", f"w{tag}"], [f"y{tag}"],
                                          strides=[stride] * 2))
            ins += [(k, FLOAT, list(feeds[k].shape)) for k in (f"x{tag}", f"w{tag}")]
            outs.append(f"y{tag}")
    nodes += [helper.make_node("ReduceSum", [o], [f"s{o}"], keepdims=0) for o in outs]
    nodes.append(helper.make_node("Sum", [f"s{o}" for o in outs], ["y"]))
    model = make_model(nodes, ins, [("y", FLOAT, [])])
    weights = [k for k in feeds if k.startswith("w")]
    g = grad_graph(model, weights, None, 123)
    convs = {n.name for n in g.nodes if n.op_type == "Conv"}
    rule = [n for n in g.nodes if n.metadata_props and node_props(n).get(GRAD_OF_PROP) in convs]
    made = {n.output[0]: n for n in rule if n.op_type == "Constant"}
    shapes = {i for n in rule if n.op_type in ("Reshape", "Slice") for i in n.input[1:]}
    # [0, 0, -1], [0, 0, 1, 1] and the strided Slice's starts, ends, axes and steps.
    assert len(shapes) == 6 and shapes <= set(made), sorted(shapes)
    assert {"Flatten", "FusedMatMul"} & {n.op_type for n in rule} == {"Flatten"}
    runs = run_at_threads(g, feeds, threads=(1, 2))
    sized = run_at_threads(_views_with_sizes(g), feeds, threads=(1, 2))
    for n in (1, 2):
        for name, value in runs[n].items():
            assert np.array_equal(value, sized[n][name]), (n, name)


@pytest.mark.parametrize("group,stride,pad,out_pad,dil", [
    (1, 2, 1, 1, 1),
    (1, 2, 0, 0, 1),
    (2, 2, 1, 0, 1),
    (1, 3, 2, 2, 2),
    (1, 1, 1, 0, 1),
])
def test_conv_transpose2d(group, stride, pad, out_pad, dil):
    feeds = {"x": rand(2, 4, 4, 5), "w": rand(4, 6 // group, 3, 3), "b": rand(6)}
    m = single("ConvTranspose", feeds, group=group, strides=[stride] * 2, pads=[pad] * 4,
               output_padding=[out_pad] * 2, dilations=[dil] * 2)

    def fn(x, w, b):
        return F.conv_transpose2d(x, w, b, stride=stride, padding=pad, output_padding=out_pad,
                                  groups=group, dilation=dil)

    check(m, feeds, fn, list(feeds))


def test_conv_transpose_output_shape_attribute():
    feeds = {"x": rand(1, 2, 3, 3), "w": rand(2, 3, 2, 2)}
    m = single("ConvTranspose", feeds, strides=[2, 2], output_shape=[6, 6])
    fn = lambda x, w: F.conv_transpose2d(x, w, stride=2)  # noqa: E731
    check(m, feeds, fn, list(feeds))


# ---------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("kernel,stride,pad,ceil,dil", [
    (2, 2, 0, False, 1),
    (3, 2, 1, False, 1),
    (3, 2, 1, True, 1),
    (2, 2, 0, True, 1),
    (3, 1, 1, False, 2),
])
def test_maxpool(kernel, stride, pad, ceil, dil):
    feeds = {"x": rand(2, 3, 7, 8)}
    m = single("MaxPool", feeds, kernel_shape=[kernel] * 2, strides=[stride] * 2,
               pads=[pad] * 4, ceil_mode=int(ceil), dilations=[dil] * 2)

    def fn(x):
        return F.max_pool2d(x, kernel, stride, pad, dilation=dil, ceil_mode=ceil)

    check(m, feeds, fn, ["x"])


def test_maxpool_keeps_existing_indices_output_and_opset13():
    feeds = {"x": rand(1, 2, 6, 6)}
    node = helper.make_node("MaxPool", ["x"], ["y", "idx"], kernel_shape=[2, 2], strides=[2, 2])
    m = make_model([node], [("x", FLOAT, [1, 2, 6, 6])], [("y", FLOAT, [1, 2, 3, 3])], opset=13)
    check(m, feeds, lambda x: F.max_pool2d(x, 2, 2), ["x"])


def test_maxpool_overlapping_needs_opset16():
    feeds = {"x": rand(1, 1, 5, 5)}
    m = single("MaxPool", feeds, opset=13, kernel_shape=[3, 3], strides=[2, 2])
    with pytest.raises(GradientError, match="opset 16"):
        onnx_grads(m, feeds, ["x"])


@pytest.mark.parametrize("include_pad", [True, False])
@pytest.mark.parametrize("kernel,stride,pad,ceil", [
    (2, 2, 0, False),
    (3, 2, 1, False),
    (3, 2, 1, True),
    (3, 1, 1, False),
    (3, 2, 0, True),
    (2, 3, 0, True),
])
def test_avgpool(include_pad, kernel, stride, pad, ceil):
    feeds = {"x": rand(2, 3, 7, 8)}
    m = single("AveragePool", feeds, kernel_shape=[kernel] * 2, strides=[stride] * 2,
               pads=[pad] * 4, ceil_mode=int(ceil), count_include_pad=int(include_pad))

    def fn(x):
        return F.avg_pool2d(x, kernel, stride, pad, ceil_mode=ceil,
                            count_include_pad=include_pad)

    check(m, feeds, fn, ["x"])


def test_global_pools():
    feeds = {"x": rand(2, 3, 4, 5)}
    m = single("GlobalAveragePool", feeds)
    check(m, feeds, lambda x: x.mean((2, 3), keepdim=True), ["x"])
    m = single("GlobalMaxPool", feeds)
    check(m, feeds, lambda x: x.amax((2, 3), keepdim=True), ["x"])


# ---------------------------------------------------------------------------- normalization
def _bn_feeds(shape):
    c = shape[1]
    return {"x": rand(*shape), "s": rand(c), "b": rand(c), "m": rand(c),
            "v": np.abs(rand(c)) + 0.5}


@pytest.mark.parametrize("shape,opset", [((4, 3, 2, 3), 15), ((5, 3), 15), ((2, 3, 4), 18)])
def test_batchnorm_training_mode(shape, opset):
    feeds = _bn_feeds(shape)
    node = helper.make_node("BatchNormalization", list(feeds), ["y", "rm", "rv"],
                            training_mode=1, epsilon=1e-3, momentum=0.9)
    ins = [(k, FLOAT, list(v.shape)) for k, v in feeds.items()]
    c = shape[1]
    m = make_model([node], ins, [("y", FLOAT, list(shape))], opset=opset)
    m.graph.value_info.extend([helper.make_tensor_value_info(n, FLOAT, [c]) for n in ("rm", "rv")])

    def fn(x, s, b, m, v):
        return F.batch_norm(x, m.clone(), v.clone(), s, b, training=True, eps=1e-3)

    check(m, feeds, fn, ["x", "s", "b"])


def test_batchnorm_inference_mode():
    feeds = _bn_feeds((2, 3, 4, 4))
    m = single("BatchNormalization", feeds, epsilon=1e-5)

    def fn(x, s, b, m, v):
        return F.batch_norm(x, m, v, s, b, training=False, eps=1e-5)

    check(m, feeds, fn, ["x", "s", "b"])


@pytest.mark.parametrize("axis,bias", [(-1, True), (-2, True), (1, False)])
def test_layernorm(axis, bias):
    x = rand(2, 3, 4, 5)
    norm_shape = x.shape[axis % 4:]
    feeds = {"x": x, "s": rand(*norm_shape)}
    if bias:
        feeds["b"] = rand(*norm_shape)
    m = single("LayerNormalization", feeds, axis=axis, epsilon=1e-5)

    def fn(x, s, b=None):
        return F.layer_norm(x, norm_shape, s, b, eps=1e-5)

    check(m, feeds, fn, list(feeds))


def test_layernorm_reuses_requested_mean_output():
    feeds = {"x": rand(3, 6), "s": rand(6), "b": rand(6)}
    node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mu"], axis=-1)
    m = make_model([node], [(k, FLOAT, list(v.shape)) for k, v in feeds.items()],
                   [("y", FLOAT, [3, 6])])
    check(m, feeds, lambda x, s, b: F.layer_norm(x, (6,), s, b), list(feeds))


def test_instancenorm():
    feeds = {"x": rand(2, 3, 4, 5), "s": rand(3), "b": rand(3)}
    m = single("InstanceNormalization", feeds, epsilon=1e-5)
    check(m, feeds, lambda x, s, b: F.instance_norm(x, weight=s, bias=b, eps=1e-5),
          list(feeds))


# ---------------------------------------------------------------------------- resize
def _resize_model(x, scales, **attrs):
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], **attrs)
    const = helper.make_node("Constant", [], ["scales"], value=helper.make_tensor(
        "scales", 1, [len(scales)], scales))
    y_shape = [int(d * s) for d, s in zip(x.shape, scales, strict=True)]
    return make_model([const, node], [("x", FLOAT, list(x.shape))], [("y", FLOAT, y_shape)])


def test_resize_nearest_2x():
    x = rand(1, 2, 3, 4)
    m = _resize_model(x, [1.0, 1.0, 2.0, 2.0], mode="nearest",
                      coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    check(m, {"x": x}, lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), ["x"])


def test_resize_bilinear_half_pixel():
    x = rand(1, 2, 3, 4)
    m = _resize_model(x, [1.0, 1.0, 2.0, 2.0], mode="linear",
                      coordinate_transformation_mode="half_pixel")
    fn = lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")  # noqa: E731
    check(m, {"x": x}, fn, ["x"])


@pytest.mark.parametrize("size", [(7, 5), (3, 2)])
def test_resize_bicubic_as_torch_writes_it(size):
    """F.interpolate(mode='bicubic') exports as cubic Resize with a=-0.75 (Dinov2)."""
    x = rand(1, 2, 4, 3)
    sizes = helper.make_node("Constant", [], ["sizes"], value=helper.make_tensor(
        "sizes", 7, [4], [1, 2, *size]))
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="cubic",
                            cubic_coeff_a=-0.75, coordinate_transformation_mode="half_pixel")
    m = make_model([sizes, node], [("x", FLOAT, [1, 2, 4, 3])], [("y", FLOAT, [1, 2, *size])])
    fn = lambda x: F.interpolate(x, size=size, mode="bicubic")  # noqa: E731
    check(m, {"x": x}, fn, ["x"])


@pytest.mark.parametrize("auto_pad,crop", [("SAME_UPPER", (0, 6)), ("SAME_LOWER", (1, 7))])
def test_conv_transpose_auto_pad(auto_pad, crop):
    feeds = {"x": rand(1, 2, 3, 3), "w": rand(2, 3, 3, 3)}
    m = single("ConvTranspose", feeds, strides=[2, 2], auto_pad=auto_pad)
    a, b = crop
    fn = lambda x, w: F.conv_transpose2d(x, w, stride=2)[..., a:b, a:b]  # noqa: E731
    check(m, feeds, fn, list(feeds))


def test_resize_nearest_sizes_input_default_modes():
    x = rand(1, 2, 3, 4)
    sizes = helper.make_node("Constant", [], ["sizes"], value=helper.make_tensor(
        "sizes", 7, [4], [1, 2, 6, 8]))
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest")
    m = make_model([sizes, node], [("x", FLOAT, [1, 2, 3, 4])], [("y", FLOAT, [1, 2, 6, 8])])
    check(m, {"x": x}, lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), ["x"])


def test_resize_nearest_uneven_sizes():
    x = rand(1, 1, 3, 4)
    sizes = helper.make_node("Constant", [], ["sizes"], value=helper.make_tensor(
        "sizes", 7, [4], [1, 1, 5, 4]))
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest",
                            coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    m = make_model([sizes, node], [("x", FLOAT, [1, 1, 3, 4])], [("y", FLOAT, [1, 1, 5, 4])])
    check(m, {"x": x}, lambda x: F.interpolate(x, size=(5, 4), mode="nearest"), ["x"])


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_LOWER", count_include_pad=1),
    dict(kernel_shape=[2, 3], strides=[1, 2], pads=[1, 0, 0, 1], count_include_pad=1),
    dict(kernel_shape=[2, 2], strides=[1, 1], dilations=[2, 2], pads=[1, 1, 1, 1]),
    dict(kernel_shape=[3, 2], strides=[2, 2], dilations=[1, 2], ceil_mode=1,
         count_include_pad=1, pads=[1, 1, 1, 1]),
])
def test_avgpool_adjoint_identity(attrs):
    """AveragePool is linear, so sum(y * w) must equal sum(x * dx) for the loss sum(y * w)."""
    x = rand(1, 2, 7, 8)
    m = single("AveragePool", {"x": x}, opset=19, **attrs)
    loss, got = onnx_grads(m, {"x": x}, ["x"])
    assert abs(loss - float((x * got["x"]).sum())) <= 1e-4 * max(1.0, abs(loss))


@pytest.mark.parametrize("mode,ctm,scale", [
    ("linear", "align_corners", 1.5),
    ("linear", "asymmetric", 2.5),
    ("nearest", "half_pixel", 0.5),
    ("nearest", "pytorch_half_pixel", 3.0),
    ("cubic", "asymmetric", 1.5),
])
def test_resize_adjoint_identity(mode, ctm, scale):
    x = rand(1, 2, 4, 6)
    m = _resize_model(x, [1.0, 1.0, scale, scale], mode=mode,
                      coordinate_transformation_mode=ctm)
    loss, got = onnx_grads(m, {"x": x}, ["x"])
    assert abs(loss - float((x * got["x"]).sum())) <= 1e-4 * max(1.0, abs(loss))


def test_conv_transpose1d_asymmetric_pads():
    feeds = {"x": rand(2, 3, 5), "w": rand(3, 2, 4), "b": rand(2)}
    m = single("ConvTranspose", feeds, strides=[2], pads=[1, 2])
    fn = lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2)[..., 1:-2]  # noqa: E731
    check(m, feeds, fn, list(feeds))


# ---------------------------------------------------------------------------- expanded ops
# Opset-21..23 ops without their own rule are expanded at load time into the function body
# their ONNX schema defines (memcc/frontend/function_ops.expand_function_ops).
def _opset_model(op: str, feeds: dict, out_shape, opset: int, **attrs):
    m = make_model([helper.make_node(op, list(feeds), ["y"], **attrs)],
                   [(k, FLOAT, list(v.shape)) for k, v in feeds.items()],
                   [("y", FLOAT, list(out_shape))], opset=opset)
    m.ir_version = 10
    return m


def test_group_normalization_opset21():
    feeds = {"x": rand(2, 4, 3, 3), "s": rand(4), "b": rand(4)}
    m = _opset_model("GroupNormalization", feeds, (2, 4, 3, 3), 21, num_groups=2,
                     epsilon=1e-5)
    check(m, feeds, lambda x, s, b: F.group_norm(x, 2, s, b, 1e-5), list(feeds))


def test_rms_normalization_opset23():
    feeds = {"x": rand(2, 3, 8), "w": rand(8)}
    m = _opset_model("RMSNormalization", feeds, (2, 3, 8), 23, epsilon=1e-6, axis=-1)
    check(m, feeds, lambda x, w: F.rms_norm(x, (8,), w, 1e-6), list(feeds))


def test_rotary_embedding_opset23():
    b, h, s, d = 2, 2, 3, 8
    feeds = {"x": rand(b, h, s, d), "c": rand(b, s, d // 2), "s": rand(b, s, d // 2)}
    m = _opset_model("RotaryEmbedding", feeds, (b, h, s, d), 23)

    def rotate(x, c, s):
        c, s = c[:, None], s[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)

    check(m, feeds, rotate, list(feeds))


def test_mish_opset18():
    feeds = {"x": rand(3, 5)}
    check(_opset_model("Mish", feeds, (3, 5), 18), feeds, lambda x: F.mish(x), ["x"])


IMAGE, C2I_CHANNELS = (7, 6), 3


def _col2im_model(kernel, stride, pad, dilation):
    cols_per = [(IMAGE[i] + 2 * pad[i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
                for i in range(2)]
    cols = [2, C2I_CHANNELS * kernel[0] * kernel[1], cols_per[0] * cols_per[1]]
    nodes = [helper.make_node("Constant", [], ["img"], value=helper.make_tensor(
                 "img", TensorProto.INT64, [2], list(IMAGE))),
             helper.make_node("Constant", [], ["blk"], value=helper.make_tensor(
                 "blk", TensorProto.INT64, [2], list(kernel))),
             helper.make_node("Col2Im", ["cols", "img", "blk"], ["y"], strides=list(stride),
                              pads=[pad[0], pad[1], pad[0], pad[1]], dilations=list(dilation))]
    return make_model(nodes, [("cols", FLOAT, cols)], [("y", FLOAT, [2, C2I_CHANNELS, *IMAGE])],
                      opset=18)


@pytest.mark.parametrize("kernel,stride,pad,dilation", [
    ((3, 3), (1, 1), (1, 1), (1, 1)), ((3, 3), (2, 2), (1, 1), (1, 1)),
    ((2, 3), (2, 1), (0, 1), (1, 2))])
def test_col2im_is_unfolded_back(kernel, stride, pad, dilation):
    """Col2Im (torch's F.fold, VOLO's outlook attention) against torch: its gradient is
    F.unfold of the image's gradient, written as a Conv with one-hot kernels."""
    m = _col2im_model(kernel, stride, pad, dilation)
    shape = [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim]
    cols = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    check(m, {"cols": cols}, lambda cols: F.fold(cols, IMAGE, kernel, dilation=dilation,
                                                   padding=pad, stride=stride), ["cols"])


def _grid_sample_model(align: int, padding: str, opset: int, mode: str = "bilinear"):
    nodes = [helper.make_node("GridSample", ["x", "grid"], ["y"], mode=mode,
                              padding_mode=padding, align_corners=align)]
    return make_model(nodes, [("x", FLOAT, [2, 3, 5, 6]), ("grid", FLOAT, [2, 4, 7, 2])],
                      [("y", FLOAT, [2, 3, 4, 7])], opset=opset)


def _grid_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {"x": rng.standard_normal((2, 3, 5, 6)).astype(np.float32),
            "grid": rng.uniform(-1.2, 1.2, (2, 4, 7, 2)).astype(np.float32)}


@pytest.mark.parametrize("align,padding,opset", [(0, "zeros", 16), (1, "zeros", 16),
                                                 (0, "border", 20), (1, "border", 16)])
def test_grid_sample_bilinear(align, padding, opset):
    """F.grid_sample (a spatial transformer's warp) against torch, for the image and the
    grid, with sampling points inside, on and past the border."""
    m = _grid_sample_model(align, padding, opset, "linear" if opset >= 20 else "bilinear")
    check(m, _grid_feeds(),
          lambda x, grid: F.grid_sample(x, grid, mode="bilinear", padding_mode=padding,
                                        align_corners=bool(align)), ["x", "grid"])


def test_grid_sample_modes_without_a_rule_are_refused_by_node():
    m = _grid_sample_model(0, "zeros", 16, "nearest")
    with pytest.raises(GradientError, match="GridSample with mode bilinear.*mode=nearest"):
        grad_graph(m, ["x", "grid"])


@pytest.mark.parametrize("which", ["grid_sample", "col2im"])
def test_scatter_and_unfold_gradients_are_the_same_at_1_2_and_4_threads(which):
    """GridSample's image gradient scatter-adds into shared positions and Col2Im's is a
    grouped Conv: each thread count, run twice, gives the same bits, and every count the
    same gradient."""
    from threads import run_at_threads

    if which == "grid_sample":
        m, feeds, wrt = _grid_sample_model(0, "zeros", 16), _grid_feeds(), ["x", "grid"]
    else:
        m, feeds, wrt = _col2im_model((3, 3), (2, 2), (1, 1), (1, 1)), None, ["cols"]
        feeds = {"cols": rand(*[d.dim_value for d in
                                m.graph.input[0].type.tensor_type.shape.dim])}
    runs = run_at_threads(grad_graph(m, wrt, None, 123), feeds, threads=(1, 2, 4))
    for n, out in runs.items():
        for name, value in out.items():
            np.testing.assert_array_equal(value, runs[1][name], err_msg=f"{name}, {n} threads")
