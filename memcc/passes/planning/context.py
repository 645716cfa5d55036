"""What a strategy reads and what it returns: the contract between the plan pass
(``planner.choose_plan``) and the strategies it runs (``strategies``).

In: a ``PlanningContext`` (the step, its linear model ``PlanModel``, the sqrt(n)
segmentations, how plans are judged and the deadline; built once per ``choose_plan`` call,
nothing in it changes) and a ``Budget``. Out: a ``StrategyResult``, the simulated plans the
strategy found, one ``StrategyRun`` per run for the report, and the last ILP solve's
statistics. The plan pass picks the winner from that, judging every plan by the same
simulator. A new strategy is one function registered with ``@strategy(name)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.lowering.lower import VariantMemo
from memcc.passes.plan import Offload, Plan, StepStructure
from memcc.passes.planning.model.offload_terms import OffloadVars
from memcc.passes.planning.model.problem import Problem
from memcc.passes.planning.model.recompute_terms import RecomputeUnits
from memcc.passes.planning.model.variant_terms import VariantVars
from memcc.passes.planning.request import Budget
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate


@dataclass(frozen=True)
class PlanModel:
    """The linear model of the step's memory (the array ``problem`` the solvers read) plus
    the maps from its variables back to decisions: recompute units of forward nodes, the
    gradient-rule variants it may choose and, on a device provider, the values it may
    swap out."""

    problem: Problem
    units: RecomputeUnits
    offload: OffloadVars = field(default_factory=lambda: OffloadVars({}))
    variants: VariantVars = field(default_factory=VariantVars)

    @property
    def groups(self) -> tuple[tuple[str, ...], ...]:
        return self.units.groups

    def plan(self, x: np.ndarray, strategy: str, **notes) -> Plan:
        """The plan a solution of ``problem`` stands for."""
        plan = self.plan_units(self.units.units_of(x), strategy, **notes)
        swapped = {v: Offload("host") for var, v in self.offload.value_of.items()
                   if x[var] > 0.5}
        chosen = dict(c for var, c in self.variants.choice_of.items() if x[var] > 0.5)
        if swapped:
            plan = replace(plan, offload=swapped)
        return replace(plan, variants=chosen) if chosen else plan

    def starts(self, sims: list[Simulation], graph: Graph) -> list[np.ndarray]:
        """Warm starts for the ILP from plans already simulated."""
        position = {n.name: i for i, n in enumerate(graph.nodes)}
        out = []
        for sim in sims:
            if sim.plan.recompute:
                x = self.units.start_from(self.problem.n_vars, sim.rerun_before, position)
                if x is not None:
                    out.append(x)
        return out

    def plan_units(self, chosen: np.ndarray, strategy: str, **notes) -> Plan:
        """The plan that recomputes the units marked in ``chosen`` (bool per unit)."""
        names = frozenset(n for u in np.nonzero(chosen)[0] for n in self.groups[int(u)])
        return Plan(names, strategy, notes)


@dataclass(frozen=True)
class PlanningContext:
    """Everything a strategy may read. Built once per ``choose_plan`` call, so a refusal's
    smallest-budget search reuses the model and the segmentations."""

    graph: Graph
    costs: CostModel
    structure: StepStructure
    baseline: Simulation
    model: PlanModel
    segmentations: tuple[Simulation, ...]
    deadline: float          # time.perf_counter() value after which strategies stop
    time_limit: float
    # How every candidate is judged: the device's allocation rules, swapped-out copies in
    # host memory (a device provider), and the step's small buffers where plans must fit
    # with the heap room of those they add (heap_base; None where they need not).
    rules: SimulationRules = field(default_factory=SimulationRules)
    # Seconds of the deadline kept for what runs after the solves (``auto``'s polish): a
    # time-objective solve stopped at its limit took everything left, and the polish, with
    # no time, ran none of its moves (the zoo's GPT-2 with row chunks at --budget min).
    reserved_s: float = 0.0
    # Seconds this context took to build (the model and the segmentations simulated): how
    # fast this machine works through this step now. ``after_s``: seconds of the deadline
    # kept for the work the caller does after the strategy returns (``Budget.MIN``'s
    # search over the region variants; ``planner._Search``).
    prepare_s: float = 0.0
    after_s: float = 0.0
    # How many sqrt(n) segment counts were simulated (``planner.segment_counts``): the
    # region search over the same step simulates as many.
    segment_counts: int | None = None
    # The variant substitutions of the plans judged so far (``simulate(memo=...)``): a
    # search judges many plans with few sets of variants. Results are the same without.
    memo: VariantMemo = field(default_factory=VariantMemo, compare=False, repr=False)

    @property
    def host_copies(self) -> bool:
        """A device provider whose saved values may be swapped to host memory."""
        return self.rules.host_copies

    def simulate(self, plan: Plan) -> Simulation:
        return simulate(self.graph, plan, self.costs, self.structure, self.rules,
                        self.memo)

    def remaining(self) -> float:
        """Seconds the solves may still take (the deadline less ``reserved_s`` and
        ``after_s``)."""
        return self.deadline - self.reserved_s - self.after_s - time.perf_counter()


@dataclass(frozen=True)
class StrategyRun:
    """One run of a strategy: its report entry (``fields``: ``strategy``, ``detail``,
    ``status``, the solver's figures, ...; the report's ``strategies`` rows are these) and
    the simulated plans it returned (``sims``, which the pass summarises into the row:
    how many, how many fit, which won)."""

    fields: dict
    sims: tuple[Simulation, ...] = ()


@dataclass
class StrategyResult:
    """What a strategy returns: (candidate name, simulated plan) pairs, one ``StrategyRun``
    per run, and the last ILP solve's statistics (None: no solve ran)."""

    plans: list[tuple[str, Simulation]] = field(default_factory=list)
    runs: list[StrategyRun] = field(default_factory=list)
    solver: dict | None = None

    def add(self, name: str, sims: list[Simulation], run: dict) -> None:
        self.plans.extend((name, s) for s in sims)
        self.runs.append(StrategyRun(dict(run), tuple(sims)))

    def extend(self, other: StrategyResult) -> None:
        self.plans.extend(other.plans)
        self.runs.extend(other.runs)
        self.solver = other.solver or self.solver


Strategy = Callable[[PlanningContext, Budget], StrategyResult]
REGISTRY: dict[str, Strategy] = {}


def strategy(name: str) -> Callable[[Strategy], Strategy]:
    """Register a strategy under ``name`` (what ``--strategy`` accepts)."""
    def register(fn: Strategy) -> Strategy:
        REGISTRY[name] = fn
        return fn
    return register
