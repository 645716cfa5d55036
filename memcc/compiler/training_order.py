"""The step handed to the planner in the order ``memcc train`` runs it.

``memcc train`` (and the step compile writes) runs each optimizer update just after its
gradient is complete (``passes.analysis.update_schedule``), so each gradient dies there, not
at the end of the step. The planner judges its candidates in the order of the graph it is
given (``simulate`` with ``early_updates`` off, the cheaper analysis, for the many plans a
search judges; the ILP's memory rows are that order's too). Given the file's order, where
every gradient is held until the updates at the end, it searched for the smallest peak of
an order that never runs: a plan smallest there kept saved values the trained order could
drop, and a plan cheap there could be dear as trained. Compile then mended the result by
judging it again as trained and shedding recompute to the budget
(``compiler/trained_smallest.py``), which made the plan depend on where the solver's
clock stopped (MobileNetV2 at 50%: +8.5% in one process, +48.9% in another, refused at the
default limit; BENCHMARKS.md, "Planning in the order the step trains").

So the planner gets the step with its updates already moved, wherever
``passes.analysis.arrange.arrange_step`` keeps the move for the step as built (its peak is
not higher). A plan's own clones can free an update to move further; the final judgement
(``planning.as_trained``) still moves it. The nodes, and what each computes, are the
file's: only their order differs, so results are the same bits.
"""

from __future__ import annotations

import copy

from memcc.compiler.options import CompileOptions
from memcc.graph import Graph
from memcc.passes.analysis.arrange import UPDATES_EARLY, arrange_step
from memcc.step import TrainingStep


def in_training_order(graph: Graph, options: CompileOptions) -> tuple[Graph, dict]:
    """``graph`` with its updates moved early where ``memcc train`` moves them for the step
    as built, and what the report says of it (``order``; ``note`` where it kept the file's:
    why)."""
    step = TrainingStep.of(graph)
    arranged = arrange_step(graph, step, early_updates=True,
                            host_copies=options.swaps or options.device == "cuda")
    if arranged.schedule != UPDATES_EARLY:
        return graph, {"order": arranged.schedule, "note": arranged.note}
    moved = copy.copy(arranged.graph)
    moved.metadata = dict(graph.metadata)
    return moved, {"order": UPDATES_EARLY}
