"""``memcc compile``'s summary lines (``memcc/report_text.py``) as a person reads them."""

from __future__ import annotations

from memcc.report_text import summary_lines


def _report(recomputed: list[str]) -> dict:
    plan = {"peak_bytes": 500, "fits": True, "strategy": "ilp", "overhead": 0.035,
            "recomputed_values": recomputed}
    return {"budget_bytes": 1_000, "baseline": {"peak_bytes": 800}, "plan": plan}


def test_one_recomputed_value_is_singular_and_more_are_plural():
    # A ResNet compiled at --budget min printed "1 values recomputed" (session 36 audit).
    one = summary_lines(_report(["a"]))
    assert any("ilp: 1 value recomputed," in line for line in one), one
    two = summary_lines(_report(["a", "b"]))
    assert any("ilp: 2 values recomputed," in line for line in two), two


def test_chosen_row_chunks_say_their_step_time_against_the_step_without_them():
    """The summary's added time is against the chunked step as built; a DeiT-tiny at
    --budget min read +15.9% where the chosen split made the step 2.5 times as long as the
    unchunked one (the sweep of session 24): the row-chunk line says that too."""
    report = _report(["a"])
    report["row_chunks"] = {
        "chosen": {"loss": 1, "attention": 8, "mlp": 8}, "searched": True,
        "candidates": [{"chunks": {"loss": 1, "attention": 1, "mlp": 1}, "added_time": 0.134,
                        "chosen": False},
                       {"chunks": {"loss": 1, "attention": 8, "mlp": 8}, "added_time": 1.5253,
                        "chosen": True}]}
    assert ("row chunks attention 8, mlp 8: predicted step time +152.5% against the step "
            "without chunks, plan included (chosen by compile of 2 settings planned)"
            ) in summary_lines(report)
    report["row_chunks"]["chosen"] = {"loss": 1, "attention": 1, "mlp": 1}
    report["row_chunks"]["candidates"][0]["chosen"] = True
    report["row_chunks"]["candidates"][1]["chosen"] = False
    assert "row chunks none (chosen by compile of 2 settings planned)" in summary_lines(report)


def test_a_smallest_budget_the_clock_cut_says_so():
    """Two runs of --budget min on the shipped GPT-2 named 5.00 and 4.82 MB, the report
    holding ``limit_hit: "time"`` and the summary saying "(smallest reachable)" alone (a
    README walk-through, session 33). A search the clock stopped is now said, at
    --budget min only (at a budget the plan fits either way)."""
    report = _report(["a"])
    report["budget_was_min"] = True
    report["options"] = {"time_limit": 60.0}
    report["strategies"] = [{"strategy": "ilp", "limit_hit": "time"},
                            {"strategy": "polish", "cut_by_time_limit": ["polish"]},
                            {"strategy": "ilp", "limit_hit": "work"}]
    said = [line for line in summary_lines(report) if line.startswith("search")]
    assert said == ["search   2 searches stopped by their share of --time-limit 60 s: a longer "
                    "--time-limit may reach a smaller budget, and runs can differ"]
    report["strategies"] = [{"strategy": "ilp", "limit_hit": "work"}]
    assert not any(line.startswith("search") for line in summary_lines(report))
    # A solve the clock left unrun counts too (request.stopped_by_clock, as analyze reads it).
    report["strategies"] = [{"strategy": "ilp", "status": "not run: time limit reached"}]
    assert any(line.startswith("search   1 search stopped by its share of --time-limit 60 s")
               for line in summary_lines(report))  # not "1 search ... their share
    report["strategies"] = [{"strategy": "ilp", "limit_hit": "time"}]
    report["budget_was_min"] = False
    assert not any(line.startswith("search") for line in summary_lines(report))


def test_a_cpu_plan_beyond_its_variants_tolerance_gets_cpu_advice():
    """A CPU plan with inexact variants that failed --verify was told about "the CUDA
    tolerance ... on this GPU" (the plans-trained sweep, session 33: a ViT under AdamW)."""
    from memcc.compiler.advice import next_steps
    from memcc.compiler.options import CompileOptions

    v = {"outputs_match": False, "comparison": "within relative 1e-05 (the plan's inexact "
         "variants)", "measured_peak_bytes": 1, "budget_bytes": 10, "peak_within_budget": True,
         "order_matches_plan": True}
    said = " ".join(next_steps(v, CompileOptions(), 1, "m.onnx", 0))
    assert "CUDA" not in said and "GPU" not in said
    assert "--no-variants" in said and "within relative 1e-05" in said


def test_the_replan_for_time_signs_its_added_times():
    """A plan made again for time can add less than nothing (its variants cost less than
    the nodes they replace): the line read "for time: +-0.1%" (a walk-through)."""
    report = _report(["a"])
    report["plan"]["overhead"] = -0.001
    report["baseline"]["compute_cost_s"] = 1.0
    report["passes"] = [{"name": "plan", "summary": {"replanned_at_smallest": {
        "smallest_peak_plan": {"added_time_s": 0.25}}}}]
    line = next(x for x in summary_lines(report) if "planned again" in x)
    assert "(+25.0%)" in line and line.endswith("for time: -0.1%") and "+-" not in line
