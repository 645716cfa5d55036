"""README and docs/ as a new user meets them: links resolve inside the repository, the test
install command is the one CI runs, and the quick start leaves a checkout clean.

These catch first-use friction that no code test sees: a link to a file outside the
repository, two different install commands, untracked files after following the README.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memcc.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]

MD_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in backticks: `docs/X.md`, `memcc/cli.py`, `../x` (not `~/.cache/...`).
CODE_PATH = re.compile(r"`((?:\.\./|/)?[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*\.(?:md|py))`")


def _quick_start() -> list[str]:
    """The command lines of README's first code block (the quick start)."""
    block = README.read_text().split("```")[1]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def _pip_install_args(line: str) -> set[tuple[str, str]]:
    """``pip install`` arguments as (flag, value) pairs, ignoring order and ``-q``."""
    words = shlex.split(line)
    words = words[words.index("install") + 1:]
    pairs: set[tuple[str, str]] = set()
    while words:
        w = words.pop(0)
        if w in ("-q", "--quiet", "--upgrade"):
            continue
        if w.startswith("-") and words:
            pairs.add((w, words.pop(0)))
        else:
            pairs.add(("", w))
    return pairs


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_and_paths_stay_inside_the_repository_and_exist(doc):
    text = doc.read_text()
    targets = [(m, doc.parent) for m in MD_LINK.findall(text) if "://" not in m]
    targets += [(m, ROOT) for m in CODE_PATH.findall(text)]
    for target, base in targets:
        path = target.split("#")[0]
        assert not path.startswith(("../", "/")), f"{doc.name} points outside the repo: {target}"
        resolved = (base / path).resolve()
        if "/" not in path and not resolved.exists():  # bare `X.md`: a doc at the top or in docs/
            resolved = ROOT / "docs" / path
        assert ROOT in resolved.parents, f"{doc.name}: {target} leaves the repository"
        assert resolved.exists(), f"{doc.name} refers to {target}, which does not exist"


def test_sources_cite_docs_that_exist():
    """Module docstrings cite ``ORT_NOTES.md §n`` etc.; each cited doc must ship here."""
    cited = set()
    for py in (ROOT / "memcc").rglob("*.py"):
        cited |= set(re.findall(r"\b([A-Z][A-Z_]+\.md)\b", py.read_text()))
    assert "ORT_NOTES.md" in cited  # the check below must see the citations it is about
    missing = [name for name in sorted(cited)
               if not (ROOT / name).exists() and not (ROOT / "docs" / name).exists()]
    assert not missing, f"cited in memcc/ but not in the repository: {missing}"


def test_one_test_install_command_everywhere():
    """Quick start, Install section and .ci/run install the test extras the same way."""
    readme = [line for line in README.read_text().splitlines() if '".[test]"' in line]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if "pip install" in line and ".[test]" in line]
    assert len(ci) == 1 and len(readme) >= 2
    assert any('".[test]"' in line for line in _quick_start())
    commands = [re.search(r"pip install [^`#]*", line).group(0).strip() for line in readme]
    want = _pip_install_args(ci[0])
    assert want >= {("-c", "constraints.txt"), ("-e", ".[test]")}
    for command in commands:
        assert _pip_install_args(command) == want, command


def _git_ignored(paths: list[str]) -> set[str]:
    r = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *paths],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stderr
    return set(r.stdout.split())


def _git_tracked() -> set[str]:
    """Paths git tracks in the checkout (repository-relative, as README names them)."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def _untracked_quick_start_paths(lines: list[str]) -> list[str]:
    """Repository paths the quick start's memcc commands name that git does not track: the
    files those commands write (the report, the plot), whether or not they exist yet."""
    tracked = _git_tracked()
    return [w for line in lines if line.startswith("memcc ") for w in shlex.split(line)[2:]
            if "/" in w and not w.startswith("-") and w not in tracked]


def test_quick_start_leaves_the_checkout_clean(tmp_path):
    """Every file the quick start writes into the repository is ignored by git.

    The compile runs for real (default output paths, next to the input), so whatever
    compile writes today is what gets checked, not a list kept by hand.
    """
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    lines = _quick_start()
    compile_line = next(line for line in lines if line.startswith("memcc compile"))
    model = shlex.split(compile_line)[2]
    assert (ROOT / model).exists() and "-o" not in shlex.split(compile_line)

    work = tmp_path / Path(model).parent
    work.mkdir(parents=True)
    shutil.copy(ROOT / model, work)
    before = set(work.iterdir())
    r = CliRunner().invoke(app, ["compile", str(work / Path(model).name), "--budget", "1TB",
                                 "--cost", "analytic"])
    assert r.exit_code == 0, r.output
    written = [str(Path(model).parent / p.name) for p in set(work.iterdir()) - before]
    assert len(written) >= 2  # the step and its report

    # ...and every other path a quick-start command names that git does not track. Whether
    # the file exists does not matter: after following README it does (the quick start wrote
    # it), and it must be ignored all the same.
    named = _untracked_quick_start_paths(lines)
    assert named  # the report line names its report and its plot
    paths = sorted(set(written + named))
    assert _git_ignored(paths) == set(paths)


def test_checkout_stays_clean_after_following_the_quick_start(tmp_path):
    """README in order: the quick start's outputs sit where it writes them (next to the
    model, in ``examples/``), and then the tests still pass (issue 35, item 6).

    The compile step's own outputs are found by running it; the files README's commands
    leave in the checkout are put there (empty) for the duration of this test only.
    """
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    lines = _quick_start()
    model = Path(shlex.split(next(line for line in lines if line.startswith("memcc compile")))[2])
    outputs = [ROOT / model.parent / f"{model.stem}.memcc.onnx",
               ROOT / model.parent / f"{model.stem}.memcc.report.json"]
    outputs += [ROOT / p for p in _untracked_quick_start_paths(lines)]
    created = [p for p in dict.fromkeys(outputs) if not p.exists()]
    try:
        for path in created:
            path.write_bytes(b"")
        test_quick_start_leaves_the_checkout_clean(tmp_path)
        r = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--",
                            *(str(p.relative_to(ROOT)) for p in outputs)],
                           capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr
    finally:
        for path in created:
            path.unlink(missing_ok=True)
