"""One size of the searched dimension at a time: ``SizeSearch`` builds the step at a size,
costs it, and answers "does it fit?" with the cheapest question that settles it (the step
as built, the bytes no plan can remove, the sqrt(n) bound, then the planner), caching
everything learnt about the size in a ``SizeProbe``.

``tune.search`` drives it over the range; nothing here decides which sizes to ask about.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import onnx

from memcc.compiler.planning import as_trained
from memcc.compiler.training_order import in_training_order
from memcc.errors import MemccError
from memcc.frontend.build import build_training_step
from memcc.frontend.load import load_graph
from memcc.frontend.weights_apart import Arrays, own_weights, owned
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import (
    CUDA_NOMINAL,
    CostModel,
    DeviceRates,
    analytic_costs,
    host_link_for,
)
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.floor import runtime_bytes
from memcc.passes.planning.planner import BudgetError, PlanOutcome, choose_plan
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate
from memcc.passes.providers.provider_step import for_provider
from memcc.tune.options import Say, SearchRange, TuneOptions


def floor_bytes(step: Graph, provider: str) -> int:
    """The bytes no plan can remove: the step's inputs, parameters and optimizer state, and
    on CUDA what the session holds for itself (``floor.runtime_bytes``)."""
    persistent = set(step.inputs) | set(step.initializers)
    return int(sum(step.info[v].nbytes for v in persistent if v in step.info)) \
        + runtime_bytes(provider)


# ---------------------------------------------------------------------------- one size
@dataclass
class SizeProbe:
    """Everything learnt about one size, filled in as the search asks (the cache)."""

    batch: int
    graph: Graph
    costs: CostModel
    structure: StepStructure
    baseline: Simulation
    floor_bytes: int
    lr: float | None
    sqrtn_peak: int | None = None
    smallest: int | None = None
    outcome: PlanOutcome | None = None
    # What a budget must hold for those plans: the peak and the heap room of the small
    # buffers they add (``Simulation.fit_bytes``), as compile judges a fit. Judged by the
    # peak alone, a sqrt(n) plan "fitted" at a size where compile refused every plan
    # (``tune`` of a transformers ViT then stopped with "fitted but the plan at the budget
    # was refused"; first-use audit, session 36).
    sqrtn_fit: int | None = None
    smallest_fit: int | None = None

    def smallest_fits(self, budget: int) -> bool:
        """Whether the smallest plan found fits ``budget`` as compile judges it."""
        assert self.smallest is not None
        return (self.smallest if self.smallest_fit is None else self.smallest_fit) <= budget


class SizeSearch:
    """The cached, tiered "does this size fit?" and the plans the table needs."""

    def __init__(self, model: onnx.ModelProto, label: str, rng: SearchRange,
                 options: TuneOptions, plan_budget: int, say: Say) -> None:
        self.model, self.label, self.rng, self.opts = model, label, rng, options
        # The values of ``model``'s stubs (``load.read_model_apart``; the caller sets
        # them): views into the mapped file until ``own_weights``, then arrays every
        # size's step shares.
        self.weights: Arrays = {}
        self._built: dict[int, Graph] = {}  # steps built, not yet probed (``step``)
        self._owned = False
        self.budget = plan_budget
        self.compile = options.compile_options()
        self.slack = options.slack_bytes or 0  # tune() counts it on the smallest size
        self.say = say
        self.probes: dict[int, SizeProbe] = {}
        self.stats = {"builds": 0, "sqrtn_bounds": 0, "plans": 0, "min_searches": 0}
        self._rates: DeviceRates | None = None
        self._cuda: dict = {}  # the CUDA calibration, once read

    # -- building and costs
    def step(self, b: int) -> Graph:
        """The training step at size ``b`` as compile plans it, nothing priced yet (the
        floor check of ``tune`` needs no more); its weights are ``self.weights``'s."""
        if b in self.probes:
            return self.probes[b].graph
        graph = self._built.get(b)
        if graph is None:
            self.say(f"{self.rng.dim}={b}: building the step")
            lr = self.opts.lr_for(b)
            build = self.opts.build if lr is None or self.opts.build.optimizer == "none" \
                else replace(self.opts.build, lr=lr)
            dims = {**self.opts.dims, self.rng.dim: b}
            forward = load_graph(self.model, dims, source=self.label, mapped=True,
                                 weights=self.weights)
            graph = build_training_step(forward, build, source=self.label)
            graph, _ = for_provider(graph, self.opts.provider)  # as compile plans it
            self._built[b] = graph
        return graph

    def own_weights(self) -> None:
        """Copy the weights out of the mapped file, once, before anything runs or keeps a
        step: the steps built so far and those built later share the copies."""
        if self._owned:
            return
        self._owned = True
        copies = {name: owned(a) for name, a in self.weights.items()}
        by_id = {id(a): copies[name] for name, a in self.weights.items()}
        self.weights = copies
        for graph in [*self._built.values(), *(p.graph for p in self.probes.values())]:
            for name, a in graph.initializers.items():
                graph.initializers[name] = by_id.get(id(a), a)
            own_weights(graph)  # anything else still a view into the file

    def probe(self, b: int) -> SizeProbe:
        p = self.probes.get(b)
        if p is not None:
            return p
        graph = self.step(b)
        self.own_weights()  # pricing may run the step (measured node times)
        del self._built[b]
        lr = self.opts.lr_for(b)
        costs = self._costs(graph)
        graph, _ = in_training_order(graph, self.compile)  # as compile plans it
        st = StepStructure.of(graph)
        # On CUDA, judged by the arena replay, as compile judges it.
        base = simulate(graph, Plan(), costs, st, SimulationRules(self.opts.provider))
        p = SizeProbe(b, graph, costs, st, base, floor_bytes(graph, self.opts.provider), lr)
        self.probes[b] = p
        self.stats["builds"] += 1
        return p

    def _costs(self, graph: Graph) -> CostModel:
        """As compile prices a step (analytic rates calibrated once per search); on CUDA
        with the host link, so that tune plans swaps where compile would."""
        cm = self._node_costs(graph)
        return replace(cm, link=host_link_for(self.opts.provider))

    def _node_costs(self, graph: Graph) -> CostModel:
        if self.opts.cost in ("measured", "auto"):
            from memcc.backend.profiling import measured_costs

            try:
                return measured_costs(graph, self.opts.provider)
            except MemccError:
                if self.opts.cost == "measured":
                    raise
        if self.opts.provider == "cuda":
            # Node times measured on a GPU, where memcc ships them
            # (passes/analysis/cuda_node_times.py).
            from memcc.passes.analysis.cuda_node_times import default_calibration

            if "cal" not in self._cuda:
                self._cuda["cal"] = default_calibration()  # read once per search
            if self._cuda["cal"] is not None:
                return self._cuda["cal"].costs(graph)
        if self._rates is None:
            if self.opts.provider == "cpu":
                from memcc.backend.profiling import calibrate_cpu_rates

                self._rates = calibrate_cpu_rates()
            else:
                self._rates = CUDA_NOMINAL
        return analytic_costs(graph, self._rates)

    def _choose(self, p: SizeProbe, budget: Budget, strategy: str, *,
                trained: bool = True) -> PlanOutcome:
        """The planner's plan of size ``p`` at ``budget``, asked as compile asks it (by
        keyword: ``PlanRequest``'s ``deadline``, added, shifted positional arguments), and
        judged as compile judges it: as ``memcc train`` runs the step (``as_trained``),
        so that the sizes tune says fit are the sizes compile reaches. ``trained=False``:
        judged in the order the search was given only (the step as built, updates moved early:
        ``compiler/training_order.py``), an upper bound on that (the sqrt(n) bound)."""
        out = choose_plan(p.graph, p.costs, PlanRequest(
            budget=budget, strategy=strategy, time_limit=self.opts.time_limit,
            kinds=DecisionKinds(offload=self.opts.provider == "cuda"),
            device=self.opts.provider, heap_room=self.compile.heap_room),
            structure=p.structure, baseline=p.baseline)
        return self._as_trained(p, out, smallest=budget.is_min) if trained else out

    def _as_trained(self, p: SizeProbe, out: PlanOutcome, *, smallest: bool) -> PlanOutcome:
        return as_trained(p.graph, out, p.costs, self.compile, p.structure, smallest=smallest)

    # -- the tiers
    def cheap_fits(self, b: int) -> tuple[bool | None, str]:
        """Settled without the planner's search: (fits, evidence), or (None, '')."""
        p = self.probe(b)
        if p.baseline.peak_bytes <= self.budget:
            return True, "baseline"
        if self.opts.strategy == "none":
            return False, "baseline"
        if p.floor_bytes > self.budget:
            return False, "floor"
        if p.outcome is not None:
            return True, "plan"
        if p.smallest is not None:
            return p.smallest_fits(self.budget), "min-search"
        self.sqrtn_peak(b)
        if p.sqrtn_fit is not None and p.sqrtn_fit <= self.budget:
            return True, "sqrtn"
        if self.opts.strategy == "sqrtn":  # its smallest peak is exactly that
            p.smallest, p.smallest_fit = p.sqrtn_peak, p.sqrtn_fit
            return False, "min-search"
        return None, ""

    def fits(self, b: int, *, expect: bool | None = None) -> tuple[bool, str]:
        """Certain answer. Where the cheap tiers cannot tell, plan at the budget when a fit
        is expected (the table needs that plan; a refusal still gives the smallest peak),
        else run only the --budget min search (a refusal would run it after a failed
        at-budget search anyway). ``expect=None``: expect a fit where the sqrt(n) peak,
        scaled by how far below it the planner reached at sizes already searched, is
        within the budget."""
        ok, why = self.cheap_fits(b)
        if ok is not None:
            return ok, why
        p = self.probes[b]
        if expect is None:
            ratios = [q.smallest / q.sqrtn_peak for q in self.probes.values()
                      if q.smallest is not None and q.sqrtn_peak]
            expect = p.sqrtn_peak is not None and \
                p.sqrtn_peak * min(ratios, default=1.0) <= self.budget
        if expect:
            return self.plan(b) is not None, "plan"
        self.say(f"{self.rng.dim}={b}: smallest reachable peak ({self.opts.strategy})")
        out = self._choose(p, Budget.MIN, self.opts.strategy)
        self.stats["min_searches"] += 1
        p.smallest, p.smallest_fit = out.best.peak_bytes, out.best.fit_bytes
        return p.smallest_fits(self.budget), "min-search"

    def plan(self, b: int) -> PlanOutcome | None:
        """The plan ``memcc compile`` would make at the budget (None: it refuses)."""
        p = self.probe(b)
        if p.outcome is not None:
            return p.outcome
        if p.smallest is not None and p.smallest > self.budget:
            return None
        # A step that fits as built is its own plan (recomputing adds time, never saves it).
        strategy = "none" if p.baseline.peak_bytes <= self.budget else self.opts.strategy
        if strategy != "none":
            self.say(f"{self.rng.dim}={b}: planning ({strategy})")
            self.stats["plans"] += 1
        try:
            p.outcome = self._choose(p, Budget.of(self.budget), strategy)
        except BudgetError as exc:
            # As compile does: the smallest plan, as trained, where that fits the budget.
            least = None if exc.outcome is None else \
                self._as_trained(p, exc.outcome, smallest=True)
            if least is not None and least.best.fit_bytes <= self.budget:
                p.outcome = least
                return least
            # The refusal ran the smallest-peak search: its answer decides this size
            # ("min-search"), so it counts as one.
            self.stats["min_searches"] += 1
            p.smallest = exc.smallest if least is None else least.best.peak_bytes
            # Refused at this budget: no plan fits it with its heap room, whatever its peak.
            p.smallest_fit = max(p.smallest, self.budget + 1)
            return None
        return p.outcome

    def sqrtn_peak(self, b: int) -> int:
        """The smallest peak of the sqrt(n) segmentations (about a second to find)."""
        p = self.probe(b)
        if p.sqrtn_peak is None:
            self.say(f"{self.rng.dim}={b}: sqrt(n) segmentations")
            # An upper bound where it only settles fits; the answer where sqrt(n) is the
            # user's strategy (then judged as compile judges it).
            out = self._choose(p, Budget.MIN, "sqrtn", trained=self.opts.strategy == "sqrtn")
            p.sqrtn_peak, p.sqrtn_fit = out.best.peak_bytes, out.best.fit_bytes
            self.stats["sqrtn_bounds"] += 1
        return p.sqrtn_peak

    def estimate(self, b: int) -> float:
        """The smallest peak at ``b`` as far as known (for aiming only): the planner's,
        else the sqrt(n) one."""
        p = self.probes[b]
        if p.smallest is not None:
            return float(p.smallest)
        if p.floor_bytes > self.budget:
            return float(p.floor_bytes)
        return float(self.sqrtn_peak(b))

    # -- the edge
    def edge(self, low: int, high: int, decide: Callable[[int], bool],
             value: Callable[[int], float]) -> int:
        """The largest size in [low, high) that ``decide`` accepts, given that ``low`` is
        accepted and ``high`` is not (or lies past the range). Aims where a line through
        ``value`` at the bounds meets the budget; halves after an aim that did not halve
        the interval (so it never takes more than twice the steps of plain bisection)."""
        aim = True
        while high - low > 1:
            width = high - low
            guess = low + width // 2
            if aim and high in self.probes:
                v_lo, v_hi = value(low), value(high)
                if v_hi > v_lo:
                    at = low + (self.budget - v_lo) * width / (v_hi - v_lo)
                    guess = min(max(int(at), low + 1), high - 1)
            if decide(guess):
                low = guess
            else:
                high = guess
            aim = not aim or 2 * (high - low) <= width
        return low


