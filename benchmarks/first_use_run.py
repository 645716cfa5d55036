"""Run the first-use commands on exported models, as a new user would, and tabulate them.

BENCHMARKS.md's first-use sweeps run, per model, the commands README teaches, each in its
own process under a timeout: build, analyze, compile at 50% (with ``--verify``) and at
``--budget min``, run the smallest plan, train two steps then resume to four (compared with
four steps straight, parameters and optimizer state bit for bit), compile halfway between
``--budget min``'s budget and the one the step as built needs (its peak with the margin,
slack and heap room; at least 2% over ``--budget min``'s; ``--verify``), and export the
trained weights. A row records what each command said (its wall time, the report's
figures) or why it failed, so a regression anywhere in the pipeline shows as a failed cell.

    python benchmarks/first_use_models.py --out DIR          # the exports (timm, torchvision)
    python benchmarks/first_use_run.py DIR [--cases a,b] [--time-limit 20] [--out rows.jsonl]

A case named ``*.dyn`` has a symbolic batch axis named ``batch``, bound with ``--dim
batch=4``. Prints one markdown row per case as it finishes and writes the rows as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]   # memcc from this checkout, installed or not
MB = 1e6


def _memcc(args: list[str], timeout: float) -> tuple[int, float, str, str]:
    """(exit status, wall seconds, stdout, stderr's tail) of one memcc command."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", "from memcc.cli import main; main()", *args],
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, e.stdout or "", f"timed out after {timeout:.0f} s"
    return rc, time.perf_counter() - t0, out if isinstance(out, str) else out.decode(), \
        (err if isinstance(err, str) else err.decode())[-600:]


def _json(out: str) -> dict:
    """The last JSON object a command printed on stdout."""
    start = out.rfind("\n{")
    return json.loads(out[start + 1 if start >= 0 else out.find("{"):])


def _data(step: Path, path: Path, batches: int = 4) -> None:
    """Training data for the built step: ``batches`` of ``memcc run``'s synthetic batches
    (``synthetic_feeds``: floats N(0, 1), token ids and labels within their ranges)."""
    from memcc.backend.step_feeds import synthetic_feeds
    from memcc.frontend.load import load_graph

    graph = load_graph(step)
    parts = [synthetic_feeds(graph, seed=k) for k in range(batches)]
    np.savez(path, **{n: np.concatenate([p[n] for p in parts]) for n in parts[0]})


def _same_checkpoints(a: Path, b: Path) -> bool:
    """The newest checkpoints of two runs hold the same arrays, bit for bit."""
    from memcc.backend.checkpoint import load

    x, y = load(a).tensors, load(b).tensors
    return sorted(x) == sorted(y) and all(np.array_equal(x[k], y[k]) for k in x)


def _fail(rc: int, err: str) -> str:
    line = next((s for s in reversed(err.strip().splitlines()) if s.strip()), "")
    return f"FAILED rc {rc}: {line[:160]}"


def run_case(src: Path, work: Path, tl: float, timeout: float) -> dict:
    """Every first-use command on one export; each cell the figures or why it failed."""
    name = src.name[:-5]
    dim = ["--dim", "batch=4"] if name.endswith(".dyn") else []
    row: dict = {"case": name}
    w = work / name
    w.mkdir(parents=True, exist_ok=True)
    step = w / "step.onnx"
    rc, s, _, err = _memcc(["build", str(src), "-o", str(step), *dim], timeout)
    row["build"] = f"ok {s:.0f} s" if rc == 0 else _fail(rc, err)
    if rc:
        return row
    rc, s, out, err = _memcc(["analyze", str(src), "--json", *dim], timeout)
    row["analyze_s"] = round(s, 1)
    built = _json(out)["peak_bytes"] if rc == 0 else None
    row["as_built_mb"] = built and round(built / MB, 1)
    if rc:
        row["analyze"] = _fail(rc, err)
    plan = ["--cost", "analytic", "--time-limit", str(tl), *dim]
    rc, s, out, err = _memcc(["compile", str(src), "--budget", "50%", "--verify", "-o",
                              str(w / "half.onnx"), *plan], timeout)
    row["half"] = (f"{'fits' if rc == 0 else 'refused' if rc in (1, 2) else _fail(rc, err)}"
                   f", {s:.0f} s")
    rc, s, out, err = _memcc(["compile", str(src), "--budget", "min", "-o",
                              str(w / "min.onnx"), *plan], timeout)
    if rc:
        row["min"] = _fail(rc, err)
        return row
    rep = json.loads((w / "min.report.json").read_text())
    row["min"] = {"budget_mb": round(rep["budget_bytes"] / MB, 2),
                  "plan_mb": round(rep["plan"]["peak_bytes"] / MB, 1),
                  "share": built and round(rep["plan"]["peak_bytes"] / built, 3),
                  "added": round(rep["plan"]["overhead"], 3), "s": round(s, 1),
                  "strategy": rep["plan"]["strategy_label"]}
    rc, s, out, err = _memcc(["run", str(w / "min.onnx"), "--steps", "3", "--json"], timeout)
    if rc == 0:
        r = _json(out)
        row["run"] = {"measured_mb": round(r["measured_peak_bytes"] / MB, 2),
                      "ratio": round(r["measured_over_predicted"], 3),
                      "order": r["order_matches_plan"]}
    else:
        row["run"] = _fail(rc, err)
    row["train"] = _train(step, w, timeout)
    if built:  # halfway to the budget the step as built needs (its peak, margin, slack and
        # heap room), and at least 2% over the smallest
        as_built = built / (1 - rep["margin"]) + rep["slack_bytes"] + rep["heap_allowance_bytes"]
        budget = max((rep["budget_bytes"] + as_built) / 2, rep["budget_bytes"] * 1.02)
        row["between"] = _between(src, w, budget, plan, timeout)
    return row


def _train(step: Path, w: Path, timeout: float) -> str:
    """Two steps, resumed to four, against four straight; then the weights exported."""
    data = w / "data.npz"
    _data(step, data)
    base = ["train", str(step), "--data", str(data), "--json"]
    for args in (["--steps", "2", "--checkpoint", str(w / "ck")],
                 ["--steps", "4", "--checkpoint", str(w / "ck"), "--resume"],
                 ["--steps", "4", "--checkpoint", str(w / "ck4")]):
        rc, s, out, err = _memcc(base + args, timeout)
        if rc:
            return _fail(rc, err)
    same = _same_checkpoints(w / "ck", w / "ck4")
    rc, s, out, err = _memcc(["export", str(step), "--checkpoint", str(w / "ck"), "-o",
                              str(w / "trained.onnx")], timeout)
    return (f"ok, resume {'bit-identical' if same else 'DIFFERS'} to 4 straight, "
            f"export {'ok' if rc == 0 else _fail(rc, err)}")


def _between(src: Path, w: Path, budget: float, plan: list[str], timeout: float) -> dict | str:
    rc, s, out, err = _memcc(["compile", str(src), "--budget", f"{int(budget)}", "--verify",
                              "-o", str(w / "mid.onnx"), *plan], timeout)
    if rc:
        return _fail(rc, err)
    rep = json.loads((w / "mid.report.json").read_text())
    v = rep.get("verification") or {}
    return {"budget_mb": round(budget / MB, 2), "plan_mb": round(rep["plan"]["peak_bytes"] / MB, 1),
            "measured_mb": v.get("measured_peak_bytes") and round(v["measured_peak_bytes"] / MB, 1),
            "added": round(rep["plan"]["overhead"], 3), "verify": v.get("ok"), "s": round(s, 1)}


def markdown(row: dict) -> str:
    def cell(v):
        if isinstance(v, dict):
            return ", ".join(f"{k} {x}" for k, x in v.items())
        return "" if v is None else str(v)
    keys = ("case", "build", "analyze_s", "as_built_mb", "half", "min", "run", "train", "between")
    return "| " + " | ".join(cell(row.get(k)) for k in keys) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("exports", type=Path, help="folder of exported .onnx files")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--work", type=Path, default=None, help="folder for the outputs")
    ap.add_argument("--time-limit", type=float, default=20.0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per command")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines, one row per case")
    a = ap.parse_args()
    wanted = set(a.cases.split(",")) if a.cases else None
    work = a.work or a.exports / "first_use"
    for src in sorted(a.exports.glob("*.onnx")):
        if wanted is not None and src.name[:-5] not in wanted:
            continue
        row = run_case(src, work, a.time_limit, a.timeout)
        print(markdown(row), flush=True)
        if a.out:
            with a.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
