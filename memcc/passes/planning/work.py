"""The planner's work outside the solver, counted in simulated nodes instead of seconds.

Every plan the planner judges is simulated (lowered, then its liveness analysed), and
outside the ILP those simulations are what a compile spends its time on: the sqrt(n)
segmentations, the rebuilt-again plans with their variant kinds, the polish. Each such
stage gets a count of simulations bought by its share of ``--time-limit`` at
``SIMULATED_NODES_PER_S``, so the same step, budget and limit give the same plan on a
quiet and on a loaded machine; the clock (the planner's deadline) is only a safety net for
a machine much slower than that rate, and where it stops a stage the report says so.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memcc.passes.planning.context import PlanningContext

# The work a share of ``--time-limit`` buys, in simulated nodes: one simulation costs about
# the lowered step's node count, at 11,000-16,000 nodes a second on CI's 2-core machine
# with other jobs running (zoo steps of 460-2,555 nodes, 2026-11-27). A count, not a clock,
# so that the plan does not depend on how busy the machine is.
SIMULATED_NODES_PER_S = 12_000
MIN_MOVES = 4
# Every node ``simulate`` has judged in this process: what a compile's stages spent, read
# as a difference (``compiler/chunk_budget.py`` weighs the row-chunk screens by it).
_SIMULATED = [0]


# Python's full (generation 2) collections while plans are judged: about never. Each one
# walks every object the process tracks, and a search keeps many plans' lowered steps and
# liveness reports alive: on the transformers GPT-2 124M compile at --budget min, 24-26 full
# collections took 10 s of a 95-110 s compile (gc.callbacks, a loaded 2-core machine). The
# plans make almost no reference cycles (reference counts free them), and the young
# collections still run: with no collection at all the compile's largest resident size
# was 5.4 GB against 5.7 GB.
FULL_COLLECTION_EVERY = 1_000_000


@contextmanager
def few_full_collections() -> Iterator[None]:
    """Plans judged without full garbage collections (``FULL_COLLECTION_EVERY``); the
    thresholds as they were afterwards, whatever happened."""
    before = gc.get_threshold()
    gc.set_threshold(before[0], before[1], max(before[2], FULL_COLLECTION_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*before)


def count_simulated(nodes: int) -> None:
    """``simulate`` judged a plan of ``nodes`` nodes."""
    _SIMULATED[0] += nodes


def simulated_nodes() -> int:
    """The nodes simulated so far in this process (a running count: take differences)."""
    return _SIMULATED[0]


@dataclass
class Allowance:
    """How much one stage may search: ``moves`` simulations, a count fixed by the size of
    what it simulates and ``--time-limit`` (``Allowance.of``). ``deadline`` (a perf_counter
    value: the planner's own) is only a safety net, so that the limit holds on a machine
    much slower than ``SIMULATED_NODES_PER_S``. ``stopped``: per stage, what stopped it
    ("moves", the same on every run; "time limit", where the plan may then depend on the
    machine, and the report says so)."""

    moves: int
    deadline: float = float("inf")
    spent: int = 0
    stopped: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, p: PlanningContext, share: float, *, nodes: int | None = None,
           least: int = MIN_MOVES) -> Allowance:
        """``share`` of ``p``'s time limit as simulations of ``nodes`` nodes each (the
        step's, where each move simulates a plan about its size), at least ``least``."""
        size = max(len(p.graph.nodes) if nodes is None else nodes, 1)
        moves = int(share * p.time_limit * SIMULATED_NODES_PER_S / size)
        # The safety net leaves the caller the room it asked for (``after_s``).
        return cls(max(moves, least), p.deadline - p.after_s)

    def take(self, stage: str) -> bool:
        """Whether one more simulation may run (it is counted)."""
        why = ("moves" if self.spent >= self.moves
               else "time limit" if time.perf_counter() > self.deadline else None)
        if why is not None:
            self.stopped.setdefault(stage, why)
            return False
        self.spent += 1
        return True


def account(*allowances: Allowance) -> dict:
    """The report's account of one or more stages' work: the simulations they ran, the most
    they were allowed, and ``cut_by_time_limit`` naming the stages the clock, not the
    count, stopped (only then may another run find another plan)."""
    stopped = {k: v for a in allowances for k, v in a.stopped.items()}
    out: dict = {"simulations": sum(a.spent for a in allowances),
                 "simulations_allowed": sum(a.moves for a in allowances)}
    cut = [stage for stage, why in stopped.items() if why == "time limit"]
    return {**out, "cut_by_time_limit": cut} if cut else out
