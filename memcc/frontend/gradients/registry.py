"""The table of gradient rules, one function per ONNX op type.

A rule receives the forward node and the gradients of its outputs (``None`` where an output
gets no gradient) and returns one entry per node input: a value name holding the gradient of
that input, or ``None``. Rules only need to produce gradients for inputs where
``ctx.needs_grad(name)`` is true; everything else may be ``None``. Rules emit standard ONNX
ops through ``ctx.emit`` and can read the static type of any value with ``ctx.info``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo


@dataclass
class GradContext:
    """What a rule may use: the graph being extended and which values need gradients."""

    graph: Graph
    emit: Emitter
    requires_grad: set[str]

    def needs_grad(self, name: str) -> bool:
        return bool(name) and name in self.requires_grad

    def info(self, name: str) -> TensorInfo:
        return self.graph.info[name]

    @property
    def opset(self) -> int:
        return self.graph.opset

    def producers(self) -> dict[str, onnx.NodeProto]:
        """value -> producing node, indexed incrementally: rules ask often while the
        backward pass grows, and a fresh walk of the graph per question is quadratic.
        (Rules append nodes; the few forward-side insertions, like MaxPool's index Cast,
        produce no constants and no shape values, so missing them changes no answer.)"""
        if not hasattr(self, "_producers"):
            self._producers: dict[str, onnx.NodeProto] = {}
            self._indexed = 0
        nodes = self.graph.nodes
        for node in nodes[self._indexed:]:
            for o in node.output:
                if o:
                    self._producers[o] = node
        self._indexed = len(nodes)
        return self._producers

    def share_producers(self, producers: dict[str, onnx.NodeProto]) -> None:
        """Use ``producers`` (value -> producing node, current for every node of the graph)
        as the index, when the caller keeps one for many contexts on one graph
        (``passes.lowering.variant_substitution.apply_variants``)."""
        self._producers = producers
        self._indexed = len(self.graph.nodes)

    def constant_value(self, name: str):
        """The numpy value of ``name`` when it is an initializer or a Constant node output."""
        from memcc.frontend.constants import constant_value

        return constant_value(self.graph, name, self.producers())


GradRule = Callable[[GradContext, onnx.NodeProto, list[str | None]], list[str | None]]

RULES: dict[str, GradRule] = {}

# Ops whose outputs never carry gradient even when they are floating point
# (they are pieces of shape or index computations, or random/constant producers).
NON_DIFFERENTIABLE: set[str] = {
    "Shape", "Size", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal",
    "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Range", "NonZero",
    "ArgMax", "ArgMin", "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Not",
    "And", "Or", "Xor", "IsNaN", "IsInf", "Sign", "Floor", "Ceil", "Round",
    "Bernoulli", "Multinomial", "OneHot",
}


def register(*op_types: str) -> Callable[[GradRule], GradRule]:
    def deco(fn: GradRule) -> GradRule:
        for op in op_types:
            if op in RULES:
                raise RuntimeError(f"gradient rule for {op} registered twice")
            RULES[op] = fn
        return fn

    return deco


def supported_ops() -> list[str]:
    return sorted(set(RULES) | NON_DIFFERENTIABLE)
