"""benchmarks/first_use_run.py on the zoo's smallest model: every first-use command runs and
its cell says what it measured (a regression in any command shows as a FAILED cell)."""

from __future__ import annotations

import onnx

from benchmarks import first_use_run
from models import build_model


def test_every_command_of_a_row_runs(tmp_path):
    exports = tmp_path / "exports"
    exports.mkdir()
    onnx.save(build_model("mlp", batch=4), str(exports / "mlp.zoo.train.onnx"))
    row = first_use_run.run_case(exports / "mlp.zoo.train.onnx", tmp_path / "work", tl=5,
                                 timeout=120)
    assert row["build"].startswith("ok"), row
    assert row["as_built_mb"] > 0 and "FAILED" not in row["half"], row
    assert row["min"]["plan_mb"] <= row["as_built_mb"], row
    assert row["run"]["order"] is True and row["run"]["measured_mb"] > 0, row
    assert row["train"].startswith("ok, resume bit-identical"), row
    assert row["train"].endswith("export ok"), row
    assert row["between"]["verify"] is True, row
    assert row["between"]["budget_mb"] > row["min"]["budget_mb"], row
    assert first_use_run.markdown(row).count("|") == 10
