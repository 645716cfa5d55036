"""Reverse-mode differentiation that emits the backward pass as standard ONNX ops.

Current ORT packages have no gradient kernels (ORT_NOTES.md §5), so every gradient is
spelled with ordinary operators, one rule per op type (``memcc.frontend.gradients``).
Shapes are static by the time this runs, which lets rules resolve broadcasting and
reshapes at compile time instead of emitting shape arithmetic.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from memcc.errors import GradientError, UnsupportedOpError
from memcc.frontend.emit import Emitter
from memcc.frontend.gradients import load_rules
from memcc.frontend.gradients.registry import NON_DIFFERENTIABLE, RULES, GradContext
from memcc.frontend.recurrent import RECURRENT_OPS
from memcc.graph import Graph, ancestors, node_label
from memcc.step import DEFAULT_RULE, node_prop, record_rule_io, tag_node

# A node whose outputs torch computes without gradient (a buffer's new value written under
# torch.no_grad, ``frontend/buffer_updates.py``): no gradient passes through it.
NO_GRAD_PROP = "memcc.no_grad"

def differentiable_values(graph: Graph, loss: str, wrt: Sequence[str],
                          cut: Collection[str] = ()) -> set[str]:
    """Values on a floating-point path from any of ``wrt`` to ``loss`` (not through the
    nodes named in ``cut``, nor through those marked ``NO_GRAD_PROP``)."""
    cut = set(cut) | {n.name for n in graph.nodes if node_prop(n, NO_GRAD_PROP)}
    forward: set[str] = set(w for w in wrt if graph.info[w].is_float)
    for node in graph.nodes:
        if node.op_type in NON_DIFFERENTIABLE or node.name in cut:
            continue
        if any(i in forward for i in node.input if i):
            for o in node.output:
                if o and o in graph.info and graph.info[o].is_float:
                    forward.add(o)
    backward: set[str] = {loss}
    for node in reversed(graph.nodes):
        if node.op_type in NON_DIFFERENTIABLE or node.name in cut:
            continue
        if any(o in backward for o in node.output if o):
            backward.update(i for i in node.input if i)
    return forward & backward


def differentiate(graph: Graph, loss: str, wrt: Sequence[str], *,
                  source: str = "<model>", seeds: Mapping[str, str] | None = None,
                  skip: Collection[str] = ()) -> dict[str, str]:
    """Append the backward pass of ``loss`` to ``graph``; return {value: its gradient}.

    Gradient contributions are summed as soon as a second one arrives, so at most one
    partial sum per value is live at a time. ``seeds``: gradients the forward pass already
    computed (value -> gradient), for nodes named in ``skip``, whose rules are not run (the
    chunked loss takes its own gradient on the way, ``frontend/chunked_loss.py``), or the
    loss's own gradient when it is not 1 (``frontend/loss_scaling.py``).
    """
    load_rules()
    requires = differentiable_values(graph, loss, wrt)
    if loss not in requires:
        return {}
    forward_nodes = list(graph.nodes)
    emit = Emitter(graph, prefix="grad/")
    ctx = GradContext(graph=graph, emit=emit, requires_grad=requires)
    loss_info = graph.info[loss]
    grads: dict[str, str] = dict(seeds or {})
    producer = next((n for n in forward_nodes if loss in n.output), None)
    # The loss's own seed is 1 unless given (loss scaling seeds it with the scale); with a
    # skipped producer there is none: its rule would read it.
    if loss not in grads and (producer is None or producer.name not in skip):
        grads[loss] = emit.const(np.ones(loss_info.shape), loss_info.dtype,
                                 name=f"{loss}.seed")
    for node in reversed(forward_nodes):
        if node.op_type in NON_DIFFERENTIABLE or node.name in skip:
            continue
        gouts = [grads.get(o) if o else None for o in node.output]
        if all(g is None for g in gouts):
            continue
        if not any(ctx.needs_grad(i) for i in node.input):
            continue
        rule = RULES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if rule is None:
            raise UnsupportedOpError(_no_rule_message(node, loss, wrt, requires, forward_nodes,
                                                      source))
        emit.created = []
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
        for emitted in emit.created:
            tag_node(emitted, grad_of=node.name, rule=DEFAULT_RULE)
        # What the rule read and returned, so that a variant can later take its place.
        record_rule_io(node, gouts, [g if g is not None and ctx.needs_grad(i) else None
                                     for i, g in zip(node.input, gins, strict=False)])
    return {w: grads[w] for w in wrt if w in grads}


def _no_rule_message(node, loss: str, wrt: Sequence[str], requires: set[str],
                     forward_nodes: list, source: str) -> str:
    """Say which op, where, how it reaches the loss, and whether freezing avoids it.

    The node needs a gradient only because some trainable parameter lies upstream of it;
    freezing exactly those parameters (``--freeze``) removes the need, at the price of not
    training them, so the message names them and a pattern that covers them.
    """
    path = _path_to_loss(node, loss, forward_nodes)
    shown = path if len(path) <= 6 else path[:3] + ["..."] + path[-2:]
    behind = _parameters_upstream(node, wrt, requires, forward_nodes)
    supported = ", ".join(sorted({*RULES, *RECURRENT_OPS}))
    msg = (f"{source}: no gradient rule for {node_label(node)} (op '{node.op_type}', domain "
           f"'{node.domain or 'ai.onnx'}'), which lies on the path to the loss: "
           f"{' -> '.join(shown)} ({len(path)} nodes). ")
    if behind and len(behind) < len(wrt):
        flags = " ".join(f"--freeze '{p}'" for p in _covering_patterns(behind, wrt))
        msg += (f"Freezing the {len(behind)} of {len(wrt)} trainable parameters upstream "
                f"of it avoids it (they would then not train): {flags}. ")
    else:
        msg += ("Freezing parameters does not avoid it: every trainable parameter is "
                "upstream of it. ")
    return msg + (f"Export the model without this op, or file an issue with the model. "
                  f"Supported ops: {supported}.")


def _path_to_loss(node, loss: str, forward_nodes: list) -> list[str]:
    """Node names from ``node`` to the producer of ``loss`` along data edges (BFS)."""
    readers: dict[str, list] = {}
    producer: dict[str, object] = {}
    for n in forward_nodes:
        for i in n.input:
            if i:
                readers.setdefault(i, []).append(n)
        for o in n.output:
            if o:
                producer[o] = n
    target = producer.get(loss)
    prev: dict[str, str | None] = {node.name: None}
    queue = [node]
    while queue:
        n = queue.pop(0)
        if n is target:
            break
        for o in n.output:
            for r in readers.get(o, []):
                if r.name not in prev:
                    prev[r.name] = n.name
                    queue.append(r)
    if target is None or target.name not in prev:
        return [node.name]
    path, cur = [], target.name
    while cur is not None:
        path.append(cur)
        cur = prev[cur]
    return path[::-1]


def _parameters_upstream(node, wrt: Sequence[str], requires: set[str],
                         forward_nodes: list) -> list[str]:
    producer = {o: n for n in forward_nodes for o in n.output if o}
    _, found = ancestors(
        [i for i in node.input if i in requires], producer,
        lambda p: () if p.op_type in NON_DIFFERENTIABLE else [i for i in p.input if i in requires])
    return [w for w in wrt if w in found]


def _covering_patterns(names: list[str], among: Sequence[str]) -> list[str]:
    """Shell patterns that match exactly ``names`` among ``among``: their common prefix and
    ``*`` when that catches nothing else, else the names themselves (at most 4, then the
    common prefix of the rest)."""
    prefix = os.path.commonprefix(names)
    if len(names) == 1:
        return names
    if prefix and not [a for a in among if a.startswith(prefix) and a not in names]:
        return [f"{prefix}*"]
    if len(names) <= 4:
        return list(names)
    return list(names[:4]) + [f"... ({len(names) - 4} more)"]
