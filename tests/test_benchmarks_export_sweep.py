"""benchmarks/export_sweep.py end to end on one small module (torchvision and timm are not
test dependencies): export in train mode, compile as built and at --budget min --verify,
one table row from the reports."""

from __future__ import annotations

import onnx
from exports import HardSwishSE

from benchmarks import export_sweep


def test_a_row_reports_the_verified_plan(monkeypatch, tmp_path):
    monkeypatch.setattr(export_sweep, "_models", lambda: {"tiny": lambda: HardSwishSE(0.2)})
    monkeypatch.setitem(export_sweep.RESOLUTION, "tiny", 32)
    for exporter in ("torchscript", "dynamo_noopt"):
        row = export_sweep.one("tiny", exporter, tmp_path, batch=16, time_limit=20)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[:2] == ["tiny", exporter], row
        assert cells[7].startswith("OK:"), row
        as_built, plan, measured = (float(c) for c in cells[2:5])
        assert plan <= as_built and measured > 0
        # Each exporter's own file (the script asks TorchScript for opset 17, dynamo writes
        # its own newer default).
        model = onnx.load(str(tmp_path / f"tiny.{exporter}.onnx"), load_external_data=False)
        opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
        assert (opset == 17) == (exporter == "torchscript"), opset


def test_at_a_fraction_too_small_the_named_budget_is_compiled(monkeypatch, tmp_path):
    monkeypatch.setattr(export_sweep, "_models", lambda: {"tiny": lambda: HardSwishSE(0.2)})
    monkeypatch.setitem(export_sweep.RESOLUTION, "tiny", 32)
    # a tenth of the step's peak as built: below what parameters and state alone take
    row = export_sweep.one("tiny", "torchscript", tmp_path, batch=16, time_limit=20, at=0.1)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7].startswith("OK:") and "refused" in cells[7], row


def test_an_eval_mode_export_is_its_own_file_and_verifies(monkeypatch, tmp_path):
    monkeypatch.setattr(export_sweep, "_models", lambda: {"tiny": lambda: HardSwishSE(0.2)})
    monkeypatch.setitem(export_sweep.RESOLUTION, "tiny", 32)
    row = export_sweep.one("tiny", "torchscript", tmp_path, batch=16, time_limit=20,
                           train=False)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[7].startswith("OK:"), row
    model = onnx.load(str(tmp_path / "tiny.torchscript.eval.onnx"))
    # eval mode: no Dropout left in the graph
    assert not [n for n in model.graph.node if n.op_type == "Dropout"]
