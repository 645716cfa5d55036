"""Attention over query chunks: the scores and probabilities never formed whole.

An attention's scores ``q k^T`` and probabilities ``softmax(.)`` are batch x heads x
queries x keys floats: at 1,024 tokens they outgrow every other tensor of a transformer
layer, and the backward holds several of that size at once (the probabilities, their
gradient, the scores' gradient). Each query row depends on its own row of scores only, so
the computation from ``q k^T`` to ``probs @ v`` can run over row chunks of ``q``. The
forward then makes the same rows in pieces; the backward works on one chunk's
probabilities at a time, and where the planner recomputes them, only one chunk's are live
(what FlashAttention's backward does, in standard ONNX ops).

The rewrite runs on the forward model before the autodiff (``memcc build --attention-chunks
K``), so the gradient rules see ordinary nodes. An attention is found by its structure,
not by names:

- a MatMul ``M2`` whose first input is computed from a MatMul ``M1``'s output by row-wise
  nodes only (elementwise ops with broadcasting, Softmax over the last axis, Dropout, the
  NaN guards of transformers' exports), with exactly one Softmax among them;
- nothing outside reads those nodes' values;
- every other input of those nodes (the scale, the mask, a bias) either spans the query
  axis (then it is split with ``q``) or broadcasts over it.

Rows are computed by the same arithmetic, but the gradients of ``k`` and ``v`` become sums
over the chunks, rounded in another order: the tier is equivalent, within
``ATTENTION_CHUNKS_TOLERANCE`` of the whole attention (tests/test_chunked_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from memcc.errors import InputError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.shape_ops import concat_values, norm_axis, split_values
from memcc.graph import Graph, TensorInfo, attr

# Relative difference of the loss and every gradient to the whole attention's, at 1, 2 and
# 4 threads, that tests/test_chunked_attention.py holds the zoo's GPT-2 and exports to.
ATTENTION_CHUNKS_TOLERANCE = 1e-5

# Ops that compute each query row from the same row of their inputs (with broadcasting).
_ROW_WISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Where", "Cast", "IsNaN", "IsInf", "Not", "And", "Or",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Neg", "Exp", "Tanh",
    "Max", "Min", "Identity", "Dropout", "Softmax",
})


@dataclass(frozen=True)
class Attention:
    """One attention core: ``scores = M1(q, k^T)`` ... ``M2(probs, v)``."""

    first: onnx.NodeProto            # M1: q @ k^T
    nodes: tuple[onnx.NodeProto, ...]  # the row-wise nodes between, in graph order
    last: onnx.NodeProto             # M2: probs @ v
    queries: int                     # the query axis' length

    @property
    def name(self) -> str:
        return self.last.name


def find_attentions(graph: Graph) -> list[Attention]:
    """Every attention core of ``graph`` that can run over query chunks."""
    du = graph.def_use()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    found: list[Attention] = []
    taken: set[int] = set()
    for node in graph.nodes:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            continue
        core = _core_ending_at(graph, du, node)
        if core is None or any(id(n) in taken for n in (core.first, *core.nodes)):
            continue
        taken.update(id(n) for n in (core.first, *core.nodes, core.last))
        found.append(Attention(core.first, tuple(sorted(core.nodes, key=lambda n: order[id(n)])),
                               core.last, core.queries))
    return found


def _core_ending_at(graph: Graph, du, last: onnx.NodeProto) -> Attention | None:
    probs = last.input[0]
    pi = graph.info.get(probs)
    if pi is None or len(pi.shape) < 2 or pi.shape[-2] < 2:
        return None
    queries = pi.shape[-2]
    # Walk back from the probabilities over row-wise nodes to the scores' MatMul.
    between: dict[str, onnx.NodeProto] = {}
    firsts: dict[str, onnx.NodeProto] = {}
    stack = [probs]
    while stack:
        v = stack.pop()
        p = du.producer.get(v)
        if p is None or p.name in between or p.name in firsts:
            continue
        if p.op_type == "MatMul" and p.domain in ("", "ai.onnx"):
            firsts[p.name] = p
            continue
        if p.op_type not in _ROW_WISE or p.domain not in ("", "ai.onnx"):
            continue
        between[p.name] = p
        stack.extend(i for i in p.input if i)
    # The scores' MatMul is the one whose output the chain starts from; a bias made by
    # another MatMul joins the chain later, so its candidate covers fewer nodes.
    best: Attention | None = None
    for first in firsts.values():
        nodes = _downstream(between, first.output[0])
        if nodes is None or not _is_closed(graph, du, nodes, first, last, queries):
            continue
        softmaxes = [n for n in nodes.values() if n.op_type == "Softmax"]
        if len(softmaxes) != 1 or not _softmax_over_last(graph, softmaxes[0]):
            continue
        if best is None or len(nodes) > len(best.nodes):
            best = Attention(first, tuple(nodes.values()), last, queries)
    return best


def _downstream(between: dict[str, onnx.NodeProto],
                scores: str) -> dict[str, onnx.NodeProto] | None:
    """The nodes of ``between`` that read ``scores`` or each other's outputs."""
    made = {scores}
    chosen: dict[str, onnx.NodeProto] = {}
    changed = True
    while changed:
        changed = False
        for n in between.values():
            if n.name not in chosen and any(i in made for i in n.input):
                chosen[n.name] = n
                made.update(o for o in n.output if o)
                changed = True
    return chosen or None


def _is_closed(graph: Graph, du, nodes: dict[str, onnx.NodeProto], first: onnx.NodeProto,
               last: onnx.NodeProto, queries: int) -> bool:
    """Only the chain reads its values, each spans the query axis, the last node's input
    is one of them, and every outside input splits along the query axis or broadcasts."""
    names = set(nodes) | {last.name}
    made = {first.output[0]}
    for n in nodes.values():
        made.update(o for o in n.output if o)
    if last.input[0] not in made or last.input[1] in made:
        return False
    outputs = set(graph.outputs)
    masks = {n.output[1] for n in nodes.values() if n.op_type == "Dropout" and len(n.output) > 1}
    for v in made - masks:
        ti = graph.info.get(v)
        if v in outputs or ti is None or len(ti.shape) < 2 or ti.shape[-2] != queries:
            return False
        if any(r.name not in names for r in du.readers.get(v, ())):
            return False
    q = graph.info.get(first.input[0])
    if q is None or len(q.shape) < 2 or q.shape[-2] != queries:
        return False
    for n in nodes.values():
        if n.op_type == "Dropout" and len(n.output) > 1 and n.output[1] \
                and du.readers.get(n.output[1]):
            return False          # its mask is read outside
        for i in n.input:
            if i and i not in made and _side_split(graph.info.get(i), queries) is None:
                return False
    return True


def _side_split(ti: TensorInfo | None, queries: int) -> bool | None:
    """True: split it with the queries; False: it broadcasts over them; None: neither."""
    if ti is None:
        return None
    if len(ti.shape) < 2 or ti.shape[-2] == 1:
        return False
    return True if ti.shape[-2] == queries else None


def _softmax_over_last(graph: Graph, node: onnx.NodeProto) -> bool:
    rank = len(graph.info[node.output[0]].shape)
    axis = attr(node, "axis", -1 if graph.opset >= 13 else 1)
    return graph.opset >= 13 and norm_axis(axis, rank) == rank - 1


def chunk_attentions(graph: Graph, chunks: int, source: str) -> int:
    """Rewrite every attention core of ``graph`` (a forward model) over ``chunks`` query
    chunks, in place; return how many there were."""
    if chunks <= 1:
        return 0
    cores = find_attentions(graph)
    if not cores:
        raise InputError(
            f"{source}: --attention-chunks found no attention to split: it looks for a "
            "MatMul of queries by keys, row-wise nodes with one Softmax over the last axis, "
            "and a MatMul by the values, whose values nothing else reads. Build without "
            "--attention-chunks.")
    emit = Emitter(graph, detached=True)
    for core in cores:
        _rewrite(graph, emit, core, chunks)
    graph.set_nodes(graph.nodes)
    return len(cores)


def _rewrite(graph: Graph, emit: Emitter, core: Attention, chunks: int) -> None:
    k = max(1, min(int(chunks), core.queries))
    sizes = [core.queries * (c + 1) // k - core.queries * c // k for c in range(k)]
    emit.nodes.clear()
    split_of: dict[str, list[str]] = {}

    def parts(v: str) -> list[str]:
        if v not in split_of:
            rank = len(graph.info[v].shape)
            split_of[v] = split_values(emit, v, rank - 2, sizes)
        return split_of[v]

    made = {core.first.output[0]} | {o for n in core.nodes for o in n.output if o}
    outs: list[str] = []
    for c in range(k):
        renamed: dict[str, str] = {}

        def chunk_of(v: str, c: int = c, renamed: dict[str, str] = renamed) -> str:
            if not v:
                return v
            if v in renamed:
                return renamed[v]
            if _side_split(graph.info.get(v), core.queries):
                return parts(v)[c]
            return v

        for node in (core.first, *core.nodes, core.last):
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = emit.fresh(f"{node.name}/q{c}")
            del clone.input[:]
            if node is core.first:    # the queries' rows; the keys are whole
                clone.input.extend([parts(node.input[0])[c], node.input[1]])
            elif node is core.last:   # the chunk's probabilities by all the values
                clone.input.extend([renamed[node.input[0]], node.input[1]])
            else:
                clone.input.extend(chunk_of(i) for i in node.input)
            del clone.output[:]
            for o in node.output:
                if not o or (node.op_type == "Dropout" and o != node.output[0]):
                    clone.output.append("")
                    continue
                new = emit.fresh(f"{o}/q{c}")
                ti = graph.info[o]
                shape = list(ti.shape)
                shape[-2] = sizes[c]
                graph.info[new] = TensorInfo(ti.dtype, tuple(shape))
                renamed[o] = new
                clone.output.append(new)
            while clone.output and not clone.output[-1]:
                del clone.output[-1]
            emit.nodes.append(clone)
        outs.append(renamed[core.last.output[0]])
    out = core.last.output[0]
    rank = len(graph.info[out].shape)
    joined = concat_values(emit, outs, rank - 2)
    # The Concat writes the original output name, so its readers stay as they are.
    emit.nodes[-1].output[0] = out
    graph.info.pop(joined, None)
    removed = {id(n) for n in (core.first, *core.nodes, core.last)}
    at = next(i for i, n in enumerate(graph.nodes) if n is core.last)
    kept_before = [n for n in graph.nodes[:at] if id(n) not in removed]
    kept_after = [n for n in graph.nodes[at + 1:] if id(n) not in removed]
    graph.nodes[:] = kept_before + list(emit.nodes) + kept_after
    for v in made:
        graph.info.pop(v, None)
