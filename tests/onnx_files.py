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


def with_dropout(model, ratio: float = 0.1):
    """``model`` (an ONNX ModelProto) with a training-mode Dropout after every Relu, as a
    PyTorch ``nn.Dropout(ratio)`` exports: the ratio and the mode are constants."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    g.initializer.extend([helper.make_tensor("dropout.ratio", TensorProto.FLOAT, [], [ratio]),
                          helper.make_tensor("dropout.train", TensorProto.BOOL, [], [True])])
    nodes = []
    for n in g.node:
        nodes.append(n)
        if n.op_type == "Relu":
            y = n.output[0]
            n.output[0] = f"{y}.pre_dropout"
            nodes.append(helper.make_node("Dropout", [n.output[0], "dropout.ratio",
                                                     "dropout.train"], [y],
                                          name=f"{n.name}.dropout"))
    del g.node[:]
    g.node.extend(nodes)
    return out
