"""The one simulator every strategy is judged by: lower a plan, then analyse liveness.

Because the peak comes from the same lowering that writes the output file
(``passes/lowering/lower.py``: variants -> recompute -> copies, each pass checked) and the same
liveness analysis that the measurements are checked against, a strategy cannot look better
here than it will be when run.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.analysis.arena import ArenaReport, cpu_arena_peak
from memcc.passes.analysis.arrange import arrange_step
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.device_memory import DevicePrediction, predict_device
from memcc.passes.analysis.liveness import (
    HEAP_BYTES_PER_SMALL_BUFFER,
    LivenessReport,
    small_buffers,
)
from memcc.passes.lowering.lower import PassReport, VariantMemo, lower
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.work import count_simulated
from memcc.step import TrainingStep

# Whose allocation rules a peak follows: the CPU provider straight from malloc, the CUDA
# arena, or the CPU provider through the same arena class.
DEVICES = ("cpu", "cuda", "cpu-arena")


@dataclass(frozen=True)
class Simulation:
    plan: Plan
    graph: Graph                      # the lowered step
    liveness: LivenessReport
    peak_bytes: int
    compute_cost_s: float             # all nodes of the lowered step
    added_time_s: float               # nodes the lowering added, less those it removed
    cloned_nodes: tuple[str, ...]
    recomputed_values: tuple[str, ...]
    rerun_before: dict[str, str]        # cloned forward node -> node it runs before
    passes: tuple[PassReport, ...] = ()  # what each lowering pass did
    arena: ArenaReport | None = None     # an arena device: the replay behind peak_bytes
    # CUDA: the runtime's device bytes (arena + bound buffers + stored values)
    device: DevicePrediction | None = None
    # Heap room for the small buffers the lowering added (``simulate(heap_base=...)``):
    # not part of the peak, but of what the plan needs to fit (``fit_bytes``).
    heap_room: int = 0

    @property
    def fit_bytes(self) -> int:
        """What a budget must hold for this plan: its peak and its added small buffers'
        heap room (passes.analysis.liveness.heap_allowance_bytes)."""
        return self.peak_bytes + self.heap_room


@dataclass(frozen=True)
class SimulationRules:
    """How a plan is judged (``simulate``), the same for every plan of one search.

    ``device``: whose allocation rules the peak follows. ``"cuda"``: the device pages
    behind what the CUDA arena reserves for the step (``passes.analysis.arena``: 256-byte
    rounding, regions that cannot merge, each large region in whole 2 MiB pages), without
    shrink between steps, plus the buffers the runtime binds (state, updated in place;
    batch; loss) and the stored values, in the steady state of repeated steps, for the step
    arranged as the CUDA runtime runs it (``passes.analysis.device_memory.predict_step``).
    ``"cpu"``: the live bytes with the CPU allocator's page rounding, as measured with the
    arena off (``backend/session.py``). ``"cpu-arena"``: the CPU provider allocating
    through the same arena class (``arena.cpu_arena_peak``).

    ``host_copies``: the step runs on a device provider, where swapped-out copies live
    in host memory (not in the peak; ``liveness.host_peak_bytes``).

    ``heap_base``: the small buffers of the step planned (``liveness.small_buffers``,
    counted once by the caller), to weigh the heap room of those the lowering adds
    (recompute clones, variants' values) into ``fit_bytes``; None weighs none. The room of
    the step's own is the budget's slack (``compiler.CompileOptions.slack_for``).

    ``early_updates``: also move each update to just after its gradient is complete where
    that lowers the peak (the order ``memcc compile`` writes and ``memcc train`` runs);
    off, the graph's order, a bound on it at a third of the analysis (for the many candidate
    plans a search judges; compile hands the search the step with its updates moved early
    already, ``compiler/training_order.py``, so the bound is close)."""

    device: str = "cpu"
    host_copies: bool = False
    heap_base: int | None = None
    early_updates: bool = False

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device '{self.device}': one of {', '.join(DEVICES)}")


def simulate(graph: Graph, plan: Plan, costs: CostModel,
             structure: StepStructure | None = None,
             rules: SimulationRules | None = None,
             memo: VariantMemo | None = None) -> Simulation:
    """The plan lowered, and judged as ``memcc train`` runs it (``passes.analysis.arrange``): each
    update written over the value it replaces where that is safe, so one copy of the
    state, not two, is counted at the end of the step; ``rules`` say by whose allocation
    rules and in which order (``SimulationRules``). ``memo``: the variant substitutions of
    this step made before (``lowering.lower.VariantMemo``): the same result, sooner.
    """
    rules = rules or SimulationRules()
    device, host_copies = rules.device, rules.host_copies
    heap_base, early_updates = rules.heap_base, rules.early_updates
    lowered = lower(graph, plan, structure, memo=memo)
    count_simulated(len(lowered.graph.nodes))
    step = TrainingStep.of(lowered.graph)
    runs = arrange_step(lowered.graph, step, host_copies=host_copies or device == "cuda",
                        early_updates=early_updates)
    live = runs.prediction
    arena, peak, prediction = None, live.peak_bytes, None
    if device == "cuda":
        prediction = predict_device(runs.graph, live, aliased=runs.in_place.aliased,
                                    updates=step.state)
        arena, peak = prediction.arena, prediction.steady_bytes
    elif device == "cpu-arena":
        arena, peak = cpu_arena_peak(runs.graph, live)
    added = added_seconds(graph, lowered.graph, costs)
    return Simulation(
        plan=plan,
        graph=runs.graph,
        liveness=live,
        peak_bytes=int(peak),
        compute_cost_s=costs.total(graph) + added,
        added_time_s=added,
        cloned_nodes=lowered.cloned_nodes,
        recomputed_values=lowered.recomputed_values,
        rerun_before=dict(lowered.rerun_before),
        passes=lowered.reports,
        arena=arena,
        device=prediction,
        heap_room=(HEAP_BYTES_PER_SMALL_BUFFER
                   * max(small_buffers(lowered.graph) - heap_base, 0)
                   if heap_base is not None else 0),
    )


def added_seconds(original: Graph, lowered: Graph, costs: CostModel) -> float:
    """Seconds the lowering added: every node that is new (a recompute clone, a variant's
    node, a copy) priced by ``CostModel.price`` (never 0 for a node that runs a kernel),
    less the nodes it removed (a substituted rule's)."""
    before = {n.name for n in original.nodes}
    after = {n.name for n in lowered.nodes}
    added = sum(costs.price(n, lowered) for n in lowered.nodes if n.name not in before)
    removed = sum(costs.of(n) for n in original.nodes if n.name not in after)
    return float(added - removed)
