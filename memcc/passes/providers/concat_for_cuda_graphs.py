"""Concats of more than 32 inputs as nested Concats, so that a CUDA graph can capture them.

ORT's CUDA Concat hands its kernel the input pointers; while a CUDA graph is being captured it
takes at most 32 of them and fails the run otherwise: "CUDA Concat supports at most 32 inputs
during CUDA Graph capture, but got 49 inputs" (onnxruntime-gpu 1.31.1 on an H200,
2026-11-27). ``memcc.Trainer`` captures the step as a CUDA graph by default, so one such
Concat stops training on its first step. It did on ResNet-50: the weight gradient of its 7x7
stem as a MatMul over patches (``conv_weight_grad_cuda``) concatenates 49 strided views, one
per kernel tap. Exporters write wide Concats too (``torch.cat`` of many tensors).

On CUDA every Concat of more than ``MAX_INPUTS`` inputs gets its first inputs gathered by an
inner Concat on the same axis, as few as bring the outer one down to ``MAX_INPUTS`` (49 inputs:
the first 18 in an inner Concat, then 1 + 31): the fewest elements copied twice. Concat only
moves data, so the output is the same bits; the inner Concat's output is one more value the
planner sees (at most the whole output's size, live from the inner to the outer node).
"""

from __future__ import annotations

import onnx

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo, attr

MAX_INPUTS = 32


def is_wide_concat(node: onnx.NodeProto) -> bool:
    return (node.op_type == "Concat" and node.domain in ("", "ai.onnx")
            and len(node.input) > MAX_INPUTS)


def split_wide_concats(graph: Graph) -> tuple[Graph, dict]:
    """A copy of ``graph`` where no Concat has more than ``MAX_INPUTS`` inputs (``graph``
    itself when none has), and how many Concats were split."""
    if not any(is_wide_concat(n) for n in graph.nodes):
        return graph, {"concats_split": 0}
    out = graph.copy()
    emit = Emitter(out, detached=True)
    nodes: list[onnx.NodeProto] = []
    split = 0
    for node in out.nodes:
        if is_wide_concat(node):
            split += 1
            start = len(emit.nodes)
            inputs = _narrowed(emit, node)
            for made in emit.nodes[start:]:  # the same provenance (role, gradient of)
                made.metadata_props.extend(node.metadata_props)
            nodes.extend(emit.nodes[start:])
            del node.input[:]
            node.input.extend(inputs)
        nodes.append(node)
    out.set_nodes(nodes)
    return out, {"concats_split": split}


def _narrowed(emit: Emitter, node: onnx.NodeProto) -> list[str]:
    """``node``'s inputs with inner Concats in front, at most ``MAX_INPUTS`` of them."""
    axis = int(attr(node, "axis", 0))
    inputs = list(node.input)
    while len(inputs) > MAX_INPUTS:
        head = inputs[:min(MAX_INPUTS, len(inputs) - MAX_INPUTS + 1)]
        inputs = [emit.op("Concat", head, axis=axis, info=_joined(emit, head, axis)),
                  *inputs[len(head):]]
    return inputs


def _joined(emit: Emitter, values: list[str], axis: int) -> TensorInfo | None:
    """The inner Concat's type: the inputs' sizes on ``axis`` added (None where one is not
    known: the planner then reads it as the graph's shape inference gives it)."""
    infos = [emit.graph.info.get(v) for v in values]
    if any(i is None for i in infos):
        return None
    first = infos[0].shape
    k = axis % len(first)
    return TensorInfo(infos[0].dtype,
                      (*first[:k], sum(i.shape[k] for i in infos), *first[k + 1:]))
