"""benchmarks/export_sweep.py end to end on one small module (torchvision and timm are not
test dependencies): export in train mode, compile as built and at --budget min --verify,
one table row from the reports."""

from __future__ import annotations

from exports import HardSwishSE

from benchmarks import export_sweep


def test_a_row_reports_the_verified_plan(monkeypatch, tmp_path):
    monkeypatch.setattr(export_sweep, "_models", lambda: {"tiny": lambda: HardSwishSE(0.2)})
    monkeypatch.setitem(export_sweep.RESOLUTION, "tiny", 8)
    row = export_sweep.one("tiny", "torchscript", tmp_path, batch=4, time_limit=20)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["tiny", "torchscript"], row
    assert cells[7].startswith("OK:"), row
    as_built, plan, measured = (float(c) for c in cells[2:5])
    assert plan <= as_built and measured > 0
