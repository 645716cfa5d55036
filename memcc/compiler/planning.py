"""Compile's planning stage: the plan pass under a user's budget, with the heap room of the
plan's own small buffers, optimizer state in host memory where it pays, and the chosen plan
judged again as ``memcc train`` runs it.

In: the step, its costs, the options and the user's ``Budget`` (``Budget.MIN``: the
smallest). Out: ``Planned`` (the outcome, the rewritten step, the slack kept, the budget
plans aimed at), or compile's refusal: the planner refuses with numbers in neutral words,
and the sentences a user reads (which ``--budget`` to give, what else to try) are composed
here, once (``_no_fit``; a budget under the step's floor: ``compiler/floor_check.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from memcc.compiler.advice import chunks_hint
from memcc.compiler.options import CompileOptions, plan_budget_under, user_budget
from memcc.compiler.progress import Progress
from memcc.compiler.shed_starts import cheaper_by_shedding, within_budget
from memcc.compiler.trained_smallest import (
    recompute_all_as_trained,
    trained_rules,
)
from memcc.compiler.training_order import in_training_order
from memcc.graph import Graph
from memcc.pass_contract import PassReport
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.lowering.offload_state import offload_state, optimizer_state
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.floor import SESSION_HELD, runtime_bytes
from memcc.passes.planning.planner import (
    BudgetError,
    PlanOutcome,
    choose_plan,
)
from memcc.passes.planning.request import Budget, PlanRequest, stopped_by_clock
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate
from memcc.passes.planning.variant_report import describe_variants
from memcc.sizes import format_size

# Each round plans for less room than the last; the plan's own small buffers settle within
# one or two (a handful of recomputed values each time).
REPLANS_FOR_HEAP_ROOM = 3


class Planned(NamedTuple):
    """What compile's plan stage returns for one step: the plan pass's outcome (as
    trained), the rewritten step, the slack the budget keeps for the plan's small buffers,
    and the budget plans aimed at (None for ``Budget.MIN``: there the report states the
    plan's own peak)."""

    outcome: PlanOutcome
    step: Graph
    slack: int
    planning_budget: int | None


@dataclass(frozen=True)
class StageHooks:
    """How the planning stage reports to compile: ``timed`` runs a named stage and appends
    its ``PassReport`` to ``passes`` (the same list compile's report is built from),
    ``say`` prints progress, ``label`` names the model in messages."""

    timed: Callable[[str, Callable[[], tuple]], object]
    passes: list[PassReport]
    say: Progress
    label: str


def _no_fit(budget: int, smallest: int, slack: int, options: CompileOptions,
            hooks: StageHooks, clock_cut: bool = False) -> BudgetError:
    """Compile's refusal of ``budget``: ``smallest`` is the budget --budget min gives (the
    smallest plan, as trained, with ``slack`` for its heap room), and the message says
    what to give; ``clock_cut``: the search was stopped by --time-limit (a walk-through's
    GPT-2 was refused 10.03 MB at --time-limit 0.5 and fitted it at 30)."""
    passes = hooks.passes
    cut = (f"The search was cut short by the time --time-limit gave it "
           f"({options.time_limit:g} s): a longer --time-limit may fit this budget. "
           if clock_cut else "")
    return BudgetError(
        f"{hooks.label}: the training step does not fit in {format_size(budget)} "
        f"({budget:,} bytes). The smallest budget memcc found for it is "
        f"{format_size(smallest)} ({smallest:,} bytes; strategy {options.strategy}, with "
        f"{options.margin:.0%} + {slack:,} bytes of safety margin). "
        + cut + _runtime_part(options)
        + f"Nothing was written. Use --budget {smallest} "
        "or more, --budget min (it searches with the whole --time-limit, and where this "
        "compile also planned row-chunk settings it can find less), or a smaller batch."
        + chunks_hint(next(p.summary for p in passes if p.name == "load")),
        budget=budget or 0, smallest=smallest,
    )


def _cut_by_clock(outcomes: list[PlanOutcome | None], options: CompileOptions,
                  started: float) -> bool:
    """Whether --time-limit stopped the search: a solve the clock stopped or left unrun,
    or planning past its deadline."""
    return any(stopped_by_clock(r) for o in outcomes if o is not None for r in o.runs) or \
        time.perf_counter() >= (options.deadline or started + options.time_limit)


def _runtime_part(options: CompileOptions) -> str:
    """What of a smallest budget no plan can change on this provider, said where there is
    some (a small model's budget on CUDA is mostly the session's own)."""
    held = runtime_bytes(options.provider)
    return f"Of it, {format_size(held)} is what {SESSION_HELD}, whatever the plan. " \
        if held else ""


def plan_in_budget(graph: Graph, budget: Budget, costs: CostModel, options: CompileOptions,
                   structure: StepStructure, hooks: StageHooks) -> Planned:
    """The plan pass and its rewrite, keeping heap room for the small buffers of the plan
    it returns (``CompileOptions.slack_for``). The step as built has the fewest small
    buffers; recompute clones add some, which the planner weighs when it picks a plan
    (``Simulation.fit_bytes``) and, where the plan it returns still lacks room, compile
    plans again for less."""
    timed, passes, say = hooks.timed, hooks.passes, hooks.say
    started = time.perf_counter()
    graph, order = in_training_order(graph, options)
    request = options.plan_request(Budget.MIN)
    slack = base_slack = options.slack_for(graph)
    plan_budget = None if budget.is_min else plan_budget_under(budget.bytes, options, slack)

    def sim_slack(sim: Simulation) -> int:   # heap room for a plan's own small buffers
        return max(base_slack, options.slack_for(sim.graph))

    def own_slack(outcome: PlanOutcome) -> int:
        return sim_slack(outcome.best)

    def ceiling(sim: Simulation) -> int:  # a plan's peak within the user's budget
        return plan_budget_under(budget.bytes, options, sim_slack(sim))

    def no_fit(exc: BudgetError, trained: PlanOutcome | None) -> BudgetError:
        # what --budget min gives: the smallest plan, as trained, with its own heap room
        room = slack if trained is None else own_slack(trained)
        need = user_budget(exc.smallest_fit if trained is None else
                           trained.best.peak_bytes, options, room)
        cut = _cut_by_clock([exc.outcome, trained], options, started)
        return _no_fit(budget.bytes, need, room, options, hooks, cut)

    def plan_for(target: int | None) -> PlanOutcome:
        """The plan for ``target`` (None: the smallest); where none fits it, the smallest
        plan if that fits the budget with the heap room of its own small buffers (a
        previous plan's may have been more), else the refusal, naming the budget that
        --budget min gives."""
        asked = request.at(Budget.MIN if target is None else Budget.of(target))
        try:
            return timed("plan", lambda: _with(order, plan_stage(
                graph, costs, asked, options, structure,
                None if target is None else ceiling)))
        except BudgetError as exc:
            smallest = None if exc.outcome is None else as_trained(
                graph, exc.outcome, costs, options, structure, smallest=True)
            if smallest is None or budget.is_min or smallest.best.peak_bytes > \
                    plan_budget_under(budget.bytes, options, own_slack(smallest)):
                raise no_fit(exc, smallest) from None
            fitted = within_budget(graph, smallest, costs, options, structure, ceiling)
            return timed("plan", lambda: (fitted, plan_summary(graph, fitted, costs, options,
                                                                structure) | order))

    outcome = plan_for(plan_budget)
    plan_sim = outcome.best
    base_sim = outcome.baseline
    rewritten = timed("rewrite", lambda: rewrite_stage(plan_sim, base_sim))
    # Recomputed values are buffers too: keep heap room for the plan's own small buffers,
    # planning again, for less, while they leave the plan over its budget.
    for _ in range(REPLANS_FOR_HEAP_ROOM):
        own = own_slack(outcome)
        if plan_budget is None or plan_sim.peak_bytes <= plan_budget_under(budget.bytes,
                                                                           options, own):
            break
        first = {"peak_bytes": plan_sim.peak_bytes, "planning_budget_bytes": plan_budget,
                 "small_buffers_heap_bytes": own - slack}
        slack = own
        plan_budget = plan_budget_under(budget.bytes, options, slack)
        say(f"planning again, for {format_size(plan_budget)}: the plan's recomputed values "
            "need heap room of their own")
        del passes[-2:]  # that plan and its rewrite: the report keeps the one used
        outcome = plan_for(plan_budget)
        passes[-1].summary["planned_again"] = first
        plan_sim, base_sim = outcome.best, outcome.baseline
        rewritten = timed("rewrite", lambda p=plan_sim, b=base_sim: rewrite_stage(p, b))
    # What the report states: the room the returned plan keeps for its own small buffers.
    slack = own_slack(outcome)
    if not budget.is_min:
        plan_budget = plan_budget_under(budget.bytes, options, slack)
    return Planned(outcome, rewritten, slack, plan_budget)


def _with(order: dict, stage: tuple[PlanOutcome, dict]) -> tuple[PlanOutcome, dict]:
    """The plan stage's outcome, its summary saying the order the step was planned in."""
    outcome, summary = stage
    return outcome, summary | order


def plan_offloading_state(graph: Graph, budget: Budget, costs: CostModel,
                          options: CompileOptions, structure: StepStructure,
                          hooks: StageHooks) -> tuple[Planned, dict | None]:
    """``plan_in_budget``, and on CUDA with offload on, the same with the optimizer state in
    host memory (``passes.lowering.offload_state``) where that reaches further or costs less: tried
    when the budget is not reached without it, for ``--budget min`` (the smaller budget wins),
    and when the plan without it adds more time than the state's copies would. The two
    share ``--time-limit``, half each (each had the whole limit: a ResNet-18's ``--budget
    min`` on CUDA took 33 s at ``--time-limit 20``, 22 s now; BENCHMARKS.md). Returns
    ``plan_in_budget``'s ``Planned`` and the report's ``offloaded_state`` (None: not
    tried)."""
    passes, say = hooks.passes, hooks.say
    state = optimizer_state(graph) if options.provider == "cuda" and options.swaps else []
    if state:   # the plans without and with the state in host memory share --time-limit
        options = replace(options, time_limit=options.time_limit / 2)
    start = len(passes)
    try:
        plain = plan_in_budget(graph, budget, costs, options, structure, hooks)
        refusal = None
    except BudgetError as exc:
        if not state:
            raise
        plain, refusal = None, exc
    if not state:
        return plain, None
    everything = [n for n, _ in state]
    tries = [everything]
    if plain is None and not budget.is_min:
        # out of reach by a known deficit: first the largest tensors that cover it, with
        # room for the update that visits the device (the rest then costs no copies)
        deficit, covered, prefix = refusal.smallest - budget.bytes, 0, []
        for name, nbytes in state:
            if covered >= 2 * deficit + state[0][1]:
                break
            prefix.append(name)
            covered += nbytes
        if len(prefix) < len(everything):
            tries.insert(0, prefix)
    middle = len(passes)
    off = moved = None
    for names in tries:
        moved = offload_state(graph, names)
        copies_s = moved.added_seconds(costs.link)
        if plain is not None and not budget.is_min \
                and plain.outcome.best.added_time_s <= copies_s:
            return plain, None  # fits, and adds less time than the copies alone would
        say(f"planning with {len(names)} optimizer state tensors in host memory "
            f"({format_size(moved.bytes)})")
        try:
            off = plan_in_budget(moved.graph, budget, costs, options,
                                 StepStructure.of(moved.graph), hooks)
            break
        except BudgetError as exc:
            del passes[middle:]
            if names is tries[-1]:
                if plain is None:
                    raise exc from refusal
                return plain, None

    def reach(result: Planned) -> int:
        return user_budget(result.outcome.best.peak_bytes, options, result.slack)

    without = refusal.smallest if plain is None else reach(plain)
    off_time = off.outcome.best.added_time_s + copies_s
    use = plain is None or (reach(off) < reach(plain) if budget.is_min
                            else off_time < plain.outcome.best.added_time_s)
    if use:
        del passes[start:middle]
        off = _baseline_as_built(off, plain, graph, costs, options, structure)
    else:
        del passes[middle:]
    report = moved.to_json(costs.link) | {
        "used": use, "smallest_budget_bytes": reach(off) if budget.is_min else None,
        "smallest_budget_without_bytes": without if budget.is_min or plain is None else None,
        "plan_added_time_s": round(off_time, 6),
        "method": ("predicted (passes.lowering.offload_state + passes.analysis.device_memory), "
                   "not measured")}
    return (off if use else plain), report


def _baseline_as_built(off: Planned, plain: Planned | None, graph: Graph, costs: CostModel,
                       options: CompileOptions, structure: StepStructure) -> Planned:
    """``off`` (planned with the optimizer state in host memory) with the step as built as
    its baseline, as the report states it (README, "Report fields"): its own baseline is
    the step with the state moved, which printed "baseline peak 297.80 MB" for a ResNet-18
    whose step as built needs 343.93 MB, and a baseline that changed with the budget."""
    if plain is not None:
        base = plain.outcome.baseline
    else:   # the step as built was refused: judged as ``as_trained`` judges a baseline
        ordered, _ = in_training_order(graph, options)
        base = min((simulate(ordered, Plan(), costs, structure, rules) for rules in
                    (SimulationRules(options.device), trained_rules(options))),
                   key=lambda sim: sim.peak_bytes)
    return off._replace(outcome=replace(off.outcome, baseline=base))


# ``as_trained``: another run's smallest plan is judged as trained where its budget is within
# this factor of the search's pick.
ALTERNATIVES_WINDOW = 1.10
# ... and the search's other plans within it, as many as simulating this many nodes allows
# (about 2 s; fixed, not a share of --time-limit, so that analyze, which searches with
# compile's segmentations under a limit of its own, judges the same plans as compile).
NEAR_SIMULATED_NODES = 24_000


def _to_judge(graph: Graph, outcome: PlanOutcome, near: float) -> list[Simulation]:
    """The plans ``--budget min`` judges as trained besides the pick: each run's smallest
    within ``near`` bytes of budget, then as many of the others within it, smallest budget
    first, as ``NEAR_SIMULATED_NODES`` of simulation buys (``planning.alternatives``)."""
    judged = [a for a in outcome.alternatives if a.fit_bytes <= near]
    more = NEAR_SIMULATED_NODES // max(len(graph.nodes), 1)
    return judged + [a for a in outcome.near if a.fit_bytes <= near][:more]


def plan_stage(graph: Graph, costs: CostModel, request: PlanRequest, options: CompileOptions,
               structure: StepStructure,
               ceiling: Callable[[Simulation], int] | None = None) -> tuple[PlanOutcome, dict]:
    """The plan pass for ``request`` (built from ``options``: on CUDA, saved values may also
    be swapped to host memory, never on the CPU provider, where host and device are one
    memory), the plan judged as trained, at a budget (``ceiling``: the peak a plan may have
    with its own heap room) the plan recomputing everything shed to it where that is cheaper
    (``shed_starts.cheaper_by_shedding``), and its report summary."""
    outcome = choose_plan(graph, costs, request, structure=structure)
    outcome = as_trained(graph, outcome, costs, options, structure,
                         smallest=request.budget.is_min)
    if ceiling is not None:
        outcome = cheaper_by_shedding(graph, outcome, costs, options, structure, ceiling)
    return outcome, plan_summary(graph, outcome, costs, options, structure)


def as_trained(graph: Graph, outcome: PlanOutcome, costs: CostModel, options: CompileOptions,
               structure: StepStructure, *, smallest: bool = False) -> PlanOutcome:
    """The chosen plan and the step as built, judged in the order ``memcc train`` runs them:
    updates in place and each moved to just after its gradient where that lowers the peak
    (``simulate(early_updates=True)``). The search judges candidates in the order it was
    given (``compiler/training_order.py``: updates moved early for the step as built; a
    bound on this one, at a third of the analysis); the step compile writes is this order,
    so the peak it reports is the peak of the step as trained, never above the one the
    search accepted.

    ``smallest`` (the outcome of a search for the smallest peak: ``--budget min``, or a
    refusal's): a plan's own recompute can let updates move further than the search's order
    has them, so the plan smallest there may keep saved values the trained order could
    drop; the plan
    that recomputes every saved value it may (with the chosen plan's variants) is judged
    as trained too, and returned where it needs a smaller budget
    (``compiler/trained_smallest.py``)."""
    rules = trained_rules(options)

    def trained(sim: Simulation) -> Simulation:
        again = simulate(graph, sim.plan, costs, structure, rules)
        return replace(again, heap_room=sim.heap_room) \
            if again.peak_bytes <= sim.peak_bytes else sim

    best, picked = trained(outcome.best), outcome.picked
    if smallest:
        # The smallest budget as trained: each run's smallest plan judged so too (the trained
        # order moves updates by each plan's own recompute: timm's GhostNet, the polish's plan
        # 18.02 -> 17.12 MB as trained, where the pick's stayed at 18.36 MB).
        # Those within ALTERNATIVES_WINDOW of the pick only: each is a simulation of the
        # whole step (2-3 s on a 30,905-node one), and the trained order moved GhostNet's
        # by 5%.
        near = outcome.best.fit_bytes * ALTERNATIVES_WINDOW
        for alt in _to_judge(graph, outcome, near):
            again = trained(alt)
            if (again.fit_bytes, again.peak_bytes) < (best.fit_bytes, best.peak_bytes):
                best, picked = again, f"{outcome.picked or outcome.strategy}: another run's " \
                    "plan, smaller as trained"
    candidates = list(outcome.candidates)
    # --strategy none recomputes nothing: its smallest plan is the step as built.
    if smallest and options.strategy != "none" and (
            everything := recompute_all_as_trained(graph, best, costs, options, structure)):
        best, picked = everything, f"{outcome.picked or outcome.strategy}, then recompute all"
        candidates.append({"strategy": "recompute all (as trained)",
                           "peak_bytes": best.peak_bytes, "added_time_s": best.added_time_s})
    return replace(outcome, best=best, baseline=trained(outcome.baseline), picked=picked,
                   candidates=candidates)


def plan_summary(graph, outcome: PlanOutcome, costs, options, structure) -> dict:
    best, base = outcome.best, outcome.baseline
    variants = describe_variants(graph, best, costs, structure,
                                 host_copies=options.provider == "cuda",
                                 device=options.device)
    saved = {v: graph.info[v].nbytes for v in best.recomputed_values}
    summary = {
        "strategy": outcome.strategy,
        "strategy_label": outcome.label,
        "recomputed_nodes": len(best.plan.recompute),
        "recomputed_values": len(best.recomputed_values),
        "recomputed_value_bytes": int(sum(saved.values())),
        "peak_bytes": best.peak_bytes,
        "baseline_peak_bytes": base.peak_bytes,
        "bytes_saved": base.peak_bytes - best.peak_bytes,
        "predicted_added_time_s": round(best.added_time_s, 6),
        "variant_nodes": len(variants["chosen"]),
        "exactness": variants["exactness"],
        "variants": variants,
        "smallest_peak_bytes": outcome.smallest_peak,
        "solver": outcome.solver,
        "candidates": outcome.candidates,
        "runs": outcome.runs,
    }
    return summary


def rewrite_stage(plan_sim: Simulation, base_sim: Simulation) -> tuple[Graph, dict]:
    g = plan_sim.graph
    if g.shares is not None:   # the lowering kept the step's nodes: the step written owns its
        own = g.copy()
        g.set_nodes(own.nodes, own.def_use())
        g.shares = None
    return g, {
        "nodes_before": len(base_sim.graph.nodes), "nodes_after": len(g.nodes),
        "cloned_nodes": len(plan_sim.cloned_nodes),
        "recomputed": list(plan_sim.recomputed_values),
    }
