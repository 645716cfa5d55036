"""The array form of a memory-planning problem that every solver works on.

Time is the step's schedule (one point after each node of the original order). Each
decision variable ``x[i]`` (1 = recompute forward node i's outputs in the backward pass)
changes the bytes live over some time intervals: it frees a saved activation between its
last forward reader and its last backward reader (negative term), holds the recomputed
copy from where it is rebuilt to its last reader (positive term), and keeps the inputs of
the clone alive until the clone runs (positive term). ``base[t]`` is the baseline (nothing
recomputed). The model is linear in ``x`` and conservative where the exact effect depends
on other decisions; the exact simulator (lowering + liveness) has the last word.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Problem:
    base: np.ndarray        # float64[T]: bytes live at each time point with no recompute
    cost: np.ndarray        # float64[n]: added seconds when variable i is set
    term_var: np.ndarray    # int64[m]
    term_bytes: np.ndarray  # float64[m], signed
    term_start: np.ndarray  # int64[m], inclusive
    term_end: np.ndarray    # int64[m], inclusive
    names: tuple[str, ...]  # variable -> forward node name
    # Optional "unless" variable per term (-1: none): the term counts max(0, x[var] - x[u]),
    # e.g. a kept input held until a recomputed reader re-runs, unless it is recomputed too.
    term_unless: np.ndarray | None = None
    # Optional "with" variable per term (-1: none): the term counts only when both x[var]
    # and x[with] are set, e.g. a recomputed input re-run early for a recomputed reader.
    term_with: np.ndarray | None = None
    # Pairs (u, m) that may not both be set: a recomputed node's recomputable inputs are then
    # kept, so no recompute chain re-runs a node earlier than the model assumes.
    exclusive: np.ndarray | None = None  # int64[k, 2]

    @property
    def n_vars(self) -> int:
        return len(self.cost)

    @property
    def horizon(self) -> int:
        return len(self.base)

    def memory(self, x: np.ndarray) -> np.ndarray:
        """Modelled bytes live at every time point for a 0/1 (or fractional) choice ``x``."""
        diff = np.zeros(self.horizon + 1)
        w = self.term_bytes * self.activation(x)
        np.add.at(diff, self.term_start, w)
        np.add.at(diff, self.term_end + 1, -w)
        return self.base + np.cumsum(diff[:-1])

    def activation(self, x: np.ndarray) -> np.ndarray:
        """How much of each term is switched on by ``x`` (0..1)."""
        xf = np.asarray(x, dtype=np.float64)
        on = xf[self.term_var]
        if self.term_unless is not None:
            u = self.term_unless
            has = u >= 0
            on = on.copy()
            on[has] = np.maximum(0.0, on[has] - xf[u[has]])
        if self.term_with is not None:
            w = self.term_with
            has = w >= 0
            on = on.copy()
            on[has] = np.maximum(0.0, on[has] + xf[w[has]] - 1.0)
        return on

    def peak(self, x: np.ndarray) -> float:
        return float(self.memory(x).max(initial=0.0))

    def row(self, t: int) -> dict[int, float]:
        """Coefficients of the memory constraint at time ``t``: keys are variable indices,
        ``("unless", v, u)`` for max(0, x[v] - x[u]) or ``("and", v, w)`` for x[v] * x[w]."""
        mask = (self.term_start <= t) & (t <= self.term_end)
        none = np.full(int(mask.sum()), -1)
        unless = self.term_unless[mask] if self.term_unless is not None else none
        with_ = self.term_with[mask] if self.term_with is not None else none
        coeffs: dict = {}
        for v, b, u, w in zip(self.term_var[mask], self.term_bytes[mask], unless, with_,
                              strict=True):
            if u >= 0:
                key = ("unless", int(v), int(u))
            elif w >= 0:
                key = ("and", int(v), int(w))
            else:
                key = int(v)
            coeffs[key] = coeffs.get(key, 0.0) + float(b)
        return coeffs


@dataclass(frozen=True)
class Solution:
    x: np.ndarray           # bool[n]
    status: str             # "optimal", "feasible" (time limit with incumbent), "infeasible", ...
    gap: float | None       # relative optimality gap reported by the solver
    objective: float        # modelled added seconds
    solve_time_s: float
    solver: str
    iterations: int = 1
