"""Decomposed activations differentiated from their input alone (``activation_from_input``).

Exporters write GELU and SiLU as chains of elementwise nodes: GPT-2's tanh GELU is eight
(Pow, Mul, Add, Mul, Tanh, Add, Mul, Mul). Their default rules, node by node, keep four
activation-sized values from the forward pass to the backward (x, 0.5x, tanh(.), 1+tanh(.));
BERT's erf GELU keeps three, SiLU two. Recomputing them cannot help much: the recomputed
intermediates are all live again at the backward. This variant replaces the rules of the
whole chain by one backward that reads only the chain's input x and evaluates the
closed-form derivative, holding at most four activation-sized buffers of its own at a
time, its result included.

The chain is found by what it computes, not by how it is spelled: the elementwise nodes
with scalar constants that end at the anchor node are evaluated in float64 on probe points
and compared with each known activation. Operand order, Pow against x*x*x, and where the
0.5 is applied do not matter. Tier: equivalent, since the derivative is rounded in another
order than the chain rule through the nodes (tests/test_variants_activations.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx

from memcc.frontend.constants import constant_value
from memcc.frontend.gradients.elementwise import scalar_like
from memcc.frontend.gradients.registry import GradContext
from memcc.frontend.gradients.variant_registry import (
    EQUIVALENT,
    Region,
    VariantContext,
    register_variant,
)
from memcc.graph import Graph
from memcc.step import GRAD_OF_PROP, ROLE_PROP, node_props

Grads = list[str | None]

# Relative error against the default rules: at most 9.2e-7 on the zoo's GPT-2 and 5.5e-7 on
# its BERT (`python benchmarks/variant_checks.py activations`, docs/VARIANTS.md).
ACTIVATION_TOLERANCE = 1e-5
MAX_REGION_NODES = 16

_erf = np.vectorize(math.erf)
UNARY: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Tanh": np.tanh, "Erf": _erf, "Exp": np.exp, "Neg": np.negative, "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v)),
}
BINARY: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide,
    "Pow": np.power,
}

_C_TANH = math.sqrt(2.0 / math.pi)
_A_TANH = 0.044715


@dataclass(frozen=True)
class Activation:
    """A known activation: its values (to recognise a chain) and how to emit its derivative."""

    name: str
    f: Callable[[np.ndarray], np.ndarray]
    derivative: Callable[[GradContext, str], str]


def _affine_unit(ctx: GradContext, v: str, alpha: float, beta: float) -> str:
    """``alpha * v + beta`` for ``v`` whose result lies in [0, 1], as HardSigmoid: its clamp
    then never acts, and ORT runs it in place, where Mul and Add each take a new buffer."""
    return ctx.emit.op("HardSigmoid", [v], info=ctx.info(v), alpha=alpha, beta=beta)


# The derivatives below are ordered for the fewest activation-sized buffers live at once:
# binary ops never write in place on ORT's CPU provider, unary activations do
# (``liveness.INPLACE_OPS``), and x is read last as early as possible.
def _gelu_tanh_derivative(ctx: GradContext, x: str) -> str:
    """0.5 (1 + t) + x (1 - t^2) 0.5 c (1 + 3 a x^2), t = tanh(c x (1 + a x^2))."""
    e = ctx.emit

    def k(v: float) -> str:
        return scalar_like(ctx, v, x)

    slope = e.mul(e.add(e.mul(e.mul(x, x), k(1.5 * _A_TANH * _C_TANH)), k(0.5 * _C_TANH)), x)
    t = e.unary("Tanh", e.mul(e.add(e.mul(e.mul(x, x), k(_A_TANH * _C_TANH)), k(_C_TANH)), x))
    sech2 = _affine_unit(ctx, e.mul(t, t), -1.0, 1.0)          # 1 - t^2
    slope = e.mul(sech2, slope)
    return e.add(_affine_unit(ctx, t, 0.5, 0.5), slope)        # 0.5 (1 + t) + ...


def _gelu_erf_derivative(ctx: GradContext, x: str) -> str:
    """0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi)."""
    e = ctx.emit

    def k(v: float) -> str:
        return scalar_like(ctx, v, x)

    cdf = _affine_unit(ctx, e.unary("Erf", e.mul(x, k(1.0 / math.sqrt(2.0)))), 0.5, 0.5)
    pdf = e.unary("Exp", e.mul(e.mul(x, x), k(-0.5)))
    return e.add(cdf, e.mul(pdf, e.mul(x, k(1.0 / math.sqrt(2.0 * math.pi)))))


def _silu_derivative(ctx: GradContext, x: str) -> str:
    """s (1 + x (1 - s)), s = sigmoid(x)."""
    e = ctx.emit
    s = e.unary("Sigmoid", x)
    return e.mul(s, e.add(e.mul(x, e.sub(scalar_like(ctx, 1.0, x), s)),
                          scalar_like(ctx, 1.0, x)))


ACTIVATIONS = (
    Activation("gelu_tanh",
               lambda v: 0.5 * v * (1.0 + np.tanh(_C_TANH * (v + _A_TANH * v ** 3))),
               _gelu_tanh_derivative),
    Activation("gelu_erf", lambda v: 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0))),
               _gelu_erf_derivative),
    Activation("silu", lambda v: v * UNARY["Sigmoid"](v), _silu_derivative),
)
_PROBES = np.linspace(-6.0, 6.0, 97)
# Each activation's values on the probes, computed once.
_EXPECTED = tuple((act, act.f(_PROBES)) for act in ACTIVATIONS)


@dataclass(frozen=True)
class ActivationRegion:
    region: Region
    activation: Activation

    @property
    def input(self) -> str:
        return self.region.inputs[0]


def _is_forward(node: onnx.NodeProto) -> bool:
    if not node.metadata_props:
        return True
    props = node_props(node)
    return GRAD_OF_PROP not in props and ROLE_PROP not in props


def _scalar(graph: Graph, name: str, producers) -> float | None:
    v = constant_value(graph, name, producers)
    if v is None or v.size != 1 or not np.issubdtype(v.dtype, np.number):
        return None
    return float(v.reshape(()))


def match_activation(graph: Graph, anchor: onnx.NodeProto) -> ActivationRegion | None:
    """The known activation whose decomposed chain ends at ``anchor``, if there is one: the
    largest chain of forward elementwise nodes (scalar constants aside) that computes it
    from one value x, whose values nobody outside reads (but x's and the anchor's), and
    whose x is read by nothing else in the forward pass (so its gradient is the chain's)."""
    if anchor.op_type not in BINARY and anchor.op_type not in UNARY:
        return None
    du = graph.def_use()
    y = anchor.output[0] if anchor.output else ""
    yi = graph.info.get(y)
    if yi is None or not yi.is_float or not yi.shape:
        return None
    producers = du.producer
    # Grow the chain backwards from the anchor over same-shape elementwise nodes.
    members: dict[str, onnx.NodeProto] = {}
    stack = [anchor]
    while stack:
        n = stack.pop()
        if n.name in members or len(members) >= MAX_REGION_NODES:
            continue
        if not _is_forward(n) or n.domain not in ("", "ai.onnx"):
            continue
        if n.op_type not in UNARY and n.op_type not in BINARY:
            continue
        if len(n.output) != 1 or graph.info.get(n.output[0]) != yi:
            continue
        members[n.name] = n
        for i in n.input:
            if i and _scalar(graph, i, producers) is None and i in producers:
                stack.append(producers[i])
    best: ActivationRegion | None = None
    ordered = _topological(members)
    for x in _candidate_inputs(members, producers, graph):
        if graph.info.get(x) != yi:   # a broadcast input: its gradient would need a sum
            continue
        chain = _chain_from(x, anchor, ordered, du, graph.outputs)
        if chain is None or (best is not None and len(chain) <= len(best.region.nodes)):
            continue
        values = _evaluate(chain, x, graph, producers)
        if values is None:
            continue
        for act, want in _EXPECTED:
            if np.allclose(values, want, rtol=1e-6, atol=1e-7):
                best = ActivationRegion(Region(tuple(n.name for n in chain), (x,)), act)
                break
    return best


def _candidate_inputs(members: dict[str, onnx.NodeProto], producers,
                      graph: Graph) -> list[str]:
    """Every value a member reads that is not a scalar constant, and every member's output:
    the chain's input is one of them."""
    out: list[str] = []
    for n in members.values():
        for v in list(n.input) + list(n.output):
            if v and v not in out and _scalar(graph, v, producers) is None:
                out.append(v)
    return out


def _chain_from(x: str, anchor: onnx.NodeProto, ordered: list[onnx.NodeProto],
                du, outputs: list[str]) -> list[onnx.NodeProto] | None:
    """The members (``ordered``: producers first) on a path from ``x`` to the anchor, when
    they compute the anchor's output from ``x`` and scalar constants alone and their values
    are read only by each other, by their own default rules, and (the anchor's) by anyone."""
    if x == anchor.output[0]:
        return None
    downstream: set[str] = {x}
    chain: list[onnx.NodeProto] = []
    for n in ordered:
        if any(i in downstream for i in n.input):
            chain.append(n)
            downstream.add(n.output[0])
    if not chain or chain[-1] is not anchor:
        return None
    names = {n.name for n in chain}
    made = {n.output[0] for n in chain}
    for n in chain:
        for i in n.input:
            if i and i != x and i not in made and i in du.producer \
                    and du.producer[i].op_type != "Constant":
                return None   # reads another activation: not a function of x alone
    if (made - {anchor.output[0]}) & set(outputs):
        return None
    for v in made - {anchor.output[0]}:
        for r in du.readers.get(v, ()):
            if r.name in names:
                continue
            if _is_forward(r) or node_props(r).get(GRAD_OF_PROP) not in names:
                return None
    for r in du.readers.get(x, ()):
        if _is_forward(r) and r.name not in names:
            return None
    return chain


def _topological(members: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto]:
    """The members with each producer before its readers (the chain is a small DAG)."""
    made = {n.output[0]: n.name for n in members.values()}
    done: list[onnx.NodeProto] = []
    seen: set[str] = set()

    def visit(n: onnx.NodeProto) -> None:
        if n.name in seen:
            return
        seen.add(n.name)
        for i in n.input:
            if i in made:
                visit(members[made[i]])
        done.append(n)

    for n in members.values():
        visit(n)
    return done


def _evaluate(chain: list[onnx.NodeProto], x: str, graph: Graph,
              producers) -> np.ndarray | None:
    """The chain's output on the probe points, in float64 (None: a constant is not a
    scalar, or the arithmetic is undefined there)."""
    vals: dict[str, np.ndarray] = {x: _PROBES}
    with np.errstate(all="ignore"):
        for n in chain:
            args = []
            for i in n.input:
                if i in vals:
                    args.append(vals[i])
                else:
                    c = _scalar(graph, i, producers)
                    if c is None:
                        return None
                    args.append(np.float64(c))
            if n.op_type in UNARY and len(args) == 1:
                out = UNARY[n.op_type](args[0])
            elif n.op_type in BINARY and len(args) == 2:
                out = BINARY[n.op_type](args[0], args[1])
            else:
                return None
            vals[n.output[0]] = np.broadcast_to(np.asarray(out, dtype=np.float64),
                                                _PROBES.shape)
    y = vals[chain[-1].output[0]]
    return y if np.all(np.isfinite(y)) else None


def _region(graph: Graph, node: onnx.NodeProto) -> Region | None:
    found = match_activation(graph, node)
    return found.region if found is not None else None


@register_variant("Mul", "Div", name="activation_from_input", tier=EQUIVALENT,
                  tolerance=ACTIVATION_TOLERANCE, region=_region)
def _activation_from_input(ctx: VariantContext, node: onnx.NodeProto, gouts: Grads) -> Grads:
    """The decomposed activation (tanh or erf GELU, SiLU) ending here, differentiated from
    its input alone: the chain's intermediates are no longer kept for the backward."""
    found = match_activation(ctx.graph, node)
    g = gouts[0]
    if found is None or g is None:
        raise ValueError("no known activation ends at this node")
    x = found.input
    return [ctx.emit.mul(g, found.activation.derivative(ctx, x))]
