"""Random draws of a training step from the Dropout counter: RandomUniform(Like) and
RandomNormal(Like) that depend only on (seed, step, node, element).

ORT seeds an unseeded RandomUniformLike or RandomNormalLike from the clock, once per
process: two runs of one step draw differently, and a resumed run draws what the
uninterrupted one did not. Exporters write such draws for an in-place ``nn.Dropout`` (the
dynamo exporter: RandomUniformLike, Less, Mul), stochastic depth, ONNX's ``Bernoulli``
(which memcc expands to RandomUniformLike) and ``torch.randn_like`` (a VAE's
reparameterisation: RandomNormalLike). ``counter_dropouts`` (``dropout_masks.py``) replaces
each by nodes that hash (seed, the step counter ``dropout.step``, the element's flat
index) as the Dropout masks do:

- uniform in [low, high): the hash's top 24 bits, exact in float32, times 2^-24 (high -
  low), plus low (``uniform_values``);
- normal: Box-Muller on two hashes of the element (the node's seed and a second one made
  from it), ``sqrt(-2 ln u1) cos(2 pi u2)`` with u1 in (0, 1], times scale, plus mean
  (``normal_values``; float32 ``Log``, ``Sqrt`` and ``Cos`` round as the provider's kernels
  do, so the reference holds to a few ulps).

The seed is the node's ``seed`` attribute, else a hash of its name. Export writes the
original node back (``restore_dropouts``); where the step no longer holds the tensor a
``*Like`` draw took its shape from (the dynamo optimizer's zero-filled ``self_float``), it
writes the op of that fixed shape instead (``shaped``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from memcc.frontend.counter_hash import dropout_hash
from memcc.graph import Graph, TensorInfo, attr

UNIFORM_OPS = ("RandomUniformLike", "RandomUniform")
NORMAL_OPS = ("RandomNormalLike", "RandomNormal")
RANDOM_OPS = UNIFORM_OPS + NORMAL_OPS
_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)
_SECOND = 0x2545F491          # xor'ed into a normal draw's seed for its second hash
_TOP = np.float32(2.0 ** -24)


@dataclass(frozen=True)
class Draw:
    """One draw to rewrite: its distribution, shape, element type and parameters ((low,
    high) for a uniform, (mean, scale) for a normal)."""

    normal: bool
    shape: tuple[int, ...]
    elem: int
    a: float
    b: float


def rewritable_random(graph: Graph, node: onnx.NodeProto) -> Draw | None:
    """The draw of a random op this module rewrites (a float output of rank >= 1 and known
    shape), else None (ORT's op stays)."""
    if node.op_type not in RANDOM_OPS or node.domain not in ("", "ai.onnx"):
        return None
    ti = graph.info.get(node.output[0])
    if ti is None or len(ti.shape) == 0 or not all(isinstance(v, int) for v in ti.shape):
        return None
    if ti.dtype not in _FLOATS:
        return None
    if node.op_type in NORMAL_OPS:
        return Draw(True, tuple(ti.shape), ti.dtype, float(attr(node, "mean", 0.0)),
                    float(attr(node, "scale", 1.0)))
    return Draw(False, tuple(ti.shape), ti.dtype, float(attr(node, "low", 0.0)),
                float(attr(node, "high", 1.0)))


def keys_of(seed: int, draw: Draw) -> list[int]:
    """The seeds of a draw's hashes: one, or two for a normal."""
    return [seed, (seed ^ _SECOND) & 0x7FFFFFFF] if draw.normal else [seed]


# ------------------------------------------------------------------------- reference
def _unit(seed: int, step: int, shape: tuple[int, ...]) -> np.ndarray:
    """The hash's top 24 bits as float32 (exact)."""
    return (dropout_hash(seed, step, shape) // np.uint32(256)).astype(np.float32)


def uniform_values(seed: int, step: int, shape: tuple[int, ...], low: float, high: float,
                   dtype=np.float32) -> np.ndarray:
    """What a rewritten RandomUniform(Like) draws at ``step`` (numpy reference)."""
    u = _unit(seed, step, shape)
    return (u * np.float32(2.0 ** -24 * (high - low)) + np.float32(low)).astype(dtype)


def normal_values(seed: int, step: int, shape: tuple[int, ...], mean: float, scale: float,
                  dtype=np.float32) -> np.ndarray:
    """What a rewritten RandomNormal(Like) draws at ``step`` (numpy reference)."""
    s1, s2 = keys_of(seed, Draw(True, shape, TensorProto.FLOAT, mean, scale))
    u1 = (_unit(s1, step, shape) + np.float32(0.5)) * _TOP
    radius = np.sqrt(np.log(u1) * np.float32(-2.0))
    angle = np.cos(_unit(s2, step, shape) * np.float32(2.0 * np.pi * 2.0 ** -24))
    z = radius * angle
    return (z * np.float32(scale) + np.float32(mean)).astype(dtype)


# ------------------------------------------------------------------------- the rewrite
def emit_draw(gen, node: onnx.NodeProto, draw: Draw, slots: list[int]) -> None:
    """Emit ``node``'s draw through the Dropout generator ``gen`` (its hashes at ``slots``),
    writing ``node``'s output."""
    emit, shape = gen.emit, draw.shape
    f32 = TensorInfo(TensorProto.FLOAT, shape)

    def unit(slot: int) -> str:
        top = gen.op("Div", gen.hash(shape, slot), gen.c(256), shape)
        return emit.op("Cast", [top], to=TensorProto.FLOAT, info=f32)

    def scalar(v: float, name: str) -> str:
        return emit.const(np.asarray(v, np.float32), name=name)

    if draw.normal:
        u1 = emit.op("Mul", [emit.op("Add", [unit(slots[0]), scalar(0.5, "normal.half")],
                                     info=f32), scalar(2.0 ** -24, "normal.top")], info=f32)
        radius = emit.op("Sqrt", [emit.op("Mul", [emit.op("Log", [u1], info=f32),
                                                  scalar(-2.0, "normal.minus_two")],
                                          info=f32)], info=f32)
        angle = emit.op("Cos", [emit.op("Mul", [unit(slots[1]), scalar(
            2.0 * np.pi * 2.0 ** -24, "normal.turn")], info=f32)], info=f32)
        v = emit.op("Mul", [emit.op("Mul", [radius, angle], info=f32),
                            scalar(draw.b, "normal.scale")], info=f32)
    else:
        v = emit.op("Mul", [unit(slots[0]), scalar(2.0 ** -24 * (draw.b - draw.a),
                                                   "uniform.scale")], info=f32)
    out = [node.output[0]]
    offset = scalar(draw.a, "normal.mean" if draw.normal else "uniform.low")
    if draw.elem == TensorProto.FLOAT:
        emit.op("Add", [v, offset], outputs=out, info=f32)
    else:
        v = emit.op("Add", [v, offset], info=f32)
        emit.op("Cast", [v], to=draw.elem, outputs=out, info=TensorInfo(draw.elem, shape))
    gen.mark_original(node)


def shaped(like: onnx.NodeProto, ti: TensorInfo) -> onnx.NodeProto:
    """A ``*Like`` draw whose input only gave the shape, as the op of that fixed shape (the
    same distribution), for an export whose step no longer holds the input."""
    keep = ("low", "high", "mean", "scale", "seed")
    kept = {a.name: helper.get_attribute_value(a) for a in like.attribute if a.name in keep}
    node = helper.make_node(like.op_type[:-len("Like")], [], list(like.output),
                            name=like.name, shape=list(ti.shape), dtype=ti.dtype, **kept)
    node.metadata_props.extend(like.metadata_props)
    return node
