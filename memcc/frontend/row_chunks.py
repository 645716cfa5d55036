"""Attentions and MLPs over row chunks: their largest tensors never formed whole.

A transformer layer's largest tensors live between two matrix products, and each of their
rows depends on the same row of the products' first input only:

- an attention's scores ``q k^T`` and probabilities ``softmax(.)``: batch x heads x queries
  x keys floats, which outgrow everything else at long sequences; each query row needs
  its own row of ``q`` and all of ``k`` and ``v``;
- an MLP's hidden activations ``act(x W1) W2`` (and a gated MLP's ``act(x Wg) * (x Wu)``):
  four times the model width per token, and a decomposed GELU keeps several of them.

So the nodes from the first product to the last can run over row chunks of the first
input (the queries, or the tokens). The forward makes the same rows in pieces; the
backward works on one chunk at a time, and where the planner recomputes the chunk's
values, only one chunk's are live (FlashAttention's backward, and the sequence chunking
of long-context training, in standard ONNX ops).

The rewrite runs on the forward model before the autodiff (``memcc build
--attention-chunks K`` / ``--mlp-chunks K``), so the gradient rules see ordinary nodes.
Regions are found by structure, not by names:

- attention: a MatMul whose first input is computed from another MatMul's output by
  row-wise nodes only (elementwise ops with broadcasting, Softmax over the last axis,
  Dropout, the NaN guards of transformers' exports), with exactly one Softmax among them;
- MLP: a MatMul (or Gemm) by a 2-D weight whose first input is computed by row-wise nodes
  from MatMuls of one value by 2-D weights (one for a plain MLP, two for a gated one). Where
  the products run on flattened [tokens, width] rows and Reshapes turn them into [batch,
  tokens, width] for the activation and back (transformers' GPT-2 writes its Conv1D layers
  so), the chunks stay flat and the Reshapes are dropped from them;
- in both, nothing outside reads the region's values, and every other input of its nodes
  (a scale, a mask, a bias) either spans the row axis (it is split too) or broadcasts
  over it.

Rows are computed by the same arithmetic, but the gradients of what every chunk reads
(the keys and values, the weights) become sums over the chunks, rounded in another order:
the tier is equivalent, within ``ROW_CHUNKS_TOLERANCE`` (tests/test_row_chunks.py).

The Concat that joins a region's chunks records how to compute the region whole again
(``frontend/whole_rows.py``): ``memcc export`` writes the model so, at any row count.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import onnx

from memcc.errors import InputError
from memcc.frontend.canonicalize import reseed_dropouts
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.shape_ops import norm_axis, split_values
from memcc.frontend.whole_rows import record_whole_rows
from memcc.graph import Graph, TensorInfo, attr

# Relative difference of the loss and every gradient to the whole regions', at 1, 2 and 4
# threads, that tests/test_row_chunks.py holds the zoo's GPT-2 and exports to.
ROW_CHUNKS_TOLERANCE = 1e-5

ATTENTION = "attention"
MLP = "mlp"

# Ops that compute each row from the same row of their inputs (with broadcasting).
_ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Where", "Cast", "IsNaN", "IsInf", "Not", "And", "Or",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Neg", "Exp", "Tanh",
    "Max", "Min", "Identity", "Dropout",
})
_ROW_WISE = {
    ATTENTION: _ELEMENTWISE | {"Softmax"},
    MLP: _ELEMENTWISE | {"Pow", "Erf", "Sigmoid", "Relu", "LeakyRelu", "Elu", "Selu",
                         "Softplus", "HardSigmoid", "HardSwish", "Clip", "Sqrt",
                         "Reciprocal", "Gelu"},
}
# The command-line flag that asks for each kind.
FLAGS = {ATTENTION: "--attention-chunks", MLP: "--mlp-chunks"}


@dataclass(frozen=True)
class RowRegion:
    """Nodes computed row by row: ``firsts`` (products whose first input is split into
    rows), the row-wise ``nodes`` after them, and ``last`` (the product whose first input
    they compute; its output is joined again)."""

    kind: str
    firsts: tuple[onnx.NodeProto, ...]
    nodes: tuple[onnx.NodeProto, ...]   # in graph order
    last: onnx.NodeProto
    rows: int                           # the length of the row axis (-2)
    # The products run on flattened 2-D rows and the region reshapes them (the chunks stay
    # 2-D: its Reshapes are dropped, its other inputs are scalars or per-column vectors).
    flat: bool = False

    @property
    def members(self) -> tuple[onnx.NodeProto, ...]:
        return (*self.firsts, *self.nodes, self.last)


def find_regions(graph: Graph, kind: str) -> list[RowRegion]:
    """Every region of ``kind`` in ``graph`` that can run over row chunks."""
    du = graph.def_use()
    order = {id(n): i for i, n in enumerate(graph.nodes)}
    found: list[RowRegion] = []
    taken: set[int] = set()
    for node in graph.nodes:
        if not _is_product(graph, node, kind):
            continue
        region = _region_ending_at(graph, du, node, kind)
        if region is None or any(id(n) in taken for n in region.members):
            continue
        taken.update(id(n) for n in region.members)
        # Graph order, so that each chunk's clones are emitted producers first.
        found.append(replace(region, nodes=tuple(sorted(region.nodes,
                                                        key=lambda n: order[id(n)]))))
    return found


def find_attentions(graph: Graph) -> list[RowRegion]:
    return find_regions(graph, ATTENTION)


def find_mlps(graph: Graph) -> list[RowRegion]:
    return find_regions(graph, MLP)


def _is_weight(graph: Graph, name: str) -> bool:
    ti = graph.info.get(name)
    return ti is not None and len(ti.shape) == 2


def _is_product(graph: Graph, node: onnx.NodeProto, kind: str) -> bool:
    """A MatMul; for MLPs also a Gemm of rows by a 2-D weight plus a per-column bias."""
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "MatMul":
        return True
    if kind != MLP or node.op_type != "Gemm" or attr(node, "transA", 0):
        return False
    bias = graph.info.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    return _is_weight(graph, node.input[1]) and (bias is None or len(bias.shape) <= 1)


def _keeps_rows(graph: Graph, node: onnx.NodeProto) -> bool:
    """A Reshape that only regroups the leading axes (the last one, the width, stays)."""
    if node.op_type != "Reshape":
        return False
    a, b = graph.info.get(node.input[0]), graph.info.get(node.output[0])
    return (a is not None and b is not None and len(a.shape) >= 2 and len(b.shape) >= 2
            and a.shape[-1] == b.shape[-1] and a.numel == b.numel)


def _splits_columns(graph: Graph, node: onnx.NodeProto) -> bool:
    """A Split along the last axis: a fused gate-and-up product's two halves (Phi-3)."""
    if node.op_type != "Split":
        return False
    x = graph.info.get(node.input[0])
    return x is not None and len(x.shape) >= 2 and \
        norm_axis(attr(node, "axis", 0), len(x.shape)) == len(x.shape) - 1


def _region_ending_at(graph: Graph, du, last: onnx.NodeProto, kind: str) -> RowRegion | None:
    a = last.input[0]
    ai = graph.info.get(a)
    if ai is None or len(ai.shape) < 2 or ai.shape[-2] < 2:
        return None
    if kind == MLP and not _is_weight(graph, last.input[1]):
        return None
    # Walk back from the last product's input over row-wise nodes to the first products.
    between: dict[str, onnx.NodeProto] = {}
    products: dict[str, onnx.NodeProto] = {}
    stack = [a]
    while stack:
        p = du.producer.get(stack.pop())
        if p is None or p.name in between or p.name in products:
            continue
        if _is_product(graph, p, kind):
            products[p.name] = p
            continue
        if p.domain not in ("", "ai.onnx") or not (
                p.op_type in _ROW_WISE[kind] or (kind == MLP and (
                    _keeps_rows(graph, p) or _splits_columns(graph, p)))):
            continue
        between[p.name] = p
        # A Reshape's shape input is not data; every other input may come from the region.
        stack.extend(i for i in (p.input[:1] if p.op_type == "Reshape" else p.input) if i)
    if kind == ATTENTION:
        return _attention(graph, du, between, products.values(), last, ai.shape[-2])
    firsts = tuple(products.values())
    if not firsts or any(not _is_weight(graph, f.input[1]) for f in firsts) \
            or len({f.input[0] for f in firsts}) != 1:
        return None
    nodes = _downstream(between, {f.output[0] for f in firsts})
    flat = any(n.op_type == "Reshape" for n in nodes.values())
    x = graph.info.get(firsts[0].input[0])
    if not nodes or x is None or (flat and (len(x.shape) != 2 or len(ai.shape) != 2)):
        return None
    rows = x.shape[0] if flat else ai.shape[-2]
    region = RowRegion(MLP, firsts, tuple(nodes.values()), last, rows, flat)
    return region if _is_closed(graph, du, region) else None


def _attention(graph: Graph, du, between: dict[str, onnx.NodeProto], products,
               last: onnx.NodeProto, rows: int) -> RowRegion | None:
    """The scores' MatMul is the one whose output the chain starts from; a bias made by
    another MatMul joins the chain later, so its candidate covers fewer nodes."""
    best: RowRegion | None = None
    for first in products:
        nodes = _downstream(between, {first.output[0]})
        if not nodes:
            continue
        candidate = RowRegion(ATTENTION, (first,), tuple(nodes.values()), last, rows)
        if not _is_closed(graph, du, candidate):
            continue
        softmaxes = [n for n in nodes.values() if n.op_type == "Softmax"]
        if len(softmaxes) != 1 or not _softmax_over_last(graph, softmaxes[0]):
            continue
        if best is None or len(nodes) > len(best.nodes):
            best = candidate
    return best


def _downstream(between: dict[str, onnx.NodeProto], starts: set[str]
                ) -> dict[str, onnx.NodeProto]:
    """The nodes of ``between`` that read ``starts`` or each other's outputs: a walk over
    readers, linear in the region (a fixed point over ``between`` was quadratic, and on an
    unrolled recurrent layer, whose row-wise chain runs through every time step, took
    most of a minute)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in between.values():
        for i in dict.fromkeys(n.input):
            if i:
                readers.setdefault(i, []).append(n)
    chosen: dict[str, onnx.NodeProto] = {}
    stack = list(starts)
    while stack:
        for n in readers.get(stack.pop(), ()):
            if n.name not in chosen:
                chosen[n.name] = n
                stack.extend(o for o in n.output if o)
    return chosen


def _made(region_nodes, firsts) -> set[str]:
    made = {f.output[0] for f in firsts}
    for n in region_nodes:
        made.update(o for o in n.output if o)
    return made


def _is_closed(graph: Graph, du, region: RowRegion) -> bool:
    """Only the region reads its values, each spans the row axis (``flat``: its leading
    axes hold the rows), the last product's first input is one of them, and every outside
    input splits along the rows or broadcasts over them."""
    nodes, firsts, last = region.nodes, region.firsts, region.last
    rows, flat = region.rows, region.flat
    names = {n.name for n in nodes} | {last.name}
    made = _made(nodes, firsts)
    if last.input[0] not in made or any(i in made for i in last.input[1:]):
        return False
    outputs = set(graph.outputs)
    masks = {n.output[1] for n in nodes if n.op_type == "Dropout" and len(n.output) > 1}
    for v in made - masks:
        ti = graph.info.get(v)
        if v in outputs or ti is None or len(ti.shape) < 2:
            return False
        if (ti.numel // ti.shape[-1] if flat else ti.shape[-2]) != rows:
            return False
        if any(r.name not in names for r in du.readers.get(v, ())):
            return False
    for f in firsts:
        q = graph.info.get(f.input[0])
        if q is None or len(q.shape) < 2 or q.shape[-2] != rows:
            return False
    for n in nodes:
        if n.op_type == "Dropout" and len(n.output) > 1 and n.output[1] \
                and du.readers.get(n.output[1]):
            return False          # its mask is read outside
        if n.op_type == "Reshape":
            continue              # its shape input is dropped with it in the chunks
        for i in n.input:
            if i and i not in made and _side_split(graph.info.get(i), rows, flat) is None:
                return False
    return True


def _side_split(ti: TensorInfo | None, rows: int, flat: bool = False) -> bool | None:
    """True: split it with the rows; False: it broadcasts over them; None: neither. On
    flat chunks only scalars and per-column vectors broadcast the same way."""
    if ti is None:
        return None
    if flat:
        return False if len(ti.shape) <= 1 else None
    if len(ti.shape) < 2 or ti.shape[-2] == 1:
        return False
    return True if ti.shape[-2] == rows else None


def _softmax_over_last(graph: Graph, node: onnx.NodeProto) -> bool:
    rank = len(graph.info[node.output[0]].shape)
    axis = attr(node, "axis", -1 if graph.opset >= 13 else 1)
    return graph.opset >= 13 and norm_axis(axis, rank) == rank - 1


_WHAT = {
    ATTENTION: "a MatMul of queries by keys, row-wise nodes with one Softmax over the last "
               "axis, and a MatMul by the values",
    MLP: "MatMuls (or Gemms) of one value by 2-D weights, row-wise nodes (bias, activation, "
         "gate, Reshapes of flattened rows), and a MatMul by a 2-D weight",
}


def chunk_regions(graph: Graph, kind: str, chunks: int, source: str) -> tuple[Graph, dict]:
    """Rewrite every region of ``kind`` in ``graph`` (a forward model) over ``chunks`` row
    chunks, in place; return the graph and how many regions there were (the pass contract,
    ``memcc/pass_contract.py``)."""
    if chunks <= 1:
        return graph, {"regions": 0}
    regions = find_regions(graph, kind)
    if not regions:
        raise InputError(
            f"{source}: {FLAGS[kind]} found no {kind} to split: it looks for {_WHAT[kind]}, "
            f"whose values nothing else reads. Build without {FLAGS[kind]}.")
    emit = Emitter(graph, detached=True)
    # Each region's chunked nodes take the place of its last product (every input of the
    # region exists by then, and its output's readers come after); one pass over the nodes.
    instead = {id(r.last): _rewrite(graph, emit, r, chunks) for r in regions}
    removed = {id(n) for r in regions for n in r.members}
    nodes: list[onnx.NodeProto] = []
    for n in graph.nodes:
        if id(n) in instead:
            nodes.extend(instead[id(n)])
        elif id(n) not in removed:
            nodes.append(n)
    graph.set_nodes(nodes)
    for r in regions:
        for v in _made(r.nodes, r.firsts):
            graph.info.pop(v, None)
    return graph, {"regions": len(regions)}


def _rewrite(graph: Graph, emit: Emitter, region: RowRegion,
             chunks: int) -> list[onnx.NodeProto]:
    """The nodes that compute ``region`` over ``chunks`` row chunks, its output joined
    under the original name."""
    k = min(int(chunks), region.rows)
    sizes = [region.rows * (c + 1) // k - region.rows * c // k for c in range(k)]
    start = len(emit.nodes)
    split_of: dict[str, list[str]] = {}

    def parts(v: str) -> list[str]:
        if v not in split_of:
            split_of[v] = split_values(emit, v, len(graph.info[v].shape) - 2, sizes)
        return split_of[v]

    outs: list[str] = []
    first: dict[str, str] = {}  # chunk 0's values -> the whole ones (frontend/whole_rows.py)
    for c in range(k):
        renamed: dict[str, str] = first if c == 0 else {}

        def chunk_of(v: str, c: int = c, renamed: dict[str, str] = renamed) -> str:
            if not v or v in renamed:
                return renamed.get(v, v)
            split = _side_split(graph.info.get(v), region.rows, region.flat)
            return parts(v)[c] if split else v

        for node in region.members:
            if region.flat and node.op_type == "Reshape":
                renamed[node.output[0]] = chunk_of(node.input[0])   # chunks stay flat
                continue
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = emit.fresh(f"{node.name}/r{c}")
            if clone.op_type == "Dropout":   # a mask sequence of its own for every chunk
                reseed_dropouts([clone], "")
            del clone.input[:]
            if any(node is f for f in region.firsts):   # the first input's rows
                clone.input.extend([parts(node.input[0])[c], *node.input[1:]])
            elif node is region.last:     # the chunk's rows by the whole weight (and bias)
                clone.input.extend([renamed[node.input[0]], *node.input[1:]])
            else:
                clone.input.extend(chunk_of(i) for i in node.input)
            del clone.output[:]
            for o in node.output:
                if not o or (node.op_type == "Dropout" and o != node.output[0]):
                    clone.output.append("")
                    continue
                new = emit.fresh(f"{o}/r{c}")
                ti = graph.info[o]
                lead = () if region.flat else ti.shape[:-2]   # flat chunks stay 2-D
                graph.info[new] = TensorInfo(ti.dtype, (*lead, sizes[c], ti.shape[-1]))
                renamed[o] = new
                clone.output.append(new)
            while clone.output and not clone.output[-1]:
                del clone.output[-1]
            emit.nodes.append(clone)
        outs.append(renamed[region.last.output[0]])
    out = region.last.output[0]
    # Joined under the original name, so the output's readers stay as they are.
    emit.op("Concat", outs, outputs=[out], axis=len(graph.info[out].shape) - 2,
            info=graph.info[out])
    made = {o for n in emit.nodes[start:] for o in n.output}
    # Flat chunks dropped the region's Reshapes, so its inner values keep their chunk
    # names there (a shape computation read off the whole 3-D value would misread a flat
    # one): only the joined output is named back, and the 3-D values are recorded as
    # Reshapes of chunk 0's flat ones.
    inner = {} if region.flat else {new: o for o, new in first.items()
                                    if new in made and new != o}
    record_whole_rows(emit.nodes[-1], {p[0]: v for v, p in split_of.items() if p[0] != v},
                      {**inner, outs[0]: out},
                      _unflattened(graph, region, first) if region.flat else {})
    return emit.nodes[start:]


def _unflattened(graph: Graph, region: RowRegion, first: dict[str, str]
                 ) -> dict[str, tuple[str, str, list[int]]]:
    """A flat region's values that were not 2-D: each one -> (chunk 0's flat value, the
    shape input of the dropped Reshape that gave values of its shape that shape, the
    shape)."""
    shape_of = {tuple(graph.info[n.output[0]].shape): n.input[1] for n in region.members
                if n.op_type == "Reshape" and len(graph.info[n.output[0]].shape) != 2}
    out = {}
    for n in region.members:
        for o in n.output:
            ti = graph.info.get(o)
            if o and ti is not None and tuple(ti.shape) in shape_of and o in first:
                out[o] = (first[o], shape_of[tuple(ti.shape)], list(ti.shape))
    return out
