"""The package's structure (issue 32): imports run one way, no import circles, small modules,
short and narrow functions. Read from the source with ``ast`` alone (nothing is imported),
so the whole file runs in well under a second.

Layers, bottom to top (a module may import from its own layer and the ones below):

0. the shared bottom: every module directly under ``memcc/`` that is not a driver
   (``errors``, ``sizes``, ``graph``, ``step``, and any shared helper that joins them);
1. ``memcc.frontend``;
2. ``memcc.passes``, inside it ``plan`` < ``analysis`` < ``providers`` < ``lowering`` <
   ``planning`` (``passes/__init__.py`` says why);
3. ``memcc.backend``;
4. the drivers (``DRIVERS``) and the package itself (``memcc/__init__.py``).

Function-level imports count for the layers (an import that breaks a circle is still an
import against the layers) but not for circles: a circle is a set of modules that import
one another when they are loaded, so only imports run at load time make one.

Today's violations are listed in ``ALLOWED``: other work is removing them. The test fails on
a violation that is not listed, and on a listed one that is gone, so the list only shrinks.
The checks themselves are tested on small made-up packages at the end of the file, so
each one is known to fail when it should.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "memcc"

# Modules (and packages) directly under memcc/ that drive the rest: everything else
# directly under memcc/ is the shared bottom. A new driver module goes here.
DRIVERS = ("compiler", "analyze", "tune", "trainer", "report", "report_view", "report_text",
           "api", "cli", "dist", "__main__")
# Inside memcc.passes, bottom to top.
PASS_ROOMS = ("plan", "analysis", "providers", "lowering", "planning")
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 6
# The gradient rule catalogues: one rule per op, long by nature.
LONG_MODULES_BY_DESIGN = {f"memcc/frontend/gradients/{m}.py"
                          for m in ("elementwise", "nn", "shape_ops", "variant_rules")}

# Today's violations (2026-11-26, branch h32-low), each a key the checks below produce:
#   "upward: <importer> -> <imported>"   an import against the layers
#   "cycle: <a> <b> ..."                 modules importing one another at load time
#   "lines: <file>"                      a module over MAX_MODULE_LINES
#   "long: <file>::<function>"           a function over MAX_FUNCTION_LINES
#   "wide: <file>::<function>"           a function over MAX_PARAMETERS parameters
# Other helpers are removing these now; the lead empties this list when their work is
# merged. Do not add to it: fix the new violation instead.
ALLOWED = frozenset({
})


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class Import:
    importer: str     # module name
    target: str       # module name (a submodule where ``from pkg import sub`` names one)
    path: str         # the importing file, relative to the root
    line: int
    at_load: bool     # run when the module loads (not inside a function or TYPE_CHECKING)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files(root: Path, package: str) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of ``package`` under ``root``."""
    return {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk_imports(body: list[ast.stmt], at_load: bool):
    """Every import statement under ``body``, with whether it runs when the module loads."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, at_load
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk_imports(node.body, False)
        elif isinstance(node, ast.If) and _is_type_checking(node):
            yield from _walk_imports(node.body, False)
            yield from _walk_imports(node.orelse, at_load)
        else:
            for field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
                children = getattr(node, field_name, None)
                if isinstance(children, list):
                    yield from _walk_imports(
                        [c for c in children if isinstance(c, ast.AST)], at_load)


@functools.cache
def parsed(path: Path) -> tuple[ast.Module, int]:
    """A file's syntax tree and its number of lines, read once per run."""
    text = path.read_text()
    return ast.parse(text, filename=str(path)), len(text.splitlines())


def imports_of(name: str, path: Path, root: Path, modules: set[str]) -> list[Import]:
    """The imports of module ``name`` (file ``path``) that land inside the package."""
    tree, _ = parsed(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    rel = str(path.relative_to(root))
    found = []
    for node, at_load in _walk_imports(tree.body, True):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        for target in dict.fromkeys(targets):
            while target and target not in modules:   # ``import memcc.x.y`` of a name
                target = target.rpartition(".")[0]
            if target and target != name:
                found.append(Import(name, target, rel, node.lineno, at_load))
    return found


# ---------------------------------------------------------------------------- the checks
def layer(module: str, package: str = PACKAGE) -> tuple[int, int]:
    """(layer, room inside memcc.passes) of a module of the package."""
    parts = module.split(".")
    if len(parts) == 1:
        return (4, 0)  # the package's own __init__: the façade over the drivers
    top = parts[1]
    if top in DRIVERS:
        return (4, 0)
    if top == "frontend":
        return (1, 0)
    if top == "passes":
        room = parts[2] if len(parts) > 2 else "plan"
        return (2, PASS_ROOMS.index(room) if room in PASS_ROOMS else 0)
    if top == "backend":
        return (3, 0)
    return (0, 0)


def upward_imports(imports: list[Import]) -> dict[str, Import]:
    """Key -> the first import against the layers for each (importer, imported) pair."""
    out: dict[str, Import] = {}
    for imp in imports:
        if layer(imp.target) > layer(imp.importer):
            out.setdefault(f"upward: {imp.importer} -> {imp.target}", imp)
    return out


def import_cycles(imports: list[Import]) -> dict[str, list[Import]]:
    """Key -> the load-time imports that close each circle (strongly connected components
    of the load-time import graph with more than one module)."""
    edges: dict[str, list[Import]] = {}
    for imp in imports:
        if imp.at_load:
            edges.setdefault(imp.importer, []).append(imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        # Tarjan's algorithm, iterative: (node, next edge to follow).
        work = [(start, 0)]
        while work:
            node, k = work.pop()
            if k == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            out = edges.get(node, [])
            if k < len(out):
                work.append((node, k + 1))
                nxt = out[k].target
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                components.append(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    cycles = {}
    for comp in components:
        if len(comp) > 1:
            inside = [i for m in sorted(comp) for i in edges.get(m, []) if i.target in comp]
            cycles["cycle: " + " ".join(sorted(comp))] = inside
    return cycles


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    first = (a.posonlyargs + a.args)[:1]
    return n - 1 if first and first[0].arg in ("self", "cls") else n


def _is_cli_command(fn: ast.FunctionDef | ast.AsyncFunctionDef, rel: str) -> bool:
    """A CLI command (``@app.command``/``@app.callback`` in ``memcc/cli*``): its
    parameters are its options."""
    if not Path(rel).name.startswith("cli") and "/cli" not in rel:
        return False
    for d in fn.decorator_list:
        call = d.func if isinstance(d, ast.Call) else d
        if isinstance(call, ast.Attribute) and call.attr in ("command", "callback"):
            return True
    # Registered elsewhere (``app.command()(fn)`` in ``memcc/cli/__init__.py``): every
    # parameter is a typer option or argument (``Annotated[...]`` or an ``...Opt`` /
    # ``...Arg`` alias of one).
    params = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return bool(params) and all(_is_typer_annotation(p.annotation) for p in params)


def _is_typer_annotation(note: ast.expr | None) -> bool:
    if isinstance(note, ast.Subscript):
        return isinstance(note.value, ast.Name) and note.value.id == "Annotated"
    return isinstance(note, ast.Name) and note.id.endswith(("Opt", "Arg"))


def _statements_under(node: ast.AST) -> list[ast.AST]:
    """The statements directly under ``node`` (functions are statements, so no expression
    needs walking: that keeps the check fast)."""
    out: list[ast.AST] = []
    for field_name in ("body", "orelse", "finalbody", "handlers", "cases"):
        children = getattr(node, field_name, None)
        if isinstance(children, list):
            out.extend(c for c in children if isinstance(c, ast.AST))
    return out


def size_violations(files: dict[str, Path], root: Path) -> dict[str, str]:
    """Key -> what is too big: modules, functions (by qualified name), parameter lists."""
    out: dict[str, str] = {}
    for path in files.values():
        rel = path.relative_to(root).as_posix()
        tree, lines = parsed(path)
        if lines > MAX_MODULE_LINES and rel not in LONG_MODULES_BY_DESIGN:
            out[f"lines: {rel}"] = f"{rel} has {lines} lines (at most {MAX_MODULE_LINES})"

        def visit(node: ast.AST, prefix: str, rel: str = rel) -> None:
            for child in _statements_under(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    qual = f"{prefix}{child.name}"
                    length = child.end_lineno - child.lineno + 1
                    if length > MAX_FUNCTION_LINES:
                        out[f"long: {rel}::{qual}"] = (
                            f"{rel}:{child.lineno} {qual} has {length} lines "
                            f"(at most {MAX_FUNCTION_LINES}): split it into named steps")
                    n = _parameters(child)
                    if n > MAX_PARAMETERS and not _is_cli_command(child, rel):
                        out[f"wide: {rel}::{qual}"] = (
                            f"{rel}:{child.lineno} {qual} takes {n} parameters (at most "
                            f"{MAX_PARAMETERS}): group them into a small typed value")
                    visit(child, f"{qual}.")
                elif isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                else:
                    visit(child, prefix)

        visit(tree, "")
    return out


def all_violations(root: Path = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """Every violation of the package under ``root``: key -> a message naming the place."""
    files = package_files(root, package)
    modules = set(files)
    imports = [i for name, p in files.items() for i in imports_of(name, p, root, modules)]
    found: dict[str, str] = {}
    for key, imp in upward_imports(imports).items():
        where = "inside a function" if not imp.at_load else "at load time"
        found[key] = (f"{imp.path}:{imp.line} imports {imp.target} ({where}), a layer above "
                      f"{imp.importer}; move the shared code down, or, if {imp.importer} "
                      "is a new driver, name it in DRIVERS")
    for key, edges in import_cycles(imports).items():
        found[key] = "modules import one another at load time: " + "; ".join(
            f"{i.path}:{i.line} imports {i.target}" for i in edges)
    found.update(size_violations(files, root))
    return found


def _compare(found: dict[str, str], allowed: frozenset[str], kind: str) -> list[str]:
    """The problems: violations of ``kind`` not allowed, and allowed ones that are gone."""
    new = [found[k] for k in sorted(found) if k.startswith(kind) and k not in allowed]
    gone = [f"{k!r} no longer happens: remove it from ALLOWED in tests/test_structure.py"
            for k in sorted(allowed) if k.startswith(kind) and k not in found]
    return new + gone


# ---------------------------------------------------------------------------- the package
@pytest.fixture(scope="module")
def found() -> dict[str, str]:
    return all_violations()


@pytest.mark.parametrize("kind", ["upward", "cycle", "lines", "long", "wide"])
def test_the_package_keeps_its_structure(found, kind):
    problems = _compare(found, ALLOWED, kind)
    assert not problems, "\n".join(problems)


def test_the_allowlist_names_only_known_kinds():
    kinds = ("upward: ", "cycle: ", "lines: ", "long: ", "wide: ")
    assert all(k.startswith(kinds) for k in ALLOWED)


# ---------------------------------------------------------------------------- the checks fail
def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A made-up ``memcc`` under ``tmp_path`` with these files (path -> source)."""
    for rel, source in {"memcc/__init__.py": "", **files}.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for parent in p.relative_to(tmp_path).parents:
            init = tmp_path / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                init.write_text("")
        p.write_text(source)
    return tmp_path


def test_an_upward_import_is_found_with_file_line_and_module(tmp_path):
    root = _package(tmp_path, {
        "memcc/graph.py": "import os\nfrom memcc.backend.runner import run\n",
        "memcc/backend/runner.py": "def run():\n    from memcc.tune import tune\n",
        "memcc/tune.py": "def tune():\n    pass\n",
        "memcc/passes/analysis/a.py": "from memcc.passes.planning import b\n",
        "memcc/passes/planning/b.py": "from memcc.passes.analysis import a\n",
    })
    found = all_violations(root)
    assert "memcc/graph.py:2 imports memcc.backend.runner" in \
        found["upward: memcc.graph -> memcc.backend.runner"]
    assert "memcc/backend/runner.py:2 imports memcc.tune (inside a function)" in \
        found["upward: memcc.backend.runner -> memcc.tune"]
    assert "upward: memcc.passes.analysis.a -> memcc.passes.planning.b" in found
    assert "upward: memcc.passes.planning.b -> memcc.passes.analysis.a" not in found


def test_a_circle_is_found_from_load_time_imports_only(tmp_path):
    root = _package(tmp_path, {
        "memcc/frontend/a.py": "from memcc.frontend import b\n",
        "memcc/frontend/b.py": "import memcc.frontend.c\n",
        "memcc/frontend/c.py": "from . import a\n",
        "memcc/frontend/d.py": "from memcc.frontend import e\n",
        "memcc/frontend/e.py": "def f():\n    from memcc.frontend import d\n",
    })
    cycles = {k: v for k, v in all_violations(root).items() if k.startswith("cycle")}
    assert list(cycles) == ["cycle: memcc.frontend.a memcc.frontend.b memcc.frontend.c"]
    assert "memcc/frontend/c.py:1 imports memcc.frontend.a" in \
        cycles["cycle: memcc.frontend.a memcc.frontend.b memcc.frontend.c"]


def test_sizes_are_found_and_cli_commands_are_let_off(tmp_path):
    body = "".join(f"        x{k} = {k}\n" for k in range(80))
    root = _package(tmp_path, {
        "memcc/big.py": "x = 1\n" * 501,
        "memcc/frontend/gradients/nn.py": "x = 1\n" * 900,
        "memcc/fine.py": "x = 1\n" * 500,
        "memcc/long.py": f"class C:\n    def f(self):\n{body}        return 0\n",
        "memcc/wide.py": "def g(a, b, c, d, e, f, *, h):\n    pass\n"
                         "def ok(self, a, b, c, d, e, f):\n    pass\n",
        "memcc/cli.py": "@app.command()\ndef run(a, b, c, d, e, f, g):\n    pass\n"
                        "def helper(a, b, c, d, e, f, g):\n    pass\n",
    })
    found = all_violations(root)
    sizes = sorted(k for k in found if not k.startswith(("upward", "cycle")))
    assert sizes == ["lines: memcc/big.py", "long: memcc/long.py::C.f",
                     "wide: memcc/cli.py::helper", "wide: memcc/wide.py::g"]
    assert "memcc/long.py:2 C.f has 82 lines" in found["long: memcc/long.py::C.f"]


def test_a_new_violation_fails_and_a_fixed_one_must_leave_the_list():
    found = {"wide: memcc/a.py::f": "memcc/a.py:1 f takes 7 parameters"}
    assert _compare(found, frozenset(), "wide") == ["memcc/a.py:1 f takes 7 parameters"]
    assert _compare(found, frozenset(found), "wide") == []
    stale = _compare({}, frozenset(found), "wide")
    assert len(stale) == 1 and "no longer happens" in stale[0]
