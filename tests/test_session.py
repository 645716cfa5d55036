"""``memcc.backend.session.make_session``: what memcc sets beyond ORT's defaults, and why."""

from __future__ import annotations

import json

import pytest
from onnx import TensorProto, helper

from memcc.backend import session
from memcc.step import PRECISION_KEY


def _relu(precision: str | None = None):
    model = helper.make_model(
        helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if precision is not None:
        helper.set_model_props(model, {PRECISION_KEY: json.dumps({"precision": precision})})
    return model


def test_a_failing_kernel_is_not_retried_on_another_provider():
    """ORT's Python ``run`` retries a failed CUDA run on the CPU (printing only) unless told
    not to: a step measured there would be a CPU figure under a CUDA label."""
    assert session.make_session(_relu(), "cpu")._enable_fallback is False


@pytest.mark.parametrize("precision, env, options, expected", [
    ("fp16", None, None, True),
    ("bf16", None, None, False),
    (None, None, None, False),
    ("fp16", "heuristic", None, False),  # the user chose the search
    ("fp16", None, {"cudnn_conv_algo_search": "EXHAUSTIVE"}, False),
])
def test_float16_steps_leave_cudnn_heuristics_unless_a_search_was_chosen(
        monkeypatch, precision, env, options, expected):
    if env is None:
        monkeypatch.delenv(session.CUDNN_SEARCH_ENV, raising=False)
    else:
        monkeypatch.setenv(session.CUDNN_SEARCH_ENV, env)
    sess = session.make_session(_relu(precision), "cpu")
    settings = session.SessionSettings(cuda_options=options)
    assert session._needs_default_search(sess, settings) is expected
    # A ModelProto is asked before its session exists (no second session for it).
    assert session._needs_default_search(_relu(precision), settings) is expected
