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
``running * momentum + var * k * (1 - momentum)``: two per-channel Muls beside the node. The
division comes before the kernel, not a correction after it that reads ``running`` again,
because ORT's CPU kernel writes its update into the running-statistics input's buffer where
another node reads that input (``tests/test_ort_facts.py``), and the correction read the
updated value. The running mean is the same in both. Other producers keep ONNX's
definition (Keras, for one, updates with the population variance). ``carried_value`` finds
the running variance behind the two Muls (and behind the Casts of a 16-bit step that
computes them in float32) for ``memcc export --eval``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

from memcc.graph import Graph, TensorInfo, behind
from memcc.step import Role, tag_node

PRODUCER_KEY = "memcc.producer"
PYTORCH = "pytorch"
# The names of the two Muls (the node names; their outputs may be renamed to ``stat.new``).
FED_SUFFIX = ".unbiased_fed"
UPDATED_SUFFIX = ".unbiased"


def follows_pytorch(graph: Graph) -> bool:
    """Whether the model came from ``torch.onnx.export`` (either exporter)."""
    return graph.metadata.get(PRODUCER_KEY) == PYTORCH


def _factor(graph: Graph, node: onnx.NodeProto) -> float | None:
    """``n / (n - 1)`` for the node's input; None where a channel has one value (PyTorch
    refuses to train such a BatchNorm)."""
    shape = graph.info[node.input[0]].shape
    count = int(np.prod([int(d) for i, d in enumerate(shape) if i != 1]))
    return count / (count - 1) if count > 1 else None


def unbias_running_var(graph: Graph, bn_stats) -> int:
    """Feed each training-mode BatchNorm of ``bn_stats`` (node, mean, var) its running
    variance divided by ``k`` and multiply what it writes by ``k``, in place in ``graph``
    (both Muls in the forward pass, beside the node, so that nothing outside the forward
    reads the node: a plan that recomputes its output need not run it again for the
    update). Returns how many; none unless the model ``follows_pytorch``. The value
    holding PyTorch's update is ``unbiased_value``'s."""
    if not follows_pytorch(graph):
        return 0
    before: list[onnx.NodeProto] = []
    after: dict[int, list[onnx.NodeProto]] = {}
    for node, _, var in bn_stats:
        k = _factor(graph, node)
        if k is None or node.input[4] != var:
            continue
        info = graph.info[var]
        while len(node.output) < 3:
            node.output.append("")
        if not node.output[2]:
            node.output[2] = f"{var}.scaled"
            graph.info[node.output[2]] = info
        # Names of their own (the build's emitter, made before, does not know them).
        fed, unbiased = f"{var}{FED_SUFFIX}", f"{var}{UPDATED_SUFFIX}"
        before += _scaled(var, 1.0 / k, fed, info)
        after[id(node)] = _scaled(node.output[2], k, unbiased, info)
        for made in (fed, unbiased):
            graph.info[made] = info
            graph.info[f"{made}.factor"] = TensorInfo(info.dtype, ())
        node.input[4] = fed
    if after:
        # The divisions first of all (they read graph inputs alone): a rewrite that moves
        # the node's readers earlier (the stem over batch chunks) still finds them made.
        nodes = list(before)
        for n in graph.nodes:
            nodes.append(n)
            nodes.extend(after.get(id(n), ()))
        # In place: the build's emitter appends to this very list.
        graph.nodes[:] = nodes
        graph.set_nodes(graph.nodes)
    return len(after)


def unbiased_value(node: onnx.NodeProto, var: str) -> str | None:
    """The value holding PyTorch's running variance for a node ``unbias_running_var`` fed
    (None: another node, whose own output is carried)."""
    return f"{var}{UPDATED_SUFFIX}" if node.input[4] == f"{var}{FED_SUFFIX}" else None


def _scaled(value: str, factor: float, output: str, info: TensorInfo) -> list[onnx.NodeProto]:
    """``output = value * factor``, a Constant and a Mul named after ``output``, tagged as
    the forward pass's (the running statistics are no ancestors of the loss)."""
    const = f"{output}.factor"
    nodes = [onnx.helper.make_node("Constant", [], [const], name=const,
                                   value=onnx.helper.make_tensor(const, info.dtype, [],
                                                                 [factor])),
             onnx.helper.make_node("Mul", [value, const], [output], name=output)]
    for n in nodes:
        tag_node(n, role=Role.FORWARD.value)
    return nodes


def carried_value(value: str, producer: Mapping[str, onnx.NodeProto]) -> str:
    """The value behind the two Muls (``value`` itself elsewhere), and behind the Casts
    around them where a 16-bit step computes its BatchNorm (and the Muls) in float32
    between casts for its provider (``passes/providers/sixteen_bit.py``): a float16
    BatchNorm compiled for the CPU reads ``Cast(Cast(Mul(Cast(running_var))))``. The
    value found may then have another element type than ``value``: ``read_as`` gives a
    node that reads it in ``value``'s."""
    return _behind(value, producer)[0]


def _behind(value: str, producer: Mapping[str, onnx.NodeProto]) -> tuple[str, bool]:
    """``carried_value``'s value, and whether the way there passed one of the Muls."""
    value, passed = behind(value, producer, lambda n: n.op_type == "Cast" or (
        n.op_type == "Mul" and n.name.endswith((FED_SUFFIX, UPDATED_SUFFIX))))
    return value, any(n.op_type == "Mul" for n in passed)


def read_as(graph: Graph, value: str, carried: str) -> tuple[str, list[onnx.NodeProto]]:
    """``carried`` as a node that read ``value`` can read it: ``carried`` itself where the
    two have one element type (or either is unknown), else a Cast of it to ``value``'s
    type (named after ``value``) and that Cast, to put before the reader."""
    want, have = graph.info.get(value), graph.info.get(carried)
    if want is None or have is None or want.dtype == have.dtype:
        return carried, []
    name = f"{value}.stored"
    graph.info[name] = TensorInfo(want.dtype, have.shape)
    return name, [onnx.helper.make_node("Cast", [carried], [name], name=name, to=want.dtype)]


def fed_as_stored(graph: Graph) -> Graph:
    """``graph`` with each BatchNormalization reading its running statistics as stored,
    not through the division ``unbias_running_var`` feeds it (a copy; ``graph`` itself
    where there is none). For the forward model ``memcc export`` writes: its outputs do not
    depend on that input in train mode, and built again from that file (whose producer
    export keeps), the step divides once more, as it does for PyTorch's file. A node that
    reads the statistic through Casts (a 16-bit step computing it in float32) reads a Cast
    of the stored value."""
    producer = graph.def_use().producer
    if not any(n.op_type == "BatchNormalization" and any(
            _behind(i, producer)[1] for i in n.input[3:5]) for n in graph.nodes):
        return graph
    out = graph.copy(with_index=False)
    nodes: list[onnx.NodeProto] = []
    for n in out.nodes:
        if n.op_type == "BatchNormalization":
            for k in range(3, min(5, len(n.input))):
                stored, divided = _behind(n.input[k], producer)
                if divided:
                    n.input[k], casts = read_as(out, n.input[k], stored)
                    nodes.extend(casts)
        nodes.append(n)
    out.set_nodes(nodes)
    return out
