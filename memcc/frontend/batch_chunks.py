"""A full-resolution stem over batch chunks: its activations never formed whole.

A convnet's stem (Conv -> training-mode BatchNormalization -> activation [-> MaxPool]) runs
at the image's resolution, so its activations are the step's largest tensors, and its
BatchNorm's backward holds three of them at once besides the image (gy, x-hat and dx:
``_batchnorm_train_grad``, ``frontend/gradients/nn.py``). No recompute or variant gets
below that working set. Every op of the stem but the BatchNorm works on each sample
alone; the BatchNorm needs whole-batch sums, forward (mean and variance) and backward
(sum(gy), sum(gy * x-hat)). So the stem can run over batch chunks in two passes each way:

- forward: per chunk, the convolution and its per-channel mean and centred sum of squares
  (combined over chunks as Chan et al.'s parallel variance does, so no E[x^2] - E[x]^2
  cancellation); then per chunk again, the convolution recomputed, normalised with the
  batch statistics, the activation and the pooling; the pooled chunks joined;
- backward: per chunk, the chunk's forward recomputed from the image slice and the saved
  statistics, the pooling and activation gradients (the ordinary rules, on the chunk's
  nodes), the two channel sums accumulated; then per chunk again, all of that
  recomputed, dx from the sums, and the convolution's weight gradient accumulated.

Only one chunk's activations are live at a time (plus the pooled output and its gradient,
a quarter of the stem's size behind a 2x2-strided pooling), at the price of the stem's
convolution four times instead of once and its weight gradient in pieces. The rewrite runs
on the forward model before the autodiff (``memcc build --batch-chunks K``); the forward
nodes it makes are skipped by the autodiff, which hands back the pooled output's gradient,
and ``emit_backward`` writes their backward after it. The image must need no gradient (a
graph input). Batch statistics and gradients are sums in another order: the tier is
equivalent, within ``BATCH_CHUNKS_TOLERANCE`` (tests/test_batch_chunks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx

from memcc.errors import InputError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients import load_rules
from memcc.frontend.gradients.registry import RULES, GradContext
from memcc.frontend.gradients.shape_ops import concat_values, slice_values
from memcc.graph import Graph, TensorInfo, attr
from memcc.step import tag_node

# Largest difference of the loss, every gradient and the running statistics against the
# whole stem's step, relative to the value's largest magnitude (tests/test_batch_chunks.py):
# the sums' rounding, amplified by the training BatchNorms downstream where they normalise
# few values (1.6e-6 on a transformers ResNet export at 32 px, 5.2e-6 on the zoo's
# ResNet-18 at 64 px, 2.1e-5 at 32 px, where its last stage is 1 x 1).
BATCH_CHUNKS_TOLERANCE = 1e-4
BATCH = "batch"
RULE = "batch_chunks"
# One node on the normalised value (MobileNetV3's stem: HardSwish) ...
_ACTIVATIONS = frozenset({"Relu", "Clip", "LeakyRelu", "HardSwish", "HardSigmoid", "Sigmoid",
                          "Tanh", "Elu", "Selu", "Celu", "Softplus", "Gelu"})
# ... or the value times a gate of it (SiLU as the exporters write it: x * Sigmoid(x),
# EfficientNet's stem; a HardSwish written out: x * HardSigmoid(x)).
_GATES = frozenset({"Sigmoid", "HardSigmoid"})
ACTIVATIONS_SAID = ("an activation (Relu, Clip, LeakyRelu, HardSwish, Sigmoid, Tanh, Elu, "
                    "Selu, Celu, Softplus, Gelu, or x times Sigmoid(x) or HardSigmoid(x))")


@dataclass(frozen=True)
class Stem:
    """Conv -> BatchNormalization (training) -> activation [-> MaxPool] from a graph input;
    the activation is one node, or a gate and the Mul of the value by it (``acts``)."""

    conv: onnx.NodeProto
    bn: onnx.NodeProto
    acts: tuple[onnx.NodeProto, ...]
    pool: onnx.NodeProto | None

    @property
    def nodes(self) -> list[onnx.NodeProto]:
        return [self.conv, self.bn, *self.acts] + ([self.pool] if self.pool is not None else [])

    @property
    def output(self) -> str:
        return self.nodes[-1].output[0]


@dataclass
class ChunkedStem:
    """A stem after ``chunk_forward``: its chunks (start, size along the batch), the saved
    batch statistics (``mean``, ``inv`` = 1/std, as [1, C, 1, ...]) and the forward nodes
    the autodiff must skip."""

    stem: Stem
    parts: list[tuple[int, int]]
    mean: str = ""
    inv: str = ""
    skip: list[str] = field(default_factory=list)


def find_stems(graph: Graph) -> list[Stem]:
    """The stems ``chunk_forward`` can split: a Conv of a graph input (not an initializer)
    whose output only a training-mode BatchNorm reads, whose output only an activation
    reads (``_activation``; then only a MaxPool, optionally); nothing in between is a graph
    output."""
    readers = graph.consumers()
    outputs = set(graph.outputs)
    data = {i for i in graph.inputs if i not in graph.initializers}

    def only(value: str, ops) -> onnx.NodeProto | None:
        r = readers.get(value, [])
        if len(r) == 1 and r[0].op_type in ops and r[0].input[0] == value \
                and value not in outputs:
            return r[0]
        return None

    found = []
    for conv in graph.nodes:
        if conv.op_type != "Conv" or conv.input[0] not in data:
            continue
        bn = only(conv.output[0], {"BatchNormalization"})
        if bn is None or len(bn.input) < 5 or not attr(bn, "training_mode", 0):
            continue
        single = only(bn.output[0], _ACTIVATIONS)
        acts = (single,) if single is not None else _activation(bn.output[0], readers, outputs)
        if not acts:
            continue
        pool = only(acts[-1].output[0], {"MaxPool"})
        if pool is not None and len(pool.output) > 1 and pool.output[1]:
            pool = None  # its indices are read elsewhere
        found.append(Stem(conv, bn, acts, pool))
    return found


def _activation(y: str, readers: dict, outputs: set[str]) -> tuple[onnx.NodeProto, ...]:
    """(gate, Mul) where ``y``'s only readers are a gate of it (``_GATES``) and the Mul of
    ``y`` by the gate's output, which nothing else reads; else ()."""
    r = readers.get(y, [])
    if len(r) != 2 or y in outputs:
        return ()
    gate = next((n for n in r if n.op_type in _GATES and list(n.input) == [y]), None)
    mul = next((n for n in r if n.op_type == "Mul"), None)
    if gate is None or mul is None or gate.output[0] in outputs:
        return ()
    if sorted(mul.input) != sorted([y, gate.output[0]]) \
            or len(readers.get(gate.output[0], [])) != 1:
        return ()
    return (gate, mul)


def chunk_parts(batch: int, k: int) -> list[tuple[int, int]]:
    """(start, size) of ``min(k, batch)`` chunks as equal as they can be."""
    k = max(1, min(k, batch))
    sizes = [batch // k + (1 if i < batch % k else 0) for i in range(k)]
    return [(sum(sizes[:i]), s) for i, s in enumerate(sizes)]


def chunk_stems(graph: Graph, k: int, source: str) -> list[ChunkedStem]:
    """Rewrite every stem ``find_stems`` finds over ``k`` batch chunks (``chunk_forward``);
    none found with ``k`` > 1 is an error naming the pattern."""
    if k <= 1:
        return []
    stems = find_stems(graph)
    if stems:  # a batch of one has nothing to split (memcc tune builds every size)
        return [chunk_forward(graph, s, k) for s in stems if batch_of(graph, s) > 1]
    raise InputError(f"{source}: --batch-chunks {k}: no stem to split (a Conv of a graph "
                         "input read only by a training-mode BatchNormalization, then only by "
                         f"{ACTIVATIONS_SAID}, then optionally a MaxPool); build it "
                     "with --batch-chunks 1")


def splittable_stems(graph: Graph) -> int:
    """How many stems ``--batch-chunks`` would split (a batch of one has nothing to)."""
    return sum(batch_of(graph, s) > 1 for s in find_stems(graph))


def batch_of(graph: Graph, stem: Stem) -> int:
    """The batch ``stem`` runs on (its image's first dimension)."""
    return int((graph.info[stem.conv.input[0]].shape or [1])[0])


def chunk_forward(graph: Graph, stem: Stem, k: int) -> ChunkedStem:
    """Replace ``stem``'s nodes by its forward over batch chunks (module docstring), in
    place of the Conv; the pooled output keeps its name, and the BatchNorm's running
    statistics outputs theirs (named ``stat.running`` where the export left them empty, as
    dynamo's exports restored to train mode do), so that the carried statistics
    (``frontend/update.py``) find them."""
    bn = stem.bn
    for k_out, stat in ((1, bn.input[3]), (2, bn.input[4])):
        while len(bn.output) <= k_out:
            bn.output.append("")
        if not bn.output[k_out]:   # not ``stat.new``: the step writer gives that name
            bn.output[k_out] = f"{stat}.running"
            graph.info[bn.output[k_out]] = graph.info[stat]
    chunked = ChunkedStem(stem, chunk_parts(batch_of(graph, stem), k))
    emit = Emitter(graph, prefix="batch_chunks/", detached=True)
    chunked.mean, chunked.inv = _statistics(emit, chunked)
    pooled = [_chunk_forward(emit, chunked, part).values[-1] for part in chunked.parts]
    joined = concat_values(emit, pooled, 0)
    # The last node writes the stem's output under its own name.
    last = emit.nodes[-1]
    last.output[0] = stem.output
    graph.info.pop(joined, None)
    chunked.skip = [n.name for n in emit.nodes]
    at = next(i for i, n in enumerate(graph.nodes) if n is stem.conv)
    gone = {id(n) for n in stem.nodes}
    rest = [n for n in graph.nodes if id(n) not in gone]
    # The same list object: emitters made before this one append to it.
    graph.nodes[:] = rest[:at] + emit.nodes + rest[at:]
    graph.set_nodes(graph.nodes)
    return chunked


def _statistics(emit: Emitter, chunked: ChunkedStem) -> tuple[str, str]:
    """The batch mean and 1/std over the chunks (population variance, as ORT's training
    BatchNorm normalises with), and the running statistics' new values."""
    stem, parts = chunked.stem, chunked.parts
    rank = len(emit.info(stem.conv.output[0]).shape)
    axes = [0] + list(range(2, rank))
    dtype = emit.info(stem.conv.output[0]).dtype
    means, squares = [], []
    for part in parts:
        z = _conv(emit, stem, _slice(emit, stem.conv.input[0], part))
        m = emit.reduce_mean(z, axes, keepdims=True)
        means.append(m)
        squares.append(emit.reduce_sum_square(emit.sub(z, m), axes, keepdims=True))
    batch = sum(s for _, s in parts)
    per = float(np.prod(emit.info(stem.conv.output[0]).shape[2:]))
    mean = _weighted_sum(emit, means, [s / batch for _, s in parts], dtype)
    spread = [emit.mul(d, d) for d in (emit.sub(m, mean) for m in means)]
    m2 = emit.add(_weighted_sum(emit, squares, [1.0] * len(parts), dtype),
                  _weighted_sum(emit, spread, [s * per for _, s in parts], dtype))
    var = emit.mul(m2, emit.scalar(1.0 / (batch * per), dtype))
    eps = float(attr(stem.bn, "epsilon", 1e-5))
    inv = emit.unary("Reciprocal", emit.unary("Sqrt", emit.add(var, emit.scalar(eps, dtype))))
    _running(emit, stem.bn, (mean, var))
    return mean, inv


def _running(emit: Emitter, bn: onnx.NodeProto, stats: tuple[str, str]) -> None:
    """running = running * momentum + batch statistic * (1 - momentum), written to the
    BatchNorm's own running-statistics outputs."""
    momentum = float(attr(bn, "momentum", 0.9))
    for stat, now, out in zip(bn.input[3:5], stats, bn.output[1:3], strict=True):
        info = emit.info(stat)
        flat = emit.cast(emit.reshape(now, [info.shape[0]]), info.dtype)
        new = emit.add(emit.mul(stat, emit.scalar(momentum, info.dtype)),
                       emit.mul(flat, emit.scalar(1.0 - momentum, info.dtype)))
        emit.nodes[-1].output[0] = out
        emit.graph.info.pop(new, None)


def _weighted_sum(emit: Emitter, values: list[str], weights: list[float], dtype: int) -> str:
    total = None
    for v, w in zip(values, weights, strict=True):
        term = v if w == 1.0 else emit.mul(v, emit.scalar(w, dtype))
        total = term if total is None else emit.add(total, term)
    return total


def _slice(emit: Emitter, x: str, part: tuple[int, int]) -> str:
    start, size = part
    info = emit.info(x)
    return emit.op("Slice", [x, emit.ints([start]), emit.ints([start + size]), emit.ints([0])],
                   info=TensorInfo(info.dtype, (size,) + tuple(info.shape[1:])))


def _clone_all(emit: Emitter, nodes, names: dict[str, str]) -> list[onnx.NodeProto]:
    """``nodes`` again, in order, each input renamed by ``names`` (which each clone's
    output joins, so that a later node reads an earlier clone)."""
    out = []
    for node in nodes:
        first = names[node.input[0]]
        out.append(_clone(emit, node, first, [names.get(i, i) for i in node.input]))
        names[node.output[0]] = out[-1].output[0]
    return out


def _clone(emit: Emitter, node: onnx.NodeProto, first: str,
           inputs: list[str] | None = None) -> onnx.NodeProto:
    """``node`` again on ``first`` (its other inputs kept, or ``inputs``, all of them),
    its outputs fresh, with the batch of ``first``; returns the new node (already
    emitted)."""
    inputs = [first] + list(node.input[1:]) if inputs is None else inputs
    batch = emit.info(first).shape[0]
    infos = []
    for o in node.output[:1]:
        info = emit.info(o)
        infos.append(TensorInfo(info.dtype, (batch,) + tuple(info.shape[1:])))
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    emit.op(node.op_type, inputs, info=infos[0],
            name=node.op_type, **attrs)
    return emit.nodes[-1]


def _conv(emit: Emitter, stem: Stem, x: str) -> str:
    return _clone(emit, stem.conv, x).output[0]


def _channel(emit: Emitter, v: str, rank: int, dtype: int) -> str:
    c = emit.info(v).shape[0]
    return emit.reshape(emit.cast(v, dtype), [1, c] + [1] * (rank - 2))


@dataclass(frozen=True)
class _Chunk:
    """One chunk's forward: [image slice, x-hat, normalised, activation, (pooled)] and the
    activation and pooling nodes (the backward runs their gradient rules on them)."""

    values: list[str]
    acts: list[onnx.NodeProto]
    pool: onnx.NodeProto | None


def _chunk_forward(emit: Emitter, chunked: ChunkedStem, part: tuple[int, int]) -> _Chunk:
    """One chunk's forward from the image slice and the batch statistics (the backward
    recomputes it the same way, so its values are the forward's)."""
    stem = chunked.stem
    x = _slice(emit, stem.conv.input[0], part)
    z = _conv(emit, stem, x)
    info = emit.info(z)
    rank = len(info.shape)
    xhat = emit.mul(emit.sub(z, chunked.mean), chunked.inv)
    gamma = _channel(emit, stem.bn.input[1], rank, info.dtype)
    beta = _channel(emit, stem.bn.input[2], rank, info.dtype)
    y = emit.add(emit.mul(xhat, gamma), beta)
    acts = _clone_all(emit, stem.acts, {stem.bn.output[0]: y})
    pool = _clone(emit, stem.pool, acts[-1].output[0]) if stem.pool is not None else None
    values = [x, xhat, y, acts[-1].output[0]] + ([pool.output[0]] if pool is not None else [])
    return _Chunk(values, acts, pool)


def emit_backward(graph: Graph, chunked: ChunkedStem, g_out: str | None,
                  wanted: set[str]) -> dict[str, str]:
    """Append the stem's backward from the gradient of its output (``g_out``; None: no
    gradient reaches it) in two passes over the chunks (module docstring); return the
    gradients of the parameters in ``wanted`` it reads (Conv weight and bias, BatchNorm
    scale and bias)."""
    if g_out is None:
        return {}
    load_rules()
    stem = chunked.stem
    emit = Emitter(graph, prefix="grad/batch_chunks/")
    start = len(graph.nodes)
    z_info = graph.info[stem.conv.output[0]]
    rank, dtype = len(z_info.shape), z_info.dtype
    axes = [0] + list(range(2, rank))
    sums: list[str | None] = [None, None]        # sum(gy), sum(gy * x-hat)
    for part in chunked.parts:
        chunk, gy = _chunk_gy(emit, chunked, part, g_out)
        for i, v in enumerate((gy, emit.mul(gy, chunk.values[1]))):
            s = emit.reduce_sum(v, axes, keepdims=True)
            sums[i] = s if sums[i] is None else emit.add(sums[i], s)
    sum_gy, sum_gy_xhat = sums
    n = float(np.prod([z_info.shape[a] for a in axes]))
    inv_n = emit.scalar(1.0 / n, dtype)
    gamma = _channel(emit, stem.bn.input[1], rank, dtype)
    factor = emit.mul(gamma, chunked.inv)
    grads: dict[str, str] = {}
    conv_params = [p for p in stem.conv.input[1:] if p in wanted]
    for part in chunked.parts:
        chunk, gy = _chunk_gy(emit, chunked, part, g_out)
        centred = emit.sub(gy, emit.mul(chunk.values[1], emit.mul(sum_gy_xhat, inv_n)))
        gz = emit.mul(emit.sub(centred, emit.mul(sum_gy, inv_n)), factor)
        if conv_params:
            _conv_grads(emit, stem, (chunk.values[0], gz), set(conv_params), grads)
    c = graph.info[stem.bn.input[1]].shape[0]
    for p, s in ((stem.bn.input[1], sum_gy_xhat), (stem.bn.input[2], sum_gy)):
        if p in wanted:
            grads[p] = emit.cast(emit.reshape(s, [c]), graph.info[p].dtype)
    for node in graph.nodes[start:]:
        tag_node(node, grad_of=chunked.skip[-1], rule=RULE)
    return grads


def _chunk_gy(emit: Emitter, chunked: ChunkedStem, part: tuple[int, int], g_out: str
              ) -> tuple[_Chunk, str]:
    """One chunk's forward recomputed, and the gradient reaching its BatchNorm's output
    (the pooling's and activation's own rules, on the chunk's nodes)."""
    chunk = _chunk_forward(emit, chunked, part)
    g = _slice(emit, g_out, part)
    inner = {i for n in chunk.acts for i in n.input}
    ctx = GradContext(graph=emit.graph, emit=emit,
                      requires_grad=set(chunk.values[2:4]) | inner)
    if chunk.pool is not None:
        g = RULES["MaxPool"](ctx, chunk.pool, [g])[0]
        # ORT never frees an output no node reads: a one-element Slice of the recomputed
        # pooled output (the rule reads its indices only) frees it (as variant_pool does).
        rank = len(emit.info(chunk.pool.output[0]).shape)
        slice_values(emit, chunk.pool.output[0], [0] * rank, [1] * rank, list(range(rank)))
    grads = {chunk.acts[-1].output[0]: g}
    for node in reversed(chunk.acts):   # the gate's Mul first: y gets a part from each
        got = RULES[node.op_type](ctx, node, [grads.pop(node.output[0])])
        for name, part in zip(node.input, got, strict=False):
            if part is not None and name in inner:
                grads[name] = emit.add(grads[name], part) if name in grads else part
    return chunk, grads[chunk.values[2]]


def _conv_grads(emit: Emitter, stem: Stem, chunk: tuple[str, str], wanted: set[str],
                grads: dict[str, str]) -> None:
    """One chunk's convolution weight (and bias) gradient, added to ``grads``; ``chunk``:
    the image slice and the gradient of the chunk's convolution output."""
    x, gz = chunk
    ctx = GradContext(graph=emit.graph, emit=emit, requires_grad=set(wanted))
    node = _clone(emit, stem.conv, x)
    emit.nodes.remove(node)   # the rule reads its attributes only, not its output
    got = RULES["Conv"](ctx, node, [gz])
    emit.graph.info.pop(node.output[0], None)
    for p, g in zip(node.input, got, strict=False):
        if g is not None and p in wanted:
            grads[p] = emit.add(grads[p], g) if p in grads else g
