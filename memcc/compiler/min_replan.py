"""``--budget min``, then the cheapest plan at the budget it found.

The smallest-peak search returns the plan whose peak and heap room are least, and weighs no
time: of two plans with the same peak it may keep the one that recomputes twice as much. A
first-use run on a transformers BERT under AdamW (`--time-limit 20`): `--budget min` named
4.86 MB with a plan at +33.9% predicted, where `memcc compile --budget 4.86MB` planned the
same budget at +10.7% in 8.5 s. So the setting `--budget min` chose is planned once more, at
the budget it found and for time, with ``REPLAN_SHARE`` of `--time-limit`, and that plan is
kept where it is cheaper and needs no more budget (it may need less: the budget a plan needs
counts heap room for its own small buffers, and a plan that recomputes less has fewer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memcc.compiler.options import CompileOptions, user_budget
from memcc.compiler.planning import Planned
from memcc.pass_contract import PassReport
from memcc.passes.planning.refusal import BudgetError
from memcc.passes.planning.request import Budget

# The share of --time-limit the plan at the smallest budget gets (a count, as every share).
REPLAN_SHARE = 0.25

PlanAt = Callable[[Budget, CompileOptions], Planned]


def cheaper_at_smallest(planned: Planned, needs: Callable[[Planned], int],
                        options: CompileOptions, plan_at: PlanAt,
                        passes: list[PassReport]) -> Planned | None:
    """The plan ``plan_at`` makes at the budget ``planned`` needs (``needs``), where it adds
    less time and needs no more; its plan and rewrite passes then replace ``planned``'s in
    ``passes``, and its plan pass says what it replaced (``replanned_at_smallest``). None
    (``passes`` as they were) where it is not better, or nothing fits."""
    best = planned.outcome.best
    if not best.plan.recompute and not best.plan.variants:
        return None     # nothing recomputed: nothing to buy back
    found = needs(planned)
    start = len(passes)
    try:
        # A refusal here is only a miss: no smallest-peak search after it (that is done).
        again = plan_at(Budget.of(found), replace(
            options, time_limit=options.time_limit * REPLAN_SHARE, smallest_on_refusal=False))
    except BudgetError:
        del passes[start:]
        return None
    if needs(again) > found or \
            again.outcome.best.compute_cost_s >= best.compute_cost_s:
        del passes[start:]
        return None
    plan_pass = next(p for p in reversed(passes[start:]) if p.name == "plan")
    plan_pass.summary["replanned_at_smallest"] = {
        "budget_bytes": int(found),
        "smallest_peak_plan": {"peak_bytes": int(best.peak_bytes),
                               "compute_cost_s": round(float(best.compute_cost_s), 6),
                               "added_time_s": round(float(best.added_time_s), 6)},
        "time_limit_s": round(options.time_limit * REPLAN_SHARE, 3)}
    earlier = [p for p in passes[:start] if p.name not in ("plan", "rewrite")]
    passes[:] = earlier + passes[start:]
    return again


def replan_chosen(attempt, plan_step: Callable, passes: list[PassReport]) -> None:
    """``cheaper_at_smallest`` for the setting ``--budget min`` chose (``chunk_choice``'s
    ``Attempt``; ``plan_step(graph, costs, options, budget)`` is compile's plan stage):
    its plan is replaced where the new one is better."""
    def needs(p: Planned) -> int:
        return user_budget(p.outcome.best.peak_bytes, attempt.options, p.slack)

    again = cheaper_at_smallest(
        attempt.planned, needs, attempt.options,
        lambda at, o: plan_step(attempt.graph, attempt.costs, o, at), passes)
    if again is not None:
        attempt.planned = again
