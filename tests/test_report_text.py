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
