"""One variant's rule for one node, read without touching the step: what the variant
emits (``emit``, on a view with a copied type table), the working set of its nodes
(``peak_working_set``) and the default rules it replaces as the baseline schedule runs
them (``default_span``). ``variant_terms`` turns these into the model's terms.
"""

from __future__ import annotations

from collections import ChainMap, defaultdict
from dataclasses import dataclass

import numpy as np
import onnx

from memcc.frontend.gradients.variants import Variant
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import (
    ALIAS_OPS,
    INPLACE_OPS,
    LivenessReport,
    allocation_bytes,
    scratch_bytes,
)
from memcc.passes.lowering.variant_substitution import (
    Replaced,
    dead_after_replacing,
    rule_body,
    variant_context,
)


@dataclass(frozen=True)
class Emitted:
    """A variant's nodes for one node: its backward nodes, the nodes it adds to the forward
    pass (a mask), and the type table they were emitted against."""

    back: list[onnx.NodeProto]
    fwd: list[onnx.NodeProto]
    info: dict


def emit(graph: Graph, node: onnx.NodeProto, variant: Variant,
          replaced: Replaced) -> Emitted | None:
    """The variant's nodes for ``node``, emitted on a view of ``graph`` whose type table is
    a copy (the step is not touched)."""
    info = ChainMap({}, graph.info)  # the variant's new types land in the first map
    view = Graph(nodes=graph.nodes, inputs=graph.inputs, outputs=graph.outputs,
                 initializers=graph.initializers, info=info,  # type: ignore[arg-type]
                 opsets=graph.opsets, metadata=graph.metadata, name=graph.name)
    view.set_nodes(graph.nodes, graph.def_use())
    ctx = variant_context(view, node, f"{node.name}/{variant.name}/", taken=(),
                          wants=replaced.wants)
    try:
        variant.rule(ctx, node, [g or None for g in replaced.gouts])
    except Exception:  # a variant that cannot be emitted here is not offered
        return None
    fwd = list(ctx.forward.nodes) if ctx.forward is not None else []
    return Emitted(list(ctx.emit.nodes), fwd, view.info)


def external_reads(nodes: list[onnx.NodeProto]) -> set[str]:
    made = {o for n in nodes for o in n.output if o}
    return {i for n in nodes for i in n.input if i and i not in made}


def forward_reads(rule: list[onnx.NodeProto], gouts: list[str], forward_value) -> set[str]:
    """The forward-pass values a rule's nodes read, its incoming gradients left out."""
    return {v for v in external_reads(rule) if forward_value(v)} - {g for g in gouts if g}


def peak_working_set(nodes: list[onnx.NodeProto], info, opset: int) -> int:
    """Largest bytes held by values ``nodes`` produce, walked in order, plus each kernel's
    own scratch while it runs (Where's selections); a buffer lives until the last reader
    among them of any value it holds (results, read by nobody here, to the end). Buffers
    are shared as the liveness analysis shares them: a Reshape returns its input's buffer
    and an in-place op (ScatterElements into its zeros) writes into it, so a rule that
    reshapes and scatters is not counted three times over."""
    last: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for i in n.input:
            last[i] = k
    size, birth, end = _buffers(nodes, info, last)
    live, peak = 0, 0
    ends: dict[int, int] = defaultdict(int)
    for b, k in end.items():
        ends[k] += size[b]
    for k, n in enumerate(nodes):
        if n.op_type == "Constant":
            continue
        live += sum(size[o] for o in n.output if o and birth.get(o) == k)
        peak = max(peak, live + scratch_bytes(n, info, opset))
        live -= ends.pop(k, 0)
    return peak


def _buffers(nodes: list[onnx.NodeProto], info, last: dict[str, int]
             ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The buffers ``nodes`` allocate, by ``liveness``'s alias and in-place rules (a view
    of a value from outside holds no bytes here; an outside value is never written over):
    each buffer's bytes, birth and the index of its last reader among ``nodes``."""
    buffer_of: dict[str, str] = {}
    size: dict[str, int] = {}
    birth: dict[str, int] = {}
    end: dict[str, int] = {}
    for k, n in enumerate(nodes):
        if n.op_type == "Constant":
            continue
        for j, o in enumerate(n.output):
            if not o or o not in info:
                continue
            src = n.input[0] if j == 0 and n.input else ""
            b = buffer_of.get(src) if src else None
            if src and n.op_type in ALIAS_OPS:
                if b is None:
                    continue
            elif b is None or not (end[b] == k and _writes_over(n, src, o, info)):
                b = o
                size[o], birth[o], end[o] = allocation_bytes(int(info[o].nbytes)), k, k
            buffer_of[o] = b
            end[b] = max(end[b], last.get(o, len(nodes)))
    return size, birth, end


def _writes_over(n: onnx.NodeProto, src: str, out: str, info) -> bool:
    """``n`` may write ``out`` into the buffer of its input ``src``: an in-place op, the
    same shape and element size (the caller checks that ``n`` reads that buffer last)."""
    return (n.op_type in INPLACE_OPS
            and info[src].shape == info[out].shape
            and info[src].itemsize == info[out].itemsize)


def _before_span(old: list[onnx.NodeProto], a: int, pos: dict[int, int], values,
                 live: LivenessReport) -> list[tuple[float, int, int]]:
    """Terms freeing what the default rule's nodes placed before its backward span hold
    there (MaxPool's index Cast, right after the forward node): every variant removes them,
    and the span's own part is already in the working-set terms."""
    terms = []
    for n in old:
        k = pos[id(n)]
        if k >= a or n.op_type == "Constant":
            continue
        terms.append((-float(live.scratch[k]), k, k))
        for o in n.output:
            vl = values.get(o)
            if vl is not None and vl.owns_buffer:
                end = a - 1 if vl.death is None else min(vl.death, a - 1)
                terms.append((-float(vl.nbytes), vl.birth, end))
    return terms


@dataclass
class Span:
    """The default rules a variant replaces, as the baseline schedule runs them: their
    backward span ``[a, b]``, what they read and hold there, and what removing them saves."""

    a: int
    b: int
    old_ids: set[int]
    grads: set[str]
    reads_default: set[str]
    own: np.ndarray
    removed_s: float
    early: list[tuple[float, int, int]]
    inputs_dying: list


def default_span(graph: Graph, got: Replaced, pos: dict[int, int], live: LivenessReport,
                  costs: CostModel, forward_value) -> Span | None:
    """The default rules ``got`` replaces, in the baseline schedule (None: they have no
    backward body to replace)."""
    values = live.values
    old = got.old
    body = rule_body(old, got.gouts)
    if not body:
        return None
    a, b = pos[id(body[0])], max(pos[id(n)] for n in body)
    grads = {g for g in got.gouts if g}
    # The default's own values live at each point of its span.
    own = np.zeros(b - a + 1)
    for n in old:
        for o in n.output:
            vl = values.get(o)
            if vl is None or not vl.owns_buffer or n.op_type == "Constant":
                continue
            lo, hi = max(vl.birth, a), min(b if vl.death is None else vl.death, b)
            if lo <= hi:
                own[lo - a:hi - a + 1] += vl.nbytes
        if a <= pos[id(n)] <= b:
            own[pos[id(n)] - a] += live.scratch[pos[id(n)]]
    # Only what the substitution removes: a gradient sum the rule emitted stays.
    removed = dead_after_replacing(graph, old, {g for g in got.results if g})
    return Span(
        a, b, {id(n) for n in old}, grads,
        forward_reads(old, got.gouts, forward_value), own,
        float(sum(costs.of(n) for n in removed)),
        _before_span(old, a, pos, values, live),
        # Rule inputs the default frees inside its span: the variant may read them later.
        [(v, vl) for v in external_reads(old)
         if (vl := values.get(v)) is not None and vl.owns_buffer
         and vl.death is not None and a <= vl.death < b])


