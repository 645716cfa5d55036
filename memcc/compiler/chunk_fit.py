"""Row chunks for a step that fits as built: screened by cost before any is planned.

A step that fits the budget as built may still fit only by recomputing (or offloading):
its plan adds time. A row-chunk setting that lowers the peak may need less recompute, but
the split has a price of its own (smaller matrix products, gradients summed over chunks),
and each setting planned is a whole plan: planning them all doubled compile time and
broke ``--time-limit`` on MONeT's ResNet-50. So a setting is planned only where it could
win (``search_fitting``):

1. the plan of the step as built adds time (above ``FREE``): with nothing recomputed or
   offloaded, a split can only add time, and nothing else is looked at;
2. the model has a site the setting splits (the load stage counted them: a convnet, which
   has none, pays nothing more);
3. the setting's estimated added time is below that of the best plan so far: its own (the
   chunked step as built priced by the step's cost model; the build alone, no plan; the
   chunk products priced like any node the cost model did not measure), plus the as-built
   plan's added time in the proportion of the bytes that plan shed which the split does not
   take off the peak (``chunk_choice._search_fitting``): a split that lowers the peak little
   still needs most of the recompute (the zoo's GPT-2 at 75% of its peak: a loss split
   planned at +11.7% against +10.6% as built, for twice the compile time, before this);
4. the time limit has room for it: ``--time-limit`` is the planner's, shared by the plan
   of the step as built and the settings planned after it; a setting's plan is expected to
   take as long as the first plan, scaled by its nodes, and is planned with what is left
   of the limit as its own (its step is priced by the screen, not measured again), so the
   compile does not run past the limit because of it.

Settings are taken lightest first; the plan that fits at the least predicted time wins,
and a heavier setting is tried only while the last one planned was faster (a heavier split
adds more of its own time) and still recomputes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memcc.report_text import describe_chunks as describe

# A plan adding at most this share of the step's time adds nothing a split could spare.
FREE = 0.001
# A setting's plan is expected to take the as-built step's plan time, times its nodes over
# the step's, times this; its plan gets its share of the limit (``chunk_clock.SharedLimit``).
PLAN_TIME_FACTOR = 1.0


@dataclass
class FitSearch:
    """What the fitting search is lent: the step as built's added time (``first_added``),
    ``base_time`` (the unchunked step's time, what every added time is a share of), the
    settings in ladder order, ``estimate(chunks) -> (added time, nodes)`` of a setting
    built but not planned (raises ``InputError`` where it cannot be built),
    ``plan(chunks) -> (fits, step time)`` planning it by the deadline, the seconds the
    step as built took to plan (``spent_s``), its nodes, and the deadline
    (``time.perf_counter()`` seconds)."""

    first_added: float
    base_time: float
    ladder: list[dict[str, int]]
    estimate: Callable[[dict[str, int]], tuple[float, int]]
    plan: Callable[[dict[str, int]], tuple[bool, float]]
    spent_s: float
    nodes: int
    deadline: float
    screen: list[dict] = field(default_factory=list)


def search_fitting(s: FitSearch) -> dict[str, int] | None:
    """The setting whose plan fits at less added time than the step as built's (None: keep
    the step as built); ``s.screen`` records every setting looked at, planned or not, with
    its estimated added time and why it was or was not planned."""
    from memcc.errors import InputError

    best_added, best = s.first_added, None
    for chunks in s.ladder:
        entry: dict = {"chunks": dict(chunks)}
        s.screen.append(entry)
        try:
            own, nodes = s.estimate(chunks)
        except InputError as exc:
            entry["skipped"] = f"cannot be built: {exc}"
            continue
        entry["estimated_added_time"] = round(own, 4)
        if own >= best_added:
            entry["skipped"] = (f"not less than the {best_added:+.1%} of the best plan so "
                                "far (the estimate counts its chunks and the recompute its "
                                "peak still needs)")
            break                     # heavier settings split more: they add more
        expected = s.spent_s * PLAN_TIME_FACTOR * max(nodes, 1) / max(s.nodes, 1)
        left = s.deadline - time.perf_counter()
        if left < expected:
            entry["skipped"] = (f"--time-limit: {max(left, 0.0):.1f} s left, its plan is "
                                f"expected to take {expected:.1f} s")
            break
        fits, step_time = s.plan(chunks)
        entry["planned"] = True
        if not fits:
            entry["result"] = "does not fit"
            continue
        added = step_time / s.base_time - 1.0 if s.base_time > 0 else 0.0
        entry["added_time"] = round(added, 4)
        if added >= best_added:
            entry["result"] = f"fits at {added:+.1%}, not less than {best_added:+.1%}"
            break                     # heavier and no faster: nothing left to spare
        entry["result"] = f"fits at {added:+.1%}"
        best_added, best = added, chunks
        if added - own <= FREE:
            break                     # no recompute left to spare by splitting more
    return best


def decision(first_added: float, chosen: dict[str, int], screen: list[dict]) -> str:
    """Why the chosen setting won, in words, with the added time of each looked at."""
    looked = "; ".join(
        f"{describe(e['chunks'])}: "
        + (f"estimated {e['estimated_added_time']:+.1%}, " if "estimated_added_time" in e
           else "")
        + (e.get("result", "planned") if e.get("planned") else "not planned ("
           + e.get("skipped", "") + ")")
        for e in screen)
    head = f"the step as built fits at {first_added:+.1%} (recompute, variants or offload); "
    if any(n > 1 for n in chosen.values()):
        head += f"{describe(chosen)} fits at less added time and was chosen"
    else:
        head += "no setting did better, the step as built was kept"
    return head + (f" ({looked})" if looked else "")
