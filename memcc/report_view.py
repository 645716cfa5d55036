"""Reading a compile report back (``memcc report``): tables for people and the
memory-over-time plot.

In: a report JSON file as ``memcc compile --report`` wrote it (``load_report`` checks it is
one). Out: tables printed to a rich ``Console`` and a figure saved to a file. It reads the
report only and imports no compiler module (the report is a file's contract, not the
compiler's internals); the phrases it shares with ``memcc compile``'s summary are
``memcc/report_text.py``'s.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memcc.errors import InputError
from memcc.passes.analysis.phases import COPY, RECOMPUTED, VARIANT
from memcc.report_text import describe_chunks, verify_checks
from memcc.sizes import format_size

REQUIRED = ("budget_bytes", "baseline", "plan", "passes", "compile_time_s", "solver")


def load_report(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{p}: a directory; give the report JSON file memcc compile wrote "
                         "(--report FILE.json)") from None
    except OSError as exc:
        raise InputError(f"{p}: cannot read it ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: not a JSON report ({str(exc)[:80]}); give the .report.json "
                         "file memcc compile wrote beside its step (or --report "
                         "FILE.json)") from None
    missing = [k for k in REQUIRED if k not in data] if isinstance(data, dict) else REQUIRED
    if missing:
        raise InputError(f"{p}: not a memcc compile report (missing {', '.join(missing)}); "
                         "write one with memcc compile ... --report FILE.json")
    return data


def print_report(report: dict, console: Console) -> None:
    b, p = report["baseline"], report["plan"]
    t = Table(title="memory and time", show_header=True, header_style="bold")
    for col in ("", "baseline", "plan"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("peak", format_size(b["peak_bytes"]), format_size(p["peak_bytes"]))
    t.add_row("budget", "", format_size(report["budget_bytes"]))
    t.add_row("fits", "", "yes" if p["fits"] else "NO")
    t.add_row("compute cost", f"{b['compute_cost_s'] * 1e3:.2f} ms",
              f"{p['compute_cost_s'] * 1e3:.2f} ms (+{p['overhead'] * 100:.1f}%)")
    if "kernels" in b and "kernels" in p:  # reports written before issue 30 lack them
        t.add_row("kernels per step", f"{b['kernels']:,}", f"{p['kernels']:,}")
        t.add_row("bytes moved per step", format_size(b["bytes_moved"]),
                  format_size(p["bytes_moved"]))
    for cat in b.get("breakdown_at_peak", {}):
        t.add_row(f"  at peak: {cat}", format_size(b["breakdown_at_peak"][cat]),
                  format_size(p.get("breakdown_at_peak", {}).get(cat, 0)))
    t.add_row("peak at node", str(b.get("peak_node")), str(p.get("peak_node")))
    arena = p.get("device_arena")
    if arena:  # --provider cuda: the peak is the arena's, say what it is made of
        t.add_row("  device: live bytes", "", format_size(p.get("live_peak_bytes", 0)))
        t.add_row("  device: arena fragmentation", "",
                  format_size(arena["fragmentation_bytes"]))
        if arena.get("peak_device_bytes") is not None:  # CUDA: regions in whole pages
            t.add_row("  device: partly used pages", "",
                      format_size(arena["peak_device_bytes"] - arena["peak_reserved_bytes"]))
    if p.get("host_peak_bytes"):
        t.add_row("host memory (swapped copies)", "", format_size(p["host_peak_bytes"]))
    console.print(t)

    pt = Table(title="passes", header_style="bold")
    pt.add_column("pass")
    pt.add_column("time", justify="right")
    pt.add_column("summary")
    for ps in report["passes"]:
        # The plan pass's solver/runs are the strategies table below, readable there.
        summary = ", ".join(f"{k}={_short(v)}" for k, v in ps["summary"].items()
                            if k not in ("candidates", "recomputed", "solver", "runs",
                                         "variants"))
        pt.add_row(ps["name"], f"{ps['time_s']:.2f} s", summary)
    console.print(pt)
    _print_strategies(report, console)
    _print_row_chunks(report.get("row_chunks"), console,
                      offloaded=bool((report.get("offloaded_state") or {}).get("used")))
    _print_variants(p.get("variants"), console)
    rec = p.get("recomputed_values", [])
    if rec:
        console.print(f"recomputed ({len(rec)}): " + ", ".join(rec[:20])
                      + (" ..." if len(rec) > 20 else ""))
    v = report.get("verification")
    if v:
        console.print(f"verified: {'OK' if v['ok'] else 'FAILED'}; "
                      + "; ".join(verify_checks(v)), highlight=False)
        for problem in v.get("problems", []):
            console.print(f"  problem: {problem}", highlight=False)
        for step in v.get("next_steps", []):
            console.print(f"  next: {step}", highlight=False)
        if v.get("unverified_output"):
            console.print(f"  the rewritten step was kept as {v['unverified_output']}",
                          highlight=False)
    for warning in report.get("warnings", []):
        console.print(f"warning: {warning}", highlight=False)


def _print_row_chunks(rc: dict | None, console: Console, *, offloaded: bool = False) -> None:
    """The row chunks the step was planned with, why, each setting compile planned, and,
    for a step that fits as built, each setting it screened without planning
    (compiler/chunk_choice.py, compiler/chunk_fit.py); reports from before them have no
    such sections. ``offloaded``: the plan moved optimizer state to host memory after the
    settings were weighed, so their added times leave its copies out."""
    if not rc:
        return
    console.print(f"row chunks: {describe_chunks(rc.get('chosen') or {})}"
                  + (f" ({rc['why']})" if rc.get("why") else ""), highlight=False)
    tried = rc.get("candidates") or []
    if tried:
        _print_chunk_candidates(tried, console, offloaded)
    unplanned = [e for e in rc.get("screened") or [] if not e.get("planned")]
    if unplanned:
        st = Table(title="row chunks screened, not planned (estimated added time of the "
                   "split as built, against the plan as built's "
                   f"{rc.get('as_built_added_time', 0) * 100:+.1f}%)", header_style="bold")
        for col in ("chunks", "estimated added time", "why not planned"):
            st.add_column(col, justify="right" if col.startswith("estimated") else "left")
        for e in unplanned:
            est = e.get("estimated_added_time")
            st.add_row(describe_chunks(e["chunks"]),
                       "" if est is None else f"{est * 100:+.1f}%", e.get("skipped", ""))
        console.print(st)


def _print_chunk_candidates(tried: list[dict], console: Console, offloaded: bool) -> None:
    # A walk-through read +9.3% here and +11.0% in the summary: the state's copies.
    copies = ("; before the optimizer state's copies to and from host memory, which the "
              "summary's added time includes") if offloaded else ""
    ct = Table(title=f"row chunks tried (added time against the step as built, "
                     f"unchunked{copies})", header_style="bold")
    for col in ("chunks", "result", "peak", "needs budget", "estimated", "added time", "chosen"):
        ct.add_column(col, justify="left" if col in ("chunks", "result", "chosen") else "right")
    for c in tried:
        # A setting screened, then planned again (``compiler/chunk_clock.py``): say which.
        name = describe_chunks(c["chunks"]) + (f" ({c['phase']})" if c.get("phase") else "")
        est = c.get("estimated_added_time")
        est_s = "" if est is None else f"{est * 100:+.1f}%"
        if c.get("fits"):
            added = c.get("added_time")
            ct.add_row(name, "fits", format_size(c["peak_bytes"]),
                       format_size(c["needs_budget_bytes"]), est_s,
                       "" if added is None else f"{added * 100:+.1f}%",
                       "<- chosen" if c.get("chosen") else "")
        else:
            smallest = c.get("smallest_budget_bytes")
            ct.add_row(name, str(c.get("refused", "refused")), "",
                       "" if smallest is None else format_size(smallest), est_s, "",
                       "<- chosen" if c.get("chosen") else "")
    console.print(ct)


def _print_variants(v: dict | None, console: Console) -> None:
    """Per variant kind: nodes, peak bytes saved and time added (each from simulating the
    plan without that kind), and the plan's exactness tier."""
    if not v or not v.get("by_kind"):
        return
    vt = Table(title=f"operator variants (plan is {v.get('exactness')}"
               + (f", tolerance {v['tolerance']:g})" if v.get("exactness") != "exact"
                  else ")"), header_style="bold")
    for col in ("variant", "tier", "nodes", "peak saved", "time added"):
        vt.add_column(col, justify="left" if col in ("variant", "tier") else "right")
    for key, k in v["by_kind"].items():
        vt.add_row(key, str(k.get("tier")), str(k["nodes"]), format_size(k["bytes_saved"]),
                   f"{k['added_time_s'] * 1e3:+.2f} ms")
    console.print(vt)


def _print_strategies(report: dict, console: Console) -> None:
    """Which strategies ran, what each returned, and which plan was picked.

    The ``solver`` object describes the last ILP solve only: printed alone, an infeasible
    last model read as if the plan had failed although another strategy found it.
    """
    p = report["plan"]
    label = p.get("strategy_label", p.get("strategy"))
    runs = report.get("strategies")
    if not runs:  # a report from before the strategies list
        s = report["solver"]
        console.print(f"strategy {label}; last ILP solve ({s.get('name')}): status "
                      f"{s.get('status')}, gap {s.get('gap')}; compile time "
                      f"{report['compile_time_s']:.2f} s")
        return
    base_cost = report["baseline"].get("compute_cost_s") or 0.0
    target = report.get("planning_budget_bytes")
    title = f"strategies ({label}"
    if target is not None:
        title += f"; 'fits' means within the planning budget of {format_size(target)}"
    st = Table(title=title + ")", header_style="bold")
    for col in ("strategy", "run", "result", "picked"):
        st.add_column(col)
    for run in runs:
        name = run.get("strategy", "?")
        if run.get("region_variants"):  # times here are over the step with them in place
            name += f" (over {run['region_variants']} region variants)"
        st.add_row(name, str(run.get("detail", "")),
                   _run_result(run, base_cost), "<- picked" if run.get("picked") else "")
    console.print(st)
    console.print(f"picked: {p.get('picked_strategy', p.get('strategy'))}, the "
                  + ("smallest peak" if report.get("budget_was_min") else "cheapest plan")
                  + f" that fits; compile time {report['compile_time_s']:.2f} s")


def _run_result(run: dict, base_cost: float) -> str:
    """One strategy run in words: its status, then the plan it returned."""
    parts = []
    status = run.get("status")
    if status is not None:
        how = ", ".join(x for x in (run.get("solver"), _seconds(run.get("solve_time_s"))) if x)
        parts.append(f"{status} ({how})" if how else str(status))
        if status == "infeasible" and run.get("model_budget_bytes") is not None:
            parts.append(f"no plan within the model budget of "
                         f"{format_size(run['model_budget_bytes'])}")
    if "peak_bytes" in run:
        plans, fitting = run.get("plans", 1), run.get("fitting", 0)
        added = run.get("added_time_s") or 0.0
        cost = f", +{added / base_cost * 100:.1f}% time" \
            if base_cost > 0 and run.get("strategy") != "none" else ""
        plan = f"peak {format_size(run['peak_bytes'])}{cost}"
        if plans > 1:
            parts.append(f"{plans} plans, {fitting} fit" + (
                f"; cheapest fitting: {plan}" if fitting else f"; smallest: {plan}"))
        else:
            parts.append(plan + (", fits" if fitting else ", does not fit"))
    return "; ".join(parts)


def _seconds(v) -> str:
    return "" if v is None else f"{v:.2f} s"


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and v > 100_000:
        return format_size(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)


PHASE_STYLE = {  # letter in timeline.phases -> (name, shading)
    "F": ("forward", "#e8eef8"),
    "B": ("backward", "#f8eee4"),
    "U": ("update", "#e8f4e8"),
}


def plot_timeline(report: dict, path: str | Path) -> Path:
    """Draw ``timeline_figure(report)`` to a PNG at ``path``."""
    fig = timeline_figure(report)
    import matplotlib.pyplot as plt

    try:
        return save_figure(fig, path)
    finally:
        plt.close(fig)


def check_plot_path(path: str | os.PathLike, option: str = "--plot", *,
                    inputs: Iterable[tuple[str, str | os.PathLike]] = ()) -> None:
    """Before anything is computed or printed: the plot can be written there, in a format
    matplotlib writes (named by the suffix; none means PNG), and is none of ``inputs``."""
    from matplotlib.backend_bases import FigureCanvasBase

    from memcc.backend.onnx_file import check_writable

    check_writable(path, "the plot", option, inputs=inputs)
    fmt = Path(path).suffix[1:].lower()
    known = FigureCanvasBase.get_supported_filetypes()
    if fmt and fmt not in known:
        raise InputError(f"cannot write the plot {path}: matplotlib writes no '.{fmt}' files. "
                         f"Give {option} a name ending in .png (or .{', .'.join(sorted(known))}"
                         ").")


def save_figure(fig, path: str | os.PathLike) -> Path:
    """Save a matplotlib figure atomically (a temporary file, then a rename), in the format
    its suffix names (PNG without one): a failed save leaves no half-written file."""
    from memcc.backend.onnx_file import write_atomically

    out = Path(path)
    fmt = out.suffix[1:].lower() or "png"
    try:
        return write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format=fmt))
    except OSError as exc:
        raise InputError(f"cannot write the plot {out}: {exc.strerror or exc}. Nothing was "
                         "written.") from None


def timeline_figure(report: dict):
    """Bytes live over the step, baseline and plan on one x axis, with the budget, the
    planning target, the phases of the step and what each peak is made of.

    x is the node of the step as built: the plan's nodes sit at the x of the same node in
    the baseline, and its recompute clones between the two original nodes they run
    between, so a vertical line crosses both curves at the same point of the step (node
    indices alone would shift the plan right by every clone before it). Returns the
    matplotlib Figure; the caller saves and closes it.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed, and none may exist
    import matplotlib.pyplot as plt

    tl = report.get("timeline") or {}
    if not tl.get("baseline"):
        raise InputError("the report has no timeline (written by an older memcc?)")
    mb = 1e6
    base = [v / mb for v in tl["baseline"]]
    plan = [v / mb for v in tl["plan"]]
    origin = tl.get("plan_origin")
    aligned = origin is not None and len(origin) == len(plan)
    plan_x = aligned_x(origin) if aligned else list(range(len(plan)))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5.8), gridspec_kw={"width_ratios": [3, 1]})

    phases = tl.get("phases") or ""
    if len(phases) == len(base):
        _shade_phases(ax, phases)

    ax.plot(range(len(base)), base, color="0.45", lw=1.1,
            label=f"baseline (peak {format_size(report['baseline']['peak_bytes'])})")
    ax.plot(plan_x, plan, color="tab:blue", lw=1.1,
            label=f"plan (peak {format_size(report['plan']['peak_bytes'])})")
    if aligned:
        for code, colour, what in ((RECOMPUTED, "tab:orange", "recomputed node"),
                                   (VARIANT, "tab:green", "operator variant's node"),
                                   (COPY, "tab:purple", "swap copy")):
            marked = [i for i, o in enumerate(origin) if o == code]
            if marked:
                ax.plot([plan_x[i] for i in marked], [plan[i] for i in marked], ls="none",
                        marker="o", ms=3, color=colour, zorder=3,
                        label=f"plan: {what} ({len(marked)})")

    budget = report["budget_bytes"]
    ax.axhline(budget / mb, color="tab:red", ls="--", lw=1.2,
               label=f"budget {format_size(budget)}")
    target = report.get("planning_budget_bytes")
    if target is not None:
        # In the axis's unit (MB, 10^6 bytes) like every other figure here: the default
        # slack is 1 MiB, which reads 1.05 MB.
        slack = report.get("slack_bytes", 1 << 20)
        ax.axhline(target / mb, color="tab:red", ls=":", lw=1.2,
                   label=f"planning target {format_size(target)} = budget x "
                         f"(1 - {report.get('margin', 0.02):g}) - {format_size(slack)}")
    ax.set_xlim(-0.5, len(base) - 0.5)
    ax.set_ylim(0, max(max(base), max(plan), budget / mb) * 1.12)
    ax.set_xlabel("node of the step as built (the plan's new nodes are drawn between the "
                  "nodes they run between)" if aligned else
                  "node in execution order (report without plan_origin: the plan's x is not "
                  "aligned with the baseline's)", fontsize=9)
    ax.set_ylabel("MB live (10^6 bytes)")
    ax.set_title("bytes live over the training step")
    # Below the axes: memory often stays high to the end of the step, and a legend inside
    # would hide the curves wherever it went.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8,
              frameon=False)

    _peak_bars(bx, report, ax.get_ylim())
    fig.tight_layout()
    return fig


def _shade_phases(ax, phases: str) -> None:
    """The step's phases (forward, backward, update) as shaded spans, named where wide."""
    for start, end, letter in _runs(phases):
        name, colour = PHASE_STYLE.get(letter, (letter, "#f0f0f0"))
        ax.axvspan(start - 0.5, end - 0.5, color=colour, lw=0, zorder=0)
        if start:
            ax.axvline(start - 0.5, color="0.6", lw=0.8, zorder=1)
        if end - start >= 0.04 * len(phases):
            ax.text((start + end - 1) / 2, 0.985, name, transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=9, color="0.35")


def _peak_bars(bx, report: dict, ylim: tuple[float, float]) -> None:
    """What each peak is made of, baseline and plan stacked by category, with the budget
    and the planning target, on the timeline's scale (``ylim``)."""
    mb = 1e6
    budget, target = report["budget_bytes"], report.get("planning_budget_bytes")
    cats = list(report["baseline"].get("breakdown_at_peak", {}))
    bottoms = [0.0, 0.0]
    for cat in cats:
        vals = [report["baseline"]["breakdown_at_peak"].get(cat, 0) / mb,
                report["plan"].get("breakdown_at_peak", {}).get(cat, 0) / mb]
        bx.bar(["baseline", "plan"], vals, bottom=bottoms, label=cat.replace("_", " "))
        bottoms = [bottoms[0] + vals[0], bottoms[1] + vals[1]]
    bx.axhline(budget / mb, color="tab:red", ls="--", lw=1.2)
    if target is not None:
        bx.axhline(target / mb, color="tab:red", ls=":", lw=1.2)
    bx.set_ylim(ylim)
    bx.set_title("what each peak is made of")
    bx.set_ylabel("MB at the peak")
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3, fontsize=8,
              frameon=False)


def aligned_x(origin: list[int]) -> list[float]:
    """x of each plan node in baseline coordinates (``timeline.plan_origin``).

    A node the baseline has sits at that node's index. A run of new nodes (recompute clones,
    a variant's nodes, copies: negative origins) runs just before the next original node,
    so the run is spread evenly over the gap between the original nodes before and after
    it.
    """
    xs: list[float] = [float(o) for o in origin]
    i = 0
    while i < len(origin):
        if origin[i] >= 0:
            i += 1
            continue
        j = i
        while j < len(origin) and origin[j] < 0:
            j += 1
        left = float(origin[i - 1]) if i else -0.5
        right = float(origin[j]) if j < len(origin) else left + 1.0
        for k in range(i, j):
            xs[k] = left + (k - i + 1) * (right - left) / (j - i + 1)
        i = j
    return xs


def _runs(letters: str) -> list[tuple[int, int, str]]:
    """Maximal runs of one letter as (start, end exclusive, letter)."""
    runs: list[tuple[int, int, str]] = []
    start = 0
    for i in range(1, len(letters) + 1):
        if i == len(letters) or letters[i] != letters[start]:
            runs.append((start, i, letters[start]))
            start = i
    return runs
