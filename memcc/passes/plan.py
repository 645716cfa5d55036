"""The one decision type every strategy returns, and the graph facts strategies decide over.

A ``Plan`` says, for each value the forward pass hands to the backward pass, what happens to
it: ``Keep`` it resident (the default), ``Recompute`` it there, or ``Offload`` it to host
memory (``passes/lowering/swap.py``), and for each forward node which gradient-rule variant its
backward uses (``passes/lowering/variant_substitution.py``; the default rule unless chosen
otherwise).
Everything a plan implies (the rewritten graph, its peak, its added time) comes from the
shared lowering (``passes/lowering/lower.py``) and simulator (``passes/planning/simulate.py``), so
strategies differ only in the plan they pick.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from memcc.graph import Graph
from memcc.step import DEFAULT_RULE, TrainingStep

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


# ---------------------------------------------------------------------------- actions
@dataclass(frozen=True)
class Keep:
    """Keep the saved value resident from the forward pass to its backward readers
    (JAX: ``Saveable``)."""

    kind = "keep"

    def to_json(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Recompute:
    """Free the value after the forward pass; re-run its producer before the backward
    reads it (JAX: ``Recompute``)."""

    kind = "recompute"

    def to_json(self) -> str:
        return self.kind


@dataclass(frozen=True)
class Offload:
    """Copy the value to another memory space after the forward pass and back before the
    backward reads it (JAX: ``Offloadable(src, dst)``); ``passes/lowering/swap.py`` inserts the
    copies."""

    dst: str = "host"
    src: str = "device"
    kind = "offload"

    def __post_init__(self) -> None:
        if self.dst not in MEMORY_SPACES or self.src not in MEMORY_SPACES:
            raise ValueError(f"Offload({self.src!r} -> {self.dst!r}): memory spaces are "
                             f"{', '.join(MEMORY_SPACES)}")
        if self.dst == self.src:
            raise ValueError(f"Offload to the space it is in ({self.dst!r}) moves nothing")

    def to_json(self) -> dict:
        return {"offload": {"src": self.src, "dst": self.dst}}


Action = Keep | Recompute | Offload
MEMORY_SPACES = ("device", "host")
KEEP = Keep()
RECOMPUTE = Recompute()
# Names that read like JAX's checkpoint policies.
Saveable = Keep
Offloadable = Offload
DEFAULT_VARIANT = DEFAULT_RULE


class PlanError(ValueError):
    """A plan that does not fit the step it is applied to (a bug in a strategy)."""


@dataclass(frozen=True)
class Plan:
    """Per saved value an action, per forward node a gradient-rule variant.

    ``recompute`` (forward node names whose outputs are rebuilt in the backward pass) is how
    strategies have always spoken and stays the primary field: ``Plan(names, strategy,
    notes)`` works as before. ``offload`` (saved value -> ``Offload``) and ``variants``
    (forward node -> rule variant, default ``"default"``) are the other decision kinds;
    ``actions(structure)`` is the per-value view of keep / recompute / offload.
    """

    recompute: frozenset[str] = frozenset()
    strategy: str = "none"
    notes: Mapping[str, object] = field(default_factory=dict)
    offload: Mapping[str, Offload] = field(default_factory=dict)
    variants: Mapping[str, str] = field(default_factory=dict)
    # Recomputed forward nodes whose clones, made only to rebuild another value, are not
    # kept for later readers: those rebuild them again (``passes/lowering/recompute.py``).
    recompute_again: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.recompute, frozenset):
            object.__setattr__(self, "recompute", frozenset(self.recompute))
        if not isinstance(self.recompute_again, frozenset):
            object.__setattr__(self, "recompute_again", frozenset(self.recompute_again))
        if not self.recompute_again <= self.recompute:
            extra = sorted(self.recompute_again - self.recompute)[:3]
            raise PlanError(f"recompute_again names nodes the plan does not recompute: {extra}")
        for value, action in self.offload.items():
            if not isinstance(action, Offload):
                raise PlanError(f"offload['{value}'] is {action!r}, not an Offload action")
        for node, variant in self.variants.items():
            if not isinstance(variant, str) or not variant:
                raise PlanError(f"variant of forward node '{node}' must be a rule name")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_recompute(cls, nodes, strategy: str = "none",
                       notes: Mapping[str, object] | None = None) -> Plan:
        """Today's plans: the forward nodes to recompute, everything else kept."""
        return cls(frozenset(nodes), strategy, dict(notes or {}))

    @classmethod
    def from_actions(cls, actions: Mapping[str, Action], structure: StepStructure,
                     strategy: str = "none", notes: Mapping[str, object] | None = None,
                     variants: Mapping[str, str] | None = None) -> Plan:
        """A plan from per-value actions. Recompute is realised per producer node, so all
        saved outputs of one node must agree on Recompute."""
        producer = structure.producer_of
        recompute: set[str] = set()
        offload: dict[str, Offload] = {}
        for value, action in actions.items():
            if value not in structure.saved:
                raise PlanError(f"'{value}' is not a saved value of this step")
            if isinstance(action, Recompute):
                recompute.add(producer[value])
            elif isinstance(action, Offload):
                offload[value] = action
            elif not isinstance(action, Keep):
                raise PlanError(f"unknown action {action!r} for '{value}'")
        for value in structure.saved:
            node = producer[value]
            if node in recompute and not isinstance(actions.get(value, KEEP), Recompute):
                raise PlanError(
                    f"'{value}' is kept but node '{node}', which also produces a recomputed "
                    "value, is recomputed: actions on one node's outputs must agree")
        return cls(frozenset(recompute), strategy, dict(notes or {}), offload,
                   dict(variants or {}))

    # ------------------------------------------------------------------ views
    def decision(self, node_name: str) -> Decision:
        return Decision.RECOMPUTE if node_name in self.recompute else Decision.KEEP

    def variant(self, node_name: str) -> str:
        return self.variants.get(node_name, DEFAULT_VARIANT)

    def action(self, value: str, structure: StepStructure) -> Action:
        if value in self.offload:
            return self.offload[value]
        node = structure.producer_of.get(value)
        if node is not None and node in self.recompute and node in structure.recomputable:
            return RECOMPUTE
        return KEEP

    def actions(self, structure: StepStructure) -> dict[str, Action]:
        """Every saved value's action (recompute of a non-recomputable node reads Keep,
        as the lowering treats it)."""
        return {v: self.action(v, structure) for v in sorted(structure.saved)}

    def to_json(self) -> dict:
        out = {"strategy": self.strategy, "recompute": sorted(self.recompute),
               "notes": dict(self.notes)}
        if self.offload:
            out["offload"] = {v: a.to_json()["offload"] for v, a in sorted(self.offload.items())}
        if self.variants:
            out["variants"] = dict(sorted(self.variants.items()))
        return out


@dataclass(frozen=True)
class StepStructure:
    """Which nodes of a training step are forward, and which forward nodes may be recomputed.

    Forward = the ancestors of the loss. Everything after is backward and optimizer update,
    which no plan touches. A thin view of ``memcc.step.TrainingStep`` (the one reader of the
    step's metadata) with what strategies decide over.
    """

    loss: str
    forward: frozenset[str]          # node names
    recomputable: frozenset[str]     # forward node names whose outputs a plan may recompute
    saved: frozenset[str]            # forward values read by non-forward nodes
    producer_of: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, graph: Graph | TrainingStep) -> StepStructure:
        step = graph if isinstance(graph, TrainingStep) else TrainingStep.of(graph)
        forward = step.forward
        recomputable = {
            n.name for n in step.graph.nodes
            if n.name in forward and n.op_type not in NOT_RECOMPUTABLE
            and n.domain in ("", "ai.onnx")
        }
        producer = step.graph.def_use().producer
        saved = step.saved
        producer_of = {v: producer[v].name for v in saved}
        return cls(step.loss, forward, frozenset(recomputable), saved, producer_of)


# ---------------------------------------------------------------------------- policies
# Whole-step plans named like JAX's checkpoint policies: baselines, and starting points for
# strategies and tests.
def everything_saveable(st: StepStructure, strategy: str = "everything_saveable") -> Plan:
    """Keep every saved value (no rewrite): the baseline."""
    return Plan(frozenset(), strategy)


def nothing_saveable(st: StepStructure, strategy: str = "nothing_saveable") -> Plan:
    """Recompute every saved value whose producer may be recomputed (the rest is kept)."""
    nodes = {st.producer_of[v] for v in st.saved} & st.recomputable
    return Plan(frozenset(nodes), strategy)


def save_only_these_values(st: StepStructure, values, strategy: str = "save_only") -> Plan:
    """Keep ``values``; recompute every other saved value that can be. A node with one
    output kept is kept whole (recompute is per node)."""
    keep = set(values)
    unknown = sorted(keep - st.saved)
    if unknown:
        raise PlanError(f"not saved values of this step: {', '.join(unknown[:3])}")
    kept_nodes = {st.producer_of[v] for v in keep}
    nodes = {st.producer_of[v] for v in st.saved} & st.recomputable - kept_nodes
    return Plan(frozenset(nodes), strategy)
