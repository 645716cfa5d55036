"""How a training step is arranged to run with its updates in place: aliasing, order, peak.

Shared by ``memcc.Trainer`` and ``memcc run --in-place`` so that what is measured is what
users train with. Three analyses decide it, none of which changes what the step computes:

1. ``passes.analysis.inplace``: which updates may be written over the value they replace;
2. ``passes.analysis.update_schedule``: each parameter's update moved to just after its gradient is
   complete and its old value's last reader has run (so gradients die early, and the old
   value is dead when it is overwritten);
3. ``passes.analysis.liveness`` with the aliasing counted: the predicted peak of the file's order
and
   of the moved order. The moved order is used only when its predicted peak is not higher
   (an update's temporaries could land on the activation peak of a compiled plan).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from memcc.graph import Graph
from memcc.passes.analysis.inplace import InPlaceUpdates, analyze_in_place
from memcc.passes.analysis.liveness import LivenessReport, analyze_liveness
from memcc.passes.analysis.update_schedule import schedule_updates_early
from memcc.step import TrainingStep

FILE_ORDER = "file order"
UPDATES_EARLY = "updates early"


@dataclass(frozen=True)
class ArrangedStep:
    """The step as it will run: node order, in-place updates, and its predicted peak."""

    graph: Graph
    in_place: InPlaceUpdates
    schedule: str
    note: str
    prediction: LivenessReport


def arrange_step(graph: Graph, step: TrainingStep, *, in_place: bool = True,
                 early_updates: bool = True, host_copies: bool = False) -> ArrangedStep:
    """Decide aliasing and order for ``graph`` (see the module docstring).
    ``host_copies``: the step runs on a device, where swapped-out copies live in host
    memory (``passes.analysis.liveness``)."""
    if not in_place:
        none = InPlaceUpdates({}, dict.fromkeys(step.state, "in-place updates are off"))
        return ArrangedStep(graph, none, FILE_ORDER, "",
                           analyze_liveness(graph, host_copies=host_copies))
    ip = analyze_in_place(graph, step.state)
    # Outputs the runtime binds to buffers held all step (``TrainingStep.bound``: a
    # data-parallel rank's gradient bucket) are written there, whatever their producer.
    bound = step.bound
    file_prediction = analyze_liveness(graph, in_place={**ip.aliased, **bound},
                                       host_copies=host_copies)
    note = ""
    # A rank's updates run after its all-reduce (after every gradient, or placed between
    # its buckets' segments): never moved.
    if early_updates and ip.aliased and not bound and not step.updates_placed:
        sched = schedule_updates_early(graph, step, ip.aliased)
        if sched.moved:
            moved = copy.copy(graph)
            moved.set_nodes(list(sched.nodes))
            ip_moved = analyze_in_place(moved, step.state)
            prediction = analyze_liveness(moved, in_place={**ip_moved.aliased, **bound},
                                          host_copies=host_copies)
            if prediction.peak_bytes <= file_prediction.peak_bytes:
                return ArrangedStep(moved, ip_moved, UPDATES_EARLY, "", prediction)
            note = (f"kept the file's order: updates moved early predict "
                    f"{prediction.peak_bytes:,} bytes, the file's order "
                    f"{file_prediction.peak_bytes:,}")
        else:
            note = sched.reason
    return ArrangedStep(graph, ip, FILE_ORDER, note, file_prediction)
