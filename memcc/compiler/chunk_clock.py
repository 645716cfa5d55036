"""One ``--time-limit`` for every row-chunk setting a compile plans.

Compile plans the step as loaded and, where row chunks may pay (``compiler/chunk_choice.py``),
the step built with other chunks: each setting is a whole plan. Each used to get the whole
``--time-limit``, so a compile that planned two took twice it (the zoo's GPT-2 at
``--budget min``: 116 s at the default 60 on a loaded 2-core machine). Now they share one
deadline, ``started + time_limit``, and each gets two things from ``SharedLimit``:

- its **work**: the ``time_limit`` its planner is given, from which the polish derives its
  count of simulations (``passes/planning/polish.py``, ``Allowance.of``). A fixed share of
  the limit, never what the clock left, so that the same compile gives the same plan on a
  quiet and on a loaded machine;
- its **deadline**: the safety net every stage of its plan stops at. The step as loaded
  stops at the end of its share; a setting planned after it gets what is left of the one
  limit, split evenly among the settings that may still be planned, so a first plan that
  ends early leaves the others more time (not more work).

The shares: nothing can follow (no site, every kind set by a flag, a step given already
built), the step as loaded gets the whole limit, as before. ``--budget min`` plans one
setting after it (the heaviest split, ``chunk_choice._search_min``), and that setting is
bigger (more nodes: every simulation costs more) and usually wins, so the step as loaded
gets a third (``FIRST_SHARE_MIN``). At a budget the step as loaded's plan is usually the
answer (it fits) and up to ``len(ladder)`` settings may follow, so it gets half
(``FIRST_SHARE_BUDGET``) and each setting after it an equal part of the rest (``next``).

Where the step as built does not fit a budget, compile searches in two phases
(``chunk_choice._search_budget``): each setting is first planned cheaply (``screen``:
``SCREEN_SHARE`` of the limit as its work, enough to know whether it fits and roughly at
what added time; the step as built's refusal there is a screen too: no smallest-peak
search), then the winner is planned again with the rest of the half (``final``).
An equal part each left the winner of four settings a sixth of the limit, and its plan
added 4-6 points more time than when each setting had the whole limit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

FIRST_SHARE_MIN = 1 / 3
FIRST_SHARE_BUDGET = 0.5
# A setting screened at a budget the step as built does not reach: its work, as a share of
# the limit (3 s of the default 60; the final plan of the winner gets what is left).
SCREEN_SHARE = 0.05
# The least wall time a setting is given (its sqrt(n) plans and the report's entries need
# some): the one limit can be overrun by this much per setting planned after it.
MIN_PLAN_S = 0.5


@dataclass(frozen=True)
class SharedLimit:
    """``limit`` seconds from ``started`` (a ``time.perf_counter()`` value) for the step as
    loaded and the ``later`` settings that may be planned after it; ``first_share``: the
    step as loaded's share."""

    started: float
    limit: float
    first_share: float
    later: int

    @classmethod
    def of(cls, limit: float, budget_is_min: bool, later: int) -> SharedLimit:
        """The split for a compile that may plan ``later`` settings after the step as
        loaded (0: it alone, with the whole limit)."""
        share = 1.0 if later == 0 else FIRST_SHARE_MIN if budget_is_min \
            else FIRST_SHARE_BUDGET
        return cls(time.perf_counter(), float(limit), share, later)

    @property
    def end(self) -> float:
        return self.started + self.limit

    def first(self) -> tuple[float, float | None]:
        """The step as loaded's (work, deadline); alone, the whole limit and no deadline
        (the planner counts it from when it starts, as it always did)."""
        if self.later == 0:
            return self.limit, None
        work = self.first_share * self.limit
        return work, self.started + work

    def next(self, left_to_plan: int) -> tuple[float, float]:
        """A setting planned after the step as loaded, with ``left_to_plan`` settings (it
        included) that may still be planned: its work, an equal part of what the step as
        loaded's share left of the limit (fixed, whatever the clock says), and its deadline,
        its part of the time left (at least ``MIN_PLAN_S`` from now)."""
        work = (1.0 - self.first_share) * self.limit / max(self.later, 1)
        now = time.perf_counter()
        window = max(self.end - now, 0.0) / max(left_to_plan, 1)
        return work, now + max(window, MIN_PLAN_S)

    def work_after_first(self) -> float:
        """The work, in seconds of the limit, the settings after the step as loaded get."""
        return self._rest()

    def _rest(self) -> float:
        """The work left after the step as loaded's share (a count, not the clock)."""
        return (1.0 - self.first_share) * self.limit

    def screen(self, screened: int) -> tuple[float, float]:
        """A setting screened after ``screened`` others: ``SCREEN_SHARE`` of the limit as
        its work, and as its deadline its part of the time left in proportion to the work
        left (the final plan's included)."""
        work = SCREEN_SHARE * self.limit
        pool = max(self._rest() - screened * work, work)
        now = time.perf_counter()
        window = max(self.end - now, 0.0) * work / pool
        return work, now + max(window, MIN_PLAN_S)

    def final(self, screened: int, split: int = 1, left: int = 1) -> tuple[float, float]:
        """The winner's plan after ``screened`` settings were screened: the work the
        screens left of the rest of the limit (at least a screen's), the deadline the end
        of the limit (at least ``MIN_PLAN_S`` from now). ``split`` plans sharing that
        (``chunk_budget._search_both``): each gets a ``split``-th of the work, and the
        ``left``-th part of the time left (the last one: the end of the limit)."""
        work = max(self._rest() - screened * SCREEN_SHARE * self.limit,
                   SCREEN_SHARE * self.limit) / split
        now = time.perf_counter()
        return work, max(now + max(self.end - now, 0.0) / left, now + MIN_PLAN_S)
