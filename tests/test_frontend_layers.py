"""The frontend's imports run one way (issue 32): down to memcc's bottom modules, never up
into the passes, the backend or the drivers, and never in a circle among its own modules
(the gradient rule modules register variants into ``variant_registry``, which imports no
rule module; ``frontend/ort_kernels.py`` holds the ORT facts the loader needs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRONTEND = ROOT / "memcc" / "frontend"
# What the frontend may import from memcc, apart from its own modules.
BELOW = ("memcc.errors", "memcc.graph", "memcc.step", "memcc.union_find", "memcc.sizes",
         "memcc.pass_contract")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The memcc modules ``path`` imports (``from memcc.x import y`` counts as ``memcc.x``
    and, where ``y`` is a module, ``memcc.x.y``)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("memcc.")}


def _frontend_modules() -> dict[str, Path]:
    return {_module(p): p for p in FRONTEND.rglob("*.py")}


def test_frontend_imports_nothing_above_it():
    modules = _frontend_modules()
    upward = {}
    for name, path in modules.items():
        bad = sorted(m for m in _imports(path, top_level_only=False)
                     if m not in modules and not m.startswith("memcc.frontend.")
                     and not m.startswith(BELOW))
        if bad:
            upward[name] = bad
    assert not upward, f"frontend modules importing above the frontend: {upward}"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle in ``graph`` (module -> the modules it imports), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_circle_among_frontend_modules():
    """Imports inside functions count too: ``variants.load_variants`` importing the rule
    modules that imported ``variants`` was the circle issue 32 names."""
    modules = _frontend_modules()
    graph = {name: {m for m in _imports(path, top_level_only=False) if m in modules}
             for name, path in modules.items()}
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph))}"
