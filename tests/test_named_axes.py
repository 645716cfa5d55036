"""memcc/trainer/named_axes.py: the exported model's named axes, checked by a run."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from memcc.trainer.named_axes import with_named_axes


def _relu(out_axis: str) -> onnx.ModelProto:
    """A step's forward model: the input at its built size, the output's first axis left
    as the exporter named it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [out_axis, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                             ir_version=8)


def test_an_output_axis_only_the_exporter_named_is_not_checked():
    """TorchScript names an output's axis itself ('MatMullogits_dim_0') where the user's
    dynamic_axes named the inputs' only: the check has no size for it, and the model keeps
    the input's axis (it crashed with a KeyError in a walk-through's export)."""
    axes = {"x": ["batch", None], "y": ["MatMullogits_dim_0", None]}
    model, said = with_named_axes(_relu("MatMullogits_dim_0"), axes)
    assert said is None
    dims = [d.dim_param or d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", 3]
