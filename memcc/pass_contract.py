"""The pass contract: every graph-to-graph rewrite as a named pass with one report, and one
runner that runs passes in order, checks them, times them and keeps their reports.

In: a ``Graph`` and passes. A pass has a ``name`` and ``run(graph) -> (graph, summary)``
(``summary``: a JSON-able dict of what it did); optionally ``requires(graph)`` (refuse an
input it cannot rewrite), ``ensures(before, after, report, full)`` (refuse an output that
breaks its guarantee; ``full``: the expensive checks too) and ``changed(before, after,
summary)`` (default: a new graph object came back). Functions become passes with ``Pass``;
the lowering's checked passes (``passes/lowering/lower.py``) are classes with the same
methods.

Out: the rewritten graph and ``PassRunner.reports``, one ``PassReport`` per pass in the
order run. A compile's stages that are not graph-to-graph (load a file, cost, plan, verify)
go through the same runner (``PassRunner.stage``), so ``memcc compile``'s report lists
every stage the same way (its ``passes``).

Why one contract: the lowering checked its passes and compile timed its stages with a
closure of its own, and the two reports had different fields; with one, a reader sees each
rewrite's input, output and report in one shape wherever it runs. This module imports only
``memcc.graph``: the frontend, the passes and the drivers all stand on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from memcc.graph import Graph

Say = Callable[[str], None]
T = TypeVar("T")
CHECKS = ("off", "fast", "full")


@dataclass(frozen=True)
class PassReport:
    """What one pass (or compile stage) did: its name, pass-specific facts (``summary``),
    whether the graph changed, and how long it took."""

    name: str
    summary: dict = field(default_factory=dict)
    changed: bool = True
    time_s: float = 0.0

    def to_json(self) -> dict:
        """The entry of the compile report's ``passes`` list."""
        return {"name": self.name, "time_s": round(self.time_s, 4), "summary": self.summary}


class GraphPass(Protocol):
    """One graph-to-graph rewrite. ``run`` must not modify its input graph unless the pass
    says it rewrites in place (then ``changed`` decides what the report says)."""

    name: str

    def run(self, graph: Graph) -> tuple[Graph, dict]: ...


@dataclass(frozen=True)
class Pass:
    """A pass made of functions: ``run`` and, optionally, the checks of ``GraphPass``."""

    name: str
    run: Callable[[Graph], tuple[Graph, dict]]
    requires: Callable[[Graph], None] | None = None
    ensures: Callable[[Graph, Graph, PassReport, bool], None] | None = None
    changed: Callable[[Graph, Graph, dict], bool] | None = None


class PassRunner:
    """Runs passes in order: says each (``say``), checks ``requires`` always and ``ensures``
    per ``check`` ("off", "fast", "full"), times each, and appends its ``PassReport`` to
    ``reports``. A pass that raises leaves no report."""

    def __init__(self, say: Say | None = None, check: str = "fast") -> None:
        if check not in CHECKS:
            raise ValueError(f"check={check!r}: choose off, fast or full")
        self.say = say
        self.check = check
        self.reports: list[PassReport] = []

    def run(self, passes: Iterable[GraphPass], graph: Graph) -> Graph:
        """``passes`` in order over ``graph``; the last one's output."""
        for p in passes:
            graph = self.apply(p, graph)
        return graph

    def apply(self, p: GraphPass, graph: Graph) -> Graph:
        """One pass: requires, run, ensures (per ``check``); its report appended."""
        self._said(p.name)
        t0 = time.perf_counter()
        requires = getattr(p, "requires", None)
        if requires is not None:
            requires(graph)
        out, summary = p.run(graph)
        changed = getattr(p, "changed", None)
        report = PassReport(p.name, summary,
                            out is not graph if changed is None else changed(graph, out, summary))
        ensures = getattr(p, "ensures", None)
        if ensures is not None and self.check != "off":
            ensures(graph, out, report, self.check == "full")
        self.reports.append(_timed(report, t0))
        return out

    def stage(self, name: str, fn: Callable[[], tuple[T, dict]]) -> T:
        """A compile stage that is not a graph-to-graph rewrite (``fn() -> (value,
        summary)``): said, timed and reported as a pass is; returns the value."""
        self._said(name)
        t0 = time.perf_counter()
        value, summary = fn()
        self.reports.append(_timed(PassReport(name, summary), t0))
        return value

    def _said(self, name: str) -> None:
        if self.say is not None:
            self.say(f"{name} ...")


def _timed(report: PassReport, t0: float) -> PassReport:
    return PassReport(report.name, report.summary, report.changed, time.perf_counter() - t0)
