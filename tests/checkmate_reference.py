"""Exact optima to judge memcc's planner by, on steps small enough to solve exactly.

Issue 9 asks that memcc's plan cost at most 2% more than the exact optimum at the same
budget. "The same budget" only means something when both sides count memory the same way,
and ORT's liveness (aliasing Reshapes, in-place activations, graph outputs never freed,
kernel scratch: ``passes/liveness.py``) is not Checkmate's "a value is its output bytes from
its producer to its last reader". So the reference that the 2% is measured against is
exact over memcc's own search space, judged by memcc's own simulator:

- ``exact_frontier``: every distinct plan memcc can express is enumerated and simulated.
  A plan is a set of forward nodes to recompute, but only nodes the lowering actually
  re-runs matter (``passes/recompute.py`` clones a node only when a backward node reads it,
  directly or through other clones), so the distinct plans are the *closed* sets: each
  member is read by a non-forward node or by another member. Enumerating closed sets instead
  of all subsets removes the duplicates (a recompute of a node nobody re-reads changes
  nothing), which is what makes steps of 15-20 recomputable nodes enumerable. The Pareto
  frontier (peak, added time) of all of them answers every budget at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.cost_model import CostModel
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.simulate import simulate

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


def simulate_all(graph: Graph, st: StepStructure | None = None, *,
                 limit: int = MAX_PLANS) -> list[Simulated]:
    """Simulate every distinct plan once. Checks the premise of the enumeration on the way:
    the lowering re-runs exactly the members of each closed set, once each (so a plan's
    added time is the sum of its members' costs)."""
    st = st or StepStructure.of(graph)
    unit = CostModel({n.name: 1.0 for n in graph.nodes}, "unit", "none")
    out = []
    for rec in closed_recompute_sets(graph, st, limit=limit):
        sim = simulate(graph, Plan(rec, "reference"), unit, st)
        if sorted(sim.cloned_nodes) != sorted(rec):
            raise AssertionError(f"the lowering re-ran {sorted(sim.cloned_nodes)} for the "
                                 f"closed set {sorted(rec)}")
        out.append(Simulated(rec, sim.peak_bytes))
    return out


def frontier(plans: Iterable[Simulated], costs: CostModel, graph: Graph) -> list[Point]:
    """The exact (peak, added time) frontier of ``plans`` under ``costs``."""
    node = {n.name: n for n in graph.nodes}
    return pareto(Point(p.recompute, p.peak_bytes,
                        float(sum(costs.of(node[n]) for n in p.recompute)))
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
