"""The pass contract (memcc/pass_contract.py): one runner checks, times and reports every
pass; the contract and the report reader stand below the drivers (imports checked)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from memcc.graph import Graph
from memcc.pass_contract import Pass, PassReport, PassRunner

ROOT = Path(__file__).resolve().parents[1]


def _graph() -> Graph:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    node = helper.make_node("Relu", ["x"], ["y"], name="relu")
    return Graph.from_model(helper.make_model(helper.make_graph([node], "g", [x], [y])))


def test_runner_runs_in_order_and_reports_each_pass():
    g = _graph()
    seen: list[str] = []

    def copy(graph: Graph) -> tuple[Graph, dict]:
        seen.append("copy")
        return graph.copy(), {"nodes": len(graph.nodes)}

    def same(graph: Graph) -> tuple[Graph, dict]:
        seen.append("same")
        return graph, {}

    runner = PassRunner()
    out = runner.run((Pass("copy", copy), Pass("same", same)), g)
    assert seen == ["copy", "same"] and out is not g
    assert [(r.name, r.changed, r.summary) for r in runner.reports] == [
        ("copy", True, {"nodes": 1}), ("same", False, {})]
    assert all(r.time_s >= 0 for r in runner.reports)
    assert PassReport("p", {"a": 1}, time_s=0.123456).to_json() == {
        "name": "p", "time_s": 0.1235, "summary": {"a": 1}}


def test_requires_always_ensures_per_check_and_a_failed_pass_leaves_no_report():
    g = _graph()
    calls: list[str] = []

    def refuse(graph: Graph) -> None:
        raise ValueError("refused")

    def broken(before: Graph, after: Graph, report: PassReport, full: bool) -> None:
        calls.append(f"ensures full={full}")
        raise ValueError("broken")

    with pytest.raises(ValueError, match="refused"):
        PassRunner(check="off").apply(Pass("p", lambda x: (x, {}), requires=refuse), g)
    runner = PassRunner(check="off")
    runner.apply(Pass("p", lambda x: (x, {}), ensures=broken), g)
    assert calls == [] and len(runner.reports) == 1
    for check in ("fast", "full"):
        runner = PassRunner(check=check)
        with pytest.raises(ValueError, match="broken"):
            runner.apply(Pass("p", lambda x: (x, {}), ensures=broken), g)
        assert runner.reports == []
    assert calls == ["ensures full=False", "ensures full=True"]
    with pytest.raises(ValueError, match="choose off, fast or full"):
        PassRunner(check="some")


def test_stage_says_times_and_reports_a_compile_stage():
    said: list[str] = []
    runner = PassRunner(said.append)
    assert runner.stage("load", lambda: (42, {"nodes": 3})) == 42
    assert said == ["load ..."]
    assert runner.reports[0].name == "load" and runner.reports[0].summary == {"nodes": 3}


def _memcc_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    return {m for m in names if m.startswith("memcc")}


def test_the_contract_and_the_report_reader_stand_below_the_drivers():
    """pass_contract imports only the graph (the frontend stands on it); the report reader
    and its words import no driver (compiler, tune, trainer, cli)."""
    assert _memcc_imports(ROOT / "memcc" / "pass_contract.py") == {"memcc.graph"}
    drivers = ("memcc.compiler", "memcc.tune", "memcc.trainer", "memcc.cli", "memcc.api")
    for name in ("report_view.py", "report_text.py"):
        bad = {m for m in _memcc_imports(ROOT / "memcc" / name) if m.startswith(drivers)}
        assert not bad, (name, bad)
