"""Dropout masks that depend only on (seed, step, node, element): exact resumption.

ONNX Runtime's ``Dropout`` keeps its generator inside the session: a seeded Dropout draws
the same *sequence* of masks in every session, one mask per run. A training run that
stops at step k and resumes in a new session therefore starts that sequence again, and
its masks (and every tensor after them) differ from the uninterrupted run's. Nothing a
checkpoint can hold restores a session's generator.

So a training step does not use ORT's Dropout. ``counter_dropouts`` replaces every
training-mode ``Dropout`` (constant ratio > 0, constant ``training_mode`` true) by a
counter-based generator written in standard ONNX ops (and every RandomUniform(Like) and
RandomNormal(Like), which ORT seeds from the clock, by the same hash: ``random_draws.py``),
and gives the step a carried int64
scalar, ``dropout.step``, which the step advances (``dropout.step.new = dropout.step + 1``)
like optimizer state: it is stored in checkpoints and restored with them. Each element's
keep/drop decision is a hash of (the node's seed attribute, the counter, the element's flat
index), so a resumed, re-created or re-compiled step draws exactly the masks of the
uninterrupted run, on any provider and at any thread count (``dropout_mask`` is the same
function in numpy; tests/test_dropout_masks.py holds the two together).

The hash, all in uint32 arithmetic (which wraps by definition in C++ and CUDA alike), uses
only Add, Mul, Div, GreaterOrEqual, Cast, Range, Split and Reshape, which ORT's CPU
provider runs for uint32 (its kernel registry) and its CUDA provider too (its sources; no
GPU run yet: ``benchmarks/dropout_cuda_check.py``). CUDA's sources show no BitwiseXor or
BitShift kernels, so xor-shift mixing is written as an add-shift, and a squaring supplies
the non-linearity::

    k1, k2 = keys(seed, step)     # per Dropout; computed for all of them at once
    h = (i + k1) * M0                            # i: the element's flat index
    h = h * h + k2
    h = h + h // 2**16
    h = h * M1
    keep = h >= round(ratio * 2**32)
    y = where(keep, x * 1/(1-ratio), 0)

``(i + k1) * M0`` is formed from a row vector and a column vector (broadcast, shared by the
Dropouts of one shape), so the full-size work is 6 integer ops, the comparison, the scaling
and the Where: measured costs are in
docs/DETERMINISM.md. The mask keeps the Dropout's mask output name (its gradient rule reads
it); the last node keeps the Dropout's name and records the original node, so ``memcc
export`` writes a plain ``Dropout`` back into the forward model.

Steps built before this (Dropouts with a seed attribute, no counter) are rewritten when
they are loaded (``upgrade_step``); their checkpoints hold no counter, and resuming one
sets the counter to the checkpoint's step (``checkpoint_counter``).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from memcc.errors import InputError
from memcc.frontend.counter_hash import (
    K2_SALT,
    M0,
    M1,
    M2,
    SHIFT,
    U32,
    dropout_hash,
    name_seed,
)
from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo, attr

COUNTER = "dropout.step"
COUNTER_NEW = f"{COUNTER}.new"
# On the node that computes a rewritten Dropout's output: the original node (hex of its
# serialized NodeProto), so that an export can put the plain Dropout back.
ORIGINAL_PROP = "memcc.dropout"
# Beside it: the values of the original's constant ratio and training_mode inputs (JSON:
# name -> [value, ONNX element type]). The rewrite leaves them unread, so a step drops the
# initializers or Constants that held them (a dynamo export's ``val_24``, ``val_25``);
# ``restore_dropouts`` writes them back as Constants where the graph no longer has them.
OPERANDS_PROP = "memcc.dropout.operands"

# ------------------------------------------------------------------------- reference
def threshold(ratio: float) -> int:
    """Elements whose hash is at least this are kept: P(keep) = 1 - ratio (to 2**-32)."""
    return min(int(round(float(ratio) * 2.0 ** 32)), (1 << 32) - 1)


def dropout_mask(seed: int, step: int, shape: tuple[int, ...], ratio: float) -> np.ndarray:
    """The keep mask (bool) the rewritten Dropout draws at ``step`` (numpy reference)."""
    return dropout_hash(seed, step, shape) >= U32(threshold(ratio))


# ------------------------------------------------------------------------- the rewrite
def _constant(graph: Graph, name: str,
              producers: Mapping[str, onnx.NodeProto] | None = None) -> np.ndarray | None:
    """``name``'s value where it is an initializer or a Constant's output; ``producers``:
    the graph's producer map when the caller holds one (building it per call cost a timm
    EdgeNeXt's load 2.3 s: two lookups for each of its 131 Dropouts)."""
    if not name:
        return None
    if name in graph.initializers and name not in graph.inputs:
        return np.asarray(graph.initializers[name])
    from memcc.frontend.constants import constant_node_value

    producer = (graph.producers() if producers is None else producers).get(name)
    if producer is not None and producer.op_type == "Constant":
        return constant_node_value(producer)
    return None


def rewritable(graph: Graph, node: onnx.NodeProto,
               producers: Mapping[str, onnx.NodeProto] | None = None) -> float | None:
    """The ratio of a Dropout this module rewrites (training mode known true, constant
    ratio > 0, a tensor of rank >= 1), else None: such a Dropout is an identity, or its
    mode or ratio is only known at run time and ORT's Dropout stays."""
    if node.op_type != "Dropout" or node.domain not in ("", "ai.onnx") or graph.opset < 12:
        return None
    tm = node.input[2] if len(node.input) > 2 else ""
    mode = _constant(graph, tm, producers)
    if mode is None or not bool(np.asarray(mode).reshape(-1)[0]):
        return None
    r = node.input[1] if len(node.input) > 1 else ""
    ratio = _constant(graph, r, producers) if r else np.asarray(0.5)
    if ratio is None:
        return None
    value = float(np.asarray(ratio).reshape(-1)[0])
    ti = graph.info.get(node.input[0])
    if not 0.0 < value < 1.0 or ti is None or len(ti.shape) == 0:
        return None
    return value


def warn_inactive_dropouts(graph: Graph, source: str) -> list[str]:
    """Dropouts with a ratio above 0 but no training mode (ONNX runs them as an identity) in
    a model whose other Dropouts train: the exporter wrote these as inference (the
    attention dropout inside ``scaled_dot_product_attention``, in both exporters), so the
    step does not drop there where PyTorch in train mode does. Warned, not changed: the
    graph cannot say which the user meant. Returns their names."""
    producers = graph.producers()
    dropouts = [n for n in graph.nodes if n.op_type == "Dropout"
                and n.domain in ("", "ai.onnx")]
    if not any(rewritable(graph, n, producers) for n in dropouts):
        return []
    idle = []
    for n in dropouts:
        mode = _constant(graph, n.input[2], producers) if len(n.input) > 2 else np.asarray(0)
        ratio = _constant(graph, n.input[1], producers) if len(n.input) > 1 and \
            n.input[1] else None
        if mode is not None and not bool(np.asarray(mode).reshape(-1)[0]) and \
                ratio is not None and float(np.asarray(ratio).reshape(-1)[0]) > 0.0:
            idle.append(n.name or n.output[0])
    if idle:
        from memcc.frontend.export_signature import ExportWarning

        warnings.warn(
            f"{source}: {len(idle)} Dropout node(s) have a ratio above 0 but no training mode "
            f"(e.g. '{idle[0]}'), so ONNX runs them as an identity and the step does not "
            "drop there, while the model's other Dropouts train: the exporter wrote these "
            "for inference (PyTorch's scaled_dot_product_attention exports its attention "
            "dropout so), where PyTorch in train mode drops. The step trains without them.",
            ExportWarning, stacklevel=2)
    return idle


def _seed(node: onnx.NodeProto) -> int:
    """A Dropout's seed attribute (memcc seeds every one at load, ``seed_dropouts``); a
    random op's own seed, or the seed load would give it."""
    seed = attr(node, "seed", None)
    return name_seed(node.name) if seed is None else int(seed)


def counter_dropouts(graph: Graph) -> list[str]:
    """Replace every rewritable Dropout of ``graph`` (a step, in place) by the counter-based
    generator reading ``COUNTER``; return the names of the Dropouts replaced. The caller
    makes ``COUNTER`` carried state (``add_counter``)."""
    from memcc.frontend.random_draws import RANDOM_OPS, emit_draw, keys_of, rewritable_random

    producers = graph.producers() if any(n.op_type == "Dropout" for n in graph.nodes) else {}
    targets: list[tuple[onnx.NodeProto, object]] = []   # in the graph's order: the first
    for n in graph.nodes:                               # computes every target's keys
        how = rewritable(graph, n, producers) if n.op_type == "Dropout" else \
            rewritable_random(graph, n) if n.op_type in RANDOM_OPS else None
        if how is not None:
            targets.append((n, how))
    if not targets:
        return []
    if COUNTER in graph.info and COUNTER not in graph.inputs:
        raise InputError(f"cannot add the Dropout step counter '{COUNTER}': the model has a "
                         "value of that name; rename it")
    graph.info[COUNTER] = TensorInfo(TensorProto.INT64, ())
    emit = Emitter(graph, detached=True)
    seeds: list[int] = []
    slots: list[list[int]] = []   # per target: its keys' places among ``seeds``
    for node, how in targets:
        own = [_seed(node)] if node.op_type == "Dropout" else keys_of(_seed(node), how)
        slots.append(list(range(len(seeds), len(seeds) + len(own))))
        seeds += own
    gen = _Generator(graph, emit, seeds)
    instead: dict[int, list[onnx.NodeProto]] = {}
    for d, (node, how) in enumerate(targets):
        start = len(emit.nodes)
        if d == 0:   # the keys of every target, computed once (their inputs: the counter)
            gen.keys()
        if node.op_type == "Dropout":
            gen.replace(node, how, slots[d][0])
        else:
            emit_draw(gen, node, how, slots[d])
        instead[id(node)] = emit.nodes[start:]
    nodes: list[onnx.NodeProto] = []
    for n in graph.nodes:
        nodes.extend(instead.get(id(n), [n]))
    graph.set_nodes(nodes)
    return [n.name for n, _ in targets]


class _Generator:
    """Emits the generator's nodes. Shared by all Dropouts of a step: one computation of
    every Dropout's keys (a vector over the Dropouts, then Split), and one pair of index
    vectors per shape, so that a step with many Dropouts launches few extra kernels (on
    CUDA each small op is a kernel launch)."""

    def __init__(self, graph: Graph, emit: Emitter, seeds: list[int]) -> None:
        self.graph, self.emit, self.seeds = graph, emit, seeds
        self.k1m: list[str] = []    # per Dropout: k1 * M0, shape [1]
        self.k2: list[str] = []     # per Dropout: k2, shape [1]
        self._index: dict[tuple[int, int], tuple[str, str]] = {}

    def c(self, v: int) -> str:
        return self.emit.const(np.asarray(v % (1 << 32), dtype=U32), name="dropout.k")

    def op(self, kind: str, a: str, b: str, shape: tuple[int, ...] = ()) -> str:
        return self.emit.op(kind, [a, b], info=TensorInfo(TensorProto.UINT32, shape))

    def mix(self, h: str, add: str, shape: tuple[int, ...] = ()) -> str:
        """As ``counter_hash._mix``: ((h*h + a) + (h*h + a) // 2**16) * M1."""
        h = self.op("Add", self.op("Mul", h, h, shape), add, shape)
        h = self.op("Add", h, self.op("Div", h, self.c(SHIFT), shape), shape)
        return self.op("Mul", h, self.c(M1), shape)

    def keys(self) -> None:
        """As ``step_keys``, for every Dropout at once."""
        e, c, n = self.emit, self.c, len(self.seeds)
        vec = (n,)
        step32 = e.op("Cast", [COUNTER], to=TensorProto.UINT32, name="dropout.step32",
                      info=TensorInfo(TensorProto.UINT32, ()))
        seeds = e.const(np.asarray([v % (1 << 32) for v in self.seeds], dtype=U32),
                        name="dropout.seeds")
        s = self.op("Add", self.op("Mul", step32, c(M2)), seeds, vec)
        k1 = self.mix(self.op("Mul", s, c(M0), vec), c(K2_SALT), vec)
        k2 = self.mix(self.op("Mul", self.op("Add", k1, c(K2_SALT), vec), c(M0), vec),
                      c(M2), vec)
        k1m = self.op("Mul", k1, c(M0), vec)
        ones = e.ints([1] * n)
        one = TensorInfo(TensorProto.UINT32, (1,))
        for k, out in ((k1m, self.k1m), (k2, self.k2)):
            names = e.op("Split", [k, ones], outputs=n, axis=0, info=[one] * n)
            out.extend([names] if isinstance(names, str) else names)

    def _arange(self, n: int) -> str:
        e = self.emit
        r = e.op("Range", [e.const(np.asarray(0, np.int64), name="dropout.zero"),
                           e.const(np.asarray(n, np.int64), name="dropout.n"),
                           e.const(np.asarray(1, np.int64), name="dropout.one")],
                 info=TensorInfo(TensorProto.INT64, (n,)))
        return e.op("Cast", [r], to=TensorProto.UINT32,
                    info=TensorInfo(TensorProto.UINT32, (n,)))

    def index(self, rows: int, cols: int) -> tuple[str, str]:
        """(row * cols * M0 over the rows, col * M0 over the columns), once per shape."""
        if (rows, cols) not in self._index:
            c = self.c
            self._index[rows, cols] = (
                self.op("Mul", self._arange(rows), c(cols * M0), (rows,)),
                self.op("Mul", self._arange(cols), c(M0), (cols,)))
        return self._index[rows, cols]

    def hash(self, shape: tuple[int, ...], d: int) -> str:
        """The element hash of target ``d`` over a tensor of ``shape`` (``dropout_hash``)."""
        emit = self.emit
        cols = shape[-1]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        # (i + k1) * M0 with i = row * cols + col: row * cols * M0 + k1 * M0 + col * M0.
        row_base, col = self.index(rows, cols)
        lead = (*shape[:-1], 1)
        row = self.op("Add", row_base, self.k1m[d], (rows,))
        row = emit.op("Reshape", [row, emit.ints(lead)],
                      info=TensorInfo(TensorProto.UINT32, lead))
        return self.mix(self.op("Add", row, col, shape), self.k2[d], shape)

    def mark_original(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """The last node emitted takes ``node``'s name and records it, so that an export
        writes ``node`` back (``restore_dropouts``)."""
        final = self.emit.nodes[-1]
        final.name = node.name   # provenance (memcc.grad_of) keeps pointing at a node
        final.metadata_props.extend(node.metadata_props)
        original = onnx.NodeProto()
        original.CopyFrom(node)
        del original.metadata_props[:]
        if len(original.output) > 1:   # the mask is the generator's; an export needs only y
            del original.output[1:]
        final.metadata_props.add(key=ORIGINAL_PROP, value=original.SerializeToString().hex())
        return original

    def replace(self, node: onnx.NodeProto, ratio: float, d: int) -> None:
        graph, emit = self.graph, self.emit
        x = node.input[0]
        ti = graph.info[x]
        shape = tuple(int(v) for v in ti.shape)
        h = self.hash(shape, d)
        c = self.c
        mask_name = node.output[1] if len(node.output) > 1 and node.output[1] else \
            emit.fresh(f"{node.output[0]}.keep")
        keep = emit.op("GreaterOrEqual", [h, c(threshold(ratio))], outputs=[mask_name],
                       info=TensorInfo(TensorProto.BOOL, shape))
        scale = emit.const(np.asarray(1.0 / (1.0 - ratio), dtype=ti.np_dtype),
                           name="dropout.scale")
        zero = emit.const(np.asarray(0.0, dtype=ti.np_dtype), name="dropout.zero_value")
        scaled = emit.op("Mul", [x, scale], info=ti)
        emit.op("Where", [keep, scaled, zero], outputs=[node.output[0]], info=ti)
        final = emit.nodes[-1]
        original = self.mark_original(node)
        operands = {}
        for name in original.input[1:3]:
            value = _constant(graph, name)
            if value is not None:
                operands[name] = [np.asarray(value).reshape(-1)[0].item(),
                                  helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)]
        if operands:
            final.metadata_props.add(key=OPERANDS_PROP, value=json.dumps(operands))


def add_counter(graph: Graph, state: dict[str, str]) -> str:
    """Make ``COUNTER`` carried state of the step: initial value 0, the node that advances
    it (tagged an update), its output. Return the output's name."""
    from memcc.step import Role, tag_node

    graph.initializers[COUNTER] = np.zeros((), np.int64)
    graph.info[COUNTER] = TensorInfo(TensorProto.INT64, ())
    one = helper.make_tensor(f"{COUNTER}.one", TensorProto.INT64, (), [1])
    nodes = [helper.make_node("Constant", [], [f"{COUNTER}.one"], name=f"{COUNTER}.one",
                              value=one),
             helper.make_node("Add", [COUNTER, f"{COUNTER}.one"], [COUNTER_NEW],
                              name=f"{COUNTER}.advance")]
    for n in nodes:
        tag_node(n, role=Role.UPDATE.value)
    graph.info[f"{COUNTER}.one"] = TensorInfo(TensorProto.INT64, ())
    graph.info[COUNTER_NEW] = TensorInfo(TensorProto.INT64, ())
    graph.set_nodes([*graph.nodes, *nodes])
    state[COUNTER_NEW] = COUNTER
    return COUNTER_NEW


def upgrade_step(graph: Graph) -> int:
    """A training step built before counter-based masks (its Dropouts seeded, no counter):
    rewrite its Dropouts and add the counter, in place; return how many were rewritten."""
    from memcc.step import STATE_KEY

    if COUNTER in graph.inputs:
        return 0
    replaced = counter_dropouts(graph)
    if not replaced:
        return 0
    state = json.loads(graph.metadata.get(STATE_KEY) or "{}")
    out = add_counter(graph, state)
    graph.metadata[STATE_KEY] = json.dumps(state)
    graph.inputs = [*graph.inputs, COUNTER]
    graph.outputs = [*graph.outputs, out]
    return len(replaced)


def restore_dropouts(graph: Graph) -> Graph:
    """``graph`` with every rewritten Dropout put back as the plain node it replaced (a
    copy when there is one; for exporting the forward model), with Constants for the
    ratio and training_mode values the step no longer holds (``OPERANDS_PROP``)."""
    if not any(p.key == ORIGINAL_PROP for n in graph.nodes for p in n.metadata_props):
        return graph
    out = graph.copy(with_index=False)
    defined = {*out.initializers, *out.inputs, *(o for n in out.nodes for o in n.output)}
    constants: list[onnx.NodeProto] = []
    nodes = []
    # A 16-bit step compiled for a provider without a 16-bit kernel for the generator's
    # last node computes it in float32 and casts its result down to the Dropout's output
    # (passes/providers/sixteen_bit.py): the original writes that output again, so those
    # Casts go (their float32 source is no longer written).
    renamed = {}
    for n in out.nodes:
        hexed = next((p.value for p in n.metadata_props if p.key == ORIGINAL_PROP), None)
        if hexed is not None:
            original = onnx.NodeProto()
            original.ParseFromString(bytes.fromhex(hexed))
            renamed.update({mine: theirs for mine, theirs in zip(n.output, original.output,
                                                                 strict=False)
                            if mine and theirs and mine != theirs})
    for n in out.nodes:
        if n.op_type == "Cast" and len(n.input) == 1 and renamed.get(n.input[0]) == n.output[0]:
            continue
        props = {p.key: p.value for p in n.metadata_props}
        hexed = props.get(ORIGINAL_PROP)
        if hexed is None:
            nodes.append(n)
            continue
        original = onnx.NodeProto()
        original.ParseFromString(bytes.fromhex(hexed))
        if original.op_type.endswith("Like") and original.input[0] not in defined:
            from memcc.frontend.random_draws import shaped
            original = shaped(original, out.info[original.output[0]])
        for name, (value, elem) in _operands(graph, n, original, props).items():
            if name in original.input and name not in defined:
                defined.add(name)
                dtype = helper.tensor_dtype_to_np_dtype(elem)
                constants.append(helper.make_node(
                    "Constant", [], [name], name=f"{name}.restored",
                    value=numpy_helper.from_array(np.asarray(value, dtype=dtype))))
                out.info[name] = TensorInfo(elem, ())
        nodes.append(original)
    out.set_nodes([*constants, *nodes])
    return out


def _operands(graph: Graph, node: onnx.NodeProto, original: onnx.NodeProto,
              props: dict[str, str]) -> dict[str, list]:
    """The original's constant ratio and training_mode (name -> [value, element type]):
    as recorded (``OPERANDS_PROP``), or, for a step built before they were, training_mode
    true (only training-mode Dropouts are rewritten) and the ratio from the generator's
    threshold, ``round(ratio * 2**32)``, which gives a float32 ratio back exactly."""
    if OPERANDS_PROP in props:
        return json.loads(props[OPERANDS_PROP])
    out: dict[str, list] = {}
    if len(original.input) > 2 and original.input[2]:
        out[original.input[2]] = [True, TensorProto.BOOL]
    keep = graph.producers().get(node.input[0]) if node.op_type == "Where" else None
    thr = _constant(graph, keep.input[1]) if keep is not None and \
        keep.op_type == "GreaterOrEqual" else None
    if len(original.input) > 1 and original.input[1] and thr is not None:
        out[original.input[1]] = [float(np.float32(int(thr) / 2.0 ** 32)), TensorProto.FLOAT]
    return out


def checkpoint_counter(tensors: dict[str, np.ndarray], step: int, carried: set[str]
                       ) -> dict[str, np.ndarray]:
    """A checkpoint of a step from before counter-based masks holds no counter: resume it
    with the counter at the checkpoint's step (the masks then follow this version's
    generator from there on)."""
    if COUNTER in carried and COUNTER not in tensors:
        return {**tensors, COUNTER: np.asarray(step, np.int64)}
    return tensors
