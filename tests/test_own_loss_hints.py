"""A model that computes its own loss, built without ``--loss none``: what build says.

A twelfth walk-through exported such models as users write them: ``forward(x, labels)``
returning ``cross_entropy(z, labels)`` (a scalar first output), or a dict ``{"logits",
"loss"}`` (the loss second). Build refused them, rightly, but with "needs logits with a
class axis" or "already has a value named 'labels'" and no word of ``--loss none``, or,
with ``--loss none``, without naming the scalar output that comes later.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from memcc import api
from memcc.errors import InputError


def _model(path, *, loss_first: bool, logits_out: bool = True):
    """Gemm logits [4, 5] and a ReduceMean of them standing for the loss, which the
    model takes ``labels`` for (unread: only the names and shapes matter here)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    labels = helper.make_tensor_value_info("labels", TensorProto.INT64, [4])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 5], np.ones(40, np.float32))
    nodes = [helper.make_node("Gemm", ["x", "w"], ["logits"]),
             helper.make_node("ReduceMean", ["logits"], ["own_loss"], keepdims=0)]
    loss = helper.make_tensor_value_info("own_loss", TensorProto.FLOAT, [])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 5])
    outputs = [loss] + ([logits] if logits_out else []) if loss_first else [logits, loss]
    graph = helper.make_graph(nodes, "m", [x, labels], outputs, [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _refusal(path, loss: str) -> str:
    with pytest.raises(InputError) as e:
        api.build(path, path.with_suffix(".step.onnx"), options=api.BuildOptions(loss=loss))
    return str(e.value)


def test_a_scalar_first_output_is_told_to_build_with_loss_none(tmp_path):
    text = _refusal(_model(tmp_path / "m.onnx", loss_first=True, logits_out=False),
                    "cross-entropy")
    assert "'own_loss' has shape []" in text and "build with --loss none" in text
    api.build(tmp_path / "m.onnx", tmp_path / "s.onnx", options=api.BuildOptions(loss="none"))


def test_a_model_taking_its_own_labels_is_told_of_loss_none_and_its_scalar_output(tmp_path):
    path = _model(tmp_path / "m.onnx", loss_first=False)
    text = _refusal(path, "cross-entropy")
    assert "already has a value named 'labels': an input of the model" in text
    assert "--loss none" in text and "its output 'own_loss' is a scalar" in text
    text = _refusal(path, "none")
    assert "'logits' has shape [4, 5]; its output 'own_loss' is a scalar" in text
    assert "with it first" in text


def test_logits_first_without_labels_input_is_not_told_of_an_own_loss(tmp_path):
    """A classifier with a second, scalar output builds with cross-entropy as before."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 5], np.ones(40, np.float32))
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w"], ["logits"]),
         helper.make_node("ReduceMean", ["logits"], ["aux"], keepdims=0)], "m", [x],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [4, 5]),
         helper.make_tensor_value_info("aux", TensorProto.FLOAT, [])], [w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              tmp_path / "c.onnx")
    api.build(tmp_path / "c.onnx", tmp_path / "s.onnx")
