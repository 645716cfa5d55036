"""The one decision type every strategy returns, and the graph facts strategies decide over.

A ``Plan`` says, for each forward node of a training step, whether its outputs are kept
until the backward pass needs them (the default) or recomputed there. Everything a plan
implies (the rewritten graph, its peak, its added time) comes from the shared lowering
(``passes/recompute.py``) and simulator (``passes/simulate.py``), so strategies differ only
in the plan they pick. Swap-to-host and operator variants will be further decision kinds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from memcc.graph import Graph

# Ops whose re-execution would not reproduce the same values, or that have side effects.
NOT_RECOMPUTABLE = frozenset({
    "Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
    "Bernoulli", "Multinomial", "MemcpyToHost", "MemcpyFromHost",
    # Constants are initializers to ORT: they exist for the whole step anyway.
    "Constant",
})


class Decision(enum.Enum):
    KEEP = "keep"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Plan:
    """Per forward node: keep its outputs for the backward pass, or recompute them there."""

    recompute: frozenset[str] = frozenset()
    strategy: str = "none"
    notes: Mapping[str, object] = field(default_factory=dict)

    def decision(self, node_name: str) -> Decision:
        return Decision.RECOMPUTE if node_name in self.recompute else Decision.KEEP

    def to_json(self) -> dict:
        return {"strategy": self.strategy, "recompute": sorted(self.recompute),
                "notes": dict(self.notes)}


@dataclass(frozen=True)
class StepStructure:
    """Which nodes of a training step are forward, and which forward nodes may be recomputed.

    Forward = the ancestors of the loss. Everything after is backward and optimizer update,
    which no plan touches.
    """

    loss: str
    forward: frozenset[str]          # node names
    recomputable: frozenset[str]     # forward node names whose outputs a plan may recompute
    saved: frozenset[str]            # forward values read by non-forward nodes

    @classmethod
    def of(cls, graph: Graph) -> StepStructure:
        loss = graph.metadata.get("memcc.loss") or (graph.outputs[0] if graph.outputs else "")
        producers = graph.producers()
        forward: set[str] = set()
        stack = [loss]
        seen_values: set[str] = set()
        while stack:
            v = stack.pop()
            if v in seen_values:
                continue
            seen_values.add(v)
            node = producers.get(v)
            if node is None or node.name in forward:
                continue
            forward.add(node.name)
            stack.extend(i for i in node.input if i)
        forward_values = {o for n in graph.nodes if n.name in forward for o in n.output if o}
        saved = {
            i for n in graph.nodes if n.name not in forward for i in n.input
            if i in forward_values
        }
        recomputable = {
            n.name for n in graph.nodes
            if n.name in forward and n.op_type not in NOT_RECOMPUTABLE
            and n.domain in ("", "ai.onnx")
        }
        return cls(loss, frozenset(forward), frozenset(recomputable), frozenset(saved))

