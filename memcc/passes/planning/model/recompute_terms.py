"""Term generator for the recompute decision: which forward values to rebuild, and where.

Units. Forward nodes whose outputs share one buffer (aliases, in-place writes) are decided
together: a unit. For each unit ``u`` and each candidate point ``s`` there is a binary
``y[u, s]``: "u is recomputed, its clone made just before node s"; a choice group keeps at
most one of them set (none set = keep).

Why a birth point per variable: the lowering clones a recomputed value once, before the
first backward node that needs it directly or through a recomputed reader. In a chain
a -> b -> c, all recomputed, c's need re-runs b and a right there, possibly long before
a's own backward readers; a's clone then stays live until them. Modelling the birth point
explicitly makes chains of any depth linear:

- chain: if consumer c is born at s_c, u may not be born after s_c:
  ``y[c, s_c] + sum(y[u, s] for s > s_c) <= 1``;
- saving: a recomputed value's original is freed after its last forward reader instead of
  its last backward reader: ``-bytes`` over ``(last forward reader, death]``;
- clone: ``+bytes`` from the birth to the value's death;
- held past death: a value read by a recomputed consumer born after the value's death (a
  kept input the clone needs, or a clone another clone reads later) stays live until then.
  Between two candidate points nothing is born, so one auxiliary per point and one per gap
  between points (``_hold``) make this exact at every time point.

The optimiser always prefers the latest birth allowed (earlier costs memory), which is the
lowering's rule, so the model is exact where a unit's true birth is one of its candidates.
Candidates are the unit's own first backward reader plus its consumers' candidates, at most
``CANDIDATE_BUDGET`` / units each, within [4, 10] (the latest ones and a spread back to the
earliest); a true birth between two candidates is modelled at the earlier one, which can only
overstate memory. Not modelled
(the simulator judges every answer): in-place writes between clones,
and forward nodes the lowering drops because nothing reads them any more (a saving).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from memcc.graph import Graph
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import LivenessReport, scratch_bytes
from memcc.passes.plan import StepStructure
from memcc.passes.planning.model.problem import CONTINUOUS, ProblemBuilder
from memcc.union_find import UnionFind

KIND = "recompute"
# Birth points per unit: more lets a chain's clones be born nearer to where the lowering
# makes them (an exact model), fewer keeps the MILP small enough to solve within its work
# limit. Measured (analytic costs): GPT-2 6 layers (173 units) needs 10 to fit at 28% of its
# peak; a 28-layer one (789 units) solved 5 to a better plan at 33% than 10 in the same work.
MAX_CANDIDATES = 10
MIN_CANDIDATES = 4
CANDIDATE_BUDGET = 4000  # birth variables in all


@dataclass(frozen=True)
class RecomputeUnits:
    """What the generator decided the decision units are, for the planner and sqrt(n)."""

    groups: tuple[tuple[str, ...], ...]  # unit -> forward node names, in schedule order
    unit_cost: np.ndarray                # seconds to re-run each unit
    var_unit: dict[int, int]             # decision variable -> unit
    var_birth: dict[int, int]            # decision variable -> schedule point of its clone
    crossing_bytes: np.ndarray           # per forward position: bytes crossing it
    crossing_units: list[list[int]]      # per forward position: units producing them

    def start_from(self, n_vars: int, rerun_before: dict[str, str],
                   position: dict[str, int]) -> np.ndarray | None:
        """A simulated plan written as this problem's variables (a warm start): each cloned
        unit born at its latest candidate at or before where the lowering re-ran it; None
        when a unit's re-run lies before all its candidates."""
        births: dict[int, int] = {}
        unit_of = {n: u for u, g in enumerate(self.groups) for n in g}
        for node, before in rerun_before.items():
            u = unit_of.get(node)
            if u is None or before not in position:
                continue
            births[u] = min(births.get(u, position[before]), position[before])
        x = np.zeros(n_vars)
        best: dict[int, tuple[int, int]] = {}
        for v, u in self.var_unit.items():
            s = self.var_birth[v]
            if u in births and s <= births[u] and (u not in best or s > best[u][0]):
                best[u] = (s, v)
        if len(best) < len(births):
            return None
        for _, v in best.values():
            x[v] = 1.0
        return x

    def units_of(self, x: np.ndarray) -> np.ndarray:
        """bool[units]: which units a solution recomputes."""
        chosen = np.zeros(len(self.groups), dtype=bool)
        for v, u in self.var_unit.items():
            if x[v] > 0.5:
                chosen[u] = True
        return chosen


@dataclass(frozen=True)
class _StepIndex:
    """The step's schedule as the recompute terms read it, indexed once: node positions,
    which run forward, each value's lifetime, readers (positions), the values sharing each
    buffer and each value's producer."""

    nodes: list
    pos: dict[str, int]
    fwd_pos: np.ndarray
    values: dict
    readers: dict[str, list[int]]
    members: dict[str, list[str]]
    producer: dict

    @classmethod
    def of(cls, graph: Graph, st: StepStructure, live: LivenessReport) -> _StepIndex:
        nodes = graph.nodes
        readers: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(nodes):
            for inp in n.input:
                if inp:
                    readers[inp].append(i)
        members: dict[str, list[str]] = defaultdict(list)
        for v, vl in live.values.items():
            members[vl.buffer].append(v)
        return cls(nodes, {n.name: i for i, n in enumerate(nodes)},
                   np.array([n.name in st.forward for n in nodes], dtype=bool),
                   live.values, readers, members,
                   {o: n for n in nodes for o in n.output if o})


@dataclass(frozen=True)
class _Units:
    """The recompute units and how they link: the nodes of each, each node's unit, each
    unit's outputs, the first backward reader of any of them (``direct``; T + 1: none) and
    the units that read them (``consumers``: their clones need this unit's values)."""

    groups: list[tuple[str, ...]]
    unit_of_node: dict[str, int]
    outputs_of: list[list[str]]
    direct: np.ndarray
    consumers: list[set[int]]


def add_recompute_terms(builder: ProblemBuilder, graph: Graph, st: StepStructure,
                        live: LivenessReport, costs: CostModel) -> RecomputeUnits:
    """The recompute decision's variables (one per unit and birth point), its rows (one
    birth at most per unit; a consumer's clone after its producer's) and its memory terms
    (kernel scratch, saved buffers freed and rebuilt, values held for recomputed readers)."""
    ix = _StepIndex.of(graph, st, live)
    T = len(ix.nodes)
    units = _link_units(ix, st)
    unit_cost = np.array([sum(costs.seconds.get(a, 0.0) for a in g) for g in units.groups])
    cands = _birth_points(ix, units)
    y, var_unit, var_birth = _add_births(builder, units.groups, unit_cost, cands, T)
    _add_scratch_and_chains(builder, graph, ix, units, y)
    _add_saving_terms(builder, ix, units, y)
    _add_held_terms(builder, ix, units, y)
    crossing_bytes, crossing_units = _forward_cuts(ix, st, units.unit_of_node)
    return RecomputeUnits(tuple(units.groups), unit_cost, var_unit, var_birth, crossing_bytes,
                          crossing_units)


def _link_units(ix: _StepIndex, st: StepStructure) -> _Units:
    nodes, readers = ix.nodes, ix.readers
    unit_of_node, groups = _units(nodes, st, ix.values, ix.producer)
    n_units = len(groups)
    inf = len(nodes) + 1
    # Direct need: the first backward reader of anything the unit produces.
    direct = np.full(n_units, inf)
    outputs_of: list[list[str]] = [[] for _ in range(n_units)]
    for u, g in enumerate(groups):
        for name in g:
            node = nodes[ix.pos[name]]
            for o in node.output:
                if not o:
                    continue
                outputs_of[u].append(o)
                for r in readers.get(o, ()):
                    if not ix.fwd_pos[r]:
                        direct[u] = min(direct[u], r)
    # Consumers: units that read an output of u (their clone needs u's value).
    consumers: list[set[int]] = [set() for _ in range(n_units)]
    for u in range(n_units):
        for o in outputs_of[u]:
            for r in readers.get(o, ()):
                c = unit_of_node.get(nodes[r].name)
                if c is not None and c != u:
                    consumers[u].add(c)
    return _Units(groups, unit_of_node, outputs_of, direct, consumers)


def _birth_points(ix: _StepIndex, units: _Units) -> list[list[int]]:
    """Each unit's candidate birth points, consumers first (reverse schedule order of the
    units' first node): its first backward reader and its consumers' points before it."""
    groups, direct = units.groups, units.direct
    n_units = len(groups)
    inf = len(ix.nodes) + 1
    per_unit = int(np.clip(CANDIDATE_BUDGET // max(n_units, 1), MIN_CANDIDATES, MAX_CANDIDATES))
    order = sorted(range(n_units), key=lambda u: -ix.pos[groups[u][0]])
    cands: list[list[int]] = [[] for _ in range(n_units)]
    for u in order:
        pts = set()
        if direct[u] < inf:
            pts.add(int(direct[u]))
        for c in units.consumers[u]:
            pts.update(cands[c])
        if direct[u] < inf:
            pts = {p for p in pts if p <= direct[u]}
        cands[u] = _spread(sorted(pts, reverse=True), per_unit)
    return cands


def _add_births(builder: ProblemBuilder, groups: list[tuple[str, ...]], unit_cost: np.ndarray,
                cands: list[list[int]], T: int
                ) -> tuple[list[dict[int, int]], dict[int, int], dict[int, int]]:
    """One binary per unit and birth point (``y[u][s]``), one choice row per unit; with the
    maps from each variable to its unit and its birth point."""
    var_unit: dict[int, int] = {}
    var_birth: dict[int, int] = {}
    y: list[dict[int, int]] = [{} for _ in groups]
    for u in range(len(groups)):
        for s in sorted(cands[u]):
            v = builder.variable(KIND, f"recompute {groups[u][0]} before #{s}",
                                 float(unit_cost[u]), preference=(T - s) / T)
            y[u][s] = v
            var_unit[v] = u
            var_birth[v] = s
        builder.choice(list(y[u].values()))
    return y, var_unit, var_birth


def _add_scratch_and_chains(builder: ProblemBuilder, graph: Graph, ix: _StepIndex,
                            units: _Units, y: list[dict[int, int]]) -> None:
    groups = units.groups
    # Scratch: a clone's kernel scratch (Where's two selections, ...) exists while it runs,
    # just before its birth point, on top of everything live there.
    for u in range(len(groups)):
        scratch = max((scratch_bytes(ix.nodes[ix.pos[name]], graph.info, graph.opset)
                       for name in groups[u]), default=0)
        for s, v in y[u].items():
            builder.term(v, float(scratch), s, s)

    # Chains: a consumer born at s_c needs u born at or before s_c (sum(y[u, s] for s >
    # s_c) + y[c, s_c] <= 1).
    for u in range(len(groups)):
        for c in units.consumers[u]:
            for s_c, v_c in y[c].items():
                tail = {v: 1.0 for s, v in y[u].items() if s > s_c}
                if tail:
                    builder.row({v_c: 1.0, **tail}, 1.0)


def _add_saving_terms(builder: ProblemBuilder, ix: _StepIndex, units: _Units,
                      y: list[dict[int, int]]) -> None:
    """Saving and clone terms of the buffers each unit owns."""
    values, fwd_pos = ix.values, ix.fwd_pos
    for u in range(len(units.groups)):
        if not y[u]:
            continue
        for o in units.outputs_of[u]:
            vl = values.get(o)
            if vl is None or vl.buffer != o or vl.death is None:
                continue
            all_r = [r for m in ix.members[o] for r in ix.readers.get(m, ())]
            if not any(not fwd_pos[r] for r in all_r):
                continue  # a transient: only the held-past-death terms below apply
            fwd = [r for r in all_r if fwd_pos[r]]
            lf = max(fwd) if fwd else vl.birth
            for s, v in y[u].items():
                builder.term(v, -float(vl.nbytes), lf + 1, vl.death)
                builder.term(v, float(vl.nbytes), s, vl.death)


def _add_held_terms(builder: ProblemBuilder, ix: _StepIndex, units: _Units,
                    y: list[dict[int, int]]) -> None:
    """Held past death: every value a recomputed consumer reads."""
    values = ix.values
    readers_of: dict[str, set[tuple[int, int | None]]] = defaultdict(set)
    for c in range(len(units.groups)):
        if not y[c]:
            continue
        for name in units.groups[c]:
            for inp in ix.nodes[ix.pos[name]].input:
                vl = values.get(inp)
                if vl is None:
                    continue
                bl = values.get(vl.buffer)
                if bl is None or bl.death is None:
                    continue  # pinned for the whole step: nothing to extend
                src = ix.producer.get(inp)
                u = units.unit_of_node.get(src.name) if src is not None else None
                if u != c:
                    readers_of[vl.buffer].add((c, u))
    for b, pairs in readers_of.items():
        _hold(builder, b, values[b], sorted(pairs, key=lambda p: (p[0], -1 if p[1] is None
                                                                   else p[1])), y)


def _hold(builder: ProblemBuilder, b: str, bl, pairs: list[tuple[int, int | None]],
          y: list[dict[int, int]]) -> None:
    """Terms for buffer ``b`` staying live past its death for recomputed readers.

    Births happen only at candidate points, so between two points p_i < p_next nothing
    changes: the buffer is live at p_i when some reader c is born at or after p_i and its
    producer u is kept or born by p_i; live strictly between p_i and p_next when a reader
    is born at or after p_next and u is kept or born by p_i. One auxiliary per point and
    per gap, each with one floor per (reader, producer) pair: exact at every time point."""
    death = bl.death
    points = sorted({p for c, u in pairs for p in list(y[c]) + list(y[u] if u is not None
                                                                    else ()) if p > death})
    if not points:
        return
    nbytes = float(bl.nbytes)

    def after(unit: int | None, p: int, strict: bool) -> dict[int, float]:
        if unit is None:
            return {}
        return {v: 1.0 for s, v in y[unit].items() if (s > p if strict else s >= p)}

    def aux_with_floors(label: str, reader_from: int, born_after: int, start: int,
                        end: int) -> None:
        floors = []
        for c, u in pairs:
            coeffs = after(c, reader_from, strict=False)
            if not coeffs:
                continue
            for v, one in after(u, born_after, strict=True).items():
                coeffs[v] = coeffs.get(v, 0.0) - one
            floors.append(coeffs)
        if not floors or start > end:
            return
        aux = builder.variable("alive", f"{b} alive {label}", var_type=CONTINUOUS)
        for coeffs in floors:
            builder.floor(aux, coeffs)
        builder.term(aux, nbytes, start, end)

    aux_with_floors(f"after #{death}", points[0], death, death + 1, points[0] - 1)
    for i, p in enumerate(points):
        aux_with_floors(f"at #{p}", p, p, p, p)
        if i + 1 < len(points):
            aux_with_floors(f"after #{p}", points[i + 1], p, p + 1, points[i + 1] - 1)


def _spread(points: list[int], k: int) -> list[int]:
    """At most ``k`` of ``points`` (latest first): the latest half, then an even spread back
    to the earliest, which is always kept so that every chain stays expressible."""
    if len(points) <= k:
        return points
    near = points[: k // 2]
    rest = points[k // 2:]
    picks = np.linspace(0, len(rest) - 1, k - len(near)).round().astype(int)
    return near + [rest[i] for i in sorted(set(picks.tolist()))]


def _units(nodes, st: StepStructure, values, producer
           ) -> tuple[dict[str, int], list[tuple[str, ...]]]:
    """Union the recomputable forward nodes whose outputs share a buffer."""
    parent = UnionFind(n.name for n in nodes if n.name in st.recomputable)
    find = parent.find

    for n in nodes:
        if n.name not in parent:
            continue
        for o in n.output:
            vl = values.get(o)
            if vl is None or vl.buffer == o:
                continue
            owner = producer.get(vl.buffer)
            if owner is not None and owner.name in parent:
                parent.union(n.name, owner.name)
    pos = {n.name: i for i, n in enumerate(nodes)}
    roots = sorted({find(a) for a in parent}, key=lambda a: pos[a])
    index = {r: i for i, r in enumerate(roots)}
    groups: list[list[str]] = [[] for _ in roots]
    for a in parent:
        groups[index[find(a)]].append(a)
    for g in groups:
        g.sort(key=lambda a: pos[a])
    unit_of_node = {a: index[find(a)] for a in parent}
    return unit_of_node, [tuple(g) for g in groups]


def _forward_cuts(ix: _StepIndex, st: StepStructure, unit_of_node: dict[str, int]):
    """Bytes crossing each position of the forward order, and which units produce them."""
    nodes, values, readers, members, producer = \
        ix.nodes, ix.values, ix.readers, ix.members, ix.producer
    fwd = [i for i, n in enumerate(nodes) if n.name in st.forward]
    index = {p: k for k, p in enumerate(fwd)}
    F = len(fwd)
    diff = np.zeros(F + 1)
    spans: list[tuple[int, int, int]] = []
    for b, vl in values.items():
        if vl.buffer != b or vl.birth < 0 or b not in producer:
            continue
        if producer[b].name not in st.forward:
            continue
        last = max((index[r] for v in members[b] for r in readers.get(v, ()) if r in index),
                   default=None)
        start = index.get(vl.birth)
        if last is None or start is None or last <= start:
            continue
        diff[start] += vl.nbytes
        diff[last] -= vl.nbytes
        for v in members[b]:
            owner = producer[v].name if v in producer else None
            u = unit_of_node.get(owner) if owner is not None else None
            if u is not None:
                spans.append((start, last, u))
    crossing = np.cumsum(diff[:-1])
    crossing_units: list[list[int]] = [[] for _ in range(F)]
    for start, last, u in spans:
        for k in range(start, last):
            crossing_units[k].append(u)
    return crossing, crossing_units
