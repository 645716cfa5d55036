"""The smallest plan judged as ``memcc train`` runs the step: every saved value recomputed.

The planner's search judges its candidates in the order of the step it is given, with each
update where it was placed (``passes/planning/simulate.py``, the cheaper analysis);
compile gives it the step with its updates moved early (``compiler/training_order.py``). A
plan's own recompute can let an update move further still (a clone that was the last
reader of a parameter's old value now runs sooner), which only the step judged as trained
sees. When the search was still given the file's order, where every gradient is held until
the updates at the end, this gap was wide: the plan smallest there kept saved values the
step as trained could drop, and on transformers ResNets exported in train mode
(BENCHMARKS.md, issue 31's convolution floors) the search's smallest plan, as trained,
peaked at 89.9 MB where recomputing every saved value peaks at 79.3 MB, the stem
BatchNorm backward's own floor.

So for ``--budget min`` (and a refusal's smallest budget, so that the budget it names is
one compile accepts), where a saved value the chosen plan keeps is live at its peak (else
recomputing more cannot lower it, and nothing is simulated), the plan recomputing every
saved value that may be recomputed, with
the chosen plan's gradient-rule variants, is judged as trained too, and then the recompute
dearest per byte is shed where the headroom of that simulation says keeping the value
costs no peak (one simulation checks it; a bisection over the same list where it does not
hold). In: the step, the search's best plan as trained. Out: a better one, or None.

The same shedding serves a budget the search could not fit in its order
(``shed_within``): compile then takes the smallest plan, which fits as trained, and keeps
(stops recomputing) what the budget's headroom over that plan's order holds, dearest per
byte first: a budget above ``--budget min``'s no longer gets the smallest plan's added time
(a first-use sweep's PoolFormer: +38.3% at a budget where ``--budget min`` planned +10.8%).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from memcc.compiler.options import CompileOptions
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.lowering.recompute import RECOMPUTE_SUFFIX
from memcc.passes.plan import Plan, PlanError, StepStructure, nothing_saveable
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate

# Simulations the shedding's fallback bisection may spend.
SHED_ROUNDS = 6


def trained_rules(options: CompileOptions) -> SimulationRules:
    """How a plan is judged in the order ``memcc train`` runs the step (updates in place,
    each as early as it may run)."""
    return SimulationRules(options.device, host_copies=options.swaps, early_updates=True)

Judge = Callable[[frozenset[str]], "Simulation | None"]


def recompute_all_as_trained(graph: Graph, best: Simulation, costs: CostModel,
                             options: CompileOptions, structure: StepStructure
                             ) -> Simulation | None:
    """``best``'s variants with every saved value recomputed that may be, judged as
    trained, less the recompute ``_shed`` keeps; None unless its budget (peak and the heap
    room of its own small buffers, ``CompileOptions.slack_for``) is below ``best``'s."""
    everything = nothing_saveable(structure).recompute
    if everything <= best.plan.recompute or not _keeps_at_peak(best, structure):
        return None
    judged = _recomputing(graph, best.plan, costs, options, structure)

    def need(s: Simulation) -> int:
        return s.peak_bytes + options.slack_for(s.graph)

    sim = judged(everything)
    if sim is None or need(sim) >= need(best):
        return None
    return _shed(graph, sim, costs, lambda kept: judged(everything - kept), need)


def everything_as_trained(graph: Graph, best: Simulation, costs: CostModel,
                          options: CompileOptions, structure: StepStructure
                          ) -> Simulation | None:
    """``best``'s variants with every saved value recomputed that may be, judged as
    trained (None: nothing more to recompute, or it cannot be lowered): a start for
    ``shed_within`` besides the smallest plan, which may recompute its values again for
    each reader and shed dearer (``--strategy ilp`` on the zoo's ResNet-18 at 70% got its
    +2.4% from it)."""
    everything = nothing_saveable(structure).recompute
    if everything <= best.plan.recompute:
        return None
    return _recomputing(graph, best.plan, costs, options, structure)(everything)


def _recomputing(graph: Graph, like: Plan, costs: CostModel, options: CompileOptions,
                 structure: StepStructure) -> Judge:
    """A judge, as trained, of plans recomputing a given set with ``like``'s variants."""
    rules = trained_rules(options)

    def judged(recompute: frozenset[str]) -> Simulation | None:
        plan = Plan(recompute, "recompute all", dict(like.notes),
                    variants=dict(like.variants))
        try:
            return simulate(graph, plan, costs, structure, rules)
        except PlanError:
            return None
    return judged


def shed_within(graph: Graph, sim: Simulation, costs: CostModel, options: CompileOptions,
                structure: StepStructure, ceiling: Callable[[Simulation], int]
                ) -> Simulation:
    """``sim`` (a plan that fits, judged as trained) recomputing less where its peak stays
    within ``ceiling(plan)`` (the budget left for a plan's peak with the heap room of its
    own small buffers); ``sim`` itself where nothing can be kept."""
    rules = trained_rules(options)
    plan = sim.plan

    def judged(kept: frozenset[str]) -> Simulation | None:
        shed = dataclasses.replace(plan, recompute=plan.recompute - kept,
                                   recompute_again=plan.recompute_again - kept)
        try:
            return simulate(graph, shed, costs, structure, rules)
        except PlanError:
            return None

    def over(s: Simulation) -> int:  # 0: fits (``_shed`` takes a trial no worse than sim)
        return max(s.peak_bytes - ceiling(s), 0)

    if over(sim):
        return sim
    return _shed(graph, sim, costs, judged, over, room_at=ceiling(sim))


def _keeps_at_peak(best: Simulation, structure: StepStructure) -> bool:
    """Whether a saved value ``best`` keeps (one that could be recomputed) is live at its
    peak without being read or written there: else recomputing more cannot lower that
    point, and the candidate is not simulated (most steps: the peak is an op's own
    working set, or what the search already recomputes)."""
    live = best.liveness
    if live.peak_step < 0:
        return False
    node = best.graph.nodes[live.peak_step]
    touched = set(node.input) | set(node.output)
    return any(b in structure.saved and b not in touched
               and structure.producer_of.get(b) in structure.recomputable
               for b in live.live_at_peak)


def _shed(graph: Graph, sim: Simulation, costs: CostModel, judged: Judge,
          need: Callable[[Simulation], int], room_at: int | None = None) -> Simulation:
    """Stop recomputing the nodes dearest per byte whose values, kept, fit the headroom
    under ``sim``'s peak (or under ``room_at``) between their last forward reader and their
    clone; checked by one simulation (``need`` no higher than ``sim``'s), else the longest
    prefix of that list that holds (bisection)."""
    nodes = {n.name: n for n in graph.nodes}
    gaps = _gaps(sim)

    def per_byte(name: str) -> float:
        nbytes = sum(graph.info[o].nbytes for o in nodes[name].output if o in graph.info)
        return costs.of(nodes[name], graph) / max(nbytes, 1)

    top = sim.liveness.peak_bytes if room_at is None else room_at
    # Headroom per step, as int64 slices (a loop over every step of every span was 9 s of
    # a 30,905-node step's compile).
    room = top - np.asarray(sim.liveness.live_during, dtype=np.int64)
    chosen: list[str] = []
    for name in sorted(sim.plan.recompute, key=per_byte, reverse=True):
        spans = [gaps.get(o) for o in nodes[name].output if o]
        if not spans or any(s is None for s in spans):
            continue
        if all(hi <= lo or int(room[lo:hi].min()) >= b for lo, hi, b in spans):
            for lo, hi, b in spans:
                room[lo:hi] -= b
            chosen.append(name)
    target, kept = need(sim), sim
    trial = judged(frozenset(chosen)) if chosen else None
    if trial is not None and need(trial) <= target:
        return trial
    lo, hi = 0, len(chosen) - 1
    for _ in range(SHED_ROUNDS):
        if lo >= hi:
            break
        mid = (lo + hi + 1) // 2
        trial = judged(frozenset(chosen[:mid]))
        if trial is not None and need(trial) <= target:
            lo, kept = mid, trial
        else:
            hi = mid - 1
    return kept


def _gaps(sim: Simulation) -> dict[str, tuple[int, int, int] | None]:
    """Per recomputed forward value: the steps (from, to, exclusive) of ``sim``'s order in
    which it would be live if kept and is not now (after its forward buffer is freed,
    before its clone is made), and its bytes; None where that cannot be read off (a value
    that is not freed, or one with several clones)."""
    values = sim.liveness.values
    clones: dict[str, list[str]] = {}
    for name in values:
        base, sep, _ = name.rpartition(RECOMPUTE_SUFFIX)
        if sep and (base in values) and (name == base + sep or name[len(base + sep)] == "_"):
            clones.setdefault(base, []).append(name)
    out: dict[str, tuple[int, int, int] | None] = {}
    for base, names in clones.items():
        v = values[base]
        if len(names) != 1 or v.death is None or not v.owns_buffer:
            out[base] = None
            continue
        out[base] = (v.death + 1, values[names[0]].birth, v.nbytes)
    return out
