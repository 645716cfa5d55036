"""The benchmark's statistics must say "slower" only when the data say so, and always the same.

Synthetic rounds with a known true ratio stand in for timings: each round has a shared
machine-state factor (the drift interleaving is meant to cancel) and independent per-step
noise. numpy only, well under a second.
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.stats import (
    interleaved_times,
    paired_times,
    ratio_interval,
    rounds_for,
)


def synthetic(true_ratio: float, rounds: int, noise: float, seed: int
              ) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    drift = rng.lognormal(0.0, 0.3, rounds)  # a busy machine: +-35% from round to round
    a = 0.5 * drift * rng.lognormal(0.0, noise, rounds)
    b = 0.5 * true_ratio * drift * rng.lognormal(0.0, noise, rounds)
    return a, b


def test_interval_contains_the_true_ratio() -> None:
    a, b = synthetic(1.05, rounds=30, noise=0.02, seed=1)
    r = ratio_interval(a, b)
    assert r.low <= 1.05 <= r.high
    assert r.low > 1.0  # a 5% difference under 35% drift is visible once paired
    assert "slower" in r.verdict()


def test_clear_difference_excludes_one() -> None:
    a, b = synthetic(1.2, rounds=10, noise=0.05, seed=2)
    r = ratio_interval(a, b)
    assert r.excludes_one and r.low > 1.0
    assert r.verdict().startswith("B is ") and "slower" in r.verdict()
    faster = ratio_interval(b, a)
    assert faster.high < 1.0 and "faster" in faster.verdict()


def test_no_difference_cannot_be_told_from_noise() -> None:
    a, b = synthetic(1.0, rounds=12, noise=0.08, seed=3)
    r = ratio_interval(a, b)
    assert r.low < 1.0 < r.high
    assert r.verdict().startswith("cannot tell from noise: interval ")
    assert "spans 0" in r.verdict()
    assert r.cell().endswith("~")


def test_same_seed_same_interval() -> None:
    a, b = synthetic(1.1, rounds=15, noise=0.05, seed=4)
    assert ratio_interval(a, b, seed=7) == ratio_interval(a, b, seed=7)
    assert ratio_interval(a, b, seed=7).ratio == ratio_interval(a, b, seed=8).ratio


def test_coverage_is_roughly_nominal() -> None:
    """Over many synthetic runs the 95% interval holds the truth most of the time."""
    hits = 0
    for seed in range(100):
        a, b = synthetic(1.05, rounds=20, noise=0.05, seed=100 + seed)
        r = ratio_interval(a, b, resamples=1000, seed=seed)
        hits += r.low <= 1.05 <= r.high
    assert hits >= 85


def test_rejects_unpaired_or_bad_times() -> None:
    with pytest.raises(ValueError):
        ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        ratio_interval([], [])
    with pytest.raises(ValueError):
        ratio_interval([1.0, 0.0], [1.0, 1.0])


def test_interleaving_pairs_rounds_and_varies_order() -> None:
    calls: list[str] = []
    fake_now = [0.0]

    def clock() -> float:
        return fake_now[0]

    def make(name: str, cost: float):
        def fn() -> None:
            calls.append(name)
            fake_now[0] += cost
        return fn

    t = interleaved_times({"A": make("A", 1.0), "B": make("B", 2.0)}, rounds=20, warmup=2,
                          order="random", seed=0, clock=clock)
    assert t["A"] == [1.0] * 20 and t["B"] == [2.0] * 20
    timed = calls[4:]  # two warm-up rounds first
    firsts = {timed[2 * r] for r in range(20)}
    assert firsts == {"A", "B"}  # the order changes between rounds
    calls.clear()
    interleaved_times({"A": make("A", 1.0), "B": make("B", 1.0)}, rounds=3, warmup=0,
                      order="abab", clock=clock)
    assert calls == ["A", "B"] * 3
    a, b = paired_times(make("A", 1.0), make("B", 1.0), rounds=4, warmup=0)
    assert len(a) == len(b) == 4


def test_rounds_for_grows_with_noise() -> None:
    assert rounds_for(0.02, 0.10) > rounds_for(0.02, 0.05) >= 2


def test_min_seconds_adds_rounds_up_to_the_cap() -> None:
    now = [0.0]

    def clock() -> float:
        return now[0]

    def step() -> None:
        now[0] += 0.5

    t = interleaved_times({"A": step, "B": step}, rounds=3, warmup=0, min_seconds=10.0,
                          max_rounds=50, clock=clock)
    assert len(t["A"]) == 10  # 1 s per round until 10 s were spent
    t = interleaved_times({"A": step, "B": step}, rounds=3, warmup=0, min_seconds=100.0,
                          max_rounds=20, clock=clock)
    assert len(t["B"]) == 20
