"""Operator variants: alternative gradient rules the planner may choose per forward node.

The default rule of an op (``registry.RULES``) fixes what the forward pass hands to the
backward pass and how large the backward's working set is. A variant is another rule for
the same op that saves something else (a 1-byte mask instead of a float activation, the
output instead of the input) or works in smaller pieces (a convolution's weight gradient
over batch chunks), so that less memory is live at some point, usually at some cost in time.
MONeT showed that choosing these together with recomputation is what breaks the floor that
recomputation alone hits; the planner (``passes/planning/model/variant_terms.py``) picks at most
one variant per node in the same ILP, and the lowering
(``passes/lowering/variant_substitution.py``) replaces
the default rule's backward nodes by the variant's.

A variant rule has the default rule's signature plus ``ctx.forward``: an emitter whose nodes
run right after the forward node (a mask computed while the activation is still live).
Every variant states its exactness tier:

- ``exact``: the same arithmetic on the same numbers (masks, indices, output-based rules
  that equal the default bit for bit); ``--verify`` compares bit for bit.
- ``equivalent``: mathematically the same, rounded differently (inverted affine, chunked
  sums); the stated ``tolerance`` bounds the relative error against the default rule, and
  ``--verify`` checks within it.
- ``lossy``: stores less precision (16-bit activations); only with ``--allow-lossy``.
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
                     applies: Applies | None = None, summary: str = "",
                     region: RegionOf | None = None) -> Callable[[VariantRule], VariantRule]:
    """Register ``rule`` as variant ``name`` of each op in ``op_types``; with ``region``, it
    applies where that finds one and replaces the rules of all its nodes."""
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
                                  summary or (rule.__doc__ or "").strip().split("\n")[0],
                                  region)
        return rule

    return deco


def load_variants() -> None:
    """Import the modules that register variants (and the default rules they build on)."""
    from memcc.frontend.gradients import (  # noqa: F401
        load_rules,
        variant_activations,
        variant_pool,
        variant_rules,
    )

    load_rules()


def variants_for(ctx: GradContext, node: onnx.NodeProto) -> list[Variant]:
    """The variants registered for ``node``'s op that apply to this node."""
    load_variants()
    if node.domain not in ("", "ai.onnx"):
        return []
    out = []
    for v in VARIANTS.get(node.op_type, {}).values():
        try:
            ok = v.applies(ctx, node) and (v.region is None
                                           or v.region(ctx.graph, node) is not None)
        except Exception:  # an applicability test must never break planning
            ok = False
        if ok:
            out.append(v)
    return out


def lookup(op_type: str, name: str) -> Variant | None:
    load_variants()
    return VARIANTS.get(op_type, {}).get(name)
