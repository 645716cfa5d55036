"""The ``auto`` strategy: sqrt(n) and the ILP, then the polish (shed the dearest recompute
of the cheapest fitting plans, and trade dear units for cheaper ones, while the simulator
says the step still fits). A ``PlanningContext`` and a ``Budget`` in, a ``StrategyResult``
out (``context.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from memcc.passes.plan import Plan
from memcc.passes.planning.context import PlanningContext, StrategyResult, strategy
from memcc.passes.planning.exact import exact_model
from memcc.passes.planning.request import Budget
from memcc.passes.planning.segmented import add_rebuilt_again, segmented
from memcc.passes.planning.simulate import Simulation
from memcc.passes.planning.work import Allowance, account

POLISH_CANDIDATES = 64
POLISH_STARTS = 4
POLISH_SHARE = 0.25
# The polish's trades, on its cheapest plan (``_exchange``): stop recomputing one of the
# EXCHANGE_UNITS dearest units and recompute instead one of the EXCHANGE_PARTNERS cheapest
# units live at the peak that makes. Bounded by that count and by their own share of the
# work (``Allowance``).
EXCHANGE_UNITS = 16
EXCHANGE_SHARE = 0.15
EXCHANGE_PARTNERS = 2
@dataclass(frozen=True)
class FitTest:
    """What the polish keeps a plan to: fit ``budget`` (by ``Simulation.fit_bytes`` where
    ``room``: a budget, not the smallest peak, holds the heap room of the small buffers a
    plan adds; else by the peak), trying moves while ``allowance`` lasts (what stopped the
    search is recorded under ``stage``)."""

    budget: float
    allowance: Allowance
    room: bool = False
    stage: str = "polish"

    def size(self, sim: Simulation) -> int:
        return sim.fit_bytes if self.room else sim.peak_bytes

    def fits(self, sim: Simulation) -> bool:
        return self.size(sim) <= self.budget

    def expired(self) -> bool:
        """Called before each simulation: True where the allowance is spent."""
        return not self.allowance.take(self.stage)


@strategy("auto")
def best_of_all(p: PlanningContext, budget: Budget) -> StrategyResult:
    """sqrt(n) and the ILP, then the polish (stop recomputing the most expensive nodes of
    the cheapest fitting plans while the simulator says the step still fits)."""
    out = segmented(p)
    # The solves leave the polish its shares of the clock (its count of moves is what
    # bounds it; this is so that a solve stopped at the time limit does not leave it none).
    solved = exact_model(replace(p, reserved_s=(POLISH_SHARE + EXCHANGE_SHARE)
                                 * p.time_limit), budget)
    # The ILP's seeds are the segmentations sqrt(n) already returned.
    seeds = {id(s) for s in p.segmentations}
    solved.plans = [(n, s) for n, s in solved.plans if id(s) not in seeds]
    solved.runs = [r for r in solved.runs if not r.fields.get("seed")]
    out.extend(solved)
    add_rebuilt_again(p, budget, out)
    target = budget.bytes if not budget.is_min else min(
        [s.peak_bytes for _, s in out.plans] + [p.baseline.peak_bytes])
    # The polish is a refinement: a quarter of the time limit's work, its trades 15% more.
    # Plans the ILP proved optimal (within its gap) in its model: the trades look for what
    # a solve stopped at a limit left, and on such a plan they cost time for nothing (the
    # 5,097-node GPT-2 at 33%: 8 s, no trade).
    proven = {id(s) for r in out.runs if r.fields.get("status") == "optimal" for s in r.sims}
    shedding, trading = Allowance.of(p, POLISH_SHARE), Allowance.of(p, EXCHANGE_SHARE)
    polished = _polish(p, out.plans, FitTest(target, shedding, not budget.is_min),
                       proven=proven, trades=trading)
    said = account(shedding, trading)
    if polished is None:
        out.add("auto", [], {"strategy": "polish", "detail": "the cheapest fitting plans",
                             "status": "no improvement", **said})
    else:
        sim, start, trades = polished
        out.add("auto", [sim], {"strategy": "polish", "detail": f"from the {start} plan",
                                "from": start, "status": "improved", "trades": trades,
                                **said})
    return out


def _polish(p: PlanningContext, found: list[tuple[str, Simulation]], fit: FitTest, *,
            proven: set[int] | frozenset[int] = frozenset(), trades: Allowance | None = None
            ) -> tuple[Simulation, str, int] | None:
    """Start from the cheapest fitting plans and stop recomputing their most expensive nodes
    one by one, then drop their time-costing variants, while the simulator says the step
    still fits (exact, so it never breaks a plan). Several starts, because the cheapest
    plan is not always the one that polishes best (a sqrt(n) plan with more segments may
    shed more). Returns the best polished plan, the strategy of the plan it started
    from (the report names it: ``sqrtn+polish``) and how many trades (``_exchange``) it
    kept. ``fit``: the budget, the work allowed, how fitting is judged (``FitTest.room``);
    the trades get an allowance of their own (``trades``; by default as many moves as
    ``fit``'s and the same deadline). ``proven``:
    ids of plans an ILP solve proved optimal; the trades are left out where the best plan is
    one of them."""
    pp = p.model
    budget, size = fit.budget, fit.size

    fitting = sorted(((name, sim) for name, sim in found
                      if size(sim) <= budget and (sim.plan.recompute
                                                       or sim.plan.variants)),
                     key=lambda q: q[1].added_time_s)
    variant_cost = {c: float(pp.problem.cost[var]) for var, c in pp.variants.choice_of.items()}
    index = {n: i for i, g in enumerate(pp.groups) for n in g}
    best: tuple[Simulation, str] | None = None
    seen: set[frozenset[str]] = set()

    def by_cost(names: frozenset[str]) -> list[int]:
        """The units holding ``names``, dearest first."""
        units = {index[n] for n in names if n in index}
        return sorted(units, key=lambda u: -pp.units.unit_cost[u])[:POLISH_CANDIDATES]

    for start_name, start in fitting[:POLISH_STARTS]:
        key = (start.plan.recompute, frozenset(start.plan.variants.items()))
        if key in seen:
            continue
        seen.add(key)
        # Stop recomputing the dearest units (their rebuilt-again marks go with them).
        current = _shed(p, start, fit, [
            lambda plan, g=frozenset(pp.groups[i]): without(plan, g)
            for i in by_cost(start.plan.recompute)])
        # Then share the clones of rebuilt-again units, dearest first: each one shared is a
        # chain that no longer runs twice.
        current = _shed(p, current, fit, [
            lambda plan, g=frozenset(pp.groups[i]): replace(
                plan, recompute_again=plan.recompute_again - g)
            for i in by_cost(current.plan.recompute_again)])
        # Then the variants that cost time, dearest first: the model may have credited one
        # with a saving the simulator does not see.
        dear = sorted((n for n, v in current.plan.variants.items()
                       if variant_cost.get((n, v), 0.0) > 0),
                      key=lambda n: -variant_cost[(n, current.plan.variants[n])])
        current = _shed(p, current, fit, [
            lambda plan, node=node: replace(
                plan, variants={n: v for n, v in plan.variants.items() if n != node})
            for node in dear[:POLISH_CANDIDATES]])
        if current is not start and (best is None
                                     or current.added_time_s < best[0].added_time_s):
            best = (current, start_name)
    # Then trade, on the best plan only: a dear unit that does not fit when shed alone may
    # fit when cheaper units live at the new peak are recomputed instead. Its own
    # allowance, so that starts above that use theirs up do not leave it none.
    if not fitting:
        return None
    # The cheapest plan so far: a polished one, or the cheapest start where the polish
    # left every start dearer than it.
    current, start_name = min([(fitting[0][1], fitting[0][0])] + ([best] if best else []),
                              key=lambda q: q[0].added_time_s)
    if id(current) in proven:
        return None if best is None else (*best, 0)
    own = trades or Allowance(fit.allowance.moves, fit.allowance.deadline,
                              stopped=fit.allowance.stopped)
    trading = FitTest(budget, own, fit.room, "trades")
    traded, kept = _exchange(p, current, trading, index,
                             by_cost(current.plan.recompute)[:EXCHANGE_UNITS])
    if traded is not current:
        return traded, start_name, kept
    return None if best is None else (*best, 0)


def without(plan: Plan, group: frozenset[str]) -> Plan:
    """``plan`` no longer recomputing the nodes of ``group`` (their rebuilt-again marks go
    with them): the move the polish and its trades are made of."""
    return replace(plan, recompute=plan.recompute - group,
                   recompute_again=plan.recompute_again - group)


def _exchange(p: PlanningContext, current: Simulation, fit: FitTest, index: dict[str, int],
              dear: list[int]) -> tuple[Simulation, int]:
    """For each of the ``dear`` units (dearest first): stop recomputing it, and where the
    step then no longer fits, recompute instead one of the cheaper units whose values
    recomputing moves out of the new peak (``_partners``; cheapest per byte first, at most
    ``EXCHANGE_PARTNERS`` tries). Keeps a trade where the simulator says the step fits and
    costs less. Returns the plan and the number of trades kept.

    Shedding alone cannot make these moves, and the ILP, stopped at its limit with a gap,
    leaves them: on MONeT's ResNet-50 step at 4.99 GB the trades took the polished plan
    from +12.2% to +11.0% (BENCHMARKS.md, "Eleventh session")."""
    pp = p.model
    cost = pp.units.unit_cost
    producer = p.graph.producers()
    trades = 0
    for a in dear:
        if fit.expired():
            break
        g_a = frozenset(pp.groups[a])
        if not g_a <= current.plan.recompute:
            continue
        shed = without(current.plan, g_a)
        sim = p.simulate(replace(shed, strategy="auto"))
        if fit.fits(sim):
            if sim.added_time_s < current.added_time_s:
                current = sim
            continue
        # A partner lowers the new peak by at most the bytes of its values live there.
        freed = _partners(p, sim, shed, producer, index, float(cost[a]))
        excess = fit.size(sim) - fit.budget
        for b in [u for u in freed if freed[u] >= excess][:EXCHANGE_PARTNERS]:
            if fit.expired():
                break
            traded = p.simulate(replace(
                shed, recompute=shed.recompute | frozenset(pp.groups[b]), strategy="auto"))
            if fit.fits(traded) and traded.added_time_s < current.added_time_s:
                current = traded
                trades += 1
                break
    return current, trades


def _partners(p: PlanningContext, sim: Simulation, plan: Plan, producer: dict,
              index: dict[str, int], below: float) -> dict[int, int]:
    """Units not recomputed by ``plan``, cheaper than ``below``, that produce a value live
    at ``sim``'s peak which recomputing would move out of it: every forward reader of the
    value runs before the peak and every other reader (backward nodes, clones) after it.
    Unit -> the bytes of its values live there, cheapest per byte first."""
    forward, cost = p.structure.forward, p.model.units.unit_cost
    live = sim.liveness
    t = live.peak_step
    if t < 0:
        return {}
    wanted = {v for v in live.live_at_peak if v in producer}
    readers: dict[str, list[tuple[int, bool]]] = {v: [] for v in wanted}
    for i, n in enumerate(sim.graph.nodes):
        for v in n.input:
            if v in readers:
                readers[v].append((i, n.name in forward))
    freed: dict[int, int] = {}
    for v in wanted:
        life = live.values.get(v)
        if life is None or not life.owns_buffer or any(
                (i >= t) if fwd else (i <= t) for i, fwd in readers[v]):
            continue
        name = producer[v].name
        u = index.get(name)
        if u is None or name in plan.recompute or cost[u] >= below:
            continue
        freed[u] = freed.get(u, 0) + life.nbytes
    return {u: freed[u] for u in sorted(freed, key=lambda u: (float(cost[u]) / freed[u], u))}


def _shed(p: PlanningContext, current: Simulation, fit: FitTest,
          steps: list[Callable[[Plan], Plan]]) -> Simulation:
    """Apply each of ``steps`` (a plan -> a cheaper plan) to the plan kept so far, in order,
    keeping the result where the simulator says the step still fits and costs less."""
    for step in steps:
        if fit.expired():
            break
        sim = p.simulate(replace(step(current.plan), strategy="auto"))
        if fit.fits(sim) and sim.added_time_s < current.added_time_s:
            current = sim
    return current


