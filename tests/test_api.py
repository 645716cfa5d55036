"""``memcc.api`` is the façade the CLI calls: every name it lists resolves, the CLI reaches
memcc through it alone, and importing it loads nothing heavy (``memcc --help`` and
``memcc build`` do not pay for the planner or ONNX Runtime)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import memcc.api as api

ROOT = Path(__file__).resolve().parents[1]


def test_every_api_name_resolves_and_an_unknown_one_is_an_attribute_error() -> None:
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    assert set(api.__all__) <= set(dir(api))
    with pytest.raises(AttributeError, match="no_such_name"):
        api.no_such_name  # noqa: B018


def _memcc_imports(path: Path) -> list[str]:
    """The memcc modules a file imports (``from memcc import api`` counts as memcc.api)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "memcc"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "memcc":
                found += [f"memcc.{a.name}" for a in node.names]
            elif node.module.startswith("memcc."):
                found.append(node.module)
    return found


def test_the_cli_reaches_memcc_through_the_api_alone() -> None:
    files = sorted((ROOT / "memcc" / "cli").glob("*.py"))
    assert len(files) >= 5  # the package, not an old single module
    outside = {f"{p.name}: {m}" for p in files for m in _memcc_imports(p)
               if m != "memcc.api" and not m.startswith("memcc.cli")}
    assert not outside, f"the CLI imports memcc outside memcc.api: {sorted(outside)}"


def test_importing_the_api_and_the_cli_loads_no_operation() -> None:
    heavy = ["onnxruntime", "memcc.compiler", "memcc.tune", "memcc.trainer", "matplotlib"]
    code = (f"import sys, memcc.api, memcc.cli; "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout
