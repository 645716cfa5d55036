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

In: an op type and variant name, or a node in its graph. Out: the registered ``Variant``
(``lookup``) or those that apply to the node (``variants_for``). The table and the decorator
live in ``variant_registry``, which the rule modules register into; this module loads those
modules on first use and re-exports the table's names.
"""

from __future__ import annotations

import onnx

from memcc.frontend.gradients.registry import GradContext
from memcc.frontend.gradients.variant_registry import (  # noqa: F401 - the names callers use
    EQUIVALENT,
    EXACT,
    LOSSY,
    TIERS,
    VARIANTS,
    Variant,
    VariantContext,
    register_variant,
)


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
