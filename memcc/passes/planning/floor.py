"""A lower bound on the peak of every plan for a step, cheap enough to check before any search.

``memcc compile --budget 1KB`` must not search for tens of seconds before saying that the
step cannot fit: below this bound no plan can, whatever the planner decides. The bound is
two terms, both counted in tensor bytes (every allocator memcc predicts for, malloc, ORT's
CPU arena and the CUDA arena, takes at least that much for a live value):

- what lives across the whole step: the graph's inputs and initializers (data, parameters,
  optimizer state). There when the first node runs, kept to the last, and no plan
  recomputes, frees or (today) moves them to host memory.
- the largest working set of one forward node: the values it reads and the buffers it
  writes, all live while it runs (``passes/analysis/liveness.py``: a node's inputs are freed after
  it at the earliest). Every plan runs every forward node once at least (recompute adds
  clones with the same working set); gradient-rule variants replace backward rules only, so
  backward nodes are left out. Outputs that share an input's buffer (Reshape and the other
  aliasing ops; Relu-like ops, which may write into input 0) are not counted again.

Nodes that a planner decision may split are left out of the second term: the attentions
and MLPs that row chunks can split (``frontend/row_chunks.py``) and everything from the
vocabulary projection on (the chunked loss), so that the bound stays below what such a
plan reaches. A decision that rewrites other forward nodes must leave them out here too.

On CUDA a third term: what the CUDA session holds for itself whatever the plan (cuBLAS and
cuDNN handles and workspaces, the captured graph's memory:
``passes.analysis.device_memory.CUDA_SESSION_BYTES``), which every predicted device peak
counts. Without it a small model's impossible budget on CUDA searched for tens of seconds
(torchvision's ResNet-18 at batch 4, 64 px: 211 MB refused after 43 s, where the session
alone is 201 MB).
"""

from __future__ import annotations

from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.analysis.liveness import ALIAS_OPS, INPLACE_OPS, NOT_EXECUTED
from memcc.passes.plan import StepStructure


@dataclass(frozen=True)
class Floor:
    """The bound and what it is made of (the refusal names each part)."""

    persistent_bytes: int   # inputs, parameters, optimizer state: live all step
    node: str | None        # the forward node with the largest working set (None: none)
    op_type: str | None
    node_bytes: int         # its inputs and outputs, less the persistent ones
    runtime_bytes: int = 0  # what the runtime holds for itself (``runtime_bytes``)

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.node_bytes + self.runtime_bytes


# What ``runtime_bytes`` counts on CUDA, as refusals name it.
SESSION_HELD = ("the CUDA session holds for itself (cuBLAS and cuDNN handles and "
                "workspaces, the captured graph)")


def runtime_bytes(device: str) -> int:
    """What the runtime holds on ``device`` whatever the plan, counted in every predicted
    peak there: the CUDA session's own (``CUDA_SESSION_BYTES``); none on the CPU, whose
    predictions count the step's buffers only."""
    if device != "cuda":
        return 0
    from memcc.passes.analysis.device_memory import CUDA_SESSION_BYTES

    return CUDA_SESSION_BYTES


def step_floor(graph: Graph, st: StepStructure | None = None) -> Floor:
    """The lower bound of every plan's peak for ``graph`` (see the module's docstring).
    Linear in the graph's size: a pass over its nodes, no simulation."""
    st = st or StepStructure.of(graph)
    info = graph.info
    persistent = set(graph.inputs) | set(graph.initializers)
    persistent_bytes = sum(info[v].nbytes for v in persistent if v in info)
    split = _splittable(graph, st)
    best: tuple[int, str | None, str | None] = (0, None, None)
    for n in graph.nodes:
        if n.name not in st.forward or n.name in split or n.op_type in NOT_EXECUTED:
            continue
        reads = {v for v in n.input if v and v not in persistent and v in info}
        writes = [v for v in n.output if v and v not in persistent and v in info]
        if n.op_type in ALIAS_OPS:
            writes = []
        elif n.op_type in INPLACE_OPS and writes and n.input and n.input[0] in reads:
            writes = writes[1:]
        size = sum(info[v].nbytes for v in reads) + sum(info[v].nbytes
                                                        for v in set(writes) - reads)
        if size > best[0]:
            best = (size, n.name, n.op_type)
    return Floor(int(persistent_bytes), best[1], best[2], int(best[0]))


def _splittable(graph: Graph, st: StepStructure) -> set[str]:
    """Forward nodes that row chunks may split: the attention and MLP regions, and every
    forward node downstream of a MatMul by a 2-D weight whose output reaches the loss
    only through row-wise and loss nodes (the vocabulary projection and the loss the chunked
    loss takes over). Over-approximated on purpose: leaving out a node only weakens the
    bound."""
    from memcc.frontend.row_chunks import ATTENTION, MLP, find_regions

    out: set[str] = set()
    # Over the forward pass alone: in the step, backward nodes read the regions' values,
    # which the row chunks' pattern (made for forward models) takes for outside readers.
    forward_only = Graph(nodes=[n for n in graph.nodes if n.name in st.forward],
                         inputs=list(graph.inputs), outputs=[st.loss],
                         initializers=graph.initializers, info=graph.info,
                         opsets=graph.opsets)
    for kind in (ATTENTION, MLP):
        try:
            regions = find_regions(forward_only, kind)
        except Exception:  # noqa: BLE001 - a pattern matcher on an unseen graph: the
            # bound must not fail the compile; without it, every forward node is left out
            return set(st.forward)
        for region in regions:
            out.update(n.name for n in region.members)
    # The loss's projection: the last forward MatMul (in graph order) and every forward node
    # after it.
    forward = [n for n in graph.nodes if n.name in st.forward]
    last = max((i for i, n in enumerate(forward) if n.op_type in ("MatMul", "Gemm")),
               default=None)
    if last is not None:
        out.update(n.name for n in forward[last:])
    return out
