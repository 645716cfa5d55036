"""Fusions memcc applies to a training step before it is planned.

memcc runs every step with ONNX Runtime's graph optimizations off, because ORT's fusions and
eliminations reorder the nodes and would merge recomputed nodes back into their originals
(docs/ORT_OPTIMIZATIONS.md). The fusions worth having are therefore memcc's own: applied to
the step once it is built, so the planner sees, prices and orders the graph exactly as ORT
will run it. The rule here removes a kernel launch and an activation-sized write and read,
and keeps the arithmetic, so the fused step's outputs are bit-identical to the unfused
step's (``tests/test_fuse.py`` checks it at 1 and 2 threads):

- ``transpose_into_matmul``: a Transpose that swaps the last two axes and feeds only
  MatMuls becomes the ``transA`` / ``transB`` flag of ``com.microsoft.FusedMatMul`` (ORT
  has the kernel on the CPU, float32, and on CUDA). The backward of every MatMul, and
  memcc's 1x1-convolution weight gradients, write such transposes; the GEMM reads the
  operand transposed in place (MLAS and cuBLAS both take the flag), summing in the same
  order, so the result is the same bits (measured on the CPU provider, 1 and 2 threads).

Tried and left out: folding a constant scale next to a MatMul into its ``alpha``. Exact only
for powers of two (GEMM kernels apply ``alpha`` per block of the inner dimension), and on the
zoo and the transformers exports the scales next to backward MatMuls are 8^-0.5 (the
attention's scale split over queries and keys): it never fired.

Only nodes outside the forward pass are fused: the forward model ``memcc export`` writes is
cut from the step's own forward nodes, and it must stay standard ONNX. Only float32 values:
ORT's CPU FusedMatMul has no other type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from memcc.graph import Graph, attr
from memcc.step import FUSIONS_KEY, KIND_KEY, TrainingStep, rule_io

MS_DOMAIN = "com.microsoft"
FUSED_MATMUL = "FusedMatMul"
TRANSPOSE_INTO_MATMUL = "transpose_into_matmul"
RULES = (TRANSPOSE_INTO_MATMUL,)


@dataclass
class FusionReport:
    """What the fusions did: nodes fused per rule, the step's node count before and after,
    and the bytes the removed nodes' kernels no longer move (each removed output written
    once and read once per reader)."""

    fused: dict[str, int] = field(default_factory=dict)
    nodes_before: int = 0
    nodes_after: int = 0
    bytes_saved: int = 0

    def to_json(self) -> dict:
        return {"fused": dict(self.fused), "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "bytes_saved": self.bytes_saved}


def fuse(graph: Graph, rules: tuple[str, ...] = RULES, *,
         forward: frozenset[str] | None = None) -> tuple[Graph, FusionReport]:
    """A copy of ``graph`` with ``rules`` applied (``graph`` itself when nothing fuses), and
    what they did. ``forward``: names of nodes to leave alone; by default a training step's
    forward pass, and nothing in a graph that is not a training step."""
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown fusion rule(s) {sorted(unknown)}; known: {list(RULES)}")
    out = graph.copy()
    if forward is None:
        forward = TrainingStep.of(out).forward if out.metadata.get(KIND_KEY) else frozenset()
    report = FusionReport(nodes_before=len(graph.nodes))
    if TRANSPOSE_INTO_MATMUL in rules:
        report.fused[TRANSPOSE_INTO_MATMUL] = _transpose_into_matmul(
            out, forward, _rule_boundaries(out), report)
    report.nodes_after = len(out.nodes)
    if not any(report.fused.values()):
        return graph, report
    out.opsets.setdefault(MS_DOMAIN, 1)
    return out, report


def fuse_step(graph: Graph, rules: tuple[str, ...] = RULES) -> tuple[Graph, dict]:
    """``fuse`` a training step and record what it did in the result's metadata
    (``FUSIONS_KEY``: ``FusionReport.to_json()``; the result is ``graph`` itself when nothing
    fuses), as ``memcc build`` and compile's loading of an older step do. Returns the step
    and that record (the pass contract, ``memcc/pass_contract.py``)."""
    out, report = fuse(graph, rules)
    summary = report.to_json()
    out.metadata[FUSIONS_KEY] = json.dumps(summary)
    return out, summary


def _rule_boundaries(graph: Graph) -> set[str]:
    """Values no fusion may remove: the graph's outputs and every gradient a rule read or
    wrote (``memcc.grad_in`` / ``memcc.grad_out``). An operator variant replaces one rule's
    nodes by the variant's and wires them to those values by name
    (``passes/lowering/variant_substitution.py``), so they must still exist after fusing."""
    keep = set(graph.outputs)
    for n in graph.nodes:
        io = rule_io(n)
        if io is not None:
            keep.update(v for side in io for v in side if v)
    return keep


def _saved(graph: Graph, value: str, readers: int) -> int:
    """Bytes no longer moved once ``value`` is never made: one write, one read per reader."""
    return graph.info[value].nbytes * (1 + readers)


def _is_f32(graph: Graph, *values: str) -> bool:
    return all(v in graph.info and graph.info[v].dtype == TensorProto.FLOAT for v in values)


def _as_fused_matmul(node: onnx.NodeProto) -> None:
    """Turn a MatMul into a FusedMatMul with the same inputs and output, in place (its name
    and provenance stay: reports and variants find the node as they did)."""
    if node.op_type == FUSED_MATMUL:
        return
    node.op_type, node.domain = FUSED_MATMUL, MS_DOMAIN


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(name, value)])


def _is_matmul(node: onnx.NodeProto) -> bool:
    return (node.op_type == "MatMul" and node.domain in ("", "ai.onnx")) or (
        node.op_type == FUSED_MATMUL and node.domain == MS_DOMAIN)


def _swaps_last_two(node: onnx.NodeProto, rank: int) -> bool:
    perm = list(attr(node, "perm", []) or [])
    return rank >= 2 and perm == list(range(rank - 2)) + [rank - 1, rank - 2]


# ---------------------------------------------------------------------------- rules
def _transpose_into_matmul(graph: Graph, forward: frozenset[str], keep: set[str],
                           report: FusionReport) -> int:
    du = graph.def_use()
    flags = ("transA", "transB")
    gone: set[int] = set()
    for t in list(graph.nodes):
        if t.op_type != "Transpose" or t.name in forward or not t.output[0] \
                or t.output[0] in keep:
            continue
        src, tv = t.input[0], t.output[0]
        if not _is_f32(graph, src, tv) or not _swaps_last_two(t, len(graph.info[src].shape)):
            continue
        readers = list(du.readers.get(tv, ()))
        if not readers or any(not _is_matmul(r) or r.name in forward
                              or not _is_f32(graph, r.output[0])
                              or any(graph.info.get(i) is None or len(graph.info[i].shape) < 2
                                     for i in r.input[:2])
                              for r in readers):
            continue
        # Every use must be an operand the GEMM can read transposed: a MatMul reading the
        # transpose as both operands takes it once per flag.
        for r in readers:
            _as_fused_matmul(r)
            for k in (0, 1):
                if r.input[k] == tv:
                    _set_attr(r, flags[k], 1 - int(attr(r, flags[k], 0)))
                    du.rewire(r, k, src)
        report.bytes_saved += _saved(graph, tv, len(readers))
        du.remove(t)
        gone.add(id(t))
    if gone:
        kept = [n for n in graph.nodes if id(n) not in gone]
        graph.set_nodes(kept, du.attach(kept))
    return len(gone)
