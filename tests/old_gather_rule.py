"""pytest plugin that puts the old, racy Gather gradient back, to check the tests catch it.

``python -m pytest -p tests.old_gather_rule tests/test_threads.py`` must fail (and so must the
zoo and export step tests that run at 2 and 4 threads, most of the time: the race is a
matter of timing). The old rule is one ScatterND(reduction='add') with an index per row,
which ORT's CPU kernel runs on several threads without guarding repeated rows.
"""

from __future__ import annotations

from onnx import TensorProto

import memcc.frontend.gradients.shape_ops as shape_ops
from memcc.graph import TensorInfo


def _scatternd_rows(ctx, indices: str, g: str, rows_shape: list[int]) -> str:
    emit = ctx.emit
    dtype = ctx.info(g).dtype
    idx = shape_ops._positive_indices(ctx, indices, rows_shape[0])
    shape = tuple(ctx.info(idx).shape)
    idx = emit.unsqueeze(idx, [len(shape)], info=TensorInfo(TensorProto.INT64, shape + (1,)))
    zeros = emit.zeros(rows_shape, dtype)
    return emit.op("ScatterND", [zeros, idx, g], reduction="add",
                   info=TensorInfo(dtype, tuple(rows_shape)))


def pytest_configure(config) -> None:
    shape_ops._scatter_rows = _scatternd_rows
