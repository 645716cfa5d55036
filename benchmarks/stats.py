"""Paired timing on a noisy machine: interleave the variants, pair them by round, bootstrap.

Why this shape. On the project's 2-core machine two timings of the same step differ by up to
35%, and the noise is mostly slow (a neighbour's build, thermal or frequency drift) rather
than independent per step. Timing A five times and then B five times puts that drift into
the A/B ratio. Running A and B in the same round, in an order that changes from round to
round, exposes both to the same conditions; the ratio *within* a round then cancels what the
two shared, and the spread of those per-round ratios is an honest measure of what is left.

The statistic is the median of the per-round ratios B/A (robust to the odd round where a
neighbour woke up), and its 95% interval is a percentile bootstrap over rounds with a fixed
seed, so the same times always print the same interval. Where the interval straddles 1.0 the
verdict says so, with the interval, instead of printing a ratio a reader would over-trust.

numpy only: the unit tests and the parent process of a benchmark need no torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ORDERS = ("random", "abab", "rotate")


def interleaved_times(
    fns: Mapping[str, Callable[[], object]],
    *,
    rounds: int,
    warmup: int = 1,
    order: str = "random",
    seed: int = 0,
    min_seconds: float = 0.0,
    max_rounds: int | None = None,
    clock: Callable[[], float] = time.perf_counter,
    on_round: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, list[float]]:
    """Run every callable once per round for ``rounds`` rounds; return each one's times.

    With ``min_seconds``, rounds go on past ``rounds`` until that much time was spent
    timing (at most ``max_rounds``, default ``rounds * 10``): a fast step gets many rounds
    for the same wall time a slow one spends on few, and the interval narrows with the
    square root of the rounds.

    ``warmup`` untimed rounds come first, because first calls pay for thread pools, kernel
    selection and page faults that no later step pays. ``order`` is "random" (a fresh
    permutation per round, seeded: no variant always runs right after the same neighbour,
    whose leftovers in cache or spinning threads it would inherit), "abab" (the given order
    every round) or "rotate" (round r starts at the r-th variant: each position equally
    often, deterministic). Times of round r are at index r of every list, which is what
    pairs them for ``ratio_interval``.
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, not {order!r}")
    if rounds < 1:
        raise ValueError("rounds must be at least 1")
    names = list(fns)
    if not names:
        raise ValueError("nothing to time")
    rng = np.random.default_rng(seed)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    cap = max(rounds, max_rounds if max_rounds is not None else rounds * 10)
    start = clock()
    r = 0
    while r < rounds or (min_seconds > 0 and r < cap and clock() - start < min_seconds):
        if order == "random":
            seq = [names[i] for i in rng.permutation(len(names))]
        elif order == "rotate":
            k = r % len(names)
            seq = names[k:] + names[:k]
        else:
            seq = names
        this_round: dict[str, float] = {}
        for name in seq:
            t0 = clock()
            fns[name]()
            this_round[name] = clock() - t0
        for name in names:
            times[name].append(this_round[name])
        if on_round is not None:
            on_round(r, this_round)
        r += 1
    return times


def paired_times(a: Callable[[], object], b: Callable[[], object], *, rounds: int,
                 warmup: int = 1, order: str = "random", seed: int = 0
                 ) -> tuple[list[float], list[float]]:
    """``interleaved_times`` for the common case of one original (A) and one rewrite (B)."""
    t = interleaved_times({"A": a, "B": b}, rounds=rounds, warmup=warmup, order=order,
                          seed=seed)
    return t["A"], t["B"]


@dataclass(frozen=True)
class RatioInterval:
    """Median of the paired ratios B/A and its bootstrap interval (see ``ratio_interval``)."""

    ratio: float
    low: float
    high: float
    confidence: float
    rounds: int
    a_median_s: float
    b_median_s: float

    @property
    def excludes_one(self) -> bool:
        return self.low > 1.0 or self.high < 1.0

    @property
    def half_width(self) -> float:
        """Half the interval's width, as a fraction: the smallest effect this run resolves."""
        return (self.high - self.low) / 2.0

    def verdict(self, b: str = "B", a: str | None = None) -> str:
        """One line a reader can act on: a difference with its interval, or "cannot tell"."""
        pct = f"{self.confidence:.0%} CI"
        vs = f" than {a}" if a else ""
        if self.low > 1.0:
            return (f"{b} is {_pct(self.ratio - 1)} slower{vs} "
                    f"({pct} {_pct(self.low - 1)}..{_pct(self.high - 1)})")
        if self.high < 1.0:
            return (f"{b} is {_pct(1 - self.ratio)} faster{vs} "
                    f"({pct} {_pct(1 - self.high)}..{_pct(1 - self.low)})")
        return (f"cannot tell from noise: interval {_signed(self.low - 1)}.."
                f"{_signed(self.high - 1)} spans 0 (median {_signed(self.ratio - 1)}, "
                f"{self.rounds} rounds)")

    def cell(self) -> str:
        """Compact table cell: ``1.048 (1.021..1.079)``, with ``~`` where it spans 1."""
        mark = "" if self.excludes_one else " ~"
        return f"{self.ratio:.3f} ({self.low:.3f}..{self.high:.3f}){mark}"

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high,
                "confidence": self.confidence, "rounds": self.rounds,
                "a_median_s": self.a_median_s, "b_median_s": self.b_median_s,
                "verdict": self.verdict()}


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _signed(x: float) -> str:
    return f"{100 * x:+.1f}%"


def ratio_interval(
    a_times: Sequence[float],
    b_times: Sequence[float],
    *,
    confidence: float = 0.95,
    resamples: int = 10_000,
    seed: int = 0,
) -> RatioInterval:
    """Median of ``b[i] / a[i]`` over rounds and a percentile-bootstrap interval for it.

    Rounds are resampled with replacement (the round is the unit: its two times share the
    machine's state), ``resamples`` times, from ``numpy.random.default_rng(seed)``; the
    interval is the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2`` quantiles of the
    resampled medians. With few rounds the bootstrap cannot be wider than the data, so the
    interval is optimistic below ~8 rounds; callers should run more than that.
    """
    a = np.asarray(a_times, dtype=float)
    b = np.asarray(b_times, dtype=float)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired times must be two equally long lists, got {a.shape} and "
                         f"{b.shape}")
    if a.size == 0:
        raise ValueError("no rounds to compare")
    if not (0.0 < confidence < 1.0):
        raise ValueError("confidence must lie in (0, 1)")
    if np.any(a <= 0) or np.any(b <= 0) or not np.all(np.isfinite(a + b)):
        raise ValueError("times must be positive and finite")
    ratios = b / a
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, ratios.size, size=(int(resamples), ratios.size))
    medians = np.median(ratios[idx], axis=1)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(medians, [tail, 1.0 - tail])
    return RatioInterval(
        ratio=float(np.median(ratios)), low=float(low), high=float(high),
        confidence=confidence, rounds=int(ratios.size),
        a_median_s=float(np.median(a)), b_median_s=float(np.median(b)),
    )


def rounds_for(half_width: float, spread: float, *, confidence: float = 0.95) -> int:
    """Rounds needed so that a median of paired ratios with relative ``spread`` (the
    standard deviation of log-ratios observed in a pilot) resolves ``half_width``.

    The median's standard error is about 1.25 sigma / sqrt(n) for near-normal data; this
    is a planning estimate, the bootstrap decides what a run actually resolved.
    """
    if half_width <= 0 or spread < 0:
        raise ValueError("half_width must be positive and spread non-negative")
    z = {0.9: 1.645, 0.95: 1.96, 0.99: 2.576}.get(round(confidence, 2), 1.96)
    return max(2, math.ceil((z * 1.2533 * spread / half_width) ** 2))
