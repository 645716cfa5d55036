"""Which carried inputs of a step live in host memory (what ``lowering.offload_state``
makes), read off the graph's structure.

Enters: a step's graph and its updates (output -> the input it replaces). Leaves: the
set of host-resident inputs: every reader a ``MemcpyFromHost`` and the update written by
a ``MemcpyToHost``. An analysis, so that the runtime (``backend.device_step``) and the
device prediction (``analysis.device_memory``) read it without depending on the pass
that writes the copies, and agree with any file of that shape.
"""

from __future__ import annotations

from memcc.graph import Graph
from memcc.step import TrainingStep

COPY_IN = "MemcpyFromHost"
COPY_OUT = "MemcpyToHost"


def host_resident(graph: Graph, updates: dict[str, str] | None = None) -> set[str]:
    """The carried inputs that live in host memory: every reader a ``MemcpyFromHost`` and
    their update written by a ``MemcpyToHost`` (what ``offload_state`` makes). Read off the
    structure, so the prediction and the runtime agree on any file of that shape."""
    updates = TrainingStep.of(graph).state if updates is None else updates
    du = graph.def_use()
    held = set()
    for out, inp in updates.items():
        readers = du.readers.get(inp, ())
        producer = du.producer.get(out)
        if (readers and all(r.op_type == COPY_IN for r in readers)
                and producer is not None and producer.op_type == COPY_OUT):
            held.add(inp)
    return held
