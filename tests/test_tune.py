"""``memcc tune``: the largest batch it reports fits and the next size up does not (each
checked by compiling it, as a user would), the tuned step runs like the step it came from,
and ranges, dimension names and budgets that cannot be searched fail with what to do.

One tiny MLP with a symbolic batch serves every case (a search over it takes about a
second), and its searches are shared across the module to keep CI fast.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from memcc.cli import app
from memcc.compiler import CompileOptions, compile_model
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions, build_training_step
from memcc.frontend.load import load_graph
from memcc.passes.planning.planner import BudgetError
from memcc.tune import TuneOptions, parse_range, tune
from models import build_model

# Budget and sizes chosen so the step as built fits up to a batch in the middle of the
# range, recomputation reaches further, and the range's top does not fit at all.
BUDGET = 1_300_000
RANGE = "batch=1..400"
# Margin and slack off, so the tiny step's edges are set by its activations, not by the
# 1 MiB slack meant for real models; compile is checked with the same settings.
EXACT = dict(margin=0.0, slack_bytes=0, cost="analytic")
runner = CliRunner()


def _mlp(dynamic: bool = True) -> onnx.ModelProto:
    return build_model("mlp", dynamic_batch=dynamic, width=128, depth=4, in_features=64)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tune") / "mlp.onnx"
    onnx.save(_mlp(), str(path))
    return path


@pytest.fixture(scope="module")
def searched(model_file):
    return tune(model_file, BUDGET, RANGE, TuneOptions(points=1, **EXACT))


def _compile(model_file: Path, batch: int, strategy: str = "auto"):
    # tune plans whole steps (it does not search row chunks, which compile now does for
    # a forward model): compared with compile of the same whole step.
    opts = CompileOptions(budget=BUDGET, strategy=strategy, dims={"batch": batch},
                          build=BuildOptions(loss_chunks=1, attention_chunks=1, mlp_chunks=1),
                          **EXACT)
    return compile_model(model_file, opts)


def test_the_largest_batch_fits_and_the_next_size_does_not(searched, model_file):
    r = searched
    assert 1 < r.largest_batch_without_rewrite < r.largest_batch < 400
    assert _compile(model_file, r.largest_batch).report["plan"]["fits"]
    with pytest.raises(BudgetError):
        _compile(model_file, r.largest_batch + 1)
    # Without rewriting: the step as built (strategy none) fits up to the reported size.
    _compile(model_file, r.largest_batch_without_rewrite, strategy="none")
    with pytest.raises(BudgetError):
        _compile(model_file, r.largest_batch_without_rewrite + 1, strategy="none")


def test_the_table_is_consistent_and_the_search_compiled_few_sizes(searched):
    r = searched
    rows = {c.batch: c for c in r.candidates}
    assert rows[r.largest_batch].fits and rows[r.largest_batch + 1].fits is False
    timed = [c for c in r.candidates if c.samples_per_s is not None]
    assert all(c.fits for c in timed)
    assert r.fastest_batch == max(timed, key=lambda c: c.samples_per_s).batch
    assert r.picked_batch == r.fastest_batch            # --pick fastest is the default
    for c in timed:                                      # a rewrite never saves time
        assert c.overhead >= 0 and c.peak_bytes <= r.planning_budget_bytes
    assert rows[r.largest_batch].overhead > 0           # beyond the as-built edge
    # Planner calls (plans and smallest-peak searches) are few; builds stay well under
    # the 400 sizes of the range.
    assert r.stats["plans"] + r.stats["min_searches"] <= 8
    # A size the smallest-peak search decided counts a search (a refused plan runs one).
    assert r.stats["min_searches"] >= any(c.decided_by == "min-search" for c in r.candidates)
    assert r.stats["builds"] < 40
    doc = r.to_json()
    for key in ("largest_batch", "largest_batch_without_rewrite", "fastest_batch",
                "candidates"):
        assert key in doc
    json.dumps(doc)  # plain JSON, no numpy scalars or infinities


def test_the_tuned_step_runs_like_the_step_it_came_from(model_file):
    from memcc.backend.verify import verify_rewrite

    r = tune(model_file, BUDGET, RANGE, TuneOptions(points=0, pick="largest", **EXACT))
    assert r.picked_batch == r.largest_batch and r.step.metadata.get("memcc.plan")
    original = build_training_step(load_graph(model_file, {"batch": r.picked_batch}))
    v = verify_rewrite(original, r.step, budget=BUDGET)
    # Outputs bit-identical and ORT ran the planned order. The measured peak is not
    # asserted: this step is ~1 MB of tiny buffers, where malloc's own overhead is a few
    # percent (README) and the margin is off on purpose.
    assert v["outputs_match"] and v["order_matches_plan"], v["problems"]


# A tune in a fresh process whose HiGHS writes to fd 1 as 1.16's does (its banner, when the
# first Highs object is made), whatever highspy is installed.
_PRINTING_HIGHS = """
import os, sys
import highspy
real = highspy.Highs.__init__
def init(self):
    real(self)
    os.write(1, b"Running HiGHS 9.9.9 (git hash: 0): Copyright (c) 2099\\nsolver chatter\\n")
highspy.Highs.__init__ = init
from memcc.cli import app
sys.argv[0] = "memcc"
app()
"""


def test_json_stays_json_when_the_solver_prints_on_stdout(model_file):
    proc = subprocess.run(
        [sys.executable, "-c", _PRINTING_HIGHS, "tune", str(model_file), "--budget",
         str(BUDGET + 1024 * 1024), "--dim", RANGE, "--margin", "0", "--points", "0",
         "--json"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["largest_batch"] > 0
    # The solver ran (its chatter moved to stderr); its banner is dropped.
    assert "solver chatter" in proc.stderr and "Running HiGHS" not in proc.stderr


def test_cli_writes_json_the_step_and_the_plot_with_the_suggested_lr(model_file, tmp_path):
    out, plot = tmp_path / "tuned.onnx", tmp_path / "tune.png"
    # --margin 0 with the CLI's fixed 1 MiB slack: the same planning budget as above.
    res = runner.invoke(app, [
        "tune", str(model_file), "--budget", str(BUDGET + 1024 * 1024), "--dim", RANGE,
        "--margin", "0", "--pick", "largest", "--points", "0", "--json", "-o", str(out),
        "--plot", str(plot), "--ref-batch", "32", "--ref-lr", "0.1", "--lr-rule", "sqrt"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    batch = doc["largest_batch"]
    assert doc["picked_batch"] == batch and doc["output"] == str(out)
    assert doc["lr"]["rule"] == "sqrt" and doc["lr"]["applied"]
    assert math.isclose(doc["lr"]["suggested"], 0.1 * math.sqrt(batch / 32))
    step = onnx.load(str(out))
    meta = {p.key: p.value for p in step.metadata_props}
    assert math.isclose(json.loads(meta["memcc.optimizer"])["lr"], doc["lr"]["suggested"])
    shape = [d.dim_value for d in step.graph.input[0].type.tensor_type.shape.dim]
    assert shape[0] == batch
    assert plot.stat().st_size > 0


def test_cli_table_names_both_edges(model_file):
    res = runner.invoke(app, ["tune", str(model_file), "--budget", "3MB", "--dim",
                              "batch=1..64"])
    assert res.exit_code == 0, res.output
    assert "largest batch: 64" in res.stdout and "fastest batch:" in res.stdout
    assert "analytic cost model" in res.stdout


def test_the_whole_range_fitting_or_strategy_none(model_file):
    r = tune(model_file, BUDGET, "batch=1..16", TuneOptions(points=0, **EXACT))
    assert r.largest_batch == r.largest_batch_without_rewrite == 16
    r = tune(model_file, BUDGET, RANGE, TuneOptions(points=0, strategy="none", **EXACT))
    assert r.largest_batch == r.largest_batch_without_rewrite


def test_lr_rules():
    lin = TuneOptions(ref_batch=32, ref_lr=0.1)
    assert math.isclose(lin.lr_for(128), 0.4)
    assert math.isclose(TuneOptions(ref_batch=32, ref_lr=0.1, lr_rule="sqrt").lr_for(128), 0.2)
    assert TuneOptions().lr_for(128) is None
    with pytest.raises(InputError, match="go together"):
        TuneOptions(ref_batch=32)


@pytest.mark.parametrize("text, message", [
    ("batch=1-512", "NAME=LOW..HIGH"),
    ("batch=..8", "NAME=LOW..HIGH"),
    ("batch", "NAME=LOW..HIGH"),
    ("batch=8..4", "empty"),
    ("batch=0..4", "start at 1"),
])
def test_bad_ranges_fail_clearly(text, message):
    with pytest.raises(InputError, match=message):
        parse_range(text)


def test_unknown_or_fixed_dimensions_say_how_to_export(model_file, tmp_path):
    with pytest.raises(InputError, match=r"symbolic dimensions are batch") as exc:
        tune(model_file, BUDGET, "seq=1..8", TuneOptions(**EXACT))
    assert "dynamic_axes" in str(exc.value)
    # a sequence is no batch axis: not advised as axis 0 (a walk-through read {0: 'seq'})
    assert "{0: 'seq'}" not in str(exc.value) and "batch axis" not in str(exc.value)
    assert "{AXIS: 'seq'}" in str(exc.value)
    fixed = tmp_path / "fixed.onnx"
    onnx.save(_mlp(dynamic=False), str(fixed))
    with pytest.raises(InputError, match="no symbolic dimension") as exc:
        tune(fixed, BUDGET, RANGE, TuneOptions(**EXACT))
    assert "dynamic_axes" in str(exc.value) and "dynamic_shapes" in str(exc.value)


def test_budgets_that_cannot_fit_fail_clearly(model_file, tmp_path):
    with pytest.raises(InputError, match="parameters and optimizer state alone"):
        tune(model_file, 200_000, RANGE, TuneOptions(**EXACT))
    with pytest.raises(InputError, match="give a size"):
        tune(model_file, "min", RANGE, TuneOptions(**EXACT))
    with pytest.raises(InputError, match="--budget 50%: tune searches"):
        tune(model_file, " 50% ", RANGE, TuneOptions(**EXACT))
    res = runner.invoke(app, ["tune", str(model_file), "--budget", "1GB", "--dim", RANGE,
                              "-o", str(tmp_path / "missing" / "x.onnx")])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = runner.invoke(app, ["tune", str(model_file), "--budget", "1GB", "--dim", "batch=4"])
    assert res.exit_code == 2 and "LOW..HIGH" in res.output


def test_a_training_step_is_refused(tmp_path):
    from memcc.backend.onnx_file import save_graph

    step = tmp_path / "step.onnx"
    save_graph(build_training_step(load_graph(_mlp(), {"batch": 4})), step)
    with pytest.raises(InputError, match="forward model"):
        tune(step, BUDGET, RANGE, TuneOptions(**EXACT))


def test_measure_reports_measured_throughput_next_to_the_prediction(searched):
    from memcc.tune import measure

    r = measure(searched, top=1, steps=1)
    measured = [c for c in r.candidates if c.measured_step_s is not None]
    assert len(measured) == 1 and measured[0].batch == searched.fastest_batch
    assert measured[0].measured_samples_per_s > 0 and measured[0].measured_peak_bytes > 0
    assert r.to_json()["candidates"][0].keys() >= {"measured_samples_per_s", "samples_per_s"}


def test_on_cuda_the_edge_follows_the_arena_as_compile_does(model_file):
    """With ``--provider cuda`` (no GPU here: node times estimated), tune judges sizes by the
    CUDA arena replay, as compile does: the largest size it reports compiles for CUDA, and
    the next size up is refused. (A CUDA step takes whole 2 MiB device pages, for its arena
    and for the buffers the runtime binds beside it, and its session holds handles of its
    own, so the budget is those and a few pages, and the range wider.)"""
    from memcc.passes.analysis.device_memory import CUDA_SESSION_BYTES

    opts = dict(EXACT, provider="cuda")
    budget = CUDA_SESSION_BYTES + 9_000_000
    r = tune(model_file, budget, "batch=1..8192", TuneOptions(points=0, strategy="none",
                                                               **opts))
    edge = r.largest_batch
    assert 1 <= edge < 8192  # inside the range, so the size above it is checked too
    res = compile_model(model_file, CompileOptions(budget=budget, strategy="none",
                                                   dims={"batch": edge}, **opts))
    assert res.report["plan"]["peak_bytes"] <= budget
    assert res.report["plan"]["device_arena"]["peak_device_bytes"] <= budget
    with pytest.raises(BudgetError):
        compile_model(model_file, CompileOptions(budget=budget, strategy="none",
                                                 dims={"batch": edge + 1}, **opts))
    # Below the session's own bytes nothing fits, and tune says so before any plan; just
    # above them, below one more page, the search says what would (strategy none included).
    with pytest.raises(InputError, match="CUDA session's own handles and workspaces alone"):
        tune(model_file, 1_300_000, RANGE, TuneOptions(points=0, strategy="none", **opts))
    with pytest.raises(InputError, match="needs a peak of"):
        tune(model_file, CUDA_SESSION_BYTES + 1_300_000, RANGE,
             TuneOptions(points=0, strategy="none", **opts))


def test_on_cuda_tune_plans_batchnorm_as_compile_does(tmp_path):
    """With ``--provider cuda``, compile writes training-mode BatchNorm as standard ops
    (the CUDA provider refuses it); tune has to judge the same graph, or its edge is a size
    compile refuses."""
    from exports import export

    path, _, _, _ = export("conv_bn", "torchscript", tmp_path, training=True)
    from memcc.passes.analysis.device_memory import CUDA_SESSION_BYTES

    opts = dict(EXACT, provider="cuda")
    budget = CUDA_SESSION_BYTES + 6_000_000
    r = tune(path, budget, "batch=1..4096", TuneOptions(points=0, strategy="none", **opts))
    edge = r.largest_batch
    assert 1 <= edge < 4096
    res = compile_model(path, CompileOptions(budget=budget, strategy="none",
                                             dims={"batch": edge}, **opts))
    load = next(p for p in res.report["passes"] if p["name"] == "load")
    assert load["summary"]["batchnorm_rewritten"] == 1
    with pytest.raises(BudgetError):
        compile_model(path, CompileOptions(budget=budget, strategy="none",
                                           dims={"batch": edge + 1}, **opts))


def _figure_result(candidates, *, largest: int, base_edge: int | None, budget: int,
                   target: int):
    from memcc.tune import SearchRange, TuneResult

    return TuneResult(
        model="m.onnx", range=SearchRange("batch", 1, 64), budget_bytes=budget,
        planning_budget_bytes=target, candidates=tuple(candidates), largest_batch=largest,
        largest_batch_without_rewrite=base_edge, fastest_batch=largest, picked_batch=largest,
        pick="fastest", step=None, cost_source="analytic", strategy="auto", lr_rule=None,
        lr=None, lr_applied=False, stats={}, time_s=0.0)


def test_tune_figure_draws_what_each_row_knows_and_the_whole_search():
    """issue 35, item 11: a size that misses the planning target but not the budget, the
    planning target itself, sizes the search went to past 1.3x the edge, and rows where
    only the step as built was looked at (no plan's peak drawn there)."""
    import matplotlib.pyplot as plt

    from memcc.tune import Candidate, tune_figure

    mb = 1e6

    def row(batch, fits, decided, peak, kind, base, step_s=None):
        return Candidate(batch=batch, fits=fits, decided_by=decided, peak_bytes=peak,
                         peak_kind=kind, baseline_peak_bytes=base, baseline_step_s=0.01,
                         step_s=step_s)

    rows = [row(4, True, "baseline", 40e6, "as built", 40e6, 0.01),
            row(8, True, "baseline", 80e6, "as built", 80e6, 0.02),
            row(12, True, "below-edge", None, None, 120e6),
            row(16, True, "plan", 95e6, "plan", 160e6, 0.04),
            row(18, True, "above-edge", 120e6, "sqrt(n)", 180e6),  # a bound, not a plan
            row(20, False, "min-search", 99e6, "smallest", 200e6),
            row(64, False, "floor", 150e6, "floor", 640e6)]
    result = _figure_result(rows, largest=16, base_edge=8, budget=100_000_000,
                            target=96_950_000)
    fig = tune_figure(result)
    try:
        ax = fig.axes[0]
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        plan = next(ln for label, ln in lines.items() if label.startswith("peak of the plan"))
        assert list(plan.get_xdata()) == [4, 8, 16]  # not 12 (below-edge), 18, 20, 64
        target = next(ln for label, ln in lines.items() if label.startswith("planning target"))
        assert target.get_ydata()[0] == pytest.approx(96.95)
        budget = next(ln for label, ln in lines.items() if label.startswith("budget"))
        assert budget.get_ydata()[0] == pytest.approx(100.0)
        miss = lines["does not fit"]
        assert list(miss.get_xdata()) == [20, 64]
        # batch 20 is crossed under the budget but over the target it was judged by
        assert target.get_ydata()[0] < miss.get_ydata()[0] < budget.get_ydata()[0]
        smallest = next(ln for label, ln in lines.items() if label.startswith("smallest"))
        assert list(smallest.get_xdata()) == [20]
        bound = next(ln for label, ln in lines.items() if "upper bound" in label)
        assert list(bound.get_xdata()) == [18]
        left, right = ax.get_xlim()
        assert left < 4 and right > 64  # the whole search, 64 included
        assert ax.get_xscale() == "log"
        built = next(ln for label, ln in lines.items() if label.startswith("peak as built"))
        assert list(built.get_xdata()) == [4, 8, 12, 16, 18, 20, 64]
        assert all("MB" in a.get_ylabel() or "samples" in a.get_ylabel() for a in fig.axes)
        assert max(y for y in plan.get_ydata()) <= ax.get_ylim()[1]
        assert 150e6 / mb <= ax.get_ylim()[1]  # the floor at 64 is on the chart
        assert not any("measured" in ln.get_label() for a in fig.axes for ln in a.get_lines())
    finally:
        plt.close(fig)
    # --measure: the measured peaks and speeds are drawn beside the predictions.
    import dataclasses

    rows[1] = dataclasses.replace(rows[1], measured_step_s=0.025, measured_peak_bytes=84e6)
    rows[3] = dataclasses.replace(rows[3], measured_step_s=0.05, measured_peak_bytes=97e6)
    fig = tune_figure(_figure_result(rows, largest=16, base_edge=8, budget=100_000_000,
                                     target=96_950_000))
    try:
        found = {ln.get_label(): ln for a in fig.axes for ln in a.get_lines()}
        peak = found["peak measured in ONNX Runtime (--measure)"]
        assert list(peak.get_xdata()) == [8, 16]
        assert list(peak.get_ydata()) == pytest.approx([84.0, 97.0])
        speed = next(ln for label, ln in found.items() if label.startswith("measured samples"))
        assert list(speed.get_ydata()) == pytest.approx([8 / 0.025, 16 / 0.05])
        assert "measured" in fig.axes[1].get_ylabel()
    finally:
        plt.close(fig)
