"""``memcc tune``: the largest batch, and the fastest one, whose training step fits a budget.

Users of recomputation ask "what fits?" before anything else. ``tune`` answers it ahead of
time by building the step at candidate sizes of one symbolic dimension (the batch) and
planning each with the same plan pass ``memcc compile`` uses, so "fits" here means exactly
"``memcc compile --budget`` succeeds": a plan within the budget exists, which is the case
if and only if the smallest peak the planner can reach is within it (``choose_plan``
returns the ``--budget min`` plan when the at-budget search fails; ``planner.py``).

Planning a size costs tens of seconds on large steps, so the search compiles as few sizes
as it can, and asks the cheapest question that settles each one:

1. the step as built (liveness only, well under a second): a baseline within the budget
   fits with no rewrite, so it also gives the largest batch without rewriting;
2. the bytes no plan can remove (inputs, parameters, optimizer state, constants): above
   the budget, nothing fits;
3. the sqrt(n) segmentations (about a second): one within the budget proves a fit, since
   every strategy that recomputes keeps them as candidates;
4. only then the planner itself: the plan at the budget where a fit is expected (the
   table needs that plan anyway), else the ``--budget min`` search (what a refusal runs).

Every "fits" and "does not fit" is therefore certain, and the search keeps the invariant
"``low`` fits, ``high`` does not": the edge it reports has been shown to fit and the next
size up shown not to. Between known sizes it aims where a straight line through the peaks
crosses the budget (peaks grow almost linearly with the batch), falling back to halving.
Only monotonicity in the batch is assumed. Results are cached per size; nothing is written
unless asked (``write_step``).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnx

from memcc.compiler import CompileOptions, plan_budget_under, user_budget
from memcc.errors import InputError, MemccError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph, read_model
from memcc.graph import Graph
from memcc.passes.analysis.cost_model import (
    CUDA_NOMINAL,
    CostModel,
    DeviceRates,
    analytic_costs,
    host_link_for,
)
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.planner import BudgetError, PlanOutcome, choose_plan
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate
from memcc.passes.providers.batchnorm_for_cuda import for_provider
from memcc.sizes import format_size, parse_size
from memcc.step import KIND_KEY

PICKS = ("fastest", "largest")
LR_RULES = ("linear", "sqrt")
RECOMPUTING = ("auto", "ilp", "sqrtn")  # strategies whose candidates include sqrt(n) plans
_RANGE = re.compile(r"^\s*([A-Za-z_][\w.:/-]*)\s*=\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")

Say = Callable[[str], None]


@dataclass(frozen=True)
class TuneOptions:
    """What ``memcc tune`` plans with; the CLI fills it from its flags.

    ``dims`` binds the other symbolic dimensions; ``points`` is how many sizes between the
    largest batch without rewriting and the largest batch get a full plan (each costs a
    compile: they are where a faster batch than both edges could hide)."""

    strategy: str = "auto"
    cost: str = "analytic"   # analytic by default: a measured cost model times every size
    provider: str = "cpu"
    # Seconds per planner call. Lower than compile's 60: tune makes several planner calls
    # near the edge, where on large steps the ILP's smallest-peak solve runs to half of this
    # limit (ResNet-50, 1 GB: 10 s per call -> 57 s in all, largest batch 409; 20 s -> 229 s,
    # 439; BENCHMARKS.md). A larger limit can only find more.
    time_limit: float = 10.0
    margin: float = 0.02
    # None: as compile's default (1 MiB, plus the heap allowance of the step's small
    # buffers on the CPU, counted at the range's smallest size, which has the most).
    slack_bytes: int | None = None
    build: BuildOptions = field(default_factory=BuildOptions)
    dims: Mapping[str, int] = field(default_factory=dict)
    pick: str = "fastest"
    points: int = 1
    ref_batch: int | None = None
    ref_lr: float | None = None
    lr_rule: str = "linear"

    def compile_options(self) -> CompileOptions:
        """The options tune shares with compile, as compile takes them."""
        return CompileOptions(strategy=self.strategy, provider=self.provider, cost=self.cost,
                              time_limit=self.time_limit, margin=self.margin,
                              slack_bytes=self.slack_bytes, build=self.build,
                              dims=self.dims)

    def __post_init__(self) -> None:
        # The options tune shares with compile are checked by compile's own rules, and
        # --provider auto resolves as there.
        object.__setattr__(self, "provider", self.compile_options().provider)
        if self.pick not in PICKS:
            raise InputError(f"--pick '{self.pick}': choose one of {', '.join(PICKS)}")
        if self.points < 0:
            raise InputError("--points must not be negative")
        if self.lr_rule not in LR_RULES:
            raise InputError(f"--lr-rule '{self.lr_rule}': choose one of {', '.join(LR_RULES)}")
        if (self.ref_batch is None) != (self.ref_lr is None):
            raise InputError("--ref-batch and --ref-lr go together: the learning rate that "
                             "worked (--ref-lr) at which batch size (--ref-batch)")
        if self.ref_batch is not None and self.ref_batch <= 0:
            raise InputError("--ref-batch must be positive")
        if self.ref_lr is not None and self.ref_lr <= 0:
            raise InputError("--ref-lr must be positive")

    def lr_for(self, batch: int) -> float | None:
        """The learning rate suggested for ``batch`` by the rule (None without a reference):
        linear scaling (Goyal et al.) for SGD-like training, square-root scaling (Krizhevsky;
        Hoffer et al.) often preferred for Adam-like optimizers."""
        if self.ref_batch is None or self.ref_lr is None:
            return None
        ratio = batch / self.ref_batch
        return self.ref_lr * (ratio if self.lr_rule == "linear" else math.sqrt(ratio))


@dataclass(frozen=True)
class SearchRange:
    """``batch=1..512``: the symbolic dimension searched and its inclusive bounds."""

    dim: str
    low: int
    high: int


def parse_range(text: str) -> SearchRange:
    """``"batch=1..512"`` -> SearchRange; errors say what a range looks like."""
    m = _RANGE.match(text or "")
    if m is None:
        raise InputError(f"--dim '{text}': expected NAME=LOW..HIGH for the dimension to "
                         "search, e.g. --dim batch=1..512 (other dimensions are bound as "
                         "usual: --dim seq=128)")
    name, low, high = m.group(1), int(m.group(2)), int(m.group(3))
    if low < 1:
        raise InputError(f"--dim '{text}': sizes start at 1, not {low}")
    if high < low:
        raise InputError(f"--dim '{text}': the range is empty ({low} > {high}); write "
                         f"{name}={high}..{low}")
    return SearchRange(name, low, high)


@dataclass(frozen=True)
class Candidate:
    """One size of the searched dimension and what is known about it.

    ``peak_bytes`` is the plan's peak where the size was planned at the budget, the step's
    own peak where it fits as built, else the smallest peak found (``decided_by`` says
    which); step time and throughput exist only for sizes whose plan is known."""

    batch: int
    fits: bool
    # baseline | floor | sqrtn | plan | min-search, or below-edge / above-edge: only the
    # step as built was looked at, and the size lies below the largest / above its next
    decided_by: str
    peak_bytes: int | None
    baseline_peak_bytes: int
    baseline_step_s: float
    # what ``peak_bytes`` is: "plan" (the plan at the budget), "as built", "smallest"
    # (the planner's smallest reachable), "sqrt(n)" (the smallest sqrt(n) peak, an upper
    # bound of the smallest), "floor" (inputs, parameters and state alone)
    peak_kind: str | None = None
    step_s: float | None = None
    strategy: str | None = None
    lr: float | None = None
    # --measure: median step time and peak measured in ORT (``memcc run``'s runner)
    measured_step_s: float | None = None
    measured_peak_bytes: int | None = None

    @property
    def samples_per_s(self) -> float | None:
        return None if not self.step_s else self.batch / self.step_s

    @property
    def measured_samples_per_s(self) -> float | None:
        return None if not self.measured_step_s else self.batch / self.measured_step_s

    @property
    def overhead(self) -> float | None:
        """Predicted time over the unrewritten step's, minus one."""
        if self.step_s is None or self.baseline_step_s <= 0:
            return None
        return self.step_s / self.baseline_step_s - 1.0

    def to_json(self) -> dict:
        return {
            "batch": self.batch, "fits": self.fits, "decided_by": self.decided_by,
            "peak_bytes": self.peak_bytes, "peak_kind": self.peak_kind,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "baseline_fits": self.decided_by == "baseline" and self.fits,
            "step_time_s": self.step_s, "samples_per_s": self.samples_per_s,
            "overhead": self.overhead, "strategy": self.strategy, "lr": self.lr,
            "measured_step_time_s": self.measured_step_s,
            "measured_samples_per_s": self.measured_samples_per_s,
            "measured_peak_bytes": self.measured_peak_bytes,
        }


@dataclass(frozen=True)
class TuneResult:
    """The search's answer: the table, both edges, the fastest size and the chosen step."""

    model: str
    range: SearchRange
    budget_bytes: int
    planning_budget_bytes: int
    candidates: tuple[Candidate, ...]        # every size evaluated, by batch
    largest_batch: int
    largest_batch_without_rewrite: int | None
    fastest_batch: int
    picked_batch: int
    pick: str
    step: Graph                              # the compiled step of ``picked_batch``
    cost_source: str
    strategy: str
    lr_rule: str | None
    lr: float | None                         # suggested for ``picked_batch``
    lr_applied: bool
    stats: dict                              # how many builds, plans and searches it took
    time_s: float
    # the compiled step of every size with a predicted time (for --measure)
    steps: Mapping[int, Graph] = field(default_factory=dict, repr=False, compare=False)

    def candidate(self, batch: int) -> Candidate:
        return next(c for c in self.candidates if c.batch == batch)

    def to_json(self) -> dict:
        return {
            "model": self.model, "dim": self.range.dim,
            "range": [self.range.low, self.range.high],
            "budget_bytes": self.budget_bytes,
            "planning_budget_bytes": self.planning_budget_bytes,
            "largest_batch": self.largest_batch,
            "largest_batch_without_rewrite": self.largest_batch_without_rewrite,
            "fastest_batch": self.fastest_batch,
            "pick": self.pick, "picked_batch": self.picked_batch,
            "cost_model": self.cost_source, "strategy": self.strategy,
            "lr": None if self.lr is None else {
                "rule": self.lr_rule, "suggested": self.lr, "applied": self.lr_applied},
            "candidates": [c.to_json() for c in self.candidates],
            "stats": self.stats, "time_s": round(self.time_s, 3),
        }


# ---------------------------------------------------------------------------- one size
@dataclass
class _Probe:
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


class _Search:
    """The cached, tiered "does this size fit?" and the plans the table needs."""

    def __init__(self, model: onnx.ModelProto, label: str, rng: SearchRange,
                 options: TuneOptions, plan_budget: int, say: Say) -> None:
        self.model, self.label, self.rng, self.opts = model, label, rng, options
        self.budget = plan_budget
        self.compile = options.compile_options()
        self.slack = options.slack_bytes or 0  # tune() counts it on the smallest size
        self.say = say
        self.probes: dict[int, _Probe] = {}
        self.stats = {"builds": 0, "sqrtn_bounds": 0, "plans": 0, "min_searches": 0}
        self._rates: DeviceRates | None = None
        self._cuda: dict = {}  # the CUDA calibration, once read

    # -- building and costs
    def probe(self, b: int) -> _Probe:
        p = self.probes.get(b)
        if p is not None:
            return p
        self.say(f"{self.rng.dim}={b}: building the step")
        lr = self.opts.lr_for(b)
        build = self.opts.build if lr is None or self.opts.build.optimizer == "none" \
            else replace(self.opts.build, lr=lr)
        dims = {**self.opts.dims, self.rng.dim: b}
        graph = build_training_step(load_graph(self.model, dims, source=self.label), build,
                                    source=self.label)
        graph, _ = for_provider(graph, self.opts.provider)  # as compile plans it
        costs = self._costs(graph)
        st = StepStructure.of(graph)
        # On CUDA, judged by the arena replay, as compile judges it.
        base = simulate(graph, Plan(), costs, st, SimulationRules(self.opts.provider))
        persistent = set(graph.inputs) | set(graph.initializers)
        floor = sum(graph.info[v].nbytes for v in persistent if v in graph.info)
        p = _Probe(b, graph, costs, st, base, int(floor), lr)
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
            return p.smallest <= self.budget, "min-search"
        if self.sqrtn_peak(b) <= self.budget:
            return True, "sqrtn"
        if self.opts.strategy == "sqrtn":  # its smallest peak is exactly that
            p.smallest = p.sqrtn_peak
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
        out = choose_plan(p.graph, p.costs, PlanRequest(
            Budget.MIN, self.opts.strategy, self.opts.time_limit,
            DecisionKinds(offload=self.opts.provider == "cuda"), self.opts.provider),
            structure=p.structure, baseline=p.baseline)
        self.stats["min_searches"] += 1
        p.smallest = out.best.peak_bytes
        return p.smallest <= self.budget, "min-search"

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
            p.outcome = choose_plan(p.graph, p.costs, PlanRequest(
                Budget.of(self.budget), strategy, self.opts.time_limit,
                DecisionKinds(offload=self.opts.provider == "cuda"), self.opts.provider,
                heap_room=self.compile.heap_room), structure=p.structure, baseline=p.baseline)
        except BudgetError as exc:
            p.smallest = exc.smallest
            return None
        return p.outcome

    def sqrtn_peak(self, b: int) -> int:
        """The smallest peak of the sqrt(n) segmentations (about a second to find)."""
        p = self.probe(b)
        if p.sqrtn_peak is None:
            self.say(f"{self.rng.dim}={b}: sqrt(n) segmentations")
            out = choose_plan(p.graph, p.costs, PlanRequest(
                Budget.MIN, "sqrtn", self.opts.time_limit,
                DecisionKinds(offload=self.opts.provider == "cuda"), self.opts.provider),
                structure=p.structure, baseline=p.baseline)
            p.sqrtn_peak = out.best.peak_bytes
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


# ---------------------------------------------------------------------------- the search
def tune(model: str | os.PathLike | onnx.ModelProto, budget: str | int, dim: str | SearchRange,
         options: TuneOptions | None = None, *, progress: Say | None = None) -> TuneResult:
    """Find the largest size of ``dim`` (``"batch=1..512"``) whose step fits ``budget``,
    the fastest one by predicted samples per second, and compile the one ``options.pick``
    names. Raises ``InputError`` for a model or range that cannot be searched, and when not
    even the smallest size fits (saying what fills the budget)."""
    opts = options or TuneOptions()
    say = progress or (lambda _m: None)
    t0 = time.perf_counter()
    rng = dim if isinstance(dim, SearchRange) else parse_range(dim)
    budget_bytes = _budget(budget)
    if isinstance(model, onnx.ModelProto):
        proto, label = model, "<model>"
    else:
        proto, label = read_model(model), str(model)
    _check_searchable(proto, label, rng, opts)
    search = _Search(proto, label, rng, opts, 0, say)
    first = rng.low
    search.slack = search.compile.slack_for(search.probe(first).graph)
    plan_budget = plan_budget_under(budget_bytes, search.compile, search.slack)
    search.budget = plan_budget
    if not search.fits(first, expect=True)[0]:
        raise _nothing_fits(search, first, budget_bytes)
    # The largest size without a rewrite: liveness of the built step only.
    base_edge = _largest_as_built(search, rng)
    # Cheap tiers first: the largest size the baseline or a sqrt(n) plan proves to fit.
    start = base_edge if base_edge is not None else first
    if start == rng.high or search.cheap_fits(rng.high)[0] is True:
        cheap_edge = rng.high
    else:
        cheap_edge = search.edge(start, rng.high, lambda b: search.cheap_fits(b)[0] is True,
                                 search.estimate)
    # Then the planner, for sizes the cheap tiers leave open.
    largest = cheap_edge
    if cheap_edge < rng.high and search.cheap_fits(cheap_edge + 1)[0] is None:
        largest = _planner_edge(search, cheap_edge, rng.high)
    # The table: the edges, sizes up to the baseline edge (free), a few planned between.
    for b in _table_sizes(rng.low, base_edge, largest, opts.points):
        if search.plan(b) is None and b == largest:  # pragma: no cover - fits was certain
            raise MemccError(f"{label}: {rng.dim}={b} fitted but the plan at the budget was "
                             "refused; please report this with the command")
    cands = tuple(_candidate(search, p, largest) for _, p in sorted(search.probes.items()))
    timed = [c for c in cands if c.fits and c.samples_per_s is not None]
    fastest = max(timed, key=lambda c: (c.samples_per_s, -c.batch)).batch
    picked = largest if opts.pick == "largest" else fastest
    chosen = search.plan(picked)
    assert chosen is not None
    step = _compiled(chosen)
    lr = opts.lr_for(picked)
    return TuneResult(
        model=label, range=rng, budget_bytes=budget_bytes, planning_budget_bytes=plan_budget,
        candidates=cands, largest_batch=largest, largest_batch_without_rewrite=base_edge,
        fastest_batch=fastest, picked_batch=picked, pick=opts.pick, step=step,
        cost_source=search.probes[picked].costs.source, strategy=opts.strategy,
        lr_rule=opts.lr_rule if lr is not None else None, lr=lr,
        lr_applied=lr is not None and opts.build.optimizer != "none",
        stats=dict(search.stats), time_s=time.perf_counter() - t0,
        steps={b: _compiled(p.outcome) for b, p in search.probes.items()
               if p.outcome is not None},
    )


def _compiled(outcome: PlanOutcome) -> Graph:
    """The rewritten step of a plan, with the plan recorded as ``memcc compile`` does."""
    from memcc.step import PLAN_KEY

    step = outcome.best.graph
    step.metadata[PLAN_KEY] = json.dumps(outcome.best.plan.to_json(), sort_keys=True)
    return step


def _budget(budget: str | int) -> int:
    if isinstance(budget, str) and budget.strip().lower() == "min":
        raise InputError("--budget min: tune searches for what fits a given budget; give a "
                         "size, e.g. --budget 1GB (compile --budget min gives the smallest "
                         "peak of one step)")
    n = parse_size(budget)
    if n <= 0:
        raise InputError(f"--budget {budget}: give a positive size, e.g. --budget 1GB")
    return n


def _check_searchable(model: onnx.ModelProto, label: str, rng: SearchRange,
                      opts: TuneOptions) -> None:
    """A forward model with ``rng.dim`` among its symbolic input dimensions."""
    meta = {p.key: p.value for p in model.metadata_props}
    if meta.get(KIND_KEY) == "training_step":
        raise InputError(f"{label}: already a training step, whose sizes are fixed. tune "
                         "builds the step at each size: pass the forward model it was built "
                         "from (with a symbolic batch dimension)")
    if rng.dim in opts.dims:
        raise InputError(f"--dim {rng.dim} is both searched ({rng.dim}={rng.low}..{rng.high}) "
                         f"and bound ({rng.dim}={opts.dims[rng.dim]}): drop the binding")
    inits = {t.name for t in model.graph.initializer}
    symbolic: dict[str, list[str]] = {}
    shapes = []
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = vi.type.tensor_type.shape.dim
        shapes.append(f"{vi.name} [{', '.join(d.dim_param or str(d.dim_value) for d in dims)}]")
        for d in dims:
            if d.dim_param:
                symbolic.setdefault(d.dim_param, []).append(vi.name)
    if rng.dim in symbolic:
        return
    have = (f"its symbolic dimensions are {', '.join(sorted(symbolic))} (search one of "
            "them)" if symbolic else "it has no symbolic dimension")
    raise InputError(
        f"{label}: no input has a symbolic dimension named '{rng.dim}'; {have}. Inputs: "
        f"{'; '.join(shapes) or 'none'}. Export the model with a dynamic batch axis: "
        "torch.onnx.export(model, args, f, input_names=['input'], "
        f"dynamic_axes={{'input': {{0: '{rng.dim}'}}}}), or with dynamo=True, "
        f"dynamic_shapes={{'input': {{0: torch.export.Dim('{rng.dim}')}}}}; the zoo's "
        "builders take -O dynamic_batch=true")


def _nothing_fits(search: _Search, b: int, budget: int) -> MemccError:
    p = search.probes[b]
    label, dim = search.label, search.rng.dim
    if p.floor_bytes > search.budget:
        return InputError(
            f"{label}: nothing fits {format_size(budget)}: at {dim}={b} the inputs, "
            f"parameters and optimizer state alone take {format_size(p.floor_bytes)} "
            f"(planning budget {format_size(search.budget)} after the "
            f"{search.opts.margin:.0%} + {search.slack:,} bytes margin), and "
            "recomputation cannot shrink them (nor the updated copies the step outputs). Give "
            "a larger --budget, or train fewer parameters (--freeze PATTERN keeps them fixed, "
            "without gradients or state); adamw keeps two state tensors per parameter, sgd one")
    # The smallest peak found; with --strategy none, the step as built.
    smallest = next(v for v in (p.smallest, p.sqrtn_peak, p.baseline.peak_bytes)
                    if v is not None)
    need = user_budget(smallest, search.compile, search.slack)
    return InputError(
        f"{label}: nothing fits {format_size(budget)}: even {dim}={b} needs a peak of "
        f"{format_size(smallest)} at the least (strategy {search.opts.strategy}; its step "
        f"as built peaks at {format_size(p.baseline.peak_bytes)}), and plans aim at "
        f"{format_size(search.budget)} (the budget less the {search.opts.margin:.0%} + "
        f"{search.slack:,} bytes margin). Give --budget {need} or more, or "
        "smaller sizes of the other dimensions (--dim NAME=INT)")


def _largest_as_built(search: _Search, rng: SearchRange) -> int | None:
    """The largest size whose step as built fits (liveness only, no planning)."""
    def base_fits(b: int) -> bool:
        return search.probe(b).baseline.peak_bytes <= search.budget

    if not base_fits(rng.low):
        return None
    if base_fits(rng.high):
        return rng.high
    return search.edge(rng.low, rng.high, base_fits,
                       lambda b: float(search.probes[b].baseline.peak_bytes))


def _planner_edge(search: _Search, low: int, top: int) -> int:
    """The edge above ``low`` (which fits) where the cheap tiers cannot tell: step up to
    where the sqrt(n) peaks, scaled by how far below them the planner reached, predict the
    edge, until a size does not fit; then close in. Typically three planner calls: a min
    search just above ``low`` (how much better than sqrt(n) the planner does), one just
    past the predicted edge, and the plan at the edge."""
    probe = low + 1
    while True:
        if not search.fits(probe)[0]:
            break
        low = probe
        if low == top:
            return top
        probe = min(max(_predicted_edge(search, low - 1, low) + 1, low + 1), top)
    return search.edge(low, probe, lambda b: search.fits(b)[0], search.estimate)


def _predicted_edge(search: _Search, a: int, b: int) -> int:
    """The largest size whose scaled sqrt(n) peak, on the line through sizes ``a`` < ``b``,
    is within the budget (at least ``b``)."""
    s_a, s_b = search.sqrtn_peak(a), search.sqrtn_peak(b)
    ratios = [q.smallest / q.sqrtn_peak for q in search.probes.values()
              if q.smallest is not None and q.sqrtn_peak]
    ratio = min(ratios, default=1.0)
    slope = (s_b - s_a) / (b - a)
    if slope <= 0:
        return b
    return b + max(int((search.budget / ratio - s_b) / slope), 0)


def _table_sizes(low: int, base_edge: int | None, largest: int, points: int) -> list[int]:
    """Sizes the table shows with a predicted time: powers of two up to the baseline edge
    (no planning needed there), both edges, and ``points`` sizes spaced geometrically
    between them (each a plan)."""
    sizes = {largest}
    if base_edge is not None:
        sizes.add(base_edge)
        sizes.add(low)
        b = 1
        while b <= base_edge:
            if b >= low:
                sizes.add(b)
            b *= 2
    start = base_edge if base_edge is not None else low
    if largest > start and points > 0:
        for i in range(1, points + 1):
            sizes.add(int(round(start * (largest / start) ** (i / (points + 1)))))
    return sorted(s for s in sizes if low <= s <= largest)


def _candidate(search: _Search, p: _Probe, largest: int) -> Candidate:
    """The table row of a size, from what the search learnt (it computes nothing new)."""
    base_s = p.baseline.compute_cost_s
    budget = search.budget
    row = dict(batch=p.batch, baseline_peak_bytes=p.baseline.peak_bytes,
               baseline_step_s=base_s, lr=p.lr)
    if p.baseline.peak_bytes <= budget:
        return Candidate(fits=True, decided_by="baseline", peak_bytes=p.baseline.peak_bytes,
                         peak_kind="as built", step_s=base_s, strategy="none (fits as built)",
                         **row)
    if p.outcome is not None:
        best = p.outcome.best
        return Candidate(fits=True, decided_by="plan", peak_bytes=best.peak_bytes,
                         peak_kind="plan", step_s=best.compute_cost_s,
                         strategy=p.outcome.label, **row)
    if search.opts.strategy == "none":
        return Candidate(fits=False, decided_by="baseline", peak_bytes=p.baseline.peak_bytes,
                         peak_kind="as built", **row)
    if p.smallest is not None:
        return Candidate(fits=p.smallest <= budget, decided_by="min-search",
                         peak_bytes=p.smallest, peak_kind="smallest", **row)
    if p.floor_bytes > budget:
        return Candidate(fits=False, decided_by="floor", peak_bytes=p.floor_bytes,
                         peak_kind="floor", **row)
    if p.sqrtn_peak is not None and p.sqrtn_peak <= budget:
        return Candidate(fits=True, decided_by="sqrtn", peak_bytes=p.sqrtn_peak,
                         peak_kind="sqrt(n)", **row)
    # Only its baseline was needed: it lies below the largest size (and fits, as the
    # peaks grow with the size) or above the size shown not to fit.
    below = p.batch < largest
    return Candidate(fits=below, decided_by="below-edge" if below else "above-edge",
                     peak_bytes=p.sqrtn_peak,
                     peak_kind=None if p.sqrtn_peak is None else "sqrt(n)", **row)


# ---------------------------------------------------------------------------- measuring
def measure(result: TuneResult, *, top: int = 3, steps: int = 3, provider: str = "cpu",
            progress: Say | None = None) -> TuneResult:
    """Run the ``top`` sizes by predicted throughput in ONNX Runtime (``memcc run``'s
    runner: peak in a fresh process, times in another) and return the result with their
    measured step time and peak. The prediction ranks sizes; this says whether the ranking
    holds on this machine. Each step is written to a temporary directory, then removed."""
    import tempfile

    from memcc.backend.runner import run_steps

    say = progress or (lambda _m: None)
    timed = sorted((c for c in result.candidates if c.samples_per_s is not None
                    and c.batch in result.steps), key=lambda c: -(c.samples_per_s or 0))
    measured: dict[int, tuple[float, int | None]] = {}
    with tempfile.TemporaryDirectory(prefix="memcc-tune-") as tmp:
        for c in timed[:top]:
            say(f"{result.range.dim}={c.batch}: measuring {steps} steps in ONNX Runtime")
            path = Path(tmp) / f"{result.range.dim}{c.batch}.onnx"
            from memcc.backend.onnx_file import save_graph

            save_graph(result.steps[c.batch], path)
            run = run_steps(path, steps=steps, provider=provider)
            measured[c.batch] = (run.step_time_s, run.measured_peak_bytes)
            path.unlink()
    cands = tuple(replace(c, measured_step_s=measured[c.batch][0],
                          measured_peak_bytes=measured[c.batch][1])
                  if c.batch in measured else c for c in result.candidates)
    return replace(result, candidates=cands)


# ---------------------------------------------------------------------------- outputs
def write_step(result: TuneResult, path: str | os.PathLike) -> Path:
    """Write the chosen compiled step atomically (a temporary file, then a rename)."""
    from memcc.backend.onnx_file import save_graph

    out = Path(path)
    try:
        return save_graph(result.step, out)
    except OSError as exc:
        raise InputError(f"cannot write {exc.filename or out}: {exc.strerror or exc}. "
                         "Nothing was written.") from None


def plot_tune(result: TuneResult, path: str | os.PathLike) -> Path:
    """Draw ``tune_figure(result)`` at ``path`` (atomically, in the format its suffix names)."""
    import matplotlib.pyplot as plt

    from memcc.report import save_figure

    fig = tune_figure(result)
    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


# How ``tune_figure`` draws a row's ``peak_bytes`` by what it is (``Candidate.peak_kind``):
# marker, colour, legend label. Plans and steps as built are joined by a line; bounds and
# searches are points apart, so no line suggests a plan that was never made.
_PEAK_STYLE = {
    "smallest": ("D", "#7b3fa0", "smallest reachable peak (--budget min search)"),
    "sqrt(n)": ("^", "#d08a1e", "peak of the smallest sqrt(n) plan (an upper bound)"),
    "floor": ("v", "#6b4f2a", "inputs, parameters and state alone (a lower bound)"),
}


def tune_figure(result: TuneResult):
    """Peak and predicted throughput against the size, with the budget and the planning
    target: the matplotlib Figure (the caller saves and closes it).

    Every size the search looked at is drawn, so the x axis spans the search (on a log
    scale when it covers 16x or more). The peak as built is drawn for every row; the
    plan's peak (or the step's own, where it fits as built) only where a plan or the step
    was taken at that size; smallest-peak searches, sqrt(n) bounds and floors with markers
    of their own. Sizes that do not fit are crossed; "fits" is judged against the planning
    target (``budget * (1 - margin) - slack``), so a cross can sit between target and budget.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and none may exist
    import matplotlib.pyplot as plt

    cands = sorted(result.candidates, key=lambda c: c.batch)
    mb = 1e6
    fig, ax = plt.subplots(figsize=(8, 5.6))
    xs = [c.batch for c in cands]
    ax.plot(xs, [c.baseline_peak_bytes / mb for c in cands], "o--", color="#999999",
            label="peak as built (no rewrite)")
    planned = [c for c in cands if c.peak_bytes is not None
               and c.peak_kind in ("plan", "as built")]
    ax.plot([c.batch for c in planned], [c.peak_bytes / mb for c in planned], "o-",
            color="#1f5fa8", label="peak of the plan (or as built, where that fits)")
    for kind, (marker, colour, label) in _PEAK_STYLE.items():
        rows = [c for c in cands if c.peak_bytes is not None and c.peak_kind == kind]
        if rows:
            ax.plot([c.batch for c in rows], [c.peak_bytes / mb for c in rows], marker,
                    ls="none", color=colour, label=label)
    misses = [c for c in cands if not c.fits]
    if misses:  # at the peak that decided it, else (only the step as built seen) there
        ax.plot([c.batch for c in misses],
                [(c.peak_bytes if c.peak_bytes is not None else c.baseline_peak_bytes) / mb
                 for c in misses], "x", ls="none", color="#c0392b", markersize=9,
                label="does not fit")
    ax.axhline(result.budget_bytes / mb, color="#c0392b", lw=1.2,
               label=f"budget {format_size(result.budget_bytes)}")
    ax.axhline(result.planning_budget_bytes / mb, color="#c0392b", lw=1.2, ls=":",
               label=f"planning target {format_size(result.planning_budget_bytes)} "
                     "(what fits means)")
    ax.axvline(result.largest_batch, color="#1f5fa8", lw=0.8, ls=":")
    if result.largest_batch_without_rewrite:
        ax.axvline(result.largest_batch_without_rewrite, color="#999999", lw=0.8, ls=":")
    low, high = min(xs), max(xs)
    if high >= 16 * low:
        ax.set_xscale("log", base=2)
        ax.set_xlim(low / 1.25, high * 1.25)
    else:
        pad = max(1.0, 0.04 * (high - low))
        ax.set_xlim(low - pad, high + pad)
    shown = [c.peak_bytes for c in cands if c.peak_bytes is not None]
    top = max([result.budget_bytes * 1.6, *(b * 1.05 for b in shown)])
    ax.set_ylim(0, min(top, result.budget_bytes * 4) / mb)
    ax.set_xlabel(f"{result.range.dim}")
    ax.set_ylabel("peak (MB, 10^6 bytes)")
    ax2 = ax.twinx()
    timed = [c for c in cands if c.samples_per_s is not None]
    ax2.plot([c.batch for c in timed], [c.samples_per_s for c in timed], "s-",
             color="#2e8b57", label="predicted samples/s")
    ax2.set_ylabel(f"predicted samples/s ({result.cost_source} cost model)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    ax.set_title(f"{Path(result.model).name}: largest {result.largest_batch}, fastest "
                 f"{result.fastest_batch}, budget {format_size(result.budget_bytes)}",
                 fontsize=10)
    fig.tight_layout()
    return fig
