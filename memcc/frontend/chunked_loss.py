"""Cross-entropy and the vocabulary projection over row chunks, gradient taken on the way.

A language model's logits are often the largest tensor of its step: batch x tokens x
vocabulary floats (1.6 GB for GPT-2 small at batch 8 and 1,024 tokens). The plain loss
keeps them, their log-softmax and, in the backward, a gradient of the same size, several
at once. Here the projection ``logits = h @ W`` (plus a bias, where ``nn.Linear`` has one)
and the loss run over row chunks of ``h``,
and since the loss is the step's last value, each chunk's gradient is known as soon as its
probabilities are (``(softmax - onehot) / N``): the chunk's ``dh`` and its share of ``dW``
are computed right there, and the chunk's logits are freed before the next chunk starts.
Nothing is recomputed, so the step does the same products in smaller pieces (the approach
of Liger's fused linear cross-entropy, in standard ONNX ops).

The chunks' gradients are handed to the autodiff as seeds (``differentiate(seeds=...)``),
which skips the chunk nodes. Sums over chunks are reassociated, so the loss and gradients
are equal to the plain loss's within rounding (``LOSS_CHUNKS_TOLERANCE``), not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto

from memcc.errors import InputError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.shape_ops import slice_axis
from memcc.graph import Graph, TensorInfo

# Relative difference to the plain loss's loss and gradients that tests/test_chunked_loss.py
# holds the zoo's GPT-2 and a transformers export to, at 1 and 2 threads.
LOSS_CHUNKS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ChunkedLoss:
    loss: str
    seeds: dict[str, str]          # value -> its gradient, computed by the chunks
    nodes: frozenset[str]          # the chunk nodes (and the projection), which autodiff skips
    projection: dict               # {"inputs": [h, W], "output": logits, "bias": b or absent}


@dataclass(frozen=True)
class Projection:
    """``logits = h @ W`` (+ ``bias`` over the vocabulary: ``nn.Linear`` with a bias, as
    TorchScript and dynamo write it for hidden states of rank 3, a MatMul then an Add)."""

    matmul: onnx.NodeProto
    add: onnx.NodeProto | None = None
    bias: str | None = None

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return [self.matmul] + ([self.add] if self.add is not None else [])


def projection_of(graph: Graph, logits: str) -> Projection | None:
    """The ``MatMul(h, W)`` (and bias ``Add``) that computes ``logits`` when the chunked
    loss can take it over: ``W`` two-dimensional, ``h`` at least two, float32, a bias of the
    vocabulary's size, and nothing else reads the logits or the product."""
    du = graph.def_use()
    node = du.producer.get(logits)
    if node is None or len(du.readers.get(logits, ())) > 0:
        return None
    add, bias = None, None
    if node.op_type == "Add" and node.domain in ("", "ai.onnx"):
        add = node
        for k in (0, 1):
            prod, b = du.producer.get(add.input[k]), add.input[1 - k]
            if prod is not None and prod.op_type == "MatMul" and \
                    len(du.readers.get(add.input[k], ())) == 1 and _is_vocab_bias(graph, b):
                node, bias = prod, b
                break
        else:
            return None
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    h, w = node.input[0], node.input[1]
    hi, wi, li = graph.info.get(h), graph.info.get(w), graph.info.get(logits)
    if hi is None or wi is None or li is None:
        return None
    if len(wi.shape) != 2 or len(hi.shape) < 2 or hi.shape[-1] != wi.shape[0]:
        return None
    if li.dtype != TensorProto.FLOAT or any(d <= 0 for d in hi.shape + wi.shape):
        return None
    if li.shape != (*hi.shape[:-1], wi.shape[1]):
        return None
    if bias is not None and graph.info[bias].shape[-1] != wi.shape[1]:
        return None
    return Projection(node, add, bias)


def _is_vocab_bias(graph: Graph, name: str) -> bool:
    """A float32 row over the last axis: shape [V] or [1, ..., 1, V]."""
    bi = graph.info.get(name)
    return bi is not None and bi.dtype == TensorProto.FLOAT and len(bi.shape) >= 1 and \
        all(d == 1 for d in bi.shape[:-1])


def emit_chunked_loss(graph: Graph, emit: Emitter, logits: str, chunks: int,
                      source: str) -> ChunkedLoss:
    """The mean cross-entropy of ``logits`` against ``labels`` (int64, shape of the logits
    without the class axis) over ``chunks`` row chunks, with the gradients of the
    projection's inputs (and its bias); the projection's nodes themselves are removed."""
    found = projection_of(graph, logits)
    if found is None:
        raise InputError(
            f"{source}: --loss-chunks needs the logits to come straight from a MatMul of the "
            "hidden states by a 2-D float32 weight (and an optional bias over the "
            f"vocabulary), read by nothing else; this model's '{logits}' does not. Build "
            "without --loss-chunks.")
    proj = found.matmul
    h, w = proj.input[0], proj.input[1]
    hi, wi = graph.info[h], graph.info[w]
    width, vocab = wi.shape
    rows = int(np.prod(hi.shape[:-1]))
    chunks = max(1, min(int(chunks), rows))
    if graph.opset < 16:
        raise InputError(f"{source}: --loss-chunks needs opset 16 or newer (ScatterElements "
                         f"with reduction); this model is opset {graph.opset}")
    for n in found.nodes:
        graph.nodes.remove(n)   # the list the emitter appends to: the same object
    emit.created = []
    f32 = TensorProto.FLOAT
    bias = emit.reshape(found.bias, [vocab]) if found.bias else None
    h2 = emit.reshape(h, [rows, width])
    labels = emit.reshape("labels", [rows, 1])
    inv_n = 1.0 / rows
    bounds = [rows * k // chunks for k in range(chunks + 1)]
    sums, dhs, dw, dbs = [], [], None, []
    for k in range(chunks):
        lo, hi_ = bounds[k], bounds[k + 1]
        n = hi_ - lo
        hk = slice_axis(emit, h2, 0, lo, hi_)
        yk = slice_axis(emit, labels, 0, lo, hi_)
        zk = emit.op("MatMul", [hk, w], info=TensorInfo(f32, (n, vocab)))
        if bias is not None:
            zk = emit.op("Add", [zk, bias], info=TensorInfo(f32, (n, vocab)))
        lp = emit.op("LogSoftmax", [zk], axis=-1, info=TensorInfo(f32, (n, vocab)))
        picked = emit.op("GatherElements", [lp, yk], axis=1, info=TensorInfo(f32, (n, 1)))
        sums.append(emit.reduce_sum(picked, None, keepdims=False, info=TensorInfo(f32, ())))
        p = emit.op("Exp", [lp], info=TensorInfo(f32, (n, vocab)))
        minus_one = emit.const(np.full((n, 1), -1.0, np.float32), name="minus_one")
        gz = emit.op("ScatterElements", [p, yk, minus_one], axis=1, reduction="add",
                     info=TensorInfo(f32, (n, vocab)))
        dhs.append(emit.op("Gemm", [gz, w], transB=1, alpha=inv_n,
                           info=TensorInfo(f32, (n, width))))
        if bias is not None:
            dbs.append(emit.reduce_sum(gz, [0], keepdims=False,
                                       info=TensorInfo(f32, (vocab,))))
        inputs = [hk, gz] if dw is None else [hk, gz, dw]
        dw = emit.op("Gemm", inputs, transA=1, alpha=inv_n, beta=1.0,
                     info=TensorInfo(f32, (width, vocab)))
    total = sums[0] if len(sums) == 1 else emit.op("Sum", sums, info=TensorInfo(f32, ()))
    mean = emit.mul(total, emit.scalar(inv_n, f32))
    loss = emit.op("Neg", [mean], outputs=["loss"], info=TensorInfo(f32, ()))
    dh2 = dhs[0] if len(dhs) == 1 else emit.op("Concat", dhs, axis=0,
                                                  info=TensorInfo(f32, (rows, width)))
    dh = emit.reshape(dh2, list(hi.shape))
    assert dw is not None
    seeds = {h: dh, w: dw}
    record: dict = {"inputs": [h, w], "output": logits}
    if found.bias:
        db = dbs[0] if len(dbs) == 1 else emit.op("Sum", dbs, info=TensorInfo(f32, (vocab,)))
        db = emit.mul(db, emit.scalar(inv_n, f32))
        seeds[found.bias] = emit.reshape(db, list(graph.info[found.bias].shape))
        record["bias"] = found.bias
    nodes = frozenset(n.name for n in emit.created) | {n.name for n in found.nodes}
    return ChunkedLoss(loss, seeds, nodes, record)

