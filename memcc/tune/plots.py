"""``memcc tune --plot``: peak and predicted throughput against the size, with the budget
and the planning target.

A ``TuneResult`` enters, a matplotlib figure (``tune_figure``) or a written image
(``plot_tune``) leaves; matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import os
from pathlib import Path

from memcc.sizes import format_size
from memcc.tune.results import TuneResult


def plot_tune(result: TuneResult, path: str | os.PathLike) -> Path:
    """Draw ``tune_figure(result)`` at ``path`` (atomically, in the format its suffix names)."""
    import matplotlib.pyplot as plt

    from memcc.report_view import save_figure

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
    peaks = [c for c in cands if c.measured_peak_bytes is not None]
    if peaks:  # --measure: what ORT's run of each measured size peaked at
        ax.plot([c.batch for c in peaks], [c.measured_peak_bytes / mb for c in peaks], "*",
                ls="none", color="#1f5fa8", markersize=10,
                label="peak measured in ONNX Runtime (--measure)")
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
    shown += [c.baseline_peak_bytes for c in cands]
    shown += [c.measured_peak_bytes for c in peaks]
    top = min(max([result.budget_bytes * 1.6, *(b * 1.05 for b in shown)]),
              result.budget_bytes * 4)
    ax.set_ylim(0, top / mb)
    above = [c for c in cands if c.baseline_peak_bytes > top]
    if above:  # as-built peaks past four budgets: marked at the edge, not left off unseen
        ax.plot([c.batch for c in above], [top / mb * 0.985] * len(above), "^", ls="none",
                color="#999999", clip_on=False,
                label=f"peak as built above {format_size(int(top))} (off the axis)")
    ax.set_xlabel(f"{result.range.dim}")
    ax.set_ylabel("peak (MB, 10^6 bytes)")
    ax2 = _draw_rates(ax.twinx(), cands, result.cost_source)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper center",
              bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8, frameon=False)
    ax.set_title(f"{Path(result.model).name}: largest {result.largest_batch}, fastest "
                 f"{result.fastest_batch}, budget {format_size(result.budget_bytes)}",
                 fontsize=10)
    fig.tight_layout()
    return fig


def _draw_rates(ax2, cands: list, cost_source: str):
    """Predicted samples/s per size, and with ``--measure`` the measured ones as stars, on
    the right-hand axis; returns it."""
    timed = [c for c in cands if c.samples_per_s is not None]
    ax2.plot([c.batch for c in timed], [c.samples_per_s for c in timed], "s-",
             color="#2e8b57", label="predicted samples/s")
    measured = [c for c in cands if c.measured_samples_per_s is not None]
    if measured:
        ax2.plot([c.batch for c in measured], [c.measured_samples_per_s for c in measured],
                 "*", ls="none", color="#2e8b57", markersize=10,
                 label="measured samples/s (--measure, median step)")
    ax2.set_ylabel(f"samples/s (predicted: {cost_source} cost model"
                   + ("; stars measured)" if measured else ")"))
    ax2.set_ylim(bottom=0)
    return ax2
