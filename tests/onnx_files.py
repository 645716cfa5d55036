"""Small hand-built ONNX models written to files, as a user's export would arrive."""

from __future__ import annotations

from pathlib import Path

from onnx import TensorProto, helper


def write_model(path: Path, nodes, inputs, outputs, inits=(), *, opset: int = 17) -> Path:
    """``inputs`` / ``outputs``: (name, shape) pairs of float tensors."""
    g = helper.make_graph(
        nodes, path.stem,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    path.write_bytes(m.SerializeToString())
    return path

