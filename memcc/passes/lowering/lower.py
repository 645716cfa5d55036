"""Lower a ``Plan`` to ONNX as a fixed sequence of passes, each checked before and after.

    substitute variants -> insert recompute -> insert copies

Every pass states what it ``requires`` of its input (the plan fits the step, the graph is
a valid order) and what it ``ensures`` of its output (every recomputed input is resident
when its clone runs, no copy-in precedes its copy-out, the graph is a valid topological
order with a correct def-use index), and returns the graph with its summary: the pass
contract (``memcc/pass_contract.py``), whose runner checks, times and reports each pass.
The simulator (``passes/planning/simulate.py``) is this lowering plus liveness, and the
compiler writes what it returns, so every strategy is judged by, and gets, the same rewrite.

In: a training step, a ``Plan`` and the step's ``StepStructure``. Out: a ``Lowering``, the
rewritten step with one ``PassReport`` per pass.

Variants (``passes/lowering/variant_substitution.py``) run first: they change what the forward pass
hands to the
backward pass, so the passes after them decide over the step with the variants in place.
Copies (``passes/lowering/swap.py``) are planned on device providers only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from memcc.errors import MemccError
from memcc.graph import Graph, topological_problems
from memcc.pass_contract import PassReport, PassRunner
from memcc.passes.lowering.recompute import apply_recompute
from memcc.passes.lowering.swap import COPY_IN, COPY_OUT, apply_offload, offload_problems
from memcc.passes.lowering.variant_substitution import apply_variants, variant_problems
from memcc.passes.plan import Plan, StepStructure
from memcc.step import TrainingStep

# ORT's copy ops, inserted in pairs by the swap pass.
COPY_OUT_OPS = frozenset({COPY_OUT})
COPY_IN_OPS = frozenset({COPY_IN})


class LoweringError(MemccError):
    """A plan this lowering cannot realise, or a pass that broke its own guarantee."""


@dataclass(frozen=True)
class LoweringPass:
    """One step of the lowering, bound to the plan it lowers and the step's structure (the
    pass contract's ``GraphPass``, ``memcc/pass_contract.py``, with its checks). ``run``
    must not modify its input graph."""

    plan: Plan
    st: StepStructure
    name = "lowering-pass"

    def requires(self, graph: Graph) -> None:
        """Refuse a plan this pass cannot realise on ``graph``."""

    def run(self, graph: Graph) -> tuple[Graph, dict]:
        raise NotImplementedError

    def changed(self, before: Graph, after: Graph, summary: dict) -> bool:
        return after is not before

    def ensures(self, before: Graph, after: Graph, report: PassReport,
                full: bool = False) -> None:
        """Refuse an output that breaks the pass's guarantee (``full``: index checks too)."""

    def ensure_rewrite(self, after: Graph, full: bool, replaced: tuple[str, ...], what: str,
                       where: str) -> None:
        """A rewrite that hands backward readers another copy of ``replaced`` values: the
        result is a valid order, its index is right (full checks), and no backward node
        reads an original any more (a copy-out reads it: that is how it leaves)."""
        _fail(self.name, "the lowered step is not a valid execution order",
              topological_problems(after))
        if full:
            _ensure_index(self.name, after)
        du = after.def_use()
        stale = [f"'{r.name}' reads '{v}'{where}" for v in replaced
                 for r in du.readers.get(v, ())
                 if r.name not in self.st.forward and r.op_type not in COPY_OUT_OPS]
        _fail(self.name, what, stale)


def _fail(pass_name: str, what: str, problems: list[str]) -> None:
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise LoweringError(f"{pass_name}: {what}: {'; '.join(problems[:3])}{more}")


def _ensure_index(pass_name: str, graph: Graph) -> None:
    """The def-use index the pass handed on equals one rebuilt from scratch (full checks)."""
    _fail(pass_name, "the def-use index is stale", graph.def_use().check(graph.nodes))


# ---------------------------------------------------------------------------- passes
@dataclass(frozen=True)
class SubstituteVariants(LoweringPass):
    """Replace forward nodes' default gradient rules by the variants the plan chose
    (``passes/lowering/variant_substitution.py``)."""

    name = "substitute-variants"

    def requires(self, graph: Graph) -> None:
        unknown = sorted(n for n in self.plan.variants if n not in self.st.forward)
        _fail(self.name, "variants name nodes that are not forward nodes", unknown)
        _fail(self.name, "the plan asks for variants it cannot have",
              variant_problems(graph, self.plan))

    def run(self, graph: Graph) -> tuple[Graph, dict]:
        res = apply_variants(graph, self.plan)
        return res.graph, {
            "substituted": res.substituted,
            "forward_added": res.forward_added,
            "backward_added": res.backward_added,
            "removed": res.removed,
        }

    def changed(self, before: Graph, after: Graph, summary: dict) -> bool:
        return bool(summary["substituted"])

    def ensures(self, before: Graph, after: Graph, report: PassReport,
                full: bool = False) -> None:
        if not report.changed:
            if after is not before:
                raise LoweringError(f"{self.name}: nothing substituted, yet a new graph")
            return
        _fail(self.name, "the step with variants is not a valid execution order",
              topological_problems(after))
        if full:
            _ensure_index(self.name, after)
        # The forward pass computes what it did: every original forward node is still there
        # and still forward, and the loss is unchanged.
        names = {n.name for n in after.nodes}
        lost = sorted(n for n in self.st.forward if n not in names)
        _fail(self.name, "forward nodes disappeared", lost)
        added = set(report.summary["forward_added"])
        fwd_after = TrainingStep.of(after).forward
        _fail(self.name, "the variants' forward nodes are not forward",
              sorted(added - fwd_after))


@dataclass(frozen=True)
class InsertRecompute(LoweringPass):
    """Clone recomputed forward nodes into the backward pass (``passes/lowering/recompute.py``)."""

    name = "insert-recompute"

    def requires(self, graph: Graph) -> None:
        # Recompute of a node that may not be recomputed (Dropout, Constant) is ignored, as
        # it always was; a node that is not forward at all is a strategy bug.
        stray = sorted(n for n in self.plan.recompute if n not in self.st.forward)
        _fail(self.name, "the plan recomputes nodes that are not forward nodes", stray)

    def run(self, graph: Graph) -> tuple[Graph, dict]:
        res = apply_recompute(graph, self.plan, self.st)
        return res.graph, {
            "rewrote": bool(self.plan.recompute & self.st.recomputable),  # else a plain copy
            "cloned_nodes": res.cloned_nodes,
            "recomputed_values": res.recomputed_values,
            "rerun_before": res.rerun_before,
        }

    def changed(self, before: Graph, after: Graph, summary: dict) -> bool:
        return summary["rewrote"] and bool(summary["cloned_nodes"])

    def ensures(self, before: Graph, after: Graph, report: PassReport,
                full: bool = False) -> None:
        if not report.summary["rewrote"]:  # a copy of the input, node for node
            return
        # One walk: the graph is a valid order, so every recomputed input is resident when
        # its clone runs (ONNX values live until their last reader: produced earlier is
        # enough), and nothing is produced twice. The saving is real: no backward node still
        # reads an original it was given a clone of.
        self.ensure_rewrite(after, full, report.summary["recomputed_values"],
                            "backward nodes still read recomputed originals", "")


@dataclass(frozen=True)
class InsertCopies(LoweringPass):
    """Copy offloaded values to host memory and back (``passes/lowering/swap.py``)."""

    name = "insert-copies"

    def requires(self, graph: Graph) -> None:
        not_saved = sorted(v for v in self.plan.offload if v not in self.st.saved)
        _fail(self.name, "the plan offloads values that are not saved", not_saved)
        _fail(self.name, "the plan offloads values it cannot",
              offload_problems(graph, self.plan, self.st))

    def run(self, graph: Graph) -> tuple[Graph, dict]:
        res = apply_offload(graph, self.plan, self.st)
        return res.graph, {
            "copies": 2 * len(res.copies),
            "offloaded_values": res.offloaded,
            "copied_back_before": {v: first for v, _, _, first in res.copies},
        }

    def changed(self, before: Graph, after: Graph, summary: dict) -> bool:
        return bool(summary["copies"])

    def ensures(self, before: Graph, after: Graph, report: PassReport,
                full: bool = False) -> None:
        _fail(self.name, "copy-in before copy-out", copy_order_problems(after))
        if not report.changed:
            return
        # Away means away: nothing but the forward pass and the copy-out reads the device
        # original, so its buffer is free from the copy-out on.
        self.ensure_rewrite(after, full, report.summary["offloaded_values"],
                            "backward nodes still read offloaded originals",
                            " while it is on the host")


def copy_order_problems(graph: Graph) -> list[str]:
    """Every copy-in must read a value whose copy-out already ran, or a step input held in
    host memory (optimizer state, ``passes.lowering.offload_state``) (empty: it does)."""
    copied_out: set[str] = set(getattr(graph, "inputs", ()))
    problems: list[str] = []
    for n in graph.nodes:
        if n.op_type in COPY_OUT_OPS:
            copied_out.update(o for o in n.output if o)
        elif n.op_type in COPY_IN_OPS:
            problems += [f"'{n.name}' copies '{i}' in before it was copied out"
                         for i in n.input if i and i not in copied_out]
    return problems


# The lowering's passes in order, as kinds: ``lower`` binds each to the plan and the
# step's structure as it stands when the pass runs.
PASSES: tuple[type[LoweringPass], ...] = (SubstituteVariants, InsertRecompute, InsertCopies)


# ---------------------------------------------------------------------------- the lowering
@dataclass(frozen=True)
class Lowering:
    """The lowered step, each pass's report, and the recompute facts the planner reads."""

    graph: Graph
    reports: tuple[PassReport, ...]
    cloned_nodes: tuple[str, ...] = ()
    recomputed_values: tuple[str, ...] = ()
    rerun_before: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> list[dict]:
        return [{"pass": r.name, "changed": r.changed} for r in self.reports]


class VariantMemo:
    """The substitute-variants pass's results in one search, by the variants asked.

    A search judges many plans with few sets of variants (the zoo U-Net's smallest-peak
    search: 123 plans, 8 sets), and that pass, with its checks and the step's structure
    after it, is a function of the step, its structure and the variants alone: judged once
    per set, it is most of a lowering's time saved (``simulate(memo=...)``; a
    ``PlanningContext`` keeps one). Safe to share because no pass edits its input graph
    (``LoweringPass.run``) and the recompute pass after it always returns a copy (``lower``
    uses the memo only when that pass runs), so no lowered step is one held here.
    Holds the last ``size`` sets (each a copy of the step)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._done: OrderedDict[tuple, tuple] = OrderedDict()

    def key(self, graph: Graph, plan: Plan, st: StepStructure, check: str) -> tuple:
        return id(graph), id(st), check, tuple(sorted(plan.variants.items()))

    def get(self, key: tuple) -> tuple[Graph, StepStructure, PassReport] | None:
        hit = self._done.pop(key, None)
        if hit is None:
            return None
        self._done[key] = hit  # the most recent last (never a KeyError, even if shared)
        return hit[2:]  # the step and structure keyed by id() are held in hit[:2]

    def put(self, key: tuple, graph: Graph, st: StepStructure,
            done: tuple[Graph, StepStructure, PassReport]) -> None:
        self._done[key] = (graph, st, *done)
        while len(self._done) > self.size:
            self._done.popitem(last=False)


def lower(graph: Graph, plan: Plan, structure: StepStructure | None = None, *,
          check: str = "fast", passes: tuple[type[LoweringPass], ...] = PASSES,
          memo: VariantMemo | None = None) -> Lowering:
    """Run the passes in order (``memcc.pass_contract.PassRunner``).

    ``requires`` (plans the passes cannot realise) always runs. ``check`` picks the
    ``ensures``: "fast" (default: one O(nodes) walk per pass that changed the graph, about
    a tenth of a simulation), "full" (also rebuilds each def-use index and compares: tests),
    or "off". ``memo``: the variant substitutions already made (and checked) for this step
    and structure, reused when the plan asks for the same variants (``VariantMemo``).
    """
    runner = PassRunner(check=check)
    st = structure or StepStructure.of(graph)
    g = graph
    for kind in passes:
        if kind is SubstituteVariants and memo is not None and plan.variants \
                and InsertRecompute in passes:
            g, st = _substitute_once(runner, plan, g, st, memo)
            continue
        g = runner.apply(kind(plan, st), g)
        if runner.reports[-1].changed and issubclass(kind, SubstituteVariants):
            # The passes after this one decide over the step with the variants in place
            # (what is saved changed: a mask instead of an activation).
            st = StepStructure.of(g)
    rc = next((r.summary for r in runner.reports if r.name == InsertRecompute.name), {})
    return Lowering(
        graph=g,
        reports=tuple(runner.reports),
        cloned_nodes=tuple(rc.get("cloned_nodes", ())),
        recomputed_values=tuple(rc.get("recomputed_values", ())),
        rerun_before=dict(rc.get("rerun_before", {})),
    )


def _substitute_once(runner: PassRunner, plan: Plan, graph: Graph, st: StepStructure,
                     memo: VariantMemo) -> tuple[Graph, StepStructure]:
    """The substitute-variants pass through ``memo``: run (requires, run, ensures) and
    kept the first time a set of variants is asked, its report repeated after (timed
    as the look-up it was)."""
    t0 = time.perf_counter()
    key = memo.key(graph, plan, st, runner.check)
    hit = memo.get(key)
    if hit is not None:
        out, st_out, report = hit
        runner.reports.append(PassReport(report.name, dict(report.summary), report.changed,
                                         time.perf_counter() - t0))
        return out, st_out
    out = runner.apply(SubstituteVariants(plan, st), graph)
    report = runner.reports[-1]
    st_out = StepStructure.of(out) if report.changed else st
    memo.put(key, graph, st, (out, st_out, report))
    return out, st_out
