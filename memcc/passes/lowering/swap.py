"""Swap to host memory: copy an offloaded value out after the forward pass, back before the
backward pass reads it.

For each value a plan offloads (``Plan.offload``), a ``MemcpyToHost`` runs right after the
value's last forward reader (so the device buffer dies there, as early as it can) and a
``MemcpyFromHost`` runs just before its first backward reader, which then reads the copy.
These are ORT's own copy ops (default domain, version 1): ORT loads them although
``onnx.checker`` does not know them, and the CPU provider runs them as plain copies, so the
rewrite is tested on CPU bit for bit. Where the copy-in should sit to overlap compute on a
GPU is the planner's decision (issue 11); this pass places it at the latest point.

The copies are the same bytes moved, never new arithmetic: outputs are bit-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from memcc.graph import Graph, unique_namer
from memcc.passes.plan import Plan, StepStructure

COPY_OUT = "MemcpyToHost"
COPY_IN = "MemcpyFromHost"
HOST_SUFFIX = ".host"
BACK_SUFFIX = ".back"


@dataclass(frozen=True)
class SwapResult:
    graph: Graph
    offloaded: tuple[str, ...]                     # values copied out and back
    copies: tuple[tuple[str, str, str, str], ...]  # (value, host copy, device copy, first reader)


def offload_problems(graph: Graph, plan: Plan, st: StepStructure) -> list[str]:
    """Why the offloads of ``plan`` cannot be realised on ``graph`` (empty: they can)."""
    du = graph.def_use()
    problems = []
    for v in sorted(plan.offload):
        producer = du.producer.get(v)
        if producer is None or producer.name not in st.forward:
            problems.append(f"'{v}' is not computed by the forward pass (a graph input or "
                            "weight stays where it is)")
        elif producer.name in plan.recompute & st.recomputable:
            problems.append(f"'{v}' is both recomputed and offloaded (choose one)")
        elif not any(r.name not in st.forward for r in du.readers.get(v, ())):
            problems.append(f"'{v}' has no backward reader: there is nothing to copy back for")
        elif v in graph.outputs:
            problems.append(f"'{v}' is a step output: it must stay where it is")
    return problems


def apply_offload(graph: Graph, plan: Plan, st: StepStructure) -> SwapResult:
    """A new graph with the copies of ``plan.offload`` in place; ``graph`` is untouched
    (returned as is when nothing is offloaded)."""
    if not plan.offload:
        return SwapResult(graph, (), ())
    out = graph.copy()
    du = out.def_use()
    fresh = unique_namer(list(out.values()) + [n.name for n in out.nodes])
    position = {id(n): i for i, n in enumerate(out.nodes)}
    after: dict[int, list[onnx.NodeProto]] = {}
    before: dict[int, list[onnx.NodeProto]] = {}
    copies = []
    for v in sorted(plan.offload):
        readers = list(du.readers.get(v, ()))
        forward = [r for r in readers if r.name in st.forward]
        backward = sorted((r for r in readers if r.name not in st.forward),
                          key=lambda r: position[id(r)])
        last_forward = max(forward + [du.producer[v]], key=lambda r: position[id(r)])
        host, back = fresh(v + HOST_SUFFIX), fresh(v + BACK_SUFFIX)
        out.info[host] = out.info[v]
        out.info[back] = out.info[v]
        copy_out = onnx.helper.make_node(COPY_OUT, [v], [host], name=fresh(f"{v}/{COPY_OUT}"))
        copy_in = onnx.helper.make_node(COPY_IN, [host], [back], name=fresh(f"{v}/{COPY_IN}"))
        du.add(copy_out)
        du.add(copy_in)
        for r in backward:
            for k, i in enumerate(r.input):
                if i == v:
                    du.rewire(r, k, back)
        after.setdefault(id(last_forward), []).append(copy_out)
        before.setdefault(id(backward[0]), []).append(copy_in)
        copies.append((v, host, back, backward[0].name))
    nodes: list[onnx.NodeProto] = []
    for n in out.nodes:
        nodes.extend(before.get(id(n), ()))
        nodes.append(n)
        nodes.extend(after.get(id(n), ()))
    out.set_nodes(nodes, du.attach(nodes))
    return SwapResult(out, tuple(c[0] for c in copies), tuple(copies))
