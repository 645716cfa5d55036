"""Chen et al.'s sqrt(n) checkpointing, generalised to DAGs.

The forward order is cut into k segments; at each cut the buffers that cross it (produced
before, read after by a forward node) are the checkpoints, and every other recomputable
node is recomputed. On a chain this is Chen's scheme; on a DAG each cut is moved, within
its segment's window, to the position where the fewest bytes cross. Returns one candidate
per k, because which k fits a budget is for the simulator to say.
"""

from __future__ import annotations

import math

import numpy as np


def candidates(crossing_bytes: np.ndarray, crossing_vars: list[list[int]], n_vars: int,
               recomputable_vars: np.ndarray, *, max_candidates: int = 24
               ) -> list[tuple[int, np.ndarray]]:
    """[(k, x)] for a spread of segment counts k around sqrt(F)."""
    f = len(crossing_bytes)
    if f == 0 or n_vars == 0:
        return []
    root = max(1, int(math.isqrt(f)))
    ks = sorted({max(1, int(round(root * s))) for s in
                 (0.25, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0, 2.8, 4.0)} | {1, 2, 3, 4})
    ks = spread([k for k in ks if k <= f], max_candidates, root)
    out = []
    for k in ks:
        x = recomputable_vars.copy()
        for cut in _cuts(crossing_bytes, k):
            for v in crossing_vars[cut]:
                x[v] = False
        out.append((k, x))
    return out


def spread(ks: list[int], most: int, root: int) -> list[int]:
    """At most ``most`` of the sorted counts ``ks``, spread from the fewest segments to the
    most, with the one nearest sqrt(F) among them: fewer simulations keep the range of
    trade-offs (few segments: little recomputed; many: the lowest peaks once rebuilt
    again), not only its low end."""
    if len(ks) <= most:
        return ks
    near = min(ks, key=lambda k: (abs(k - root), k))
    if most <= 1:
        return [near]
    picked = {ks[round(i * (len(ks) - 1) / (most - 2))] for i in range(most - 1)} \
        if most > 2 else {ks[0]}
    return sorted(picked | {near})


def _cuts(crossing_bytes: np.ndarray, k: int) -> list[int]:
    f = len(crossing_bytes)
    if k <= 1:
        return []
    cuts = []
    half = max(1, f // (2 * k))
    for j in range(1, k):
        centre = int(round(f * j / k))
        lo, hi = max(0, centre - half), min(f, centre + half + 1)
        window = crossing_bytes[lo:hi]
        cuts.append(lo + int(np.argmin(window)))
    return sorted(set(cuts))
