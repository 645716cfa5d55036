"""The table of operator variants and the decorator that fills it.

In: variant rules, registered by the modules that define them (``variant_rules``,
``variant_activations``, ``variant_pool``) with ``register_variant``. Out: ``VARIANTS``
(op type -> variant name -> ``Variant``) and the types a variant rule is written against
(``VariantContext``, ``Region``, the tiers). It imports no rule module, so the rule modules
and ``variants`` (which loads them and answers questions about the table) both sit above it
and nothing imports in a circle. What a variant is and what its tiers promise:
``variants``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from memcc.frontend.emit import Emitter
from memcc.frontend.gradients.registry import GradContext
from memcc.graph import Graph

EXACT = "exact"
EQUIVALENT = "equivalent"
LOSSY = "lossy"
TIERS = (EXACT, EQUIVALENT, LOSSY)


@dataclass
class VariantContext(GradContext):
    """A ``GradContext`` whose ``emit`` collects the backward nodes and whose ``forward``
    collects nodes that run right after the forward node."""

    forward: Emitter | None = None


Grads = list[str | None]
VariantRule = Callable[[VariantContext, onnx.NodeProto, Grads], Grads]
Applies = Callable[[GradContext, onnx.NodeProto], bool]


@dataclass(frozen=True)
class Region:
    """The forward nodes whose default rules one variant replaces together, ending at the
    node it is registered on: a decomposed GELU is eight nodes, and saving only its input
    takes one backward for all of them. The rule then returns one gradient per ``inputs``
    entry instead of one per input of the node."""

    nodes: tuple[str, ...]   # forward node names, the anchor last
    inputs: tuple[str, ...]  # the values it returns gradients for


# graph, anchor node -> the region the variant covers there (None: it does not apply)
RegionOf = Callable[[Graph, onnx.NodeProto], "Region | None"]


def _always(ctx: GradContext, node: onnx.NodeProto) -> bool:
    return True


@dataclass(frozen=True)
class Variant:
    """One alternative rule: which op, its name, its tier, and when it applies."""

    op_type: str
    name: str
    tier: str
    rule: VariantRule
    applies: Applies = _always
    tolerance: float = 0.0    # relative error bound against the default rule (equivalent)
    summary: str = ""
    region: RegionOf | None = None   # set: it replaces the rules of several nodes (Region)

    @property
    def key(self) -> str:
        """``Relu:mask``: how reports and plans name it."""
        return f"{self.op_type}:{self.name}"


# op type -> variant name -> Variant
VARIANTS: dict[str, dict[str, Variant]] = {}


def register_variant(*op_types: str, name: str, tier: str, tolerance: float = 0.0,
                     applies: Applies | None = None,
                     region: RegionOf | None = None) -> Callable[[VariantRule], VariantRule]:
    """Register ``rule`` as variant ``name`` of each op in ``op_types``; with ``region``, it
    applies where that finds one and replaces the rules of all its nodes. The variant's
    summary is the first line of the rule's docstring."""
    if tier not in TIERS:
        raise ValueError(f"variant tier {tier!r}: choose one of {', '.join(TIERS)}")
    if tier == EQUIVALENT and not tolerance > 0:
        raise ValueError(f"variant {name!r} is 'equivalent' and must state its tolerance")
    if name == "default":
        raise ValueError("'default' names the op's own rule; pick another variant name")

    def deco(rule: VariantRule) -> VariantRule:
        for op in op_types:
            table = VARIANTS.setdefault(op, {})
            if name in table:
                raise RuntimeError(f"variant {op}:{name} registered twice")
            table[name] = Variant(op, name, tier, rule, applies or _always, tolerance,
                                  (rule.__doc__ or "").strip().split("\n")[0],
                                  region)
        return rule

    return deco
