"""The rates a training run reports (``trainer/throughput.py``), on a clock of our own."""

from __future__ import annotations

import pytest

from memcc.trainer.throughput import Throughput


def test_the_steady_rate_leaves_out_the_first_step() -> None:
    """A first step of 3 s and then steps of 1 s at 8 samples: 8 samples a second after
    the first step, and over every step 32 samples in 6 s."""
    now = iter([0.0, 3.0, 4.0, 5.0, 6.0])
    rates = Throughput(8, clock=lambda: next(now))
    assert rates.step_done() == (pytest.approx(8 / 3), None)
    for _ in range(2):
        rates.step_done()
    rate, steady = rates.step_done()
    assert rate == pytest.approx(32 / 6) and steady == pytest.approx(8.0)
