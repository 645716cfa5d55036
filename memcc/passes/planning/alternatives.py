"""A search's other answers: the plans besides its pick that compile looks at again.

The search judges every plan in its own order of the step; ``memcc train`` runs another
(updates in place, each moved to just after its gradient, ``compiler/training_order.py``),
and a plan's own recompute decides how far they move. So the plan that needs the smallest
budget as trained need not be the one that looked smallest in the search, nor any run's
smallest: ``--budget min`` judges others as trained too (``compiler/planning.py``,
``as_trained``), and compile sheds some to a budget (``compiler/shed_starts.py``).

Two lists, because the two uses differ in what they can afford:

- ``runs_smallest``: each run's smallest plan, cheapest first. Compile sheds the first few
  (each shedding is many simulations); ``--budget min`` judges every one near the pick.
- ``nearest``: every other plan the search returned, smallest budget first. ``--budget min``
  judges as many of those near the pick as a fixed amount of simulation buys. A run's
  smallest plan as searched was not its smallest as trained on a dynamo-exported timm
  LCNet-050: an 18-segment sqrt(n) plan needed 11.02 MB as trained, the 25-segment plan a
  longer ``--time-limit`` added 11.37 MB, and only the latter, its run's smallest as
  searched, was judged, so more time gave a larger budget.
"""

from __future__ import annotations

from memcc.passes.planning.context import StrategyResult
from memcc.passes.planning.simulate import Simulation

Pool = list[tuple[str, Simulation]]


def runs_smallest(found: StrategyResult, best: Simulation, pool: Pool
                  ) -> tuple[Simulation, ...]:
    """Each run's smallest plan other than ``best`` (among the plans the strategy asked for
    may return: ``pool``), cheapest first, every one."""
    allowed = {id(sim) for _, sim in pool}
    own = [min((s for s in run.sims if id(s) in allowed),
               key=lambda s: (s.peak_bytes, s.added_time_s), default=None)
           for run in found.runs]
    seen, out = {id(best)}, []
    for sim in sorted((s for s in own if s is not None), key=lambda s: s.added_time_s):
        if id(sim) not in seen:
            seen.add(id(sim))
            out.append(sim)
    return tuple(out)


def nearest(best: Simulation, pool: Pool, known: tuple[Simulation, ...]
            ) -> tuple[Simulation, ...]:
    """Every plan of ``pool`` but ``best`` and those ``known`` (``runs_smallest``'s), the
    smallest budget first (then the cheapest)."""
    seen = {id(best)} | {id(s) for s in known}
    out: dict[int, Simulation] = {}
    for _, sim in pool:
        if id(sim) not in seen:
            out.setdefault(id(sim), sim)
    return tuple(sorted(out.values(), key=lambda s: (s.fit_bytes, s.added_time_s)))
