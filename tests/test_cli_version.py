"""``memcc --version``: the first thing a bug report asks for."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

from typer.testing import CliRunner

from memcc.cli import app

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_installed_version_and_runs_nothing_else():
    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    assert r.output == f"memcc {version('memcc')}\n"
    # The metadata is pyproject.toml's version (an editable install reads it from there).
    declared = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and r.output.split()[1] == declared.group(1)


def test_version_wins_over_a_command_and_commands_still_work(tmp_path):
    r = CliRunner().invoke(app, ["--version", "report", str(tmp_path / "nope.json")])
    assert r.exit_code == 0 and r.output.startswith("memcc ")  # eager: nothing else ran
    r = CliRunner().invoke(app, ["report", str(tmp_path / "nope.json")])
    assert r.exit_code == 2 and "no such file" in r.output
