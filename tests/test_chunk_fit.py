"""Row chunks for a step that fits as built (``compiler/chunk_fit.py``): planned only where
the plan as built adds time and a setting's own added time, estimated from its build, is
below it; within what is left of ``--time-limit``.

A zoo GPT-2 whose logits (2 x 64 tokens x 4,096 words) are its largest tensors: at 9 MB
the step as built fits only by recomputing (several per cent of added time, analytic
costs), while the loss over 8 chunks fits with nothing recomputed at a smaller added time;
at 12 MB the step as built recomputes nothing and nothing else is built.
"""

from __future__ import annotations

import io
import time

import onnx
import pytest
from rich.console import Console

from memcc.compiler import CompileOptions, compile_model
from memcc.compiler.chunk_fit import FitSearch, search_fitting
from memcc.frontend.build import BuildOptions
from memcc.report_view import print_report
from models import build_model

RECOMPUTES = 9_000_000   # the step as built fits here only by recomputing
NO_RECOMPUTE = 12_000_000  # and here with nothing recomputed


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("chunkfit") / "gpt2.onnx"
    onnx.save(build_model("gpt2", batch=2, seq_len=64, width=32, depth=1, heads=2,
                          vocab_size=4096), str(path))
    return path


def test_a_fitting_step_that_recomputes_is_split_where_that_adds_less(gpt2, tmp_path):
    said: list[str] = []
    result = compile_model(gpt2, CompileOptions(budget=RECOMPUTES, cost="analytic",
                                                time_limit=20, verify=True),
                           output=tmp_path / "out.onnx", progress=said.append)
    rc = result.report["row_chunks"]
    as_built, chosen = rc["candidates"][0], rc["candidates"][-1]
    # The premise: the step as built fits, at an added time (recompute).
    assert as_built["chunks"] == {"loss": 1, "attention": 1, "mlp": 1} and as_built["fits"]
    assert as_built["needs_budget_bytes"] <= RECOMPUTES
    assert as_built["added_time"] == rc["as_built_added_time"] > 0.02
    # The loss over 8 chunks was screened in by its estimate, planned, and won.
    assert rc["chosen"] == {"loss": 8, "attention": 1, "mlp": 1} and rc["searched"]
    assert chosen["chosen"] and chosen["chunks"] == rc["chosen"]
    assert chosen["estimated_added_time"] < as_built["added_time"]
    assert chosen["added_time"] < as_built["added_time"]
    assert rc["screened"][0]["planned"] and rc["screened"][0]["chunks"] == rc["chosen"]
    assert rc["why"].startswith(f"the step as built fits at "
                                f"{as_built['added_time']:+.1%} (recompute, variants or "
                                "offload); loss 8 fits at less added time and was chosen")
    assert any(m.startswith("row chunks: planning the step built with loss 8") for m in said)
    # The chosen plan runs and fits.
    v = result.report["verification"]
    assert v["ok"] and v["measured_peak_bytes"] <= RECOMPUTES
    names = [p["name"] for p in result.report["passes"]]
    assert names.count("load") == 1 and names.count("plan") == 1
    # Priced by the screen, not measured again.
    cost = next(p["summary"] for p in result.report["passes"] if p["name"] == "cost_model")
    assert cost["priced_from_step_as_loaded"]
    buf = io.StringIO()
    print_report(result.report, Console(file=buf, width=220))
    printed = buf.getvalue()
    assert "row chunks tried" in printed and "estimated" in printed
    assert "<- chosen" in printed and "loss 8 fits at less added time" in printed


def test_a_step_that_fits_without_recompute_builds_no_other_setting(gpt2):
    result = compile_model(gpt2, CompileOptions(budget=NO_RECOMPUTE, cost="analytic"))
    rc = result.report["row_chunks"]
    assert result.report["plan"]["overhead"] == 0.0
    assert rc["chosen"] == {"loss": 1, "attention": 1, "mlp": 1} and not rc["searched"]
    assert "candidates" not in rc and "screened" not in rc
    assert rc["why"].startswith("the step as built fits the budget with no added time")
    names = [p["name"] for p in result.report["passes"]]
    assert names.count("load") == 1 and names.count("plan") == 1


def test_flags_still_override_a_step_that_recomputes(gpt2):
    kept = compile_model(gpt2, CompileOptions(budget=RECOMPUTES, cost="analytic",
                                              build=BuildOptions(loss_chunks=1)))
    rc = kept.report["row_chunks"]
    assert rc["chosen"]["loss"] == 1
    assert all(e["chunks"]["loss"] == 1 for e in rc.get("screened", []))
    whole = compile_model(gpt2, CompileOptions(budget=RECOMPUTES, cost="analytic",
                                               build=BuildOptions(loss_chunks=1,
                                                                  attention_chunks=1,
                                                                  mlp_chunks=1)))
    rc = whole.report["row_chunks"]
    assert rc["why"].startswith("every kind was set by a flag") and "screened" not in rc
    assert whole.report["plan"]["overhead"] > 0   # it recomputes, and keeps doing so


def test_a_setting_the_time_limit_leaves_no_room_for_is_not_planned():
    """The step as built took 10 s to cost and plan; 1 s is left: the setting screened in
    by its estimate is not planned, and the screen says why."""
    planned: list = []
    s = FitSearch(first_added=0.2, base_time=1.0, ladder=[{"loss": 8}, {"loss": 16}],
                  estimate=lambda c: (0.01, 100), plan=lambda c: planned.append(c),
                  spent_s=10.0, nodes=100, deadline=time.perf_counter() + 1.0)
    assert search_fitting(s) is None and planned == []
    assert len(s.screen) == 1 and s.screen[0]["estimated_added_time"] == 0.01
    assert s.screen[0]["skipped"].startswith("--time-limit: ")
    assert "expected to take 10.0 s" in s.screen[0]["skipped"]
