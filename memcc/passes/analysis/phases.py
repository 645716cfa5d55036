"""Which phase of the training step each node belongs to, and where a plan's nodes came from.

An analysis, used by the report: the memory timeline of the baseline and of the plan is
only comparable if the same x means the same point of the step in both. Node indices do not
give that, because the plan has recompute clones inserted in its backward pass (and may
drop forward nodes whose outputs are now only recomputed), so every later index shifts.
These two facts let a reader line the plan up with the baseline node by node and mark
where the forward pass, the backward pass and the update begin.
"""

from __future__ import annotations

from memcc.graph import Graph
from memcc.passes.plan import StepStructure
from memcc.step import DEFAULT_RULE, RULE_PROP

FORWARD, BACKWARD, UPDATE = "F", "B", "U"
# The prefix memcc's gradient builder (frontend/autodiff.py) gives every value it emits.
GRAD_PREFIX = "grad/"
RECOMPUTED = -1
VARIANT = -2   # a node an operator variant added (its backward, or a mask in the forward)
COPY = -3      # a swap copy to or from host memory


def step_phases(graph: Graph, structure: StepStructure | None = None) -> str:
    """One letter per node of ``graph``, in order: F forward, B backward, U update.

    Phases are stretches of the schedule, because the report asks *when* a node runs. The
    forward phase ends with the last node the loss depends on (the planner's forward
    nodes), so a helper the gradient builder places inside the forward pass (e.g. a cast of
    MaxPool's indices right after the MaxPool) counts as forward. The backward phase ends
    with the last node that writes a gradient: a value the gradient builder named
    (``grad/...``) or a graph output named ``*.grad`` (``--optimizer none``). What follows
    (optimizer arithmetic, BatchNorm running statistics) is the update. A step not built
    by memcc has no such names: everything after its forward phase counts as backward.
    """
    st = structure or StepStructure.of(graph)
    outputs = set(graph.outputs)
    last_forward = max((i for i, n in enumerate(graph.nodes) if n.name in st.forward),
                       default=-1)
    gradient = [i for i, n in enumerate(graph.nodes) if any(
        o.startswith(GRAD_PREFIX) or (o in outputs and o.endswith(".grad")) for o in n.output)]
    last_backward = max(gradient, default=len(graph.nodes) - 1)
    return "".join(
        FORWARD if i <= last_forward else BACKWARD if i <= last_backward else UPDATE
        for i in range(len(graph.nodes))
    )


def plan_origin(baseline: Graph, plan: Graph) -> list[int]:
    """For each node of ``plan``: the index of the same node in ``baseline``, or for a new
    node what made it: -1 a recompute clone (run just before the backward node that needs
    it), -2 an operator variant's node, -3 a swap copy."""
    index = {n.name: i for i, n in enumerate(baseline.nodes)}
    return [index[n.name] if n.name in index else _new_node_origin(n) for n in plan.nodes]


def _new_node_origin(node) -> int:
    if node.op_type in ("MemcpyToHost", "MemcpyFromHost"):
        return COPY
    rule = next((p.value for p in node.metadata_props if p.key == RULE_PROP), DEFAULT_RULE)
    return VARIANT if rule != DEFAULT_RULE else RECOMPUTED
