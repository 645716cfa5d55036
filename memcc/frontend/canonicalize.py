"""Rewrite what exporters write into the plain tensor graph the rest of memcc works on.

Runs at load time, after dimensions are bound and shapes inferred, so every size is known.
Planning and gradient rules only ever see tensors of static shape, so:

- ``CastLike(x, like)`` becomes ``Cast(x, to=dtype(like))``: the dtype is known statically,
  and ``Cast`` has a gradient rule and folds like any other shape arithmetic (the dynamo
  exporter without its optimizer writes one per scalar constant it promotes).
- Sequence ops whose length and positions are static (``SplitToSequence`` feeding
  ``SequenceAt``: the dynamo exporter's spelling of ``torch.split``; ``SequenceConstruct``,
  ``ConcatFromSequence``, ``SequenceLength``, ``SequenceInsert``, ``SequenceEmpty``) become
  ``Split``/``Squeeze``/``Concat``/``Unsqueeze`` and constants: a sequence is only a list of
  tensor names here, so no sequence value survives into the graph.
- ``LSTM``, ``GRU`` and ``RNN`` become their steps, unrolled over the static sequence length
  (``recurrent``): the one rewrite here that is not exact, since ORT's kernels sum in
  another order.
- ``SoftmaxCrossEntropyLoss`` and ``NegativeLogLikelihoodLoss`` (a model that computes its
  own loss) become ``LogSoftmax``, ``GatherElements``, masks and reductions (``loss_ops``).
- ``If`` whose condition is a compile-time constant once dimensions are bound is replaced by
  the branch it takes (its nodes move into the main graph under fresh names).

Each other rewrite is exact (the same kernels on the same values). Anything that stays dynamic
(a sequence position computed from data, an ``If`` on data) is an ``InputError`` naming the
node, never a missing-shape error that would send the user after ``--dim``.

In: an ONNX model whose shapes were inferred. Out: the same model rewritten in place
(``canonicalize`` says whether it changed), every Dropout seeded (``seed_dropouts``). The
sequence rewrites are ``sequences``; what is known statically, ``static_values``; ops
defined as ONNX functions are expanded before, by ``function_ops``.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper

from memcc.errors import InputError
from memcc.frontend.counter_hash import name_seed
from memcc.frontend.loss_ops import LOSS_OPS, loss_shapes_needed, rewrite_loss_op
from memcc.frontend.recurrent import RECURRENT_OPS, unroll_recurrent
from memcc.frontend.sequences import SEQUENCE_OPS, SequenceScope, resolve_sequence
from memcc.frontend.static_values import (
    Namer,
    StaticValues,
    const_node,
    node_attr,
    value_types,
)


def needs_canonicalizing(model: onnx.ModelProto) -> bool:
    """True when the graph holds anything :func:`canonicalize` rewrites."""
    return any(n.op_type in SEQUENCE_OPS or n.op_type in RECURRENT_OPS
               or n.op_type in LOSS_OPS or n.op_type in ("CastLike", "If", "GatherND")
               for n in model.graph.node if n.domain in ("", "ai.onnx"))


def seed_dropouts(nodes: Iterable[onnx.NodeProto]) -> None:
    """Give every ``Dropout`` without a ``seed`` attribute a fixed seed of its own.

    Without one, ORT's Dropout draws its mask from a generator seeded anew in every session
    (measured: two sessions of one model give different masks), so a step with dropout never
    gave the same loss twice and ``--verify`` could not compare a plan with its original.
    With a seed, each session draws the same sequence of masks, step after step, and the
    other random ops behave so within one process (an unseeded ``RandomUniformLike`` is
    seeded from the clock once per process; a training step draws it from a counter
    instead, ``dropout_masks``). The seed is a hash of the node's name, so that no
    two Dropouts share a mask sequence and a rewrite that keeps the name keeps the draw.
    """
    reseed_dropouts([n for n in nodes if not any(a.name == "seed" for a in n.attribute)], "")


def reseed_dropouts(nodes: Iterable[onnx.NodeProto], salt: str) -> None:
    """Seed every ``Dropout`` among ``nodes`` from its name and ``salt``, replacing any seed
    it had: at load (``seed_dropouts``), for a row chunk of a Dropout (which copied its whole
    node's seed), for a training run resumed at step k (which would otherwise draw the masks
    of the run's first steps again)."""
    for node in nodes:
        if node.op_type == "Dropout" and node.domain in ("", "ai.onnx"):
            kept = [a for a in node.attribute if a.name != "seed"]
            kept.append(helper.make_attribute(
                "seed", name_seed(node.name, salt)))
            del node.attribute[:]
            node.attribute.extend(kept)


def shapes_needed(model: onnx.ModelProto) -> list[str]:
    """Values whose static type the rewrites need but shape inference left unknown."""
    types = value_types(model)
    wanted: list[str] = []
    for n in model.graph.node:
        if n.op_type == "SplitToSequence" or n.op_type in RECURRENT_OPS:
            wanted.append(n.input[0])
        elif n.op_type == "CastLike":
            wanted.append(n.input[1])
        elif n.op_type == "GatherND":
            wanted += [n.input[0], n.input[1]]
        elif n.op_type in LOSS_OPS:
            wanted += loss_shapes_needed(n)
    return [w for w in dict.fromkeys(wanted)
            if w and (w not in types or types[w][1] is None)]


def canonicalize(model: onnx.ModelProto, where: str) -> tuple[onnx.ModelProto, dict]:
    """Rewrite ``model`` (shapes already inferred) in place; return it and whether it
    changed (the pass contract's shape, ``memcc/pass_contract.py``, over the ONNX model:
    it runs before there is a ``Graph``).

    The caller re-runs shape inference afterwards: new values carry no type yet.
    """
    types = value_types(model)
    consts = StaticValues(model, types)
    changed = False
    out: list[onnx.NodeProto] = []
    seqs: dict[str, list[str]] = {}
    fresh = Namer(model)
    sequences = SequenceScope(types, consts, fresh, where, seqs)
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx"):
            out.append(node)
            continue
        if node.op_type == "CastLike":
            like = types.get(node.input[1])
            if like is None:
                out.append(node)
                continue
            out.append(helper.make_node("Cast", [node.input[0]], [node.output[0]],
                                        name=node.name, to=like[0]))
            changed = True
        elif node.op_type in SEQUENCE_OPS:
            out.extend(resolve_sequence(node, sequences))
            changed = True
        elif node.op_type in RECURRENT_OPS:
            out.extend(unroll_recurrent(node, types, consts, fresh, where))
            changed = True
        elif node.op_type == "GatherND" and _float_data_gathernd(node, types):
            out.extend(_gathernd_as_gather(node, types, fresh))
            changed = True
        elif node.op_type in LOSS_OPS:
            out.extend(rewrite_loss_op(node, types, consts.opset, fresh, where))
            changed = True
        elif node.op_type == "If":
            cond = consts.value(node.input[0])
            if cond is None or cond.size != 1:
                out.append(node)
                continue
            out.extend(_inline_branch(node, bool(cond.reshape(-1)[0]), fresh))
            changed = True
        else:
            out.append(node)
    for o in model.graph.output:
        if o.name in seqs:
            raise InputError(
                f"{where}: graph output '{o.name}' is a sequence of tensors; memcc trains on "
                "tensor outputs. Return the tensors themselves (a tuple) from forward()."
            )
    if changed:
        del model.graph.node[:]
        model.graph.node.extend(out)
    return model, {"changed": changed}


_FLOATS = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                     onnx.TensorProto.BFLOAT16})


def _float_data_gathernd(node: onnx.NodeProto, types) -> bool:
    data, idx = types.get(node.input[0]), types.get(node.input[1])
    return (data is not None and data[0] in _FLOATS and data[1] is not None
            and idx is not None and idx[1] is not None and len(idx[1]) >= 1
            and node_attr(node, "batch_dims", 0) == 0 and 1 <= idx[1][-1] <= len(data[1]))


def _gathernd_as_gather(node: onnx.NodeProto, types, fresh: Namer) -> list[onnx.NodeProto]:
    """``GatherND(data, idx)`` (batch_dims 0) as ``Gather(Reshape(data, [P, *rest]), lin)``
    with ``lin`` the row-major linear index over the first ``k`` axes: exact, and the Gather
    gradient (a deterministic chunked ScatterElements) then covers it, where a ScatterND
    gradient would lose updates across threads on ORT's CPU provider."""
    data_shape = types[node.input[0]][1]
    idx_type, idx_shape = types[node.input[1]]
    k = idx_shape[-1]
    lead, rest = data_shape[:k], data_shape[k:]
    strides = [int(np.prod(lead[j + 1:])) for j in range(k)]
    name = node.name or node.output[0]

    def v(base: str) -> str:
        return fresh(f"{name}/{base}")

    nodes: list[onnx.NodeProto] = []
    idx = node.input[1]
    if idx_type != onnx.TensorProto.INT64:
        cast = v("indices_int64")
        nodes.append(helper.make_node("Cast", [idx], [cast], name=v("Cast"),
                                      to=onnx.TensorProto.INT64))
        idx = cast
    dims = const_node(fresh, np.asarray(lead, np.int64))
    strd = const_node(fresh, np.asarray(strides, np.int64))
    zero = const_node(fresh, np.asarray(0, np.int64))
    axes = const_node(fresh, np.asarray([-1], np.int64))
    shape = const_node(fresh, np.asarray([int(np.prod(lead))] + list(rest), np.int64))
    nodes += [dims, strd, zero, axes, shape]
    neg, negi, wrap, norm, scaled, lin, flat = (v(s) for s in (
        "negative", "negative_int", "wrap", "normalized", "scaled", "linear", "rows"))
    nodes += [
        helper.make_node("Less", [idx, zero.output[0]], [neg], name=v("Less")),
        helper.make_node("Cast", [neg], [negi], name=v("Cast"), to=onnx.TensorProto.INT64),
        helper.make_node("Mul", [negi, dims.output[0]], [wrap], name=v("Mul")),
        helper.make_node("Add", [idx, wrap], [norm], name=v("Add")),
        helper.make_node("Mul", [norm, strd.output[0]], [scaled], name=v("Mul")),
        helper.make_node("ReduceSum", [scaled, axes.output[0]], [lin], name=v("ReduceSum"),
                         keepdims=0),
        helper.make_node("Reshape", [node.input[0], shape.output[0]], [flat],
                         name=v("Reshape")),
        helper.make_node("Gather", [flat, lin], [node.output[0]], name=name, axis=0),
    ]
    return nodes


def _inline_branch(node: onnx.NodeProto, cond: bool, fresh: Namer) -> list[onnx.NodeProto]:
    """The nodes of the branch ``If`` takes, renamed apart, then its outputs by Identity."""
    branch = node_attr(node, "then_branch" if cond else "else_branch", None)
    assert isinstance(branch, onnx.GraphProto)
    prefix = f"{node.name or node.output[0]}/{'then' if cond else 'else'}/"
    rename: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    for init in branch.initializer:
        rename[init.name] = fresh(prefix + init.name)
        nodes.append(helper.make_node("Constant", [], [rename[init.name]],
                                      name=fresh(prefix + "Constant"), value=init))
    for n in branch.node:
        for o in n.output:
            if o:
                rename[o] = fresh(prefix + o)
    for n in branch.node:
        m = onnx.NodeProto()
        m.CopyFrom(n)
        m.name = fresh(prefix + (n.name or n.op_type))
        _rename_values(m, rename)
        nodes.append(m)
    for src, dst in zip(branch.output, node.output, strict=False):
        if dst:
            nodes.append(helper.make_node("Identity", [rename.get(src.name, src.name)], [dst],
                                          name=fresh(prefix + "output")))
    return nodes


def _rename_values(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    for i, v in enumerate(node.input):
        if v in rename:
            node.input[i] = rename[v]
    for i, v in enumerate(node.output):
        if v in rename:
            node.output[i] = rename[v]
    for a in node.attribute:  # nested subgraphs may read the branch's values
        for g in _subgraphs(a):
            for inner in g.node:
                for i, v in enumerate(inner.input):
                    if v in rename:
                        inner.input[i] = rename[v]


def _subgraphs(a: onnx.AttributeProto) -> Iterable[onnx.GraphProto]:
    if a.type == onnx.AttributeProto.GRAPH:
        yield a.g
    elif a.type == onnx.AttributeProto.GRAPHS:
        yield from a.graphs
