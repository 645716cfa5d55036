"""Samples a second of a training run, with and without its first step.

The first step of a run pays for what no later step does (ORT's first-run allocations and
kernel choices, a data-parallel group's first collectives), so a rate over every step
understates what a long run sustains, the more so for a short run. Both loops
(``trainer/loop.py``, ``dist/train.py``) report both: ``samples_per_s`` over every step
(what ``memcc train`` prints) and ``steady_samples_per_s`` over the steps after the first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Throughput:
    """The rates of a run at ``batch_size`` samples a step, from when it was made on
    (``started``, by ``clock``)."""

    batch_size: int
    clock: Callable[[], float] = time.perf_counter
    started: float = field(init=False)
    steps: int = 0
    after_first: float | None = None

    def __post_init__(self) -> None:
        self.started = self.clock()

    def step_done(self) -> tuple[float, float | None]:
        """Count a step just finished; the rate over every step so far, and over those
        after the first (None until a second step has run)."""
        now = self.clock()
        self.steps += 1
        if self.after_first is None:
            self.after_first = now
        total = now - self.started
        rate = self.steps * self.batch_size / total if total > 0 else 0.0
        later = now - self.after_first
        steady = (self.steps - 1) * self.batch_size / later \
            if self.steps > 1 and later > 0 else None
        return rate, steady
