"""Plans shed to a budget from more than one start, the cheapest kept.

Shedding (``trained_smallest.shed_within``: stop recomputing what the budget's headroom
holds, dearest per byte first, checked by simulation as trained) is a local search, and
where it starts decides where it ends. Compile offers it starts besides the plan it has:

- ``within_budget``: a budget the search could not fit in its order where its smallest
  plan fits as trained. The smallest plan is often rebuilt again (each value recomputed
  once per reader), dear to start from; the plan recomputing every saved value it may
  and the search's other answers (``PlanOutcome.alternatives``) are shed too (the zoo's
  ResNet-18 at 70%: +26.1% from the smallest, +2.4% from another answer).
- ``cheaper_by_shedding``: under ``auto``, a budget the search fitted. The ILP's model
  can overstate what a plan keeps (births between its candidate points, the moves a
  plan's clones allow the updates), and the plan recomputing everything, shed, can be
  cheaper than its answer (timm's LeViT-128S at 80.7 MB: +9.8% from the search, +5.2%
  shed from everything; BENCHMARKS.md, "Planning in the order the step trains").

Each start costs up to ``SHED_ROUNDS`` + 2 simulations of the step, outside the planner's
deadline, so the starts besides the plan in hand are bounded by ``EXTRA_STARTS_SHARE`` of
the limit's work (``work.SIMULATED_NODES_PER_S``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import islice

from memcc.compiler.options import CompileOptions
from memcc.compiler.trained_smallest import (
    SHED_ROUNDS,
    everything_as_trained,
    shed_within,
    trained_rules,
)
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.plan import StepStructure
from memcc.passes.planning.planner import ALTERNATIVES, PlanOutcome
from memcc.passes.planning.simulate import Simulation, simulate
from memcc.passes.planning.work import SIMULATED_NODES_PER_S

# The starts shed besides the plan in hand (each judged as trained and shed, up to
# ``SHED_ROUNDS`` + 2 simulations of the step) may take this share of the limit's work.
EXTRA_STARTS_SHARE = 0.5
SHED = "then kept what the budget holds"


@dataclass
class _Shedding:
    """The cheapest plan shed to ``ceiling`` so far (``best``) and where it came from."""

    graph: Graph
    costs: CostModel
    options: CompileOptions
    structure: StepStructure
    ceiling: Callable[[Simulation], int]
    best: Simulation
    source: str

    def offer(self, trained: Simulation | None, label: str) -> None:
        """Shed ``trained`` (judged as trained; None: no such plan) to the ceiling and keep
        it where it is cheaper than the best so far."""
        if trained is None or trained.peak_bytes > self.ceiling(trained):
            return
        shed = shed_within(self.graph, trained, self.costs, self.options, self.structure,
                           self.ceiling)
        if shed.added_time_s < self.best.added_time_s:
            self.best, self.source = shed, label

    def starts(self) -> int:
        """How many starts ``EXTRA_STARTS_SHARE`` of the limit's work buys."""
        return int(EXTRA_STARTS_SHARE * self.options.time_limit * SIMULATED_NODES_PER_S
                   / (max(len(self.graph.nodes), 1) * (SHED_ROUNDS + 2)))

    def offer_starts(self, found: PlanOutcome, count: int) -> None:
        """Offer up to ``count`` starts, judged as trained, in order: ``found``'s plan
        recomputing every saved value it may, with its variants (unless it does already),
        then the search's other answers (the step as built among them left out: it is over
        any budget a search was needed for). Each is simulated only when offered."""
        rules = trained_rules(self.options)
        source = self.source

        def starts() -> Iterator[tuple[Simulation | None, str]]:
            if found.best.plan.strategy != "recompute all":   # as_trained chose it already
                yield (everything_as_trained(self.graph, found.best, self.costs, self.options,
                                             self.structure), f"{source}, then recompute all")
            for other in found.alternatives[:ALTERNATIVES]:   # the cheapest few
                if other.plan.strategy != "none":
                    yield (simulate(self.graph, other.plan, self.costs, self.structure, rules),
                           f"{other.plan.strategy} (another plan of that search)")

        for trained, label in islice(starts(), count):
            self.offer(trained, label)

    def outcome(self, found: PlanOutcome, entry: str) -> PlanOutcome:
        """``found`` with the best plan, labelled with its start, and a candidate
        ``entry`` for it; ``found`` itself where nothing beat its plan."""
        if self.best is found.best:
            return found
        candidates = [*found.candidates, {"strategy": entry,
                                          "peak_bytes": self.best.peak_bytes,
                                          "added_time_s": self.best.added_time_s}]
        return replace(found, best=self.best, picked=f"{self.source}, {SHED}",
                       candidates=candidates)


def within_budget(graph: Graph, smallest: PlanOutcome, costs: CostModel,
                  options: CompileOptions, structure: StepStructure,
                  ceiling: Callable[[Simulation], int]) -> PlanOutcome:
    """The smallest plan (what a budget the search could not fit in its order gets, where
    it fits as trained) recomputing less where the budget allows, said in the report's
    ``picked``; and the other starts (``_Shedding.offer_starts``, at least one), where one
    shed so is cheaper."""
    s = _Shedding(graph, costs, options, structure, ceiling,
                  shed_within(graph, smallest.best, costs, options, structure, ceiling),
                  smallest.picked or smallest.strategy)
    s.offer_starts(smallest, max(s.starts(), 1))
    return s.outcome(smallest, "smallest, shed to the budget")


def cheaper_by_shedding(graph: Graph, found: PlanOutcome, costs: CostModel,
                        options: CompileOptions, structure: StepStructure,
                        ceiling: Callable[[Simulation], int]) -> PlanOutcome:
    """``found`` (``auto``'s plan, fitting ``ceiling``), or a plan shed to the ceiling from
    another start (``_Shedding.offer_starts``, as many as the limit's work buys) where
    that is cheaper."""
    if options.strategy != "auto" or found.best.added_time_s <= 0:
        return found
    s = _Shedding(graph, costs, options, structure, ceiling, found.best,
                  found.picked or found.strategy)
    s.offer_starts(found, s.starts())
    return s.outcome(found, "another start, shed to the budget")
