"""Nodes whose ONNX Runtime CPU kernel can give a different answer on every run.

A training step is only right if each kernel gives the same bits however ORT splits its work
across intra-op threads: ``--verify`` compares runs bit for bit, and a kernel whose threads
read-modify-write shared memory without order loses updates (wrong, not merely reordered).
memcc's own gradient rules avoid these kernels (docs/DETERMINISM.md has the audit); a model
can still bring one in, so ``racing_nodes`` lets the builder and verify name it.
"""

from __future__ import annotations

import onnx

from memcc.graph import Graph, attr


def _reduction(node: onnx.NodeProto) -> str:
    value = attr(node, "reduction", b"none")
    return value.decode() if isinstance(value, bytes) else str(value)


def races_on_cpu(node: onnx.NodeProto) -> bool:
    """ScatterND splits its updates across threads with nothing guarding a repeated target:
    with a reduction, concurrent updates to one element lose each other (measured: 4.6 off on
    a 2000 x 256 table at 2 threads). Without a reduction repeated targets are undefined by
    ONNX anyway, so only reductions are flagged. ScatterElements adds each element's
    updates in index order on one thread and is safe."""
    return node.domain in ("", "ai.onnx") and node.op_type == "ScatterND" and (
        _reduction(node) != "none")


def racing_nodes(graph: Graph) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` whose CPU kernel is known to race at more than one thread."""
    return [n for n in graph.nodes if races_on_cpu(n)]
