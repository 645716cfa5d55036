"""Reverse-mode differentiation that emits the backward pass as standard ONNX ops.

Current ORT packages have no gradient kernels (ORT_NOTES.md §5), so every gradient is
spelled with ordinary operators, one rule per op type (``memcc.frontend.gradients``).
Shapes are static by the time this runs, which lets rules resolve broadcasting and
reshapes at compile time instead of emitting shape arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from memcc.errors import GradientError, UnsupportedOpError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients import load_rules
from memcc.frontend.gradients.registry import NON_DIFFERENTIABLE, RULES, GradContext
from memcc.graph import Graph, node_label
from memcc.step import DEFAULT_RULE, tag_node


def differentiable_values(graph: Graph, loss: str, wrt: Sequence[str]) -> set[str]:
    """Values on a floating-point path from any of ``wrt`` to ``loss``."""
    forward: set[str] = set(w for w in wrt if graph.info[w].is_float)
    for node in graph.nodes:
        if node.op_type in NON_DIFFERENTIABLE:
            continue
        if any(i in forward for i in node.input if i):
            for o in node.output:
                if o and o in graph.info and graph.info[o].is_float:
                    forward.add(o)
    backward: set[str] = {loss}
    for node in reversed(graph.nodes):
        if node.op_type in NON_DIFFERENTIABLE:
            continue
        if any(o in backward for o in node.output if o):
            backward.update(i for i in node.input if i)
    return forward & backward


def differentiate(graph: Graph, loss: str, wrt: Sequence[str]) -> dict[str, str]:
    """Append the backward pass of ``loss`` to ``graph``; return {value: its gradient}.

    Gradient contributions are summed as soon as a second one arrives, so at most one
    partial sum per value is live at a time.
    """
    load_rules()
    requires = differentiable_values(graph, loss, wrt)
    if loss not in requires:
        return {}
    forward_nodes = list(graph.nodes)
    emit = Emitter(graph, prefix="grad/")
    ctx = GradContext(graph=graph, emit=emit, requires_grad=requires)
    loss_info = graph.info[loss]
    grads: dict[str, str] = {
        loss: emit.const(np.ones(loss_info.shape), loss_info.dtype, name=f"{loss}.seed")
    }
    for node in reversed(forward_nodes):
        if node.op_type in NON_DIFFERENTIABLE:
            continue
        gouts = [grads.get(o) if o else None for o in node.output]
        if all(g is None for g in gouts):
            continue
        if not any(ctx.needs_grad(i) for i in node.input):
            continue
        rule = RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            raise UnsupportedOpError(
                f"no gradient rule for {node_label(node)} (op '{node.op_type}', domain "
                f"'{node.domain or 'ai.onnx'}'). Supported ops: {', '.join(sorted(RULES))}. "
                "Export the model without this op, or file an issue with the model."
            )
        first = len(graph.nodes)
        try:
            gins = rule(ctx, node, gouts)
        except GradientError:
            raise
        except Exception as exc:  # a rule bug must still name the node
            raise GradientError(f"gradient rule for {node_label(node)} failed: {exc}") from exc
        for inp, g in zip(node.input, gins, strict=False):
            if g is None or not ctx.needs_grad(inp):
                continue
            want = graph.info[inp].shape
            got = graph.info[g].shape if g in graph.info else None
            if got is not None and tuple(got) != tuple(want):
                raise GradientError(
                    f"gradient rule for {node_label(node)} produced shape {got} for input "
                    f"'{inp}' of shape {want}"
                )
            if inp in grads:
                grads[inp] = emit.add(grads[inp], g)
            else:
                grads[inp] = g
        # Provenance (TrainingStep.provenance): the rule's nodes and the sums of its results
        # belong to this forward node; variants will name themselves instead of the default.
        for emitted in graph.nodes[first:]:
            tag_node(emitted, grad_of=node.name, rule=DEFAULT_RULE)
    return {w: grads[w] for w in wrt if w in grads}
