"""The differentiation driver itself: unsupported ops, accumulation, non-float paths."""

from __future__ import annotations

import numpy as np
import pytest
from gradcheck import FLOAT, make_model, onnx_grads
from onnx import helper

from memcc.errors import UnsupportedOpError


def test_unsupported_op_names_op_node_and_supported_set():
    m = make_model(
        [helper.make_node("Det", ["x"], ["y"], name="the_det")],
        [("x", FLOAT, [3, 3])], [("y", FLOAT, [])],
    )
    with pytest.raises(UnsupportedOpError) as e:
        onnx_grads(m, {"x": np.eye(3, dtype=np.float32)}, ["x"])
    msg = str(e.value)
    assert "Det" in msg and "the_det" in msg and "Supported ops" in msg
