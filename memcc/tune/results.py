"""What ``memcc tune`` returns: one ``Candidate`` row per size it looked at (what fitted,
at what peak, how fast it is predicted to run, what decided it) and the ``TuneResult``
holding them with the answers (largest, largest without rewriting, fastest, picked) and the
picked size's compiled step.

Plain values with ``to_json`` (``memcc tune --json``): the search fills them, the
measurements (``tune.measurement``) and plots (``tune.plots``) read them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memcc.graph import Graph
from memcc.tune.options import SearchRange


@dataclass(frozen=True)
class Candidate:
    """One size of the searched dimension and what is known about it.

    ``peak_bytes`` is the plan's peak where the size was planned at the budget, the step's
    own peak where it fits as built, else the smallest peak found (``decided_by`` says
    which); step time and throughput exist only for sizes whose plan is known."""

    batch: int
    fits: bool
    # baseline | floor | sqrtn | plan | min-search, or below-edge / above-edge: only the
    # step as built was looked at, and the size lies below the largest / above its next
    decided_by: str
    peak_bytes: int | None
    baseline_peak_bytes: int
    baseline_step_s: float
    # what ``peak_bytes`` is: "plan" (the plan at the budget), "as built", "smallest"
    # (the planner's smallest reachable), "sqrt(n)" (the smallest sqrt(n) peak, an upper
    # bound of the smallest), "floor" (inputs, parameters and state alone)
    peak_kind: str | None = None
    step_s: float | None = None
    strategy: str | None = None
    lr: float | None = None
    # --measure: median step time and peak measured in ORT (``memcc run``'s runner)
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        return None if not self.step_s else self.batch / self.step_s

    @property
    def measured_samples_per_s(self) -> float | None:
        return None if not self.measured_step_s else self.batch / self.measured_step_s

    @property
    def overhead(self) -> float | None:
        """Predicted time over the unrewritten step's, minus one."""
        if self.step_s is None or self.baseline_step_s <= 0:
            return None
        return self.step_s / self.baseline_step_s - 1.0

    def to_json(self) -> dict:
        return {
            "batch": self.batch, "fits": self.fits, "decided_by": self.decided_by,
            "peak_bytes": self.peak_bytes, "peak_kind": self.peak_kind,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_fits": self.decided_by == "baseline" and self.fits,
            "step_time_s": self.step_s, "samples_per_s": self.samples_per_s,
            "overhead": self.overhead, "strategy": self.strategy, "lr": self.lr,
            "measured_step_time_s": self.measured_step_s,
            "measured_samples_per_s": self.measured_samples_per_s,
            "measured_peak_bytes": self.measured_peak_bytes,
        }


@dataclass(frozen=True)
class TuneResult:
    """The search's answer: the table, both edges, the fastest size and the chosen step."""

    model: str
    range: SearchRange
    budget_bytes: int
    planning_budget_bytes: int
    candidates: tuple[Candidate, ...]        # every size evaluated, by batch
    largest_batch: int
    largest_batch_without_rewrite: int | None
    fastest_batch: int
    picked_batch: int
    pick: str
    step: Graph                              # the compiled step of ``picked_batch``
    cost_source: str
    strategy: str
    lr_rule: str | None
    lr: float | None                         # suggested for ``picked_batch``
    lr_applied: bool
    stats: dict                              # how many builds, plans and searches it took
    time_s: float
    # the compiled step of every size with a predicted time (for --measure)
    steps: Mapping[int, Graph] = field(default_factory=dict, repr=False, compare=False)

    def candidate(self, batch: int) -> Candidate:
        return next(c for c in self.candidates if c.batch == batch)

    def to_json(self) -> dict:
        return {
            "model": self.model, "dim": self.range.dim,
            "range": [self.range.low, self.range.high],
            "budget_bytes": self.budget_bytes,
            "planning_budget_bytes": self.planning_budget_bytes,
            "largest_batch": self.largest_batch,
            "largest_batch_without_rewrite": self.largest_batch_without_rewrite,
            "fastest_batch": self.fastest_batch,
            "pick": self.pick, "picked_batch": self.picked_batch,
            "cost_model": self.cost_source, "strategy": self.strategy,
            "lr": None if self.lr is None else {
                "rule": self.lr_rule, "suggested": self.lr, "applied": self.lr_applied},
            "candidates": [c.to_json() for c in self.candidates],
            "stats": self.stats, "time_s": round(self.time_s, 3),
        }


