"""A compile report in words: the lines ``memcc compile`` prints and the phrases ``memcc
report`` reuses.

In: a report dict as ``memcc compile`` writes it (``compiler/report.py`` builds it;
README, "Report fields"). Out: strings. Nothing here runs a compile or reads a file, so the
compiler (its summary) and the report reader (``report_view.py``) both use it without
either depending on the other.
"""

from __future__ import annotations

from memcc.passes.analysis.liveness import HEAP_BYTES_PER_SMALL_BUFFER
from memcc.passes.planning.request import stopped_by_clock
from memcc.sizes import format_size


def _count(n: int, noun: str) -> str:
    """``1 value``, ``2 values``: the summary is read by people (it printed "1 values")."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _cut_by_clock(report: dict) -> int:
    """How many searches the clock stopped or left unrun (``request.stopped_by_clock``)."""
    return sum(stopped_by_clock(r) for r in report.get("strategies") or [])


def summary_lines(report: dict) -> list[str]:
    """The few lines ``memcc compile`` prints: budget, peaks, strategy, and with --verify
    each of the three checks (a user should not need the JSON to see what was proven)."""
    b, p = report["baseline"], report["plan"]
    lines = [
        f"budget   {format_size(report['budget_bytes'])}"
        + (" (smallest reachable)" if report.get("budget_was_min") else "")
        + (f" ({share['asked']} of the {format_size(share['as_built_budget_bytes'])} the step "
           "as built needs)" if (share := report.get("budget_share")) else "")
        + _margin_note(report),
        f"baseline peak {format_size(b['peak_bytes'])}"
        + (f" ({_chosen_chunks(report)}as built it needs a budget of "
           f"{format_size(b['needs_budget_bytes'])})" if b.get("needs_budget_bytes") else "")
        + "  ->  plan peak "
        f"{format_size(p['peak_bytes'])}  ({'fits' if p['fits'] else 'DOES NOT FIT'})",
        f"strategy {p.get('strategy_label', p['strategy'])}: "
        f"{_count(len(p['recomputed_values']), 'value')} recomputed"
        + (f" ({len(p['recompute_again_nodes'])} nodes rebuilt again for later readers)"
           if p.get("recompute_again_nodes") else "")
        + f", predicted added time {p['overhead'] * 100:.1f}%"
        + (" (less than none: the plan's operator variants cost less than the nodes they "
           "replace)" if p['overhead'] < -0.0005 else ""),
    ]
    cut = _cut_by_clock(report)
    if cut and report.get("budget_was_min"):
        limit = (report.get("options") or {}).get("time_limit")
        # "of" --time-limit: the smallest-peak search gets what the compile's other
        # stages leave of it (a walk-through read "stopped by --time-limit 30 s" on a
        # compile of 22 s in all).
        searches = f"{cut} search" + ("es" if cut != 1 else "")
        lines.append(f"search   {searches} stopped by {'its' if cut == 1 else 'their'} "
                     "share of --time-limit"
                     + (f" {limit:g} s" if isinstance(limit, (int, float)) else "")
                     + ": a longer --time-limit may reach a smaller budget, and runs can "
                     "differ")
    again = next((r["summary"]["replanned_at_smallest"] for r in report.get("passes") or []
                  if r.get("name") == "plan" and "replanned_at_smallest" in r["summary"]), None)
    if again and b.get("compute_cost_s"):
        first = again["smallest_peak_plan"]["added_time_s"] / b["compute_cost_s"]
        # signed: a plan can be faster than the step as built (a walk-through read "+-0.1%")
        lines.append(f"search   the smallest-peak plan ({first * 100:+.1f}%) planned again at "
                     f"its budget, for time: {p['overhead'] * 100:+.1f}%")
    o = report.get("offloaded_state")
    if o and o["used"]:
        reach = (f"; smallest budget {format_size(o['smallest_budget_bytes'])} with it, "
                 if o.get("smallest_budget_bytes") else "; ")
        without = o.get("smallest_budget_without_bytes")
        lines.append(f"offload  optimizer state in host memory: {len(o['tensors'])} tensors, "
                     f"{format_size(o['bytes'])}, copies add {o['added_time_s'] * 1e3:.1f} ms"
                     + (f"{reach}{format_size(without)} without (predicted)" if without
                        else ""))
    if (chunks := row_chunks_line(report)) is not None:
        lines.append(chunks)
    if (ranks := data_parallel_line(report)) is not None:
        lines.append(ranks)
    v = report.get("verification")
    if v:
        scope = " (numbers only)" if v.get("numbers_only") else ""
        lines.append(f"verify   {'OK' if v['ok'] else 'FAILED'}{scope}: "
                     + "; ".join(verify_checks(v)))
    return lines


def data_parallel_line(report: dict) -> str | None:
    """``--nproc N``: the budget and peaks above are per rank; each rank's predicted peak,
    the gradient bucket and each rank's optimizer state."""
    d = report.get("data_parallel")
    if not d:
        return None
    each = ", ".join(format_size(b) for b in d["peak_bytes_per_rank"])
    state = ", ".join(format_size(b) for b in d["optimizer_state_bytes_per_rank"])
    buckets = d.get("gradient_bucket_bytes_per_rank") or [d["gradient_bucket_bytes"]]
    bucket = (f"{format_size(buckets[0])} on every rank" if len(set(buckets)) == 1 else
              "per rank " + ", ".join(format_size(b) for b in buckets))
    return (f"ranks    {d['world_size']} (ZeRO-{d['zero']}): budget and peaks are per rank; "
            f"predicted peak per rank {each} (heaviest: rank {d['heaviest_rank']}, planned "
            f"for rank {d['planned_rank']}); gradient bucket {bucket}; optimizer state "
            f"per rank {state}")


def verify_checks(v: dict) -> list[str]:
    """The three verification checks in words, e.g. for ``summary_lines``."""
    n = v.get("outputs_compared")
    if v.get("outputs_match", not any("output" in p for p in v.get("problems", []))):
        outputs = f"{n} outputs {v.get('comparison')}"
        sensitive = v.get("input_sensitive_outputs")
        if sensitive:
            # "within relative T (...), or within 4x what 1 ulp ...": the count goes on
            # the second, so that the line says how many needed it.
            base, sep, rest = str(v.get("comparison")).partition(", or within ")
            outputs = (f"{n} outputs {base}, {sensitive} of them only within {rest}" if sep
                       else f"{outputs} ({sensitive} of them only by the latter)")
        judged = v.get("outputs_judged_by_gradient") or []
        if judged:
            outputs += (f", {len(judged)} updated parameter(s) judged by their gradients "
                        "(the optimizer amplified their rounding noise)")
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
             else "executed order not checked" if v.get("order_matches_plan") is None
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


def _chosen_chunks(report: dict) -> str:
    """``with loss 8: `` where compile chose row chunks, whose step the baseline is (the
    budget's share is of the step as loaded); else nothing."""
    rc = report.get("row_chunks") or {}
    chosen = rc.get("chosen") or {}
    if rc.get("searched") and any(n > 1 for n in chosen.values()):
        return f"the step with {describe_chunks(chosen)} compile chose: "
    return ""


def describe_chunks(chunks: dict[str, int]) -> str:
    """``loss 8, attention 4, mlp 4``; ``none`` where nothing is split."""
    parts = [f"{k} {n}" for k, n in chunks.items() if n > 1]
    return ", ".join(parts) if parts else "none"


def row_chunks_line(report: dict) -> str | None:
    """The line ``memcc compile`` prints about row chunks (None: nothing to say, the step
    was planned as loaded and nothing was searched)."""
    rc = report.get("row_chunks") or {}
    chosen = rc.get("chosen") or {}
    screened = rc.get("screened") or []
    if not rc.get("searched") and not any(n > 1 for n in chosen.values()):
        if not screened:
            return None
        n = len(screened)
        return (f"row chunks none ({n} setting{'s' if n > 1 else ''} screened by estimated "
                "added time, none planned: memcc report says why)")
    line = f"row chunks {describe_chunks(chosen)}"
    # The plan's added time (the summary's) is against the chunked step as built; what the
    # chunks cost on top is against the step without them (``added_time``): on a DeiT-tiny
    # at --budget min, +15.9% read alone hid a step 2.5 times the unchunked one's.
    won = next((c for c in rc.get("candidates") or [] if c.get("chosen")), {})
    if any(n > 1 for n in chosen.values()) and won.get("added_time") is not None:
        line += (f": predicted step time {100 * won['added_time']:+.1f}% against the step "
                 "without chunks, plan included")
    # A setting screened and then planned again (its "final" entry) counts once.
    tried = [c for c in rc.get("candidates") or [] if c.get("phase") != "final"]
    if rc.get("searched"):
        line += f" (chosen by compile of {len(tried)} settings planned)"
    return line
