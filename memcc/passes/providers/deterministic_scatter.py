"""Accumulating scatters written so that ONNX Runtime's CUDA provider gives the same bits on
every run.

ORT's CUDA kernel for ``ScatterElements(reduction="add")`` adds each update with an atomic
add, so where several updates land on one element the order of the additions, and with it
the float result, changes from run to run; ``use_deterministic_compute`` does not change
that. On an H200 (onnxruntime-gpu 1.31.1) the zoo GPT-2 and BERT steps gave different
losses in two runs for this reason alone: only the embedding table's gradient differed
(docs/DETERMINISM.md, "CUDA"). memcc emits such scatters for three gradients: Gather (the
embedding; ``shape_ops._scatter_rows``: axis 0, int32 row indices expanded along the row,
chunked), MaxPool (``nn.scatter_to_argmax``: flat argmax indices) and GatherElements.

``for_cuda_determinism`` rewrites each of them into standard ONNX ops whose CUDA kernels
have one writer per output element (or one atomic add per element per kernel), so the
order of every sum is fixed by the graph:

- **rows** (the Gather gradient, and every axis-0 scatter whose indices are constant along
  the row; a chain of chunks is merged back into one): the row ids are sorted (``TopK``
  with k = all of them on the unique key ``row * m + position``, so ties cannot exist and
  the order does not depend on the sort's stability), the update rows gathered in that
  order, then summed per run of equal ids by a segmented inclusive scan by doubling
  (``ceil(log2(m))`` steps of ``x += Gather(x, src_k)``, where ``src_k`` points 2^k rows
  back inside the same run, or at a zero row), and the table is one ``Gather`` of each
  run's last row (a small int ``ScatterElements`` without reduction, to unique cells,
  finds it; rows that no update names read the zero row). Cost: one sort of m keys and
  about 2 log2(m) + 3 passes over the [m, width] updates, instead of the atomics; no
  [tokens, vocabulary] temporary. With constant row ids the whole plan is computed here.
- **MaxPool phases** (the MaxPool gradient): the pooled outputs are split by phase,
  ``(oh mod t_h, ow mod t_w)`` with ``t = ceil(effective kernel / stride)``; within one
  phase the windows do not overlap, so the argmax targets are unique, and each phase is one
  ``ScatterElements(reduction="add")`` in a fixed order: one atomic add per element per
  kernel, which is deterministic. 3x3 stride-2 pooling: 4 scatters of a quarter each.
- **flat** (anything else, e.g. a GatherElements gradient with repeated indices along the
  axis): flat target offsets are computed and summed as rows of width 1.

Left alone, as deterministic already: scatters with at most one update per element (the
indices have extent 1 along the axis, as the loss's GatherElements gradient does; constant
unique indices; MaxPool windows that do not overlap), and ``max``/``min`` reductions, whose
result does not depend on the order. Left alone and reported as still nondeterministic:
``mul`` reductions and ``ScatterND`` forms other than one index per row.

Sums change order: the rewritten step equals the original within a tolerance, not bit for
bit (``tests/test_deterministic_scatter.py`` states it: 1e-5 of the largest element).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from memcc.frontend.emit import Emitter
from memcc.graph import Graph, node_label
from memcc.passes.providers.scatter_emission import _drop_dead, _emit_phases, _emit_rows_plan
from memcc.passes.providers.scatter_forms import _Phases, _reduction, _Rows, classify
from memcc.step import GRAD_OF_PROP, ROLE_PROP, RULE_PROP

_COPIED_PROPS = (ROLE_PROP, GRAD_OF_PROP, RULE_PROP)


@dataclass
class Report:
    """What ``for_cuda_determinism`` did. ``rewritten``: one line per rewritten scatter
    (chained chunks merged into one are listed together); ``left``: nodes that stay
    nondeterministic on CUDA, each with why; ``already``: accumulating scatters left alone
    because their result cannot depend on the order of the updates."""

    rewritten: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    already: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"rewritten": list(self.rewritten), "left": list(self.left),
                "already_deterministic": list(self.already)}


def is_accumulating_scatter(node: onnx.NodeProto) -> bool:
    """A ScatterElements or ScatterND that combines updates (reduction other than none)."""
    return (node.domain in ("", "ai.onnx") and node.op_type in ("ScatterElements", "ScatterND")
            and _reduction(node) != "none")


def for_cuda_determinism(graph: Graph) -> tuple[Graph, Report]:
    """A copy of ``graph`` with every order-dependent accumulating scatter rewritten as
    described above (``graph`` itself when there is nothing to rewrite), and the report."""
    report = Report()
    producers = graph.producers()
    plans = _plan_scatters(graph, producers, report)
    if not plans:
        return graph, report
    merged_into = _merge_chunks(graph, plans, producers)
    out = graph.copy()
    nodes, dropped = _emit_plans(graph, out, _ChunkedPlans(plans, merged_into), report)
    position = {id(n): k for k, n in enumerate(graph.nodes)}
    nodes = _drop_dead(nodes, dropped, producers, set(out.outputs),
                       lambda n: out.nodes[position[id(n)]])
    out.set_nodes(nodes)
    produced = {o for n in nodes for o in n.output if o}
    for n in graph.nodes:  # shapes of values that no longer exist (merged chunks' tables)
        for o in n.output:
            if o and o not in produced:
                out.info.pop(o, None)
    return out, report


@dataclass(frozen=True)
class _ChunkedPlans:
    """The plan of every scatter to rewrite, by node index, and the chunks merged into an
    earlier chunk's plan (index -> the index of the plan's head)."""

    plans: dict[int, _Rows | _Phases]
    merged_into: dict[int, int]


def _plan_scatters(graph: Graph, producers, report: Report) -> dict[int, _Rows | _Phases]:
    """A plan for every accumulating scatter that needs one, by node index; the others go
    into ``report`` (already deterministic, or left with why)."""
    plans: dict[int, _Rows | _Phases] = {}
    for i, node in enumerate(graph.nodes):
        if not is_accumulating_scatter(node):
            continue
        verdict = classify(graph, node, producers)
        if isinstance(verdict, str):
            kind, why = verdict.split(":", 1)
            (report.already if kind == "already" else report.left).append(
                f"{node_label(node)}:{why}")
            continue
        plans[i] = verdict
    return plans


def _merge_chunks(graph: Graph, plans: dict[int, _Rows | _Phases], producers
                  ) -> dict[int, int]:
    """Chunks of one row scatter (memcc cuts the Gather gradient into chunks, each adding
    into the previous one's table) merged: one sort and one scan for all of them. Adds each
    merged chunk's keys and values to its head's plan; returns chunk -> head."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    merged_into: dict[int, int] = {}
    index_of = {id(n): i for i, n in enumerate(graph.nodes)}
    for i in sorted(plans):
        plan = plans[i]
        if not isinstance(plan, _Rows):
            continue
        data = plan.node.input[0]
        prev = producers.get(data)
        j = index_of.get(id(prev)) if prev is not None else None
        if (j is None or j not in plans or not isinstance(plans[j], _Rows)
                or data in outputs or len(consumers.get(data, [])) != 1):
            continue
        head = merged_into.get(j, j)
        first = plans[head]
        if (first.depth, first.width) != (plan.depth, plan.width) or \
                graph.info[first.values].dtype != graph.info[plan.values].dtype:
            continue
        first.parts.append((plan.keys, plan.values))
        merged_into[i] = head
    return merged_into


def _emit_plans(graph: Graph, out: Graph, chunked: _ChunkedPlans, report: Report
                ) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """``out``'s nodes with each plan emitted where the last chunk it merges stood (the
    emitted nodes carry the replaced scatter's metadata), and the original scatters
    replaced."""
    plans, merged_into = chunked.plans, chunked.merged_into
    producers = graph.producers()
    last_of: dict[int, int] = {}
    for i, head in merged_into.items():
        last_of[head] = max(last_of.get(head, head), i)
    emit = Emitter(out, detached=True, prefix="det/")
    nodes: list[onnx.NodeProto] = []
    dropped: list[onnx.NodeProto] = []
    emit_at = {last_of.get(h, h): h for h in plans if h not in merged_into}
    for i, node in enumerate(out.nodes):
        if i not in plans:
            nodes.append(node)
            continue
        dropped.append(graph.nodes[i])
        head = emit_at.get(i)
        if head is None:
            continue  # a chunk merged into a later node's rewrite
        plan = plans[head]
        start = len(emit.nodes)
        target = graph.nodes[i]
        if isinstance(plan, _Rows):
            members = [plan.node] + [graph.nodes[k] for k, h in sorted(merged_into.items())
                                     if h == head]
            line = _emit_rows_plan(emit, out, plan, target, producers)
            names = ", ".join(f"{m.op_type} '{m.name or m.output[0]}'" for m in members)
            report.rewritten.append(f"{names}: {line}")
        else:
            line = _emit_phases(emit, plan)
            report.rewritten.append(f"{node_label(plan.node)}: {line}")
        made = emit.nodes[start:]
        props = {p.key: p.value for p in target.metadata_props if p.key in _COPIED_PROPS}
        for n in made:
            for key, value in props.items():
                n.metadata_props.add(key=key, value=value)
        nodes.extend(made)
    return nodes, dropped
