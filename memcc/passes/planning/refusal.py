"""The planner's refusal, ``BudgetError``, in a module of its own: compile refuses a budget
under the step's floor before the planner runs (``compiler/floor_check.py``), and importing
the planner for its exception class alone took a fifth of a second of that refusal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcc.errors import MemccError

if TYPE_CHECKING:
    from memcc.passes.planning.planner import PlanOutcome


class BudgetError(MemccError):
    """No plan fits the budget: carries the numbers (``budget``, and ``smallest``, the
    smallest reachable peak or budget) and, where the search for it ran, its plan
    (``outcome``: compile weighs that plan's own heap room before refusing, so the budget a
    refusal names is one it accepts). The planner's message is neutral; what a user should
    give is composed by the caller that knows the user's flags (``compiler.planning``).
    ``smallest_fit``, where no search ran: the least any plan found needs with the heap room
    of its own small buffers (``Simulation.fit_bytes``), which can be more than the
    smallest peak plus the step's own room (a screen's refusal of SegFormer named 6.64 MB
    by its peak, where that budget was then refused naming 8.07 MB)."""

    def __init__(self, message: str, *, budget: int, smallest: int,
                 outcome: PlanOutcome | None = None,
                 runs: list[dict] | None = None, smallest_fit: int | None = None) -> None:
        super().__init__(message)
        self.budget = budget
        self.smallest = smallest
        self.smallest_fit = smallest if smallest_fit is None else smallest_fit
        self.outcome = outcome
        # The strategy runs that found nothing within the budget, as the report shows them
        # (``_describe_runs``): a later search that does fit keeps them in its report, so
        # that a run is never dropped from it for having failed.
        self.runs = list(runs or [])
