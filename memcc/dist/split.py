"""A training step split in two at its updates, for data parallelism (no torch here).

``memcc build`` writes the optimizer into the step, each update right after its gradient,
so a gradient's buffer is freed as soon as its parameter is updated. Data parallelism must
average every gradient across ranks before any update reads it, so the step is cut along
the roles ``memcc.step`` derives (``Role.UPDATE`` nodes are tagged by build):

- the gradient step: every node but the updates. Outputs: the loss, each parameter's
  gradient (``memcc.gradients``) and the carried values those nodes write (BatchNorm
  running statistics);
- the update step: the update nodes alone. Inputs: parameters, gradients, optimizer state
  and the constants the updates read; outputs: the new parameters and optimizer state
  (and the Dropout counter, whose advance build tags as an update too).

The cost: the gradient step holds every gradient until it ends (as PyTorch DDP holds its
buckets), so the early-update memory advantage of the fused step is lost there; ``peaks``
predicts both (docs say by how much for the zoo models).

``update_part`` cuts the update step further, to the updates of some parameters only
(ZeRO-1: each rank updates the parameters it owns); ``owners_of_state`` says which
parameters each update output belongs to.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memcc.errors import InputError
from memcc.frontend.update_groups import update_units
from memcc.graph import Graph, ancestors
from memcc.passes.analysis.rank_step import state_owners
from memcc.step import Role, TrainingStep


@dataclass(frozen=True)
class SplitStep:
    """The two halves of a step (module docstring) and what joins them.

    ``gradients``: parameter -> the gradient value (an output of ``gradient``, an input of
    ``update``); ``grad_carried``: carried output of the gradient step -> the input it
    replaces (BatchNorm statistics); ``update_state``: the same for the update step."""

    full: Graph
    spec: TrainingStep
    gradient: Graph
    update: Graph
    gradients: dict[str, str]
    grad_carried: dict[str, str]
    update_state: dict[str, str]

    @property
    def parameters(self) -> list[str]:
        return list(self.spec.parameters)


def subgraph(full: Graph, nodes: list, outputs: list[str], extra_inputs: Iterable[str] = ()
              ) -> Graph:
    """The graph of ``nodes`` (in ``full``'s order) computing ``outputs``: its inputs are
    the values they read that none of them produces (stored values stay initializers)."""
    produced = {o for n in nodes for o in n.output if o}
    read = [i for n in nodes for i in n.input if i and i not in produced]
    wanted = dict.fromkeys([*read, *extra_inputs])
    inits = {n: full.initializers[n] for n in wanted if n in full.initializers}
    inputs = [n for n in wanted if n not in inits or n in full.inputs]
    return Graph(nodes=list(nodes), inputs=inputs, outputs=list(dict.fromkeys(outputs)),
                 initializers=inits, info=dict(full.info), opsets=dict(full.opsets),
                 name=full.name)


def split_step(graph: Graph, spec: TrainingStep, source: str = "<step>") -> SplitStep:
    """Cut ``graph`` at its updates, or an ``InputError`` saying why it cannot be cut."""
    if spec.optimizer.get("name") in (None, "none"):
        raise InputError(f"{source}: the step has no optimizer (built with --optimizer none); "
                         "data-parallel training averages gradients before an update. Build "
                         "it with --optimizer sgd or adamw")
    roles = spec.roles
    updates = [n for n in graph.nodes if roles[n.name] is Role.UPDATE]
    rest = [n for n in graph.nodes if roles[n.name] is not Role.UPDATE]
    if not updates:
        raise InputError(f"{source}: no node is tagged as an update (memcc.role=update); "
                         "rebuild the step with this memcc's memcc build")
    made_by_update = {o for n in updates for o in n.output if o}
    made_by_rest = {o for n in rest for o in n.output if o}
    leak = sorted({i for n in rest for i in n.input if i in made_by_update})
    if leak:
        raise InputError(f"{source}: '{leak[0]}' is written by an update and read before the "
                         "updates end; the step cannot be cut into gradient and update steps")
    grads = spec.gradients()
    crossing = sorted({i for n in updates for i in n.input if i in made_by_rest})
    stray = [c for c in crossing if c not in set(grads.values())]
    if stray:
        raise InputError(f"{source}: the updates read '{stray[0]}', which is not a gradient "
                         "(memcc.gradients); it would not be averaged across ranks")
    grad_carried = {o: i for o, i in spec.state.items() if o in made_by_rest}
    update_state = {o: i for o, i in spec.state.items() if o in made_by_update}
    gradient = subgraph(graph, rest, [spec.loss, *dict.fromkeys(grads.values()),
                                       *grad_carried],
                         extra_inputs=[d for d in spec.data_inputs])
    update = subgraph(graph, updates, list(update_state))
    return SplitStep(graph, spec, gradient, update, dict(grads), grad_carried, update_state)


def update_part(split: SplitStep, outputs: Iterable[str]) -> Graph:
    """The update step cut to the nodes computing ``outputs`` (ZeRO-1: a rank's own)."""
    outs = list(dict.fromkeys(outputs))
    producer = split.update.def_use().producer
    nodes, _ = ancestors(outs, producer)
    keep = {id(n) for n in nodes}
    return subgraph(split.update, [n for n in split.update.nodes if id(n) in keep], outs)


def owners_of_state(split: SplitStep) -> dict[str, list[str]]:
    """Update output -> the parameters whose gradients it reads (``P.new``, ``P.exp_avg.new``:
    one; the AdamW and Dropout step counters: none, every rank keeps them); the same
    reading ``memcc compile --nproc`` plans with (``passes.analysis.rank_step``)."""
    owners = state_owners(split.full, split.spec)
    return {o: owners[o] for o in split.update_state}


def check_zero2(graph: Graph, spec: TrainingStep, label: str) -> None:
    """Refuse ZeRO-2 where an update reads the gradients of several parameters (a loss
    scale's overflow check reads every gradient): ZeRO-2 leaves each averaged gradient on
    its owner's rank alone, so that update could not run (``memcc train --nproc 2 --zero 2``
    of an fp16 step failed in a rank: "nothing bound to the input 'grad/reducesum_19'")."""
    together = {p: k for k, unit in enumerate(update_units(graph, spec.state, spec.parameters))
                for p in unit}  # a grouped update's parameters are dealt to one rank
    shared = [o for o, owners in state_owners(graph, spec).items()
              if len({together.get(p, p) for p in owners}) > 1]
    if shared:
        raise InputError(
            f"{label}: --zero 2: the update of '{shared[0]}' ({len(shared)} such) reads the "
            "gradients of several parameters (a dynamic loss scale's overflow check reads "
            "every gradient), and ZeRO-2 keeps each averaged gradient on one rank only. Use "
            "--zero 1 or 0, or build the step with --loss-scale none")


def peaks(split: SplitStep) -> dict[str, int]:
    """Predicted peak bytes (``passes.analysis.arrange``: liveness, updates in place where
    proven) of the fused step as ``memcc train`` runs it (each update moved right after its
    gradient where that lowers the peak) and of the step in the split's order (every
    update after the last gradient, as the data-parallel step runs: the gradients are all
    held until the all-reduce), and the gradients' bytes: what the split costs."""
    from memcc.passes.analysis.arrange import arrange_step

    fused = arrange_step(split.full, split.spec).prediction.peak_bytes
    held = arrange_step(split.full, split.spec, early_updates=False).prediction.peak_bytes
    return {"fused_step": fused, "split_step": held,
            "gradients": sum(split.full.info[g].nbytes
                             for g in dict.fromkeys(split.gradients.values()))}
