"""Row chunks at a budget the step as built does not reach: screens, the winner's final
plan, and what a refusal names (``chunk_choice.choose_row_chunks`` hands it the ladder).

Each setting is a whole plan, so they are planned in two phases within what the step as
built left of ``--time-limit`` (``compiler/chunk_clock.py``): each setting screened with a
small share of the work (no smallest-budget search on a refusal), then the winner, or
where none fits the nearest, planned again with the rest. Where none fits and a setting's
screen came nearest, the step as built is searched too, and the refusal names the
smaller budget of the two.

On a large step the screens are not run where the step as built's own refused plan
simulated more nodes than the limit buys the settings after it (``affordable``): each
screen builds and costs a step as large, then simulates it, so three of them took 57 s of
a 140 s compile of a 30,905-node step at ``--time-limit 20``. A count, not the clock: the
same step and limit screen the same settings on a quiet and on a busy machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcc.compiler.chunk_clock import SharedLimit
from memcc.passes.planning.work import SIMULATED_NODES_PER_S

if TYPE_CHECKING:
    from memcc.compiler.chunk_choice import Attempt

# A plan within this share of the unchunked step's time ends the search of a budget the
# step as built does not reach (no split can beat it by more).
SEARCH_ABOVE = 0.03


def search_budget(first: Attempt, ladder: list[dict[str, int]], attempt,
                  base_time: float, clocked: tuple[SharedLimit, dict]) -> Attempt:
    """Two phases within what the step as built left of the limit: each setting screened
    (planned with ``SCREEN_SHARE`` of it as its work), then the winner planned again with
    the rest (``_final``; where none fits, ``_search_both``). The screens: lightest split
    first, then heavier ones while they are faster; the fastest that fits wins, and a plan
    within 1% of the unchunked step's time ends the search (no split can beat it by
    more). A refused split with nothing fitting yet jumps to the heaviest (the middle ones
    follow only if that fits): a refusal costs a smallest-budget search, and where the
    heaviest split does not fit, a lighter one is not expected to. Where the screens cost
    more than the limit buys (``affordable``), none is run: the step as built is planned
    again, as the final, and the report's ``not_screened`` says why."""
    clock, report = clocked
    why = affordable(first, clock, len(ladder))
    if why is not None:
        report["not_screened"] = why
        return _final(first, attempt, clock.final(0))
    best = first if first.fits else None
    nearest = first
    queue = list(ladder)
    screened = 0
    while queue:
        if best is not None and base_time > 0 \
                and best.step_time_s / base_time - 1.0 <= SEARCH_ABOVE / 3:
            break
        chunks = queue.pop(0)
        a = attempt(chunks, clock.screen(screened), "screen")
        screened += 1
        if a.fits:
            if best is not None and a.step_time_s >= best.step_time_s:
                break                  # heavier and no faster: nothing left to spare
            best = a
            continue
        if best is not None or chunks == ladder[-1]:
            if best is None and smallest_named(a) < smallest_named(nearest):
                nearest = a
            break
        if smallest_named(a) < smallest_named(nearest):
            nearest = a
        queue = queue[-1:] + queue[:-1]
    if best is None and nearest is not first and first.graph is not None:
        return _search_both(nearest, first, attempt, (clock, screened))
    return _final(best if best is not None else nearest, attempt, clock.final(screened))


def affordable(first: Attempt, clock: SharedLimit, settings: int) -> str | None:
    """None where the screens may run; else why not. They may where the step as built's
    refused plan simulated no more nodes than ``--time-limit`` buys what follows it (the
    limit after the step as built's share, at ``SIMULATED_NODES_PER_S``): a screen plans a
    step at least as large, with the same fixed work (its baseline, segmentations, the
    plan judged as trained)."""
    spent = first.simulated_nodes
    rest = clock.work_after_first()
    if first.fits or spent <= rest * SIMULATED_NODES_PER_S:
        return None
    enough = spent / SIMULATED_NODES_PER_S / (rest / clock.limit)
    return (f"{settings} row-chunk setting(s) not screened: the step as built's plan alone "
            f"simulated {spent:,} nodes, more than the {rest * SIMULATED_NODES_PER_S:,.0f} "
            f"--time-limit {clock.limit:g} leaves the settings after it (at "
            f"{SIMULATED_NODES_PER_S:,} a second); the step as built is planned again with "
            f"that work. --time-limit {enough:.0f} or more screens them")


def _final(pick: Attempt, attempt, limit: tuple[float, float]) -> Attempt:
    """The screens' winner (or, none fitting, the nearest: maybe the step as built, whose
    refusal did not search the smallest peak either) planned again on its step with
    ``limit``; the better of the two plans is kept (the final one unless it is
    slower, or refused where the screen fit; where both refuse, the final one, whose
    smallest budget was searched)."""
    if pick.graph is None:
        return pick        # a failed build
    final = attempt(pick.chunks, limit, "final", built=pick)
    if not final.fits:     # its smallest budget is searched, the screen's is not
        return pick if pick.fits else final
    return final if not pick.fits or final.step_time_s <= pick.step_time_s else pick


def _search_both(nearest: Attempt, first: Attempt, attempt,
                 clocked: tuple[SharedLimit, int]) -> Attempt:
    """Nothing fits, and a setting's screen came nearest: that setting and the step as
    built are both searched for their smallest budget, on half the final plan's work each,
    and the refusal names the smaller (a fit of the first ends it). A screen's smallest
    peak found is a poor guide to a setting's smallest budget: timm's MobileNetV3 (dynamo
    export) at 19 MB named 22.37 MB with its MLPs in 4 chunks, whose screen had found a
    smaller peak than the step as built's, where the step as built reaches 19.43 MB."""
    clock, screened = clocked
    final = _final(nearest, attempt, clock.final(screened, split=2, left=2))
    if final.fits:
        return final
    built = attempt(first.chunks, clock.final(screened, split=2), "final", built=first)
    return built if built.fits or smallest_named(built) < smallest_named(final) else final


def smallest_named(a: Attempt) -> float:
    """The smallest budget a refused attempt names (a failed build: none). A screen's is
    the least budget of the plans it found (``BudgetError.smallest_fit``), no search's."""
    return float(a.refusal.smallest) if a.refusal is not None else float("inf")
