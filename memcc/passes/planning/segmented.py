"""The segmentation strategies: ``none`` (the step as built) and ``sqrtn`` (Chen et al.'s
segmentations, rebuilt again where none fits). A ``PlanningContext`` and a ``Budget`` in, a
``StrategyResult`` out (``context.py``); no solver runs here, every plan is simulated.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from memcc.passes.lowering.variant_substitution import overlapping
from memcc.passes.planning.context import PlanningContext, StrategyResult, strategy
from memcc.passes.planning.request import Budget
from memcc.passes.planning.simulate import Simulation
from memcc.passes.planning.work import Allowance, account

# The variant kinds tried on the lowest rebuilt-again plan (``_variant_kinds``): this share
# of the work the time limit buys, counted in that plan's lowered nodes; at least the kind
# that could lower the peak the most is tried.
KINDS_SHARE = 0.1
MIN_KIND_MOVES = 1


@strategy("none")
def keep_everything(p: PlanningContext, budget: Budget) -> StrategyResult:
    """The step as built: every value kept (the baseline)."""
    return StrategyResult()


@strategy("sqrtn")
def sqrt_n(p: PlanningContext, budget: Budget) -> StrategyResult:
    """Chen et al.'s segmentations, one per segment count (``solvers/sqrtn.py``); where none
    fits, the same segmentations rebuilt again (``add_rebuilt_again``)."""
    out = segmented(p)
    add_rebuilt_again(p, budget, out)
    return out


def segmented(p: PlanningContext) -> StrategyResult:
    out = StrategyResult()
    out.add("sqrtn", list(p.segmentations),
            {"strategy": "sqrtn", "detail": f"{len(p.segmentations)} segmentations"})
    return out


def add_rebuilt_again(p: PlanningContext, budget: Budget, out: StrategyResult) -> None:
    """When nothing found so far fits (or for ``--budget min``), each segmentation again
    with every recomputed node rebuilt for each later use instead of kept
    (``Plan.recompute_again``).

    A segmentation recomputes a segment once, when its backward begins, and keeps every
    clone until its own backward reader: all of the segment's activations are live at once,
    plus every boundary. Rebuilt again, a clone made only to reach another value is dropped
    as soon as that value exists; the next reader rebuilds it from the nearest kept value.
    What stays is the boundaries, one chain and one layer's activations, at the price of
    recomputing early layers of a segment once per later layer (Chen et al.'s recursive
    form, Griewank's revolve). Measured on the zoo's ResNet-50 (batch 32, 128 px,
    ``--budget min --no-variants``, BENCHMARKS.md): the smallest peak goes from 35.2% to
    30.1% of the step as built, at +26.9% predicted time once polished.
    Only where it is needed, since each plan costs a simulation; bounded by work (one
    simulation per segmentation of at least two segments, the variant kinds by their share
    of the limit), not by the clock, so a busy machine gets the same plans; at a budget the
    deadline is a safety net (then ``cut_by_time_limit``). One segment rebuilds every layer from the
    inputs for every later one: quadratic time, and never the lowest peak where measured."""
    if any(budget.holds(sim.peak_bytes) for _, sim in out.plans):
        return
    segs = [seg for seg in p.segmentations
            if seg.plan.recompute and int(seg.plan.notes.get("segments", 0)) >= 2]
    # Counted already (``planner.segment_counts``); at a budget the deadline may cut them
    # too (a screen of a row-chunk setting: ``compiler/chunk_clock.py``), never at the
    # smallest peak, whose answer they are on convnets.
    clock = Allowance(len(segs), float("inf") if budget.is_min else p.deadline - p.after_s)
    sims = [p.simulate(replace(seg.plan, recompute_again=seg.plan.recompute,
                               notes={**seg.plan.notes, "rebuilt_again": True}))
            for seg in segs if clock.take("rebuilt again")]
    out.add("sqrtn", sims, {"strategy": "sqrtn", "rebuilt_again": True,
                            "detail": f"{len(sims)} segmentations, recomputed nodes rebuilt "
                                      "again for each later use",
                            **({"cut_by_time_limit": ["rebuilt again"]}
                               if clock.stopped.get("rebuilt again") == "time limit"
                               else {})})
    if sims:
        lowest = min(sims, key=lambda sim: (sim.peak_bytes, sim.added_time_s))
        if not budget.holds(lowest.peak_bytes):
            allowance = Allowance.of(p, KINDS_SHARE, nodes=len(lowest.graph.nodes),
                                     least=MIN_KIND_MOVES)
            if budget.is_min:   # a count only, as the segmentations: the smallest peak
                allowance.deadline = float("inf")   # must not depend on the machine's load
            kinds = _kinds(p)
            with_variants = _variant_kinds(p, lowest, kinds, allowance)
            said = {"variant_kinds": len(kinds), **account(allowance)}
            if with_variants is not lowest:
                out.add("sqrtn", [with_variants],
                        {"strategy": "sqrtn", "rebuilt_again": True,
                         "detail": "the lowest of those, with the variant kinds that lower "
                                   "its peak", **said})
            elif allowance.spent:
                fields = out.runs[-1].fields        # the rebuilt-again entry
                cut = fields.get("cut_by_time_limit", []) + said.pop("cut_by_time_limit", [])
                fields.update(said, **({"cut_by_time_limit": cut} if cut else {}))


def _kinds(p: PlanningContext) -> dict[str, dict[str, str]]:
    """Variant kind -> {forward node: kind} over the variants the model offers, the kinds
    that could lower a peak the most first: by the bytes each variant frees over the
    schedule in the model (its memory terms' bytes times the steps they span, summed; where
    a kind's nodes free more, the more likely it frees bytes at a plan's peak), summed over
    the kind's nodes, then by name. A working set made smaller (a chunked Conv) frees much
    for a moment, a saved value made smaller (an inverted activation) frees less for the
    whole backward; a peak is one moment, and a rebuilt-again plan's lies in the backward.
    The model prices variants against the step as built, not against a rebuilt-again plan,
    so this is an order to try them in, not a verdict."""
    problem, choice_of = p.model.problem, p.model.variants.choice_of
    freed = np.zeros(problem.n_vars)
    spans = problem.term_end - problem.term_start + 1
    np.add.at(freed, problem.term_var, -problem.term_bytes * spans)
    kinds: dict[str, dict[str, str]] = {}
    score: dict[str, float] = {}
    for var, (node, name) in choice_of.items():
        kinds.setdefault(name, {}).setdefault(node, name)
        score[name] = score.get(name, 0.0) + max(float(freed[var]), 0.0)
    return {name: kinds[name] for name in sorted(kinds, key=lambda k: (-score[k], k))}


def _variant_kinds(p: PlanningContext, start: Simulation, kinds: dict[str, dict[str, str]],
                   allowance: Allowance) -> Simulation:
    """``start`` with whole variant ``kinds`` added (``Conv:chunks8`` on every Conv that offers
    it, ...) one kind at a time, each kept where the simulator finds a lower peak, while
    ``allowance`` lasts (``KINDS_SHARE`` of the limit's work in ``start``'s lowered nodes).

    The ILP chooses variants for plans it can model; a rebuilt-again plan it cannot, so the
    simulator judges kinds instead of single nodes: a handful of simulations instead of one
    per node, and a kind works the same way at every layer. Unbounded, these were most of a
    compile on steps of 2,700-5,000 nodes (timm's EdgeNeXt-XXS at --budget min --time-limit
    20: 26 simulations, 20 of its 47 s; BENCHMARKS.md, "Variant kinds and screens counted
    against the time limit").

    A kind that did not lower the peak is tried again once a later kind has: the peak has
    moved. On the torchvision-layout ResNet-18 (batch 32, 224 px, stem over 8 batch chunks)
    ``Relu:product`` lowered nothing while a convolution weight gradient set the peak;
    after ``Conv:chunks4`` the peak sat at a Relu backward's Where, whose two selections
    (51 MB) the product form does not build."""
    current, version = start, 0
    kept: set[str] = set()
    judged: dict[str, int] = {}   # kind -> the ``version`` of ``current`` it did not lower
    while True:
        passed = version
        for name, nodes in kinds.items():
            if name in kept or judged.get(name) == version:
                continue
            chosen = {**nodes, **current.plan.variants}   # a node keeps its first kind
            # A variant covering several nodes' rules (a decomposed GELU) excludes those
            # nodes' own variants: the kind chosen first keeps them.
            clash = overlapping(p.graph, chosen, keep=current.plan.variants)
            chosen = {n: v for n, v in chosen.items() if n not in clash}
            if chosen == dict(current.plan.variants):
                judged[name] = version
                continue
            if not allowance.take("variant kinds"):
                return current
            sim = p.simulate(replace(current.plan, variants=chosen))
            if sim.peak_bytes < current.peak_bytes:
                current, version = sim, version + 1
                kept.add(name)
            else:
                judged[name] = version
        if version == passed:
            return current
