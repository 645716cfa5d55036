"""The compile report: the JSON every ``memcc compile`` writes (README, "Report fields") and the
few lines the CLI prints from it."""

from __future__ import annotations

from memcc.compiler.chunk_choice import summary_line
from memcc.compiler.options import BASE_SLACK_BYTES
from memcc.passes.analysis.cost_model import CostModel
from memcc.passes.analysis.liveness import HEAP_BYTES_PER_SMALL_BUFFER
from memcc.passes.analysis.phases import plan_origin, step_phases
from memcc.passes.analysis.step_traffic import step_traffic
from memcc.passes.planning.planner import PlanOutcome
from memcc.passes.planning.simulate import Simulation
from memcc.sizes import format_size


def _calibration_of(passes) -> dict:
    """The CUDA calibration the node times were estimated from, as the cost pass said."""
    for p in passes:
        if p.name == "cost_model" and p.summary.get("calibration"):
            return {"calibration": p.summary["calibration"]}
    return {}


def build_report(options, budget, plan_budget, slack, was_min, base: Simulation, plan: Simulation,
            outcome: PlanOutcome, costs: CostModel, passes, compile_time, verification) -> dict:
    base_cost = base.compute_cost_s
    plan_cost = plan.compute_cost_s
    live = plan.liveness
    # Kernels and bytes moved per step (passes/analysis/step_traffic.py): the plan's rewritten step
    # counts its recompute clones and swap copies.
    base_traffic, plan_traffic = step_traffic(base.graph), step_traffic(plan.graph)
    return {
        "budget_bytes": int(budget),
        "budget_was_min": was_min,
        "margin": options.margin,
        "slack_bytes": int(slack),
        "heap_allowance_bytes": int(max(slack - BASE_SLACK_BYTES, 0)
                                    if options.slack_bytes is None else 0),
        "planning_budget_bytes": int(plan_budget if plan_budget is not None else plan.peak_bytes),
        "baseline": {
            "peak_bytes": base.peak_bytes,
            "compute_cost_s": base_cost,
            "breakdown_at_peak": dict(base.liveness.breakdown),
            "peak_node": base.liveness.peak_node,
            "kernels": base_traffic.kernels,
            "bytes_moved": base_traffic.bytes_moved,
        },
        "plan": {
            "peak_bytes": plan.peak_bytes,
            "compute_cost_s": plan_cost,
            "kernels": plan_traffic.kernels,
            "bytes_moved": plan_traffic.bytes_moved,
            "overhead": (plan_cost / base_cost - 1.0) if base_cost > 0 else 0.0,
            "fits": plan.peak_bytes <= budget,
            "strategy": outcome.strategy,
            "requested_strategy": outcome.requested,
            "picked_strategy": outcome.picked,
            "strategy_label": outcome.label,
            "breakdown_at_peak": dict(live.breakdown),
            "peak_node": live.peak_node,
            "recomputed_values": list(plan.recomputed_values),
            "recomputed_nodes": sorted(plan.plan.recompute),
            "recompute_again_nodes": sorted(plan.plan.recompute_again),
            "offloaded_values": sorted(plan.plan.offload),
            "variants": next((p.summary["variants"] for p in passes if p.name == "plan"
                              and "variants" in p.summary), None),
            "host_peak_bytes": live.host_peak_bytes,
            "device_arena": plan.arena.to_json() if plan.arena is not None else None,
            "device": ({k: v for k, v in plan.device.to_json().items() if k != "arena"}
                       if plan.device is not None else None),
            "live_peak_bytes": live.peak_bytes,
        },
        "passes": [p.to_json() for p in passes],
        "compile_time_s": compile_time,
        "solver": {k: outcome.solver.get(k) for k in ("name", "status", "gap")}
        | {k: v for k, v in outcome.solver.items() if k not in ("name", "status", "gap")},
        # Every strategy that ran and what it returned; ``solver`` is the last ILP solve
        # only, which need not be where the plan came from.
        "strategies": outcome.runs,
        "cost_model": {"source": costs.source, "provider": options.provider}
        | ({"host_link": costs.link.to_json()} if costs.link is not None else {})
        | _calibration_of(passes),
        "timeline": {
            "baseline": list(base.liveness.live_during),
            "plan": list(live.live_during),
            "phases": step_phases(base.graph),
            "plan_origin": plan_origin(base.graph, plan.graph),
        },
        "verification": verification,
        "options": {"strategy": options.strategy, "provider": options.provider,
                    "arena": options.arena, "time_limit": options.time_limit,
                    "cost": options.cost},
    }


def summary_lines(report: dict) -> list[str]:
    """The few lines ``memcc compile`` prints: budget, peaks, strategy, and with --verify
    each of the three checks (a user should not need the JSON to see what was proven)."""
    b, p = report["baseline"], report["plan"]
    lines = [
        f"budget   {format_size(report['budget_bytes'])}"
        + (" (smallest reachable)" if report.get("budget_was_min") else "")
        + _margin_note(report),
        f"baseline peak {format_size(b['peak_bytes'])}  ->  plan peak "
        f"{format_size(p['peak_bytes'])}  ({'fits' if p['fits'] else 'DOES NOT FIT'})",
        f"strategy {p.get('strategy_label', p['strategy'])}: "
        f"{len(p['recomputed_values'])} values recomputed"
        + (f" ({len(p['recompute_again_nodes'])} nodes rebuilt again for later readers)"
           if p.get("recompute_again_nodes") else "")
        + f", predicted added time {p['overhead'] * 100:.1f}%",
    ]
    o = report.get("offloaded_state")
    if o and o["used"]:
        reach = (f"; smallest budget {format_size(o['smallest_budget_bytes'])} with it, "
                 if o.get("smallest_budget_bytes") else "; ")
        without = o.get("smallest_budget_without_bytes")
        lines.append(f"offload  optimizer state in host memory: {len(o['tensors'])} tensors, "
                     f"{format_size(o['bytes'])}, copies add {o['added_time_s'] * 1e3:.1f} ms"
                     + (f"{reach}{format_size(without)} without (predicted)" if without
                        else ""))
    if (chunks := summary_line(report)) is not None:
        lines.append(chunks)
    v = report.get("verification")
    if v:
        lines.append(f"verify   {'OK' if v['ok'] else 'FAILED'}: " + "; ".join(verify_checks(v)))
    return lines


def verify_checks(v: dict) -> list[str]:
    """The three verification checks in words, e.g. for ``summary_lines``."""
    n = v.get("outputs_compared")
    if v.get("outputs_match", not any("output" in p for p in v.get("problems", []))):
        outputs = f"{n} outputs {v.get('comparison')}"
    else:
        outputs = (f"{v.get('outputs_differing', '?')} of {n} outputs differ "
                   f"(expected {v.get('comparison')})")
    measured, budget = v.get("measured_peak_bytes"), v.get("budget_bytes")
    if measured is None:
        peak = f"peak not measured ({v.get('measurement_method')})"
    elif budget is None:
        peak = f"measured peak {format_size(measured)}"
    else:
        sign = "<=" if measured <= budget else ">"
        peak = f"measured peak {format_size(measured)} {sign} budget {format_size(budget)}"
    order = ("executed order = planned order" if v.get("order_matches_plan")
             else "executed order differs from the plan")
    return [outputs, peak, order]


def _margin_note(report: dict) -> str:
    """What the budget keeps free besides the plan's peak, where the heap takes a share."""
    heap = report.get("heap_allowance_bytes") or 0
    if not heap:
        return ""
    return (f"; margin {report['margin']:.0%} + {format_size(report['slack_bytes'])}, "
            f"{format_size(heap)} of it for the heap of "
            f"{heap // HEAP_BYTES_PER_SMALL_BUFFER:,} small buffers")
