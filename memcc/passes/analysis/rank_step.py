"""The step one data-parallel rank runs, as one graph the planner can judge (issue 33).

``memcc train --nproc N`` (``memcc.dist``) runs a step in two sessions cut at its updates:
the gradient step writes every gradient into a flat bucket the rank holds for the whole
run, gloo all-reduces the bucket, the update step reads it. With ZeRO-1 a rank keeps the
optimizer state of the parameters it owns only and runs only their updates. So a rank's
memory is not the fused step's (each gradient freed at its update), and ``--budget`` for
ranks must be planned on what a rank holds. ``rank_step`` writes that down as a graph of
the same nodes, which the one simulator (``passes.planning.simulate``) judges unchanged:

- every update node this rank does not run is dropped, with the optimizer state only it
  read (ZeRO-1: the other ranks' shards); the parameters stay (every rank holds all);
- every output of the gradient step (each gradient, the loss, the carried BatchNorm
  statistics the ranks average) is bound to a buffer held all step (``TrainingStep.bound``:
  a graph input of its size, which the output is written into): the bucket exists before
  the first forward node runs, and no gradient is freed by its update;
- an update the update step cannot write in place (``passes.analysis.inplace``) writes an
  array of its own that the rank keeps between steps: bound the same way;
- ZeRO-2: only the gradients of the rank's own parameters are bound (its shard of the
  bucket, 1/N of the gradients). Every other gradient is allocated when the backward
  produces it (the run: an output ORT allocates) and freed after the backward, before the
  updates (the run: after its reduction to its owner): here a ``Shape`` node reads it
  there, standing for the reduction.

Plans (recompute, variants) name forward and backward nodes and values, which are the same
here and in the step: a plan chosen on the rank's graph is lowered onto the step file,
which ``memcc train --nproc`` splits again. Beyond the graph, gloo's ring all-reduce needs
scratch while no ORT buffer is live (``COMM_SCRATCH_BYTES``: measured with torch 2.13's
gloo on 100 KB to 400 MB tensors, at most 2.1 MB per rank; ZeRO-2's ``reduce`` to a
gradient's owner, 1 to 100 MB tensors: at most 2.0 MB), counted as an input held all step.

No torch here: ``memcc.dist`` imports this to deal parameters to ranks exactly as planned.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

from memcc.frontend.update_groups import update_units
from memcc.graph import Graph, TensorInfo, ancestors
from memcc.passes.analysis.inplace import analyze_in_place
from memcc.step import BOUND_KEY, STATE_KEY, Role, TrainingStep

# The buffer a bound output is written into: an input named after it.
BUFFER_SUFFIX = ".rank_buffer"
# gloo's scratch for a ring all-reduce (at most 2.1 MB measured, whatever the tensor's
# size, less for tensors under a few MB; 1 MB for a broadcast), live between the two halves
# of the step. The rank's graph holds it all step (an input of its size): a bound a few MB
# over the truth at most, which the planner sees like any other buffer.
COMM_SCRATCH_BYTES = 2 * 1024 * 1024 + 128 * 1024
COMM_SCRATCH_INPUT = "memcc.dist.comm_scratch"
# ZeRO-2: what the node standing for a sent gradient's reduction writes (``_sends``).
SENT_SUFFIX = ".rank_sent"


@dataclass(frozen=True)
class Ranks:
    """Data parallelism as a step is planned for it: ``world`` ranks, ZeRO stage ``zero``
    (0: every rank keeps all optimizer state; 1: each keeps its parameters'; 2: and only
    its parameters' averaged gradients)."""

    world: int
    zero: int = 0

    def __post_init__(self) -> None:
        if self.world < 1 or self.zero not in (0, 1, 2):
            raise ValueError(f"Ranks({self.world}, zero={self.zero})")


def assign_owners(parameters: list[str], graph: Graph, world: int) -> dict[str, int]:
    """Parameter -> the rank that updates it (ZeRO-1): largest first, each to the rank
    holding the fewest bytes so far, so the ranks' optimizer state is balanced by bytes.
    The parameters of one grouped update (``frontend/update_groups.py``) go to one rank
    together: their update reads all their gradients and writes one joined state."""
    info = graph.info
    units = update_units(graph, json.loads(graph.metadata.get(STATE_KEY, "{}")), parameters)
    load = [0] * world
    owner: dict[str, int] = {}
    for unit in sorted(units, key=lambda u: (-sum(info[p].nbytes for p in u), u[0])):
        r = min(range(world), key=lambda k: (load[k], k))
        owner.update(dict.fromkeys(unit, r))
        load[r] += sum(info[p].nbytes for p in unit)
    return owner


def state_owners(graph: Graph, spec: TrainingStep) -> dict[str, list[str]]:
    """Carried output an update writes -> the parameters whose gradients its update nodes
    read (``P.new``, ``P.exp_avg.new``: one; the AdamW and Dropout step counters: none,
    every rank keeps them)."""
    roles = spec.roles
    producer = {o: n for n in graph.nodes if roles.get(n.name) is Role.UPDATE
                for o in n.output if o}
    by_grad: dict[str, list[str]] = {}
    for p, g in spec.gradients().items():
        by_grad.setdefault(g, []).append(p)
    out: dict[str, list[str]] = {}
    for o in spec.state:
        if o not in producer:
            continue
        nodes, _ = ancestors([o], producer)
        made = {v for n in nodes for v in n.output}
        read = {i for n in nodes for i in n.input if i and i not in made}
        out[o] = sorted({p for g in read if g in by_grad for p in by_grad[g]})
    return out


def gradient_owners(spec: TrainingStep, owner: dict[str, int]) -> dict[str, int | None]:
    """Gradient -> the rank its average is reduced to (ZeRO-2): the owner of the parameters
    it belongs to; None where they have several owners (a gradient two parameters share,
    dealt apart): that one is all-reduced and every rank keeps it."""
    ranks: dict[str, set[int]] = {}
    for p, g in spec.gradients().items():
        if p in owner:
            ranks.setdefault(g, set()).add(owner[p])
    return {g: next(iter(r)) if len(r) == 1 else None for g, r in ranks.items()}


def owned_outputs(owners: dict[str, list[str]], owner: dict[str, int], rank: int
                  ) -> list[str]:
    """The update outputs ``rank`` computes: its parameters' and the shared counters."""
    return [o for o, ps in owners.items() if not ps or any(owner[p] == rank for p in ps)]


@dataclass(frozen=True)
class RankStep:
    """One rank's step (module docstring) and the bytes that make it differ from the
    fused step's: ``bucket_bytes`` (the gradient step's outputs, held all step),
    ``state_bytes`` (the optimizer state this rank keeps; ``bucket_bytes`` with ZeRO-2:
    its own gradients only, the others' in ``sent_bytes``), ``comm_bytes`` (gloo's
    scratch: ``COMM_SCRATCH_BYTES``, or the bucket's bytes where fewer; in the graph as an
    input, ``COMM_SCRATCH_INPUT``)."""

    graph: Graph
    rank: int
    ranks: Ranks
    bucket_bytes: int
    state_bytes: int
    comm_bytes: int
    sent_bytes: int = 0


def rank_step(graph: Graph, ranks: Ranks, rank: int = 0) -> RankStep:
    """The graph rank ``rank`` of ``ranks`` runs (module docstring); ``graph`` unchanged."""
    spec = TrainingStep.of(graph)
    roles = spec.roles
    updates = [n for n in graph.nodes if roles.get(n.name) is Role.UPDATE]
    made_by_update = {o for n in updates for o in n.output if o}
    params = [p for p in spec.parameters if p in graph.info]
    owner = assign_owners(params, graph, ranks.world) if ranks.zero \
        else dict.fromkeys(params, rank)
    mine = owned_outputs(state_owners(graph, spec), owner, rank)
    producer = {o: n for n in updates for o in n.output if o}
    keep_nodes, _ = ancestors(mine, producer)
    keep = {id(n) for n in keep_nodes}
    grads = list(dict.fromkeys(spec.gradients().values()))
    sent = []  # ZeRO-2: reduced to their owners, not kept (module docstring)
    if ranks.zero == 2:
        to = gradient_owners(spec, owner)
        sent = [g for g in grads if to.get(g, rank) not in (None, rank)]
    # As the split runs them: every update after the all-reduce, after every other node.
    nodes = [n for n in graph.nodes if roles.get(n.name) is not Role.UPDATE] + \
        _sends(sent, graph) + [n for n in graph.nodes if id(n) in keep]
    read = {i for n in nodes for i in n.input if i}
    dropped_state = {i for o, i in spec.state.items() if o in made_by_update and o not in mine}
    gone = {i for i in dropped_state if i not in read}
    state = {o: i for o, i in spec.state.items() if o in mine}
    grad_outputs = [spec.loss, *(g for g in grads if g not in sent),
                    *(o for o in spec.state if o not in made_by_update)]
    state_bytes = sum(graph.info[i].nbytes for o, i in state.items()
                      if o in made_by_update and i not in set(params))
    inputs = [i for i in graph.inputs if i not in gone]
    view = Graph(nodes=nodes, inputs=inputs, outputs=list(graph.outputs),
                 initializers={k: v for k, v in graph.initializers.items() if k not in gone},
                 info=dict(graph.info), opsets=dict(graph.opsets),
                 metadata=dict(graph.metadata), name=graph.name)
    in_place = analyze_in_place(view, state).aliased
    bound_outputs = [*grad_outputs, *(o for o in state if o not in in_place)]
    bound = {o: o + BUFFER_SUFFIX for o in dict.fromkeys(bound_outputs) if o in graph.info}
    for o, buf in bound.items():
        view.info[buf] = graph.info[o]
        state.pop(o, None)
    bucket_bytes = sum(graph.info[o].nbytes for o in bound if o in grad_outputs)
    sent_bytes = sum(graph.info[g].nbytes for g in sent)
    comm = min(COMM_SCRATCH_BYTES, bucket_bytes + sent_bytes)
    view.info[COMM_SCRATCH_INPUT] = TensorInfo(onnx.TensorProto.UINT8, (comm,))
    view.inputs = inputs + list(bound.values()) + [COMM_SCRATCH_INPUT]
    kept_outputs = [o for o in graph.outputs if o not in made_by_update or o in mine]
    view.outputs = list(dict.fromkeys([*kept_outputs, *bound]))
    for g in sent:
        view.info[g + SENT_SUFFIX] = TensorInfo(onnx.TensorProto.INT64,
                                                (len(graph.info[g].shape),))
    view.metadata.update({STATE_KEY: json.dumps(state), BOUND_KEY: json.dumps(bound)})
    return RankStep(view, rank, ranks, bucket_bytes, state_bytes, comm, sent_bytes)


def _sends(sent: list[str], graph: Graph) -> list[onnx.NodeProto]:
    """ZeRO-2: the gradients a rank sends, each read once more after the backward (a
    ``Shape`` node standing for its reduction), so the simulator frees it there, before the
    updates, as the run frees it; the nodes are the rank's graph's, never a file's."""
    return [onnx.helper.make_node("Shape", [g], [g + SENT_SUFFIX], name=f"memcc.dist.send/{g}")
            for g in sent if g in graph.info]


def rank_steps(graph: Graph, ranks: Ranks) -> list[RankStep]:
    """Every rank's step (one for ZeRO-0, where all ranks run the same), heaviest first:
    by optimizer state and gradients kept, the rank number breaking ties."""
    count = ranks.world if ranks.zero else 1
    steps = [rank_step(graph, ranks, r) for r in range(count)]
    return sorted(steps, key=lambda s: (-s.state_bytes - s.bucket_bytes, s.rank))
