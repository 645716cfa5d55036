"""Sequence ops resolved to tensor ops at load time.

In: one ONNX sequence op (``SplitToSequence``, ``SequenceAt``, ``SequenceConstruct``,
``ConcatFromSequence``, ``SequenceLength``, ``SequenceInsert``, ``SequenceEmpty``,
``SequenceErase``) of a model whose shapes and positions are static, and what earlier
sequence ops produced. Out: the ``Split``/``Squeeze``/``Concat``/``Unsqueeze``/Constant
nodes that replace it, and the sequence it makes recorded as a list of tensor names: no
sequence value survives into the graph. A length or position known only at run time is
an ``InputError`` naming the node. Called by ``canonicalize`` for each such node.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from memcc.errors import InputError
from memcc.frontend.static_values import Namer, StaticValues, ValueTypes, const_node, node_attr
from memcc.graph import node_label

SEQUENCE_OPS = frozenset({"SplitToSequence", "SequenceAt", "SequenceConstruct",
                          "ConcatFromSequence", "SequenceLength", "SequenceInsert",
                          "SequenceEmpty", "SequenceErase"})


@dataclass
class SequenceScope:
    """What resolving the sequence ops of one model shares: the sequences built so far
    (value -> its tensors), the static types (extended with the parts a split makes), the
    compile-time values, the namer, and where the model came from (for messages)."""

    types: ValueTypes
    consts: StaticValues
    fresh: Namer
    where: str
    seqs: dict[str, list[str]] = field(default_factory=dict)

    def dynamic(self, node: onnx.NodeProto, what: str) -> InputError:
        hint = embedding_bag_hint(node)
        return InputError(
            f"{self.where}: {node_label(node)}: {what} is only known at run time. memcc "
            "resolves sequences of tensors at load time, so their length and every position "
            "must be compile-time constants (--dim makes them so only where the bound sizes "
            "are within what the model supports: a sequence longer than its position "
            "embeddings leaves shapes unknown)"
            + (f". {hint}" if hint else "; rewrite the model to index a fixed number of "
               "tensors (e.g. torch.split with constant sizes).")
        )

    def elements(self, node: onnx.NodeProto, name: str) -> list[str]:
        if name not in self.seqs:
            raise self.dynamic(node, f"sequence '{name}' (not built by a sequence op memcc "
                                     "resolves)")
        return self.seqs[name]

    def position(self, node: onnx.NodeProto, k: int, length: int) -> int:
        if len(node.input) <= k or not node.input[k]:
            return length
        v = self.consts.value(node.input[k])
        if v is None:
            raise self.dynamic(node, f"the position '{node.input[k]}'")
        p = int(np.asarray(v).reshape(-1)[0])
        return p + length if p < 0 else p

    def outside(self, node: onnx.NodeProto, p: int, items: list[str]) -> InputError:
        return InputError(f"{self.where}: {node_label(node)}: position {p} is outside the "
                          f"sequence of {len(items)} tensors")


EMBEDDING_BAG = (
    "nn.EmbeddingBag and F.embedding_bag, which torch.onnx writes as a Loop over the bags "
    "that memcc cannot differentiate: with bags of one size, look the ids up as [N, bag] in "
    "an nn.Embedding and reduce over the bag axis (.sum(1), .mean(1), .amax(1)); with bags of "
    "several sizes, pad them to one size and multiply by a 0/1 mask before the sum instead "
    "of passing offsets.")


def embedding_bag_hint(node: onnx.NodeProto) -> str:
    """What to do instead, where the dynamo exporter's records say the node was written
    for torch's embedding_bag; else ''."""
    meta = " ".join(p.value for p in node.metadata_props
                    if p.key in ("namespace", "pkg.torch.onnx.fx_node"))
    return f"It was written for {EMBEDDING_BAG}" if "embedding_bag" in meta else ""


def resolve_sequence(node: onnx.NodeProto, scope: SequenceScope) -> list[onnx.NodeProto]:
    """Resolve one sequence op to tensor ops; record produced sequences in ``scope.seqs``."""
    op = node.op_type
    if op in ("SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase"):
        scope.seqs[node.output[0]] = _edited_list(node, scope)
        return []
    if op == "SequenceLength":
        n = len(scope.elements(node, node.input[0]))
        return [helper.make_node("Constant", [], [node.output[0]], name=node.name,
                                 value=numpy_helper.from_array(np.asarray(n, np.int64)))]
    if op == "SequenceAt":
        items = scope.elements(node, node.input[0])
        p = scope.position(node, 1, len(items))
        if not 0 <= p < len(items):
            raise scope.outside(node, p, items)
        return [helper.make_node("Identity", [items[p]], [node.output[0]], name=node.name)]
    if op == "ConcatFromSequence":
        return _concat_from_sequence(node, scope)
    return _split_to_sequence(node, scope)


def _edited_list(node: onnx.NodeProto, scope: SequenceScope) -> list[str]:
    """The tensors of the sequence an empty, construct, insert or erase op makes."""
    op = node.op_type
    if op == "SequenceEmpty":
        return []
    if op == "SequenceConstruct":
        return list(node.input)
    items = list(scope.elements(node, node.input[0]))
    if op == "SequenceInsert":
        items.insert(scope.position(node, 2, len(items)), node.input[1])
        return items
    p = scope.position(node, 1, len(items)) if len(node.input) > 1 and node.input[1] \
        else len(items) - 1
    if not 0 <= p < len(items):
        raise scope.outside(node, p, items)
    del items[p]
    return items


def _concat_from_sequence(node: onnx.NodeProto, scope: SequenceScope
                          ) -> list[onnx.NodeProto]:
    items = scope.elements(node, node.input[0])
    axis = node_attr(node, "axis", 0)
    if not items:
        raise InputError(f"{scope.where}: {node_label(node)} concatenates an empty sequence")
    if not node_attr(node, "new_axis", 0):
        return [helper.make_node("Concat", items, [node.output[0]], name=node.name,
                                 axis=axis)]
    rank = scope.types.get(items[0], (0, None))[1]
    if axis < 0:
        if rank is None:
            raise scope.dynamic(node, "the rank of the stacked tensors")
        axis += len(rank) + 1
    nodes, parts = on_each_axis("Unsqueeze", items, axis, node, scope.fresh)
    nodes.append(helper.make_node("Concat", parts, [node.output[0]], name=node.name,
                                  axis=axis))
    return nodes


def _split_sizes(node: onnx.NodeProto, scope: SequenceScope, size: int
                 ) -> tuple[list[int], np.ndarray | None]:
    """The part sizes of a SplitToSequence along an axis of ``size``, and its ``split``
    input's value (None: split into ones)."""
    split = scope.consts.value(node.input[1]) if len(node.input) > 1 and node.input[1] \
        else None
    if len(node.input) > 1 and node.input[1] and split is None:
        raise scope.dynamic(node, f"the split sizes '{node.input[1]}'")
    if split is None:
        return [1] * size, None
    if np.ndim(split) == 0:
        chunk = int(split)
        return [chunk] * (size // chunk) + ([size % chunk] if size % chunk else []), split
    return [int(s) for s in np.asarray(split).reshape(-1)], split


def _split_to_sequence(node: onnx.NodeProto, scope: SequenceScope) -> list[onnx.NodeProto]:
    x = node.input[0]
    t = scope.types.get(x)
    if t is None or t[1] is None:
        raise scope.dynamic(node, f"the shape of '{x}'")
    shape = t[1]
    axis = node_attr(node, "axis", 0) % max(len(shape), 1)
    keepdims = node_attr(node, "keepdims", 1)
    sizes, split = _split_sizes(node, scope, shape[axis])
    fresh = scope.fresh
    parts = [fresh(f"{node.output[0]}/{i}") for i in range(len(sizes))]
    nodes: list[onnx.NodeProto] = []
    if len(sizes) == 1:
        nodes.append(helper.make_node("Identity", [x], parts, name=node.name))
    elif scope.consts.opset >= 13:
        sz = const_node(fresh, np.asarray(sizes, np.int64))
        nodes += [sz, helper.make_node("Split", [x, sz.output[0]], parts, name=node.name,
                                       axis=axis)]
    else:
        nodes.append(helper.make_node("Split", [x], parts, name=node.name, axis=axis,
                                      split=sizes))
    if split is None and not keepdims:
        squeezing, parts = on_each_axis("Squeeze", parts, axis, node, fresh)
        nodes += squeezing
    for p, n in zip(parts, sizes, strict=True):  # later sequence ops read the parts' ranks
        part_shape = list(shape)
        part_shape[axis] = n
        if split is None and not keepdims:
            del part_shape[axis]
        scope.types[p] = (t[0], tuple(part_shape))
    scope.seqs[node.output[0]] = parts
    return nodes


def on_each_axis(op_type: str, values: list[str], axis: int, node: onnx.NodeProto,
                  fresh: Namer) -> tuple[list[onnx.NodeProto], list[str]]:
    """``op_type`` (Squeeze or Unsqueeze) on ``axis`` of every value, sharing one axes
    constant: the nodes, the constant first, and the results in order."""
    ax = const_node(fresh, np.asarray([axis], np.int64))
    nodes, outs = [ax], []
    for v in values:
        out = fresh(f"{v}/{op_type.lower()}d")
        nodes.append(helper.make_node(op_type, [v, ax.output[0]], [out],
                                      name=fresh(f"{node.name}/{op_type}")))
        outs.append(out)
    return nodes, outs
