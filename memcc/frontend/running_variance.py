"""BatchNorm's running variance updated as PyTorch updates it.

ONNX defines a training-mode BatchNormalization's running variance as ``running * momentum
+ var * (1 - momentum)`` with ``var`` the batch's population variance, and ORT's kernel
computes exactly that. PyTorch's ``BatchNorm`` updates it with the unbiased variance,
``var * n / (n - 1)`` (``n`` the values per channel: batch times the spatial size), and
``torch.onnx`` exports the node without saying so. A PyTorch model trained by memcc would
then come back with a running variance smaller by the factor ``(n - 1) / n`` in each
step's share: nothing in the loss or the gradients shows it, but the module in eval mode
computes something else than the same training in PyTorch (a ``BatchNorm1d`` head over a
batch of 8: 14% in the batch's share).

So for a model PyTorch exported (the file's ``producer_name``, kept by ``load_graph`` as
``memcc.producer``) the step writes PyTorch's update from the kernel's: the node is fed
``running / k`` (``k = n / (n - 1)``) and its output is multiplied by ``k``, which gives
``running * momentum + var * k * (1 - momentum)``: two per-channel Muls. The division comes
before the kernel, not a correction after it that reads ``running`` again, because ORT's
CPU kernel writes its update into the running-statistics input's buffer where another node
reads that input (``tests/test_ort_facts.py``), and the correction read the updated value.
The running mean is the same in both. Other producers keep ONNX's definition (Keras, for
one, updates with the population variance). ``carried_value`` finds the running variance
behind the two Muls for ``memcc export --eval``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo

PRODUCER_KEY = "memcc.producer"
PYTORCH = "pytorch"
# The names of the two Muls (the node names; their outputs may be renamed to ``stat.new``).
FED_SUFFIX = ".unbiased_fed"
UPDATED_SUFFIX = ".unbiased_update"


def follows_pytorch(graph: Graph) -> bool:
    """Whether the model came from ``torch.onnx.export`` (either exporter)."""
    return graph.metadata.get(PRODUCER_KEY) == PYTORCH


def _factor(graph: Graph, node: onnx.NodeProto) -> float | None:
    """``n / (n - 1)`` for the node's input; None where a channel has one value (PyTorch
    refuses to train such a BatchNorm)."""
    shape = graph.info[node.input[0]].shape
    count = int(np.prod([int(d) for i, d in enumerate(shape) if i != 1]))
    return count / (count - 1) if count > 1 else None


def feed_scaled_running_var(graph: Graph, bn_stats) -> int:
    """Feed each training-mode BatchNorm of ``bn_stats`` (node, mean, var) its running
    variance divided by ``k``, in place in ``graph``; return how many. Only for a model
    ``follows_pytorch``; ``scaled_update`` then writes the output back."""
    if not follows_pytorch(graph):
        return 0
    inserts: dict[int, list[onnx.NodeProto]] = {}
    for node, _, var in bn_stats:
        k = _factor(graph, node)
        if k is None or node.input[4] != var:
            continue
        # Names of their own (the build's emitter, made before, does not know them).
        fed, factor = f"{var}{FED_SUFFIX}", f"{var}{FED_SUFFIX}.factor"
        dtype = graph.info[var].dtype
        inserts[id(node)] = [
            onnx.helper.make_node("Constant", [], [factor], name=factor,
                                  value=onnx.helper.make_tensor(factor, dtype, [], [1.0 / k])),
            onnx.helper.make_node("Mul", [var, factor], [fed], name=fed)]
        graph.info[factor] = TensorInfo(dtype, ())
        graph.info[fed] = graph.info[var]
        node.input[4] = fed
    if inserts:
        nodes = []
        for n in graph.nodes:
            nodes.extend(inserts.get(id(n), ()))
            nodes.append(n)
        # In place: the build's emitter appends to this very list.
        graph.nodes[:] = nodes
        graph.set_nodes(graph.nodes)
    return len(inserts)


def scaled_update(emit: Emitter, node: onnx.NodeProto, var: str, updated: str,
                  output: str) -> bool:
    """Write PyTorch's running variance as ``output``, from ``updated``, the node's output
    over the fed ``var / k``; False where ``feed_scaled_running_var`` did not feed this
    node."""
    if node.input[4] == var:
        return False
    k = _factor(emit.graph, node)
    emit.op("Mul", [updated, emit.scalar(k, emit.info(var).dtype)], outputs=[output],
            info=emit.info(var))
    emit.nodes[-1].name = f"{var}{UPDATED_SUFFIX}"
    return True


def carried_value(value: str, producer: Mapping[str, onnx.NodeProto]) -> str:
    """The value behind the two Muls (``value`` itself elsewhere)."""
    node = producer.get(value)
    while node is not None and node.op_type == "Mul" and \
            node.name.endswith((FED_SUFFIX, UPDATED_SUFFIX)):
        value = node.input[0]
        node = producer.get(value)
    return value
