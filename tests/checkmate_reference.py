"""Exact optima to judge memcc's planner by, on steps small enough to solve exactly.

Issue 9 asks that memcc's plan cost at most 2% more than the exact optimum at the same
budget. "The same budget" only means something when both sides count memory the same way,
and ORT's liveness (aliasing Reshapes, in-place activations, graph outputs never freed,
kernel scratch: ``passes/analysis/liveness.py``) is not Checkmate's "a value is its output bytes
from
its producer to its last reader". So the reference that the 2% is measured against is
exact over memcc's own search space, judged by memcc's own simulator:

- ``exact_frontier``: every distinct plan memcc can express is enumerated and simulated.
  A plan is a set of forward nodes to recompute, but only nodes the lowering actually
  re-runs matter (``passes/lowering/recompute.py`` clones a node only when a backward node reads it,
  directly or through other clones), so the distinct plans are the *closed* sets: each
  member is read by a non-forward node or by another member. Enumerating closed sets instead
  of all subsets removes the duplicates (a recompute of a node nobody re-reads changes
  nothing), which is what makes steps of 15-20 recomputable nodes enumerable. The Pareto
  frontier (peak, added time) of all of them answers every budget at once.

``checkmate_milp`` is the stage x node MILP of Checkmate (Jain et al., MLSys 2020) over the
whole training step, written here from the paper: ``R[t,i]`` (node ``i`` runs in stage
``t``), ``S[t,i]`` (its output is resident when stage ``t`` starts), ``FREE[t,i,k]`` (freed
right after node ``k`` of stage ``t``) and ``U[t,k]`` (bytes in use while ``k`` runs), with
frontier-advancing stages (stage ``t`` ends with node ``t`` of the step). Only memcc's
recomputable forward nodes may run more than once; the backward and the update run once each.
Memory is Checkmate's: a node's output bytes from the run that makes it to its last reader,
inputs, parameters and constants a fixed background. Its space is larger than memcc's (a value
may be rebuilt more than once, in any later stage, also within the forward pass), and its
memory model is not ORT's, so it answers a different question than the 2% target: how much
a schedule outside memcc's space could still save. ``checkmate_frontier`` counts memcc's
plans in the same memory model (``schedule_of_plan``, ``checkmate_peak``) so that the two
compare: the MILP may never be dearer than memcc's space at the same budget.

Measured on the steps of ``tests/test_checkmate_reference.py`` (unit costs, Checkmate's
memory, fractions of the baseline peak): memcc's space reaches 0.841 (mlp), 0.876
(residual) and 0.884 (attention); the MILP reaches 0.72 (mlp, +6 runs: ``layers.0`` and its
ReLU rebuilt twice, once to rebuild ``layers.1`` and once for their own gradient), 0.814 at
the same +2 (residual: the rebuilt ``block0.fc1``/``relu1`` run before the second backward
reader, not the first) and 0.85 (attention, +8: ``k``, ``k_t`` and ``q`` rebuilt twice). All
of it is the "recomputed more than once, once per backward segment" of issue 9.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.simulate import simulate

# Enumeration is exact but exponential; refuse rather than run for minutes.
MAX_PLANS = 20_000


class TooLarge(ValueError):
    """The step has more distinct plans than ``MAX_PLANS``: pick a smaller step."""


@dataclass(frozen=True)
class Point:
    """One plan of memcc's space, as the simulator judges it."""

    recompute: frozenset[str]
    peak_bytes: int
    added_time_s: float


# ------------------------------------------------------------------ memcc's space, exactly
def closed_recompute_sets(graph: Graph, st: StepStructure | None = None, *,
                          limit: int = MAX_PLANS) -> list[frozenset[str]]:
    """Every recompute set whose members the lowering all re-runs (see the module doc).

    Walks the recomputable forward nodes from the last to the first; a node may join the set
    when a non-forward node reads it or a member already chosen (a later node) does."""
    st = st or StepStructure.of(graph)
    forward = [n for n in graph.nodes if n.name in st.recomputable]
    names = {n.name for n in forward}
    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for i in n.input:
            if i:
                readers.setdefault(i, []).append(n.name)
    read_by_backward = {
        n.name: any(r not in st.forward for o in n.output for r in readers.get(o, ()))
        for n in forward
    }
    forward_readers = {
        n.name: {r for o in n.output for r in readers.get(o, ()) if r in names}
        for n in forward
    }
    order = [n.name for n in reversed(forward)]
    out: list[frozenset[str]] = []
    chosen: set[str] = set()

    def walk(k: int) -> None:
        if k == len(order):
            out.append(frozenset(chosen))
            if len(out) > limit:
                raise TooLarge(f"more than {limit} distinct plans")
            return
        name = order[k]
        walk(k + 1)
        if read_by_backward[name] or forward_readers[name] & chosen:
            chosen.add(name)
            walk(k + 1)
            chosen.discard(name)

    walk(0)
    return out


@dataclass(frozen=True)
class Simulated:
    """One distinct plan of memcc's space and its simulated peak (which costs do not
    change: the frontier for any cost model is read off the same simulations)."""

    recompute: frozenset[str]
    peak_bytes: int
    cloned: tuple[str, ...]  # every re-run, in order (a node re-run twice is here twice)
    rerun_before: tuple[tuple[str, str], ...] = ()  # re-run node -> the node it runs before


def simulate_all(graph: Graph, st: StepStructure | None = None, *,
                 limit: int = MAX_PLANS) -> list[Simulated]:
    """Simulate every distinct plan once. Checks the premise of the enumeration on the way:
    the lowering re-runs exactly the members of each closed set (a plan's added time is then
    the cost of its re-runs, counted as often as the lowering makes them)."""
    st = st or StepStructure.of(graph)
    unit = CostModel({n.name: 1.0 for n in graph.nodes}, "unit", "none")
    out = []
    for rec in closed_recompute_sets(graph, st, limit=limit):
        sim = simulate(graph, Plan(rec, "reference"), unit, st)
        if set(sim.cloned_nodes) != rec:
            raise AssertionError(f"the lowering re-ran {sorted(sim.cloned_nodes)} for the "
                                 f"closed set {sorted(rec)}")
        out.append(Simulated(rec, sim.peak_bytes, tuple(sim.cloned_nodes),
                             tuple(sorted(sim.rerun_before.items()))))
    return out


def frontier(plans: Iterable[Simulated], costs: CostModel, graph: Graph) -> list[Point]:
    """The exact (peak, added time) frontier of ``plans`` under ``costs``."""
    node = {n.name: n for n in graph.nodes}
    return pareto(Point(p.recompute, p.peak_bytes,
                        float(sum(costs.of(node[n]) for n in p.cloned)))
                  for p in plans)


def pareto(points: Iterable[Point]) -> list[Point]:
    """The points no other point beats on both peak and added time, by increasing peak
    (so by decreasing added time)."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.peak_bytes, p.added_time_s)):
        if not front or p.added_time_s < front[-1].added_time_s:
            front.append(p)
    return front


def exact_frontier(graph: Graph, costs: CostModel, st: StepStructure | None = None, *,
                   limit: int = MAX_PLANS) -> list[Point]:
    """The exact (peak, added time) frontier of memcc's search space on ``graph``."""
    return frontier(simulate_all(graph, st, limit=limit), costs, graph)


def optimum(front: Sequence[Point], budget: float) -> Point | None:
    """The cheapest plan whose peak is within ``budget`` (None: nothing fits)."""
    fitting = [p for p in front if p.peak_bytes <= budget]
    return min(fitting, key=lambda p: (p.added_time_s, p.peak_bytes)) if fitting else None


# ------------------------------------------------------------------ Checkmate's MILP
@dataclass(frozen=True)
class StageGraph:
    """The step as Checkmate sees it: nodes in step order (Constant nodes are values, not
    work), each node's output bytes, inputs and readers by index, which nodes may be
    recomputed (memcc's recomputable forward nodes; the backward and the update run once),
    which outputs are never freed (graph outputs, outputs nobody reads), and the fixed
    background (graph inputs, initializers, constants)."""

    names: tuple[str, ...]
    cost: tuple[float, ...]
    mem: tuple[float, ...]
    deps: tuple[tuple[int, ...], ...]
    users: tuple[tuple[int, ...], ...]
    recomputable: tuple[bool, ...]
    pinned: tuple[bool, ...]
    background: float

    @classmethod
    def of(cls, graph: Graph, costs: CostModel,
           st: StepStructure | None = None) -> StageGraph:
        st = st or StepStructure.of(graph)
        nodes = [n for n in graph.nodes if n.op_type != "Constant"]
        index = {o: k for k, n in enumerate(nodes) for o in n.output if o}
        deps = [tuple(sorted({index[i] for i in n.input if i in index})) for n in nodes]
        users: list[list[int]] = [[] for _ in nodes]
        for k, ds in enumerate(deps):
            for d in ds:
                users[d].append(k)
        outputs = set(graph.outputs)

        def nbytes(v: str) -> float:
            return float(graph.info[v].nbytes) if v in graph.info else 0.0

        return cls(
            names=tuple(n.name for n in nodes),
            cost=tuple(costs.of(n) for n in nodes),
            mem=tuple(sum(nbytes(o) for o in n.output if o) for n in nodes),
            deps=tuple(deps),
            users=tuple(tuple(u) for u in users),
            recomputable=tuple(n.name in st.recomputable for n in nodes),
            pinned=tuple(any(o in outputs for o in n.output) or not users[k]
                         for k, n in enumerate(nodes)),
            background=sum(nbytes(v) for v in graph.values() if v not in index),
        )

    def runnable(self, t: int) -> list[int]:
        """Nodes stage ``t`` may run, in the order it runs them: recomputable ones before
        ``t``, then ``t`` itself (frontier-advancing stages)."""
        return [i for i in range(t) if self.recomputable[i]] + [t]


def checkmate_frontier(g: StageGraph, plans: Iterable[Simulated]) -> list[Point]:
    """memcc's space again, each plan's peak now counted in Checkmate's memory model (the
    frontier the MILP is compared with)."""
    node_cost = dict(zip(g.names, g.cost, strict=True))
    return pareto(Point(p.recompute, int(checkmate_peak(g, schedule_of_plan(g, p.rerun_before))),
                        float(sum(node_cost[n] for n in p.cloned)))
                  for p in plans)


def checkmate_peak(g: StageGraph, runs: Sequence[Sequence[int]]) -> float:
    """Peak bytes of a schedule in Checkmate's memory model, keeping nothing longer than
    needed: ``runs[t]`` are the nodes stage ``t`` runs, in order. Each computation of a node
    is an instance, live from when it is computed until its last reader (readers use the
    most recent instance); pinned outputs are never freed."""
    order = [(t, k) for t in range(len(runs)) for k in runs[t]]
    current: dict[int, int] = {}      # node -> position of its latest instance
    born: list[tuple[int, int]] = []  # (position, node)
    last: dict[int, int] = {}         # instance position -> position of its last reader
    for p, (_, k) in enumerate(order):
        for i in g.deps[k]:
            if i not in current:
                raise ValueError(f"{g.names[k]} reads {g.names[i]} before it exists")
            last[current[i]] = p
        current[k] = p
        born.append((p, k))
    delta = [0.0] * (len(order) + 1)
    for p, k in born:
        end = len(order) - 1 if g.pinned[k] else last.get(p, p)
        delta[p] += g.mem[k]
        delta[end + 1] -= g.mem[k]
    live, peak = g.background, g.background
    for p in range(len(order)):
        live += delta[p]
        peak = max(peak, live)
    return peak


def schedule_of_plan(g: StageGraph, rerun_before: Iterable[tuple[str, str]]
                     ) -> list[list[int]]:
    """memcc's lowering as stages: every node in its own stage, plus each re-run forward
    node in the stage of the backward node it was emitted for (``Simulation.rerun_before``),
    in Checkmate's order (by index) within the stage."""
    pos = {n: k for k, n in enumerate(g.names)}
    extra: dict[int, set[int]] = {}
    for fwd, before in rerun_before:
        extra.setdefault(pos[before], set()).add(pos[fwd])
    return [sorted(extra.get(t, set())) + [t] for t in range(len(g.names))]


@dataclass(frozen=True)
class MilpResult:
    status: str                    # "optimal", "infeasible" or the solver's word
    added_time_s: float | None     # recomputation only (every node once is not counted)
    runs: list[list[int]] | None   # the schedule found
    modelled_peak: float | None    # the largest U[t, k] of the solution


def checkmate_milp(g: StageGraph, budget: float, *, time_limit: float = 30.0) -> MilpResult:
    """Checkmate's MILP (Jain et al. 2020, section 4) at ``budget`` bytes, solved by HiGHS.

    Variables, for stage ``t`` and node ``i``: ``R[t,i]`` node ``i`` runs in stage ``t``
    (``R[t,t] = 1``: frontier-advancing); ``S[t,i]`` its output is resident when stage ``t``
    starts; ``FREE[t,i,k]`` it is freed right after node ``k`` runs in stage ``t`` (``i`` is
    ``k`` or an input of ``k``); ``U[t,k]`` bytes in use while ``k`` runs in stage ``t``.
    Constraints: an input is resident or recomputed earlier in the stage; a value is resident
    at a stage only if it was resident or computed in the stage before; FREE is 1 exactly when
    ``k`` runs, the value is not kept into the next stage, and no later reader in the stage
    runs (linearised with hazard counts); ``U`` follows allocations and frees in order and
    stays within the budget. Minimise the time of every run beyond the first."""
    import pulp

    T = len(g.names)
    prob = pulp.LpProblem("checkmate", pulp.LpMinimize)
    runnable = [g.runnable(t) for t in range(T)]
    R: dict[tuple[int, int], object] = {}
    for t in range(T):
        for i in runnable[t]:
            R[t, i] = 1 if i == t else prob.add_variable(f"R_{t}_{i}", cat="Binary")
    S: dict[tuple[int, int], object] = {}
    for t in range(1, T):
        for i in range(t):
            S[t, i] = 1 if g.pinned[i] else prob.add_variable(f"S_{t}_{i}", cat="Binary")

    def r(t: int, i: int):
        return R.get((t, i), 0)

    def s(t: int, i: int):
        if t >= T:  # after the last stage nothing but pinned outputs stays
            return 1 if g.pinned[i] else 0
        return S.get((t, i), 0) if t > i else 0

    prob += pulp.lpSum(g.cost[i] * v for (t, i), v in R.items() if i != t)
    for t in range(T):
        for k in runnable[t]:
            for i in g.deps[k]:
                prob += r(t, k) <= r(t, i) + s(t, i)
        for i in range(t + 1):
            if t + 1 < T and not g.pinned[i]:
                prob += S[t + 1, i] <= s(t, i) + r(t, i)
    free: dict[tuple[int, int, int], object] = {}
    for t in range(T):
        ks = runnable[t]
        for idx, k in enumerate(ks):
            later = ks[idx + 1:]
            for i in {*g.deps[k], k}:
                readers = [j for j in g.users[i] if j in later]
                hazards = (1 - r(t, k)) + s(t + 1, i) + pulp.lpSum(r(t, j) for j in readers)
                most = 2 + len(readers)
                f = prob.add_variable(f"F_{t}_{i}_{k}", cat="Binary")
                free[t, i, k] = f
                prob += 1 - f <= hazards
                prob += most * (1 - f) >= hazards
        used = g.background + pulp.lpSum(g.mem[i] * s(t, i) for i in range(t))
        for k in ks:
            used = used + g.mem[k] * r(t, k)
            prob += used <= budget
            used = used - pulp.lpSum(g.mem[i] * free[t, i, k] for i in {*g.deps[k], k})
    solver = pulp.HiGHS(msg=False, timeLimit=time_limit, threads=1)
    prob.solve(solver)
    status = pulp.LpStatus[prob.status].lower()
    if status != "optimal":
        return MilpResult(status, None, None, None)
    runs = [[i for i in runnable[t] if _on(r(t, i))] for t in range(T)]
    added = float(sum(g.cost[i] for t in range(T) for i in runs[t] if i != t))
    peak = _modelled_peak(g, runnable, r, s, free)
    return MilpResult(status, added, runs, peak)


def _on(v) -> bool:
    return bool(v) if isinstance(v, int) else (v.value() or 0.0) > 0.5


def _modelled_peak(g: StageGraph, runnable, r, s, free) -> float:
    """The largest ``U[t, k]`` of the solution, recomputed from its variable values."""
    peak = g.background
    for t in range(len(g.names)):
        used = g.background + sum(g.mem[i] for i in range(t) if _on(s(t, i)))
        for k in runnable[t]:
            if _on(r(t, k)):
                used += g.mem[k]
                peak = max(peak, used)
                used -= sum(g.mem[i] for i in {*g.deps[k], k} if _on(free[t, i, k]))
    return peak
