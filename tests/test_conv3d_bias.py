"""A Conv3d's zero bias that the dynamo exporter writes as [out_channels, 2]
(frontend/conv3d_bias.py; onnxscript issue 2931).

torch 2.14 and 2.15's dynamo exporter gives ``Conv3d(bias=False)`` a bias of zeros shaped
``Concat(Shape(W)[:1], [2])``; ORT refuses the Conv, and memcc's load failed (session 42,
torchvision's r3d_18 with ``optimize=False``). The file here is that pattern, written by
hand: it loads, the bias input is gone with the nodes that made it, and the step is the
same bits as the step of the same convolution written without a bias, at 1 and 2 threads.
A 2-D convolution's zero bias (``[out_channels]``, valid) is left as exported.
"""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper
from onnx_files import write_model
from threads import mismatches, run_once

from memcc.backend.runner import synthetic_feeds
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph


def _conv(tmp_path, name: str, spatial: int, exported_bias: bool):
    """x -> Conv (3x3 or 3x3x3, 4 -> 6 channels) -> y; with the exporter's zero bias."""
    w = numpy_helper.from_array(np.random.default_rng(2).standard_normal(
        (6, 4, *[3] * spatial)).astype(np.float32), "w")
    nodes, inputs = [], ["x", "w"]
    if exported_bias:
        tail = [2] if spatial == 3 else []  # the 3-D form's copied line; 2-D: [M]
        nodes = [helper.make_node("Shape", ["w"], ["m"], start=0, end=1),
                 helper.make_node("Constant", [], ["tail"], value_ints=tail or [1]),
                 helper.make_node("Concat" if tail else "Expand", ["m", "tail"], ["shape"],
                                  **({"axis": 0} if tail else {})),
                 helper.make_node("Constant", [], ["zero"],
                                  value=numpy_helper.from_array(np.zeros((), np.float32))),
                 helper.make_node("CastLike", ["zero", "x"], ["zero_x"]),
                 helper.make_node("Expand", ["zero_x", "shape"], ["b"])]
        inputs.append("b")
    nodes.append(helper.make_node("Conv", inputs, ["y"], name="conv", pads=[1] * 2 * spatial))
    shape = [2, 4, *[5] * spatial]
    return write_model(tmp_path / f"{name}.onnx", nodes, [("x", shape)],
                       [("y", [2, 6, *shape[2:]])], [w], opset=18)


def test_conv3d_exported_zero_bias_is_dropped(tmp_path):
    exported = load_graph(_conv(tmp_path, "exported", 3, True))
    plain = load_graph(_conv(tmp_path, "plain", 3, False))
    assert [n.op_type for n in exported.nodes] == ["Conv"]
    assert list(exported.nodes[0].input) == ["x", "w"]
    steps = [build_training_step(g, BuildOptions()) for g in (exported, plain)]
    feeds = {k: v for k, v in synthetic_feeds(steps[1], 0).items()
             if k not in steps[1].initializers}
    for threads in (1, 2):
        got, want = (run_once(s, feeds, threads) for s in steps)
        assert mismatches(want, got) == [], threads


def test_conv2d_zero_bias_is_left_as_exported(tmp_path):
    graph = load_graph(_conv(tmp_path, "two_d", 2, True))
    conv = next(n for n in graph.nodes if n.op_type == "Conv")
    assert len(conv.input) == 3
