"""A 3-D convolution's zero bias that the dynamo exporter wrote with the wrong shape, dropped.

torch.onnx's dynamo exporter (onnxscript's torchlib ``aten_conv3d``, torch 2.14 and 2.15)
gives a ``Conv3d(bias=False)`` a bias of zeros anyway, shaped ``Concat(Shape(W)[:1], [2])``:
``[out_channels, 2]``, a line copied from the complex form (onnxscript issue 2931). ONNX's
Conv takes a bias of ``[out_channels]`` only, so ORT refuses the node at run time and memcc's
load, which runs the model for the shapes inference leaves out, failed with a message that
sent the user after ``--dim`` (session 42: torchvision's ``r3d_18``, ``optimize=False``).

The bias is zeros whatever its shape, and a Conv without a bias adds nothing, so the bias
input is removed where it is an ``Expand`` of a zero scalar (a Constant, possibly through
the exporter's ``CastLike``) feeding a Conv of a rank-5 weight: the convolution the user
wrote. The nodes that computed it are removed when nothing else reads them. 1-D and 2-D
convolutions' zero biases (``[out_channels]``, valid) are left as exported.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

_DEFAULT = ("", "ai.onnx")


def _zero_scalar(name: str, producer: dict[str, onnx.NodeProto]) -> bool:
    """Whether ``name`` is a one-element Constant of zero, possibly through CastLike."""
    node = producer.get(name)
    if node is not None and node.op_type == "CastLike":
        node = producer.get(node.input[0])
    if node is None or node.op_type != "Constant" or node.domain not in _DEFAULT:
        return False
    value = next((a for a in node.attribute if a.name == "value"), None)
    if value is None:
        return False
    array = numpy_helper.to_array(value.t)
    return array.size == 1 and not np.any(array)


def drop_zero_conv3d_bias(model: onnx.ModelProto) -> list[str]:
    """Rewrite ``model``'s main graph in place (module docstring); the Convs changed."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    ranks = {t.name: len(t.dims) for t in graph.initializer}
    changed, dropped = [], []
    for node in graph.node:
        if (node.op_type != "Conv" or node.domain not in _DEFAULT or len(node.input) < 3
                or ranks.get(node.input[1]) != 5):
            continue
        bias = producer.get(node.input[2])
        if bias is None or bias.op_type != "Expand" or not _zero_scalar(bias.input[0],
                                                                        producer):
            continue
        dropped.append(node.input[2])
        del node.input[2]
        changed.append(node.name or node.output[0])
    if dropped:
        _remove_unread(graph, dropped, producer)
    return changed


def _remove_unread(graph: onnx.GraphProto, values: list[str],
                   producer: dict[str, onnx.NodeProto]) -> None:
    """Remove the producers of ``values`` and, in turn, of their inputs, each once none of
    its outputs is read (the bias's Expand, Concat, Shape and constants; a value read
    elsewhere, in a subgraph too, keeps its producer)."""
    read: dict[str, int] = {}
    for n in graph.node:
        for i in _reads(n):
            read[i] = read.get(i, 0) + 1
    for o in graph.output:
        read[o.name] = read.get(o.name, 0) + 1
    dead: set[int] = set()
    work = list(values)
    while work:
        node = producer.get(work.pop())
        if node is None or id(node) in dead or any(read.get(o, 0) for o in node.output):
            continue
        dead.add(id(node))
        for i in _reads(node):
            read[i] -= 1
            work.append(i)
    keep = [n for n in graph.node if id(n) not in dead]
    del graph.node[:]
    graph.node.extend(keep)


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads, its subgraphs' included."""
    names = [i for i in node.input if i]
    for a in node.attribute:
        for g in [a.g, *a.graphs] if a.type in (a.GRAPH, a.GRAPHS) else []:
            names += [i for s in g.node for i in _reads(s)]
    return names
