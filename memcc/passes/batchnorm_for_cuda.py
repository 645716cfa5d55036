"""Training-mode BatchNormalization written so that ONNX Runtime's CUDA provider runs it.

The CUDA provider refuses ``BatchNormalization`` with ``training_mode=1`` at opset 14 and
later when it creates the session: "Training mode does not support BN opset 14 (or higher)
yet" (onnxruntime-gpu 1.31.1 on an H100, measured). Every ``torch.onnx`` export of a
convnet in train mode has such nodes, and so has every step memcc builds from one, so on
CUDA no BatchNorm model would run at all.

On CUDA each such node becomes what its ONNX definition says it computes, in ops the CUDA
provider has kernels for:

- the batch mean, ``ReduceMean`` over every axis but the channels;
- the batch variance (the population one, as the ONNX definition and ORT's CPU kernel
  use), ``ReduceSumSquare`` of the centred input over the count;
- the output, from ``BatchNormalization`` in inference mode fed those statistics: one
  kernel, so the output costs no activation-sized temporaries beyond the centred input,
  which is freed once the variance exists;
- the running statistics, ``input * momentum + batch * (1 - momentum)`` per channel.

The backward needs nothing from the node (memcc's rule recomputes the statistics from the
input, ``frontend/gradients/nn.py``), so it is unchanged. The arithmetic is not the CPU
kernel's, so a step rewritten here matches the step as built within a tolerance, not bit
for bit (``tests/test_batchnorm_for_cuda.py`` states it). Variants of BatchNormalization
(``inverted``, ``bf16_saved``) do not apply to the rewritten nodes: the planner sees
standard ops there.
"""

from __future__ import annotations

import numpy as np
import onnx

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, attr
from memcc.step import Role, tag_node


def is_training_batchnorm(node: onnx.NodeProto, opset: int) -> bool:
    """A BatchNormalization that computes batch statistics (opset 14+, training_mode=1)."""
    return (node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx")
            and opset >= 14 and int(attr(node, "training_mode", 0)) == 1)


def expand_training_batchnorm(graph: Graph) -> tuple[Graph, dict]:
    """A copy of ``graph`` with every training-mode BatchNormalization written as above
    (``graph`` itself when there is none), and a report: how many nodes were rewritten."""
    targets = [n for n in graph.nodes if is_training_batchnorm(n, graph.opset)]
    if not targets:
        return graph, {"batchnorm_rewritten": 0}
    out = graph.copy()
    emit = Emitter(out, detached=True)
    nodes: list[onnx.NodeProto] = []
    for node in out.nodes:
        if not is_training_batchnorm(node, out.opset):
            nodes.append(node)
            continue
        start = len(emit.nodes)
        _emit_batchnorm(emit, node)
        made = emit.nodes[start:]
        for n in made:
            # The running statistics are no ancestors of the loss: the tag keeps them (and
            # every other node here) in the forward pass (TrainingStep.forward).
            tag_node(n, role=Role.FORWARD.value)
        nodes.extend(made)
    out.set_nodes(nodes)
    return out, {"batchnorm_rewritten": len(targets)}


def for_provider(graph: Graph, provider: str) -> tuple[Graph, int]:
    """The step as ``provider`` can run it, and how many BatchNormalization nodes were
    rewritten for it.

    On CUDA also every per-channel sum (BatchNorm's statistics, the gradients of its scale
    and bias: reductions over axes 0, 2, 3 of an NCHW tensor) is written as a transpose and
    a sum over trailing axes (``passes.deterministic_reductions``): ORT's CUDA kernel adds
    leading-axis sums with atomics, and on an H200 the trailing form ran issue 29's
    ResNet-50 step in 321 ms instead of 479 (ResNet-18: 15.1 against 18.4 ms), and gives
    the same bits every run."""
    if provider != "cuda":
        return graph, 0
    rewritten, report = expand_training_batchnorm(graph)
    from memcc.passes.deterministic_reductions import per_channel, to_trailing_axes

    rewritten, _ = to_trailing_axes(rewritten, only=per_channel)
    return rewritten, int(report["batchnorm_rewritten"])


def _emit_batchnorm(emit: Emitter, node: onnx.NodeProto) -> None:
    x, scale, bias, mean_in, var_in = node.input[:5]
    x_info = emit.info(x)
    rank, dtype = len(x_info.shape), x_info.dtype
    channels = int(x_info.shape[1])
    axes = [0] + list(range(2, rank))
    count = float(np.prod([x_info.shape[a] for a in axes]))
    eps = float(attr(node, "epsilon", 1e-5))
    momentum = float(attr(node, "momentum", 0.9))
    stat_dtype = emit.info(mean_in).dtype

    mean = emit.reduce_mean(x, axes, keepdims=True)
    centred = emit.sub(x, mean)
    square_sum = emit.reduce_sum_square(centred, axes, keepdims=False)
    var = emit.cast(emit.mul(square_sum, emit.scalar(1.0 / count, dtype)), stat_dtype)
    batch_mean = emit.cast(emit.reshape(mean, [channels]), stat_dtype)
    emit.op("BatchNormalization", [x, scale, bias, batch_mean, var],
            outputs=[node.output[0]], epsilon=eps, info=x_info)
    if node.name:  # reports and the backward's provenance name the node as it was
        emit.nodes[-1].name = node.name
    for k, (running, batch) in enumerate(((mean_in, batch_mean), (var_in, var)), start=1):
        if len(node.output) > k and node.output[k]:
            kept = emit.mul(running, emit.scalar(momentum, stat_dtype))
            emit.op("Add", [kept, emit.mul(batch, emit.scalar(1.0 - momentum, stat_dtype))],
                    outputs=[node.output[k]], info=emit.info(running))
