"""``backend/onnx_file.py``'s staging writes what ``onnx.save_model`` writes, on each path
(one message serialised once; external data over the threshold; tensors already marked
external), so serialising the model once instead of twice changed no file."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx.external_data_helper import set_external_data

from memcc.backend import onnx_file
from memcc.backend.onnx_file import save_model


def _model() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.arange(600, dtype=np.float32).reshape(20, 30), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", 1, [2, 20])],
                              [helper.make_tensor_value_info("y", 1, [2, 30])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_inline_model_is_written_as_save_model_writes_it(tmp_path):
    model = _model()
    save_model(model, tmp_path / "ours.onnx")
    onnx.save_model(model, str(tmp_path / "theirs.onnx"))
    assert (tmp_path / "ours.onnx").read_bytes() == (tmp_path / "theirs.onnx").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.onnx", "theirs.onnx"]


def test_a_model_over_the_threshold_goes_to_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_file, "EXTERNAL_DATA_THRESHOLD", 1000)
    model = _model()
    save_model(model, tmp_path / "big.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    back = onnx.load(str(tmp_path / "big.onnx"))
    np.testing.assert_array_equal(numpy_helper.to_array(back.graph.initializer[0]),
                                  numpy_helper.to_array(_model().graph.initializer[0]))


def test_tensors_marked_external_are_written_by_save_model(tmp_path):
    """A tensor marked external keeps ``save_model``'s handling (its data to its location)."""
    ours, theirs = _model(), _model()
    for m in (ours, theirs):
        set_external_data(m.graph.initializer[0], location="w.bin")
        assert m.graph.initializer[0].data_location == TensorProto.EXTERNAL
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    save_model(ours, tmp_path / "a" / "m.onnx")
    onnx.save_model(theirs, str(tmp_path / "b" / "m.onnx"))
    for name in ("m.onnx", "w.bin"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
