"""Reading a compile report back: tables for people and the memory-over-time plot."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from memcc.errors import InputError
from memcc.sizes import format_size

REQUIRED = ("budget_bytes", "baseline", "plan", "passes", "compile_time_s", "solver")


def load_report(path: str | Path) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InputError(f"{p}: no such file") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{p}: not a JSON report ({exc})") from None
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
    for cat in b.get("breakdown_at_peak", {}):
        t.add_row(f"  at peak: {cat}", format_size(b["breakdown_at_peak"][cat]),
                  format_size(p.get("breakdown_at_peak", {}).get(cat, 0)))
    t.add_row("peak at node", str(b.get("peak_node")), str(p.get("peak_node")))
    console.print(t)

    pt = Table(title="passes", header_style="bold")
    pt.add_column("pass")
    pt.add_column("time", justify="right")
    pt.add_column("summary")
    for ps in report["passes"]:
        summary = ", ".join(f"{k}={_short(v)}" for k, v in ps["summary"].items()
                            if k not in ("candidates", "recomputed"))
        pt.add_row(ps["name"], f"{ps['time_s']:.2f} s", summary)
    console.print(pt)
    s = report["solver"]
    console.print(f"solver {s.get('name')}: status {s.get('status')}, gap {s.get('gap')}; "
                  f"compile time {report['compile_time_s']:.2f} s; strategy {p.get('strategy')}")
    rec = p.get("recomputed_values", [])
    if rec:
        console.print(f"recomputed ({len(rec)}): " + ", ".join(rec[:20])
                      + (" ..." if len(rec) > 20 else ""))
    v = report.get("verification")
    if v:
        console.print(f"verified: {'OK' if v['ok'] else 'FAILED'}; measured peak "
                      f"{format_size(v.get('measured_peak_bytes'))}, outputs "
                      f"{v.get('comparison')}, order matches plan: {v.get('order_matches_plan')}")


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int) and v > 100_000:
        return format_size(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_short(x)}" for k, x in v.items()) + "}"
    return str(v)


def plot_timeline(report: dict, path: str | Path) -> Path:
    """Bytes live over the schedule, baseline and plan, with the budget and the peak's parts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = report.get("timeline") or {}
    if not tl.get("baseline"):
        raise InputError("the report has no timeline (written by an older memcc?)")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    mb = 1e6
    ax.plot([v / mb for v in tl["baseline"]], label="baseline", color="tab:gray", lw=1)
    ax.plot([v / mb for v in tl["plan"]], label="plan", color="tab:blue", lw=1)
    ax.axhline(report["budget_bytes"] / mb, color="tab:red", ls="--", label="budget")
    ax.set_xlabel("node in execution order")
    ax.set_ylabel("MB live")
    ax.set_title("bytes live over the step")
    ax.legend(loc="upper right")
    cats = list(report["baseline"].get("breakdown_at_peak", {}))
    bottoms = [0.0, 0.0]
    for cat in cats:
        vals = [report["baseline"]["breakdown_at_peak"].get(cat, 0) / mb,
                report["plan"].get("breakdown_at_peak", {}).get(cat, 0) / mb]
        bx.bar(["baseline", "plan"], vals, bottom=bottoms, label=cat)
        bottoms = [bottoms[0] + vals[0], bottoms[1] + vals[1]]
    bx.set_title("what the peak is made of")
    bx.set_ylabel("MB")
    bx.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
