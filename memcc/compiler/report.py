"""The compile report: the JSON every ``memcc compile`` writes (README, "Report fields").

In: ``ReportInputs``, what one compile decided (budget, the plan outcome, costs, the
passes' reports, verification, row chunks, offloaded state, warnings). Out: the report
dict, keys in the order the file shows them. The words printed from a report live in
``memcc/report_text.py``: a report read back needs them without the compiler.
"""

from __future__ import annotations

from dataclasses import dataclass

from memcc.compiler.options import BASE_SLACK_BYTES, CompileOptions, user_budget
from memcc.pass_contract import PassReport
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.host_state import host_resident
from memcc.passes.analysis.liveness import allocation_bytes
from memcc.passes.analysis.phases import plan_origin, step_phases
from memcc.passes.analysis.step_traffic import step_traffic
from memcc.passes.planning.planner import PlanOutcome
from memcc.passes.planning.simulate import Simulation


@dataclass(frozen=True)
class ReportInputs:
    """What the report is made of, as the pipeline's last stages hold it."""

    options: CompileOptions
    budget: int                   # the user's, or the one --budget min reached
    plan_budget: int | None       # what the planner planned for (None: --budget min)
    slack: int                    # bytes kept free besides the margin
    was_min: bool                 # --budget min
    outcome: PlanOutcome          # its ``best`` is the plan written, ``baseline`` the step
    costs: CostModel
    passes: list[PassReport]
    compile_time_s: float
    verification: dict | None
    row_chunks: dict              # compiler/chunk_choice.py's section
    offloaded_state: dict | None  # compiler/planning.py's section (None: not tried)
    warnings: list[str]
    data_parallel: dict | None = None   # compiler/ranks.py's section (None: no --nproc)


def build_report(r: ReportInputs) -> dict:
    """The report dict for ``r``; its ``verification`` is ``r.verification`` itself (a
    failed verification adds what to try next to it afterwards)."""
    base, plan = r.outcome.baseline, r.outcome.best
    report = {
        "budget_bytes": int(r.budget),
        "budget_was_min": r.was_min,
        "margin": r.options.margin,
        "slack_bytes": int(r.slack),
        "heap_allowance_bytes": int(max(r.slack - BASE_SLACK_BYTES, 0)
                                    if r.options.slack_bytes is None else 0),
        "planning_budget_bytes": int(r.plan_budget if r.plan_budget is not None
                                     else plan.peak_bytes),
        "baseline": _baseline(base) | {
            # what --budget must be for the step as built, margin and heap room included
            "needs_budget_bytes": user_budget(base.peak_bytes, r.options,
                                              r.options.slack_for(base.graph))},
        "plan": _plan(r, base, plan),
        "passes": [p.to_json() for p in r.passes],
        "compile_time_s": r.compile_time_s,
        "solver": {k: r.outcome.solver.get(k) for k in ("name", "status", "gap")}
        | {k: v for k, v in r.outcome.solver.items() if k not in ("name", "status", "gap")},
        # Every strategy that ran and what it returned; ``solver`` is the last ILP solve
        # only, which need not be where the plan came from.
        "strategies": r.outcome.runs,
        "cost_model": {"source": r.costs.source, "provider": r.options.provider}
        | ({"host_link": r.costs.link.to_json()} if r.costs.link is not None else {})
        | _calibration_of(r.passes),
        "timeline": {
            "baseline": list(base.liveness.live_during),
            "plan": list(plan.liveness.live_during),
            "phases": step_phases(base.graph),
            "plan_origin": plan_origin(base.graph, plan.graph),
        },
        "verification": r.verification,
        "options": {"strategy": r.options.strategy, "provider": r.options.provider,
                    "arena": r.options.arena, "time_limit": r.options.time_limit,
                    "cost": r.options.cost},
        "row_chunks": r.row_chunks,
        "offloaded_state": r.offloaded_state,
        # --nproc N: the budget and the plan's peaks are per rank (compiler/ranks.py)
        "data_parallel": r.data_parallel,
    }
    offloaded = r.offloaded_state
    if offloaded is not None and offloaded["used"]:
        # the copies are in no node's measured time: add them to the plan's (predicted)
        planned = report["plan"]
        planned["compute_cost_s"] += offloaded["added_time_s"]
        base_cost = report["baseline"]["compute_cost_s"]
        planned["overhead"] = (planned["compute_cost_s"] / base_cost - 1.0 if base_cost > 0
                               else 0.0)
    report["warnings"] = r.warnings
    return report


def _baseline(base: Simulation) -> dict:
    """The step as built: its peak, time, what is live at the peak, kernels and bytes moved
    per step (``passes/analysis/step_traffic.py``)."""
    traffic = step_traffic(base.graph)
    return {
        "peak_bytes": base.peak_bytes,
        "compute_cost_s": base.compute_cost_s,
        "breakdown_at_peak": dict(base.liveness.breakdown),
        "peak_node": base.liveness.peak_node,
        "kernels": traffic.kernels,
        "bytes_moved": traffic.bytes_moved,
    }


def _plan(r: ReportInputs, base: Simulation, plan: Simulation) -> dict:
    """The plan written: as ``_baseline``, counting its recompute clones and swap copies,
    with the strategy that chose it and what it recomputes, offloads and substitutes."""
    base_cost, plan_cost = base.compute_cost_s, plan.compute_cost_s
    live = plan.liveness
    traffic = step_traffic(plan.graph)
    outcome = r.outcome
    return {
        "peak_bytes": plan.peak_bytes,
        "compute_cost_s": plan_cost,
        "kernels": traffic.kernels,
        "bytes_moved": traffic.bytes_moved,
        "overhead": (plan_cost / base_cost - 1.0) if base_cost > 0 else 0.0,
        "fits": plan.peak_bytes <= r.budget,
        "strategy": outcome.strategy,
        "requested_strategy": outcome.requested,
        "picked_strategy": outcome.picked,
        "strategy_label": outcome.label,
        "breakdown_at_peak": _on_the_device(plan),
        "peak_node": live.peak_node,
        "recomputed_values": list(plan.recomputed_values),
        "recomputed_nodes": sorted(plan.plan.recompute),
        "recompute_again_nodes": sorted(plan.plan.recompute_again),
        "offloaded_values": sorted(plan.plan.offload),
        "variants": next((p.summary["variants"] for p in r.passes if p.name == "plan"
                          and "variants" in p.summary), None),
        "host_peak_bytes": live.host_peak_bytes,
        "device_arena": plan.arena.to_json() if plan.arena is not None else None,
        "device": ({k: v for k, v in plan.device.to_json().items() if k != "arena"}
                   if plan.device is not None else None),
        "live_peak_bytes": live.peak_bytes,
    }


def _on_the_device(plan: Simulation) -> dict[str, int]:
    """What is live at the liveness peak, by category, less the optimizer state that lives
    in host memory there (``passes/lowering/offload_state.py``): a walk-through read "at
    peak: optimizer_state 6.25 MB", the baseline's, on a plan that had moved 5.07 MB of it
    to host memory."""
    live = plan.liveness
    out = dict(live.breakdown)
    if plan.device is None or "optimizer_state" not in out:
        return out
    host = host_resident(plan.graph) & set(live.live_at_peak)
    held = sum(allocation_bytes(plan.graph.info[v].nbytes) for v in host
               if v in plan.graph.info)
    out["optimizer_state"] = max(out["optimizer_state"] - held, 0)
    return out


def _calibration_of(passes: list[PassReport]) -> dict:
    """The CUDA calibration the node times were estimated from, as the cost pass said."""
    for p in passes:
        if p.name == "cost_model" and p.summary.get("calibration"):
            return {"calibration": p.summary["calibration"]}
    return {}
