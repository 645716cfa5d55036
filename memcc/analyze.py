"""``memcc analyze``: the training step as built, before any plan: its predicted peak, what
the peak is made of, and the smallest budget memcc can reach for it.

Users wanted the step's own peak without compiling for a budget nobody means (``--budget
1GB``), and the smallest budget without waiting for a full ``--budget min`` compile. Both
come from the passes compile runs, with compile's code paths, so the numbers agree:

- the peak is ``passes.planning.simulate.simulate`` of the step with no plan, judged by the device
  the step will run on (malloc on the CPU, the arena model with ``--arena`` or
  ``--provider cuda``): ``baseline.peak_bytes`` of a compile report with the same options;
- the breakdown is the liveness analysis at that peak (``passes.analysis.liveness.categorize``),
  plus the totals over the whole step (parameters, optimizer state, the values saved for
  the backward pass, gradients) that say what a plan can and cannot shrink;
- the smallest peak is the ``--budget min`` search (``passes.planning.planner.choose_plan`` at
  ``Budget.MIN``) under a short time limit, and the budget is the one ``--budget min`` reports
  (the peak with compile's margin and slack). Where no search was cut short by the clock,
  the answer is what ``memcc compile --budget min`` plans with the same options (its
  solves are bounded by work, not time); otherwise it is an upper bound, stated as such,
  next to a lower bound no plan can go under (the inputs, parameters and state with the
  step's outputs, or with the largest forward node's outputs).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from memcc.compiler.costing import node_costs
from memcc.compiler.loading import check_provider, load_step_warned
from memcc.compiler.options import DEFAULT_TIME_LIMIT as COMPILE_TIME_LIMIT
from memcc.compiler.options import CompileOptions, user_budget
from memcc.compiler.planning import as_trained
from memcc.compiler.progress import warning_sink
from memcc.compiler.training_order import in_training_order
from memcc.frontend.weights_apart import own_weights
from memcc.graph import Graph
from memcc.passes.analysis.liveness import CATEGORIES, categorize
from memcc.passes.analysis.step_traffic import StepTraffic, step_traffic
from memcc.passes.lowering.offload_state import offload_state, optimizer_state
from memcc.passes.plan import Plan, StepStructure
from memcc.passes.planning.floor import runtime_bytes
from memcc.passes.planning.planner import (
    PlanOutcome,
    choose_plan,
    segment_counts,
)
from memcc.passes.planning.request import Budget, PlanRequest, stopped_by_clock
from memcc.passes.planning.simulate import Simulation, SimulationRules, simulate
from memcc.sizes import format_size
from memcc.step import TrainingStep

# Seconds the smallest-peak search may take by default: short enough to answer at once
# (the output says when the search was cut short and its answer is an upper bound). The
# sqrt(n) segmentations run whatever the limit: a second or more on steps of thousands of
# nodes.
DEFAULT_TIME_LIMIT = 1.0


@dataclass(frozen=True)
class Smallest:
    """The ``--budget min`` answer for the step."""

    peak_bytes: int          # the smallest plan's simulated peak (compile's plan.peak_bytes)
    budget_bytes: int        # the budget --budget min reports: the peak, margin and slack
    # No solve was cut short by the clock: ``peak_bytes`` is the peak compile's --budget
    # min plans with the same options (its budget can differ by the heap room of the small
    # buffers of another plan of that peak, 1 KiB each, on the CPU with malloc).
    exact: bool
    lower_bound_bytes: int   # no plan can peak under this
    strategy_label: str
    time_s: float
    time_limit: float
    state_in_host_memory: bool = False   # CUDA: the optimizer state waits in host memory

    def to_json(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes,
                "exact": self.exact, "lower_bound_bytes": self.lower_bound_bytes,
                "strategy": self.strategy_label, "time_s": round(self.time_s, 3),
                "time_limit": self.time_limit,
                "state_in_host_memory": self.state_in_host_memory}


@dataclass(frozen=True)
class Analysis:
    model: str
    built_training_step: bool
    provider: str
    arena: bool
    nodes: int
    peak_bytes: int
    peak_node: str | None
    live_peak_bytes: int                 # the live bytes' peak (equal to peak_bytes on malloc)
    breakdown_at_peak: dict[str, int]
    totals: dict[str, int]
    counts: dict[str, int]
    compute_cost_s: float
    cost_source: str
    smallest: Smallest | None
    time_s: float
    warnings: list[str] = field(default_factory=list)
    # Kernels and bytes moved per step as built, by op type (passes/analysis/step_traffic.py).
    traffic: StepTraffic | None = None

    @property
    def allocator(self) -> str:
        """How the prediction allocates: malloc, the CPU arena, or the CUDA arena."""
        if self.provider == "cuda":
            return "cuda-arena"
        return "arena" if self.arena else "malloc"

    def to_json(self) -> dict:
        return {
            "model": self.model, "built_training_step": self.built_training_step,
            "provider": self.provider, "arena": self.arena, "allocator": self.allocator,
            "nodes": self.nodes, "peak_bytes": self.peak_bytes, "peak_node": self.peak_node,
            "live_peak_bytes": self.live_peak_bytes,
            "breakdown_at_peak": self.breakdown_at_peak, "totals": self.totals,
            "counts": self.counts, "compute_cost_s": self.compute_cost_s,
            "cost_model": self.cost_source,
            "smallest": None if self.smallest is None else self.smallest.to_json(),
            "time_s": round(self.time_s, 3), "warnings": self.warnings,
            "kernels": None if self.traffic is None else self.traffic.kernels,
            "bytes_moved": None if self.traffic is None else self.traffic.bytes_moved,
            "traffic_by_op": None if self.traffic is None else {
                op: t.to_json() for op, t in self.traffic.by_op.items()},
        }


def analyze(model: str | os.PathLike, options: CompileOptions, *, smallest: bool = True,
            progress: Callable[[str], None] | None = None,
            warn: Callable[[str], None] | None = None) -> Analysis:
    """The step of ``model`` as built (a forward model is built with ``options.build``):
    peak, breakdown, and with ``smallest`` the ``--budget min`` answer within
    ``options.time_limit`` seconds. ``options.budget`` is ignored."""
    say = progress or (lambda _m: None)
    warnings, warning = warning_sink(warn)

    t0 = time.perf_counter()
    label = str(model)
    cuda_missing = check_provider(options, warning)
    say("loading")
    # The file's large weights stay in it (mapped): nothing here reads them but measured
    # node times, which run the step (``frontend/weights_apart.py``).
    graph, load = load_step_warned(model, label, options, warning, mapped=True)
    if options.cost != "analytic":
        own_weights(graph)
    structure = StepStructure.of(graph)
    say("node times")
    costs, cost_summary = node_costs(graph, options, warning, cuda_missing)
    say("simulating the step as built")
    base = simulate(graph, Plan(), costs, structure, SimulationRules(options.device))
    # The step as memcc train runs it (updates early where that lowers the peak), as
    # compile reports it; the search below plans that order, as compile's does.
    trained = as_trained(graph, PlanOutcome(base, base, "none", {}), costs, options,
                         structure).best
    live = trained.liveness
    breakdown = {k: int(live.breakdown.get(k, 0)) for k in CATEGORIES}
    breakdown |= {k: int(v) for k, v in live.breakdown.items() if k not in breakdown}
    totals, counts = _totals(graph, structure)
    found = None
    if smallest:
        request = _min_request(options, len(graph.nodes))
        # The limit bounds the solves only: the segmentations are simulated whatever it is,
        # a minute and more on a large step on a busy machine (an EfficientNet-B0's 3,531
        # nodes: 17 segment counts, 38-68 s on two loaded cores), so the line says so.
        say(f"smallest reachable peak (solves up to {options.time_limit:g} s, and "
            f"{request.segment_counts} sqrt(n) segmentations of {len(graph.nodes):,} nodes "
            "simulated as compile does; --no-smallest skips this)")
        planned, _ = in_training_order(graph, options)
        found = _smallest(planned, costs, options, request, structure, base if planned is graph
                          else simulate(planned, Plan(), costs, structure,
                                        SimulationRules(options.device)))
        found = _with_state_in_host_memory(planned, found, costs, options, request)
    return Analysis(
        model=label, built_training_step=bool(load["built_training_step"]),
        provider=options.provider, arena=options.arena, nodes=len(graph.nodes),
        peak_bytes=int(trained.peak_bytes), peak_node=live.peak_node,
        live_peak_bytes=int(live.peak_bytes), breakdown_at_peak=breakdown, totals=totals,
        counts=counts, compute_cost_s=float(base.compute_cost_s),
        cost_source=str(cost_summary["source"]), smallest=found,
        time_s=time.perf_counter() - t0, warnings=warnings, traffic=step_traffic(base.graph))


def _totals(graph: Graph, st: StepStructure) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes over the whole step: what the plan cannot touch (parameters, optimizer state,
    data), what it decides over (values saved for the backward pass) and the gradients."""
    step = TrainingStep.of(graph)
    info = graph.info

    def nbytes(names) -> int:
        return int(sum(info[n].nbytes for n in names if n in info))

    params = list(step.parameters)
    # The liveness categories (BatchNorm running statistics are not optimizer state).
    category = categorize(graph)
    optimizer = [v for v in dict.fromkeys(step.state.values())
                 if v in info and category.get(v) == "optimizer_state"]
    gradients = list(step.gradients().values())
    totals = {
        "parameters": nbytes(params),
        "optimizer_state": nbytes(optimizer),
        "data": nbytes(step.data_inputs),
        "saved_for_backward": nbytes(st.saved),
        "gradients": nbytes(gradients),
    }
    counts = {"parameters": len(params), "parameter_values": int(sum(
        info[p].numel for p in params if p in info)), "saved_for_backward": len(st.saved)}
    return totals, counts


def _min_request(options: CompileOptions, nodes: int) -> PlanRequest:
    """``--budget min``'s request as compile makes it, with the sqrt(n) segmentations
    compile simulates at its default limit, whatever this search's own (1 s by default):
    the smallest peak is compile's."""
    request = options.plan_request(Budget.MIN)
    return replace(request, segment_counts=segment_counts(
        replace(request, time_limit=COMPILE_TIME_LIMIT), nodes))


def _smallest(graph: Graph, costs, options: CompileOptions, request: PlanRequest,
              st: StepStructure,
              base: Simulation) -> Smallest:
    """``--budget min`` as compile runs it (``request``: the same ``PlanRequest``), within
    ``options.time_limit``; the budget it reports with compile's margin and slack."""
    t0 = time.perf_counter()
    outcome = choose_plan(graph, costs, request, structure=st, baseline=base)
    outcome = as_trained(graph, outcome, costs, options, st, smallest=True)
    spent = time.perf_counter() - t0
    best = outcome.best
    slack = max(options.slack_for(graph), options.slack_for(best.graph))
    # Solves stopped by the clock say so (``limit_hit``), solves skipped for want of time
    # in their status. The polish is cut silently, but it only sheds recompute at the same
    # peak: it changes the plan's time and heap room, never the smallest peak.
    cut = any(stopped_by_clock(r, polish=False) for r in outcome.runs)
    return Smallest(peak_bytes=int(best.peak_bytes),
                    budget_bytes=user_budget(best.peak_bytes, options, slack),
                    exact=not cut, lower_bound_bytes=min(
                        lower_bound(graph, base, st) + runtime_bytes(options.provider),
                        int(best.peak_bytes)),
                    strategy_label=outcome.label, time_s=spent,
                    time_limit=options.time_limit)


def _with_state_in_host_memory(graph: Graph, found: Smallest, costs, options: CompileOptions,
                               request: PlanRequest) -> Smallest:
    """On CUDA with offload on, ``--budget min`` also plans with the optimizer state in host
    memory and keeps the smaller budget (``compiler.planning.plan_offloading_state``):
    without it, analyze answered 347.74 MB for a ResNet-18 step whose ``--budget min``
    compiles at 300.66 MB. The answer says which (``state_in_host_memory``)."""
    state = optimizer_state(graph) if options.provider == "cuda" and options.swaps else []
    if not state:
        return found
    moved = offload_state(graph, [n for n, _ in state]).graph
    st = StepStructure.of(moved)
    off = _smallest(moved, costs, options, request, st,
                    simulate(moved, Plan(), costs, st, SimulationRules(options.device)))
    if off.budget_bytes >= found.budget_bytes:
        return found
    return replace(off, lower_bound_bytes=min(off.lower_bound_bytes, found.lower_bound_bytes),
                   time_s=found.time_s + off.time_s, state_in_host_memory=True)


def lower_bound(graph: Graph, base: Simulation, st: StepStructure) -> int:
    """Live bytes no plan can peak under: what is live after the step's last node (inputs,
    parameters, state and every output: no plan changes them), or what is live from the
    start with the outputs of the largest forward node (every plan runs it, or a clone).
    On CUDA the caller adds what the session holds for itself (``runtime_bytes``), which
    every device peak counts: without it ``--provider cuda`` said "no plan goes under
    90.92 MB" of a ResNet-18 step that compile refuses under 254.66 MB."""
    live = base.liveness
    start = int(live.start_bytes)
    persistent = set(graph.inputs) | set(graph.initializers)
    largest = 0
    for n in graph.nodes:
        if n.name in st.forward:
            largest = max(largest, sum(graph.info[o].nbytes for o in n.output
                                       if o and o in graph.info and o not in persistent))
    end = int(live.live_after[-1]) if live.live_after else start
    return max(end, start + int(largest))


def describe(a: Analysis) -> list[str]:
    """The lines ``memcc analyze`` prints."""
    where = {"malloc": "CPU, malloc", "arena": "CPU, ORT's arena (--arena)",
             "cuda-arena": "CUDA, ORT's device arena"}[a.allocator]
    built = "forward model, built here" if a.built_training_step else "training step"
    lines = [f"{a.model}: {built}; {a.nodes} nodes; predicted for {where}"]
    peak = f"peak as built     {format_size(a.peak_bytes)} ({a.peak_bytes:,} bytes)"
    peak += f" at node {a.peak_node}" if a.peak_node else ""
    if a.live_peak_bytes != a.peak_bytes:
        peak += f"; live bytes {format_size(a.live_peak_bytes)}"
    lines.append(peak)
    parts = [f"{k.replace('_', ' ')} {format_size(v)}" for k, v in a.breakdown_at_peak.items()
             if v or k in CATEGORIES[:4]]
    lines.append("  at the peak:    " + ", ".join(parts))
    t = a.totals
    lines.append(
        f"  in the step:    parameters {format_size(t['parameters'])} "
        f"({a.counts['parameter_values']:,} values in {a.counts['parameters']} tensors), "
        f"optimizer state {format_size(t['optimizer_state'])}, data "
        f"{format_size(t['data'])}, saved for backward {format_size(t['saved_for_backward'])}"
        f" ({a.counts['saved_for_backward']} values), gradients {format_size(t['gradients'])}")
    lines.append(f"  compute cost:   {a.compute_cost_s * 1000:,.2f} ms per step "
                 f"({a.cost_source} node times)")
    if a.traffic is not None:
        top = ", ".join(f"{op} {t.kernels:,} ({format_size(t.bytes_moved)})"
                        for op, t in list(a.traffic.by_op.items())[:3])
        lines.append(f"  per step:       {a.traffic.kernels:,} kernels, "
                     f"{format_size(a.traffic.bytes_moved)} read and written; most bytes: "
                     f"{top}")
    s = a.smallest
    if s is None:
        lines.append("smallest          not searched (--no-smallest)")
    else:
        how = ("exact: the peak memcc compile --budget min plans with these options"
               if s.exact
               else f"an estimate: the search stopped at --time-limit {s.time_limit:g} s, so "
                    "this is an upper bound on the smallest peak (a longer search may reach "
                    "less, and memcc compile --budget min, a search of its own, can settle "
                    f"above or below it; no plan goes under {format_size(s.lower_bound_bytes)})")
        lines.append(f"smallest peak     {format_size(s.peak_bytes)} "
                     f"({s.peak_bytes / a.peak_bytes:.0%} of as built; strategy "
                     f"{s.strategy_label}; {how})")
        lines.append(f"smallest budget   {format_size(s.budget_bytes)} ({s.budget_bytes:,} "
                     "bytes: the peak with compile's margin and slack"
                     + ("; with the optimizer state in host memory" if s.state_in_host_memory
                        else "") + f"; --budget {s.budget_bytes} fits this plan"
                     + ("" if s.exact else ", which compile's own search may not find: where "
                        "it refuses, it names the budget it found") + ")")
    lines.append(f"analyzed in {a.time_s:.1f} s")
    return lines
