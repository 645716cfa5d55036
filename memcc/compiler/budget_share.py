"""``--budget 50%``: a share of the step as built, resolved into bytes once its costs exist.

A user who does not know what a step needs asks for "half of it": the budget is the share of
the budget the step as built needs: its peak as the search judges it (in the order the
planner is given it, ``compiler/training_order.py``; the "baseline peak" compile prints,
``baseline.peak_bytes``, is the lower of that and the order memcc train runs) with the
margin and slack every budget keeps free (``user_budget``). So ``--budget 100%`` fits the
step as built with no plan, and ``--budget 50%`` asks for half of that. It is resolved
after the cost model (the simulation needs node times, not only sizes) and before the
floor check and the search, which then see plain bytes.
"""

from __future__ import annotations

import re
from dataclasses import replace

from memcc.compiler.options import CompileOptions, user_budget
from memcc.errors import InputError
from memcc.graph import Graph
from memcc.passes.plan import Plan, StepStructure

_SHARE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def budget_share(budget: str | int) -> float | None:
    """The share ``--budget`` asks for (``"50%"`` -> 0.5), None where it gives bytes or
    ``min``; an ``InputError`` for a share outside (0, 100]%."""
    if not isinstance(budget, str) or "%" not in budget:
        return None
    m = _SHARE.match(budget)
    share = float(m.group(1)) / 100 if m else 0.0
    if not 0 < share <= 1:
        raise InputError(f"--budget {budget.strip()}: a share of the step as built is a "
                         "percentage above 0 and at most 100, e.g. --budget 50%")
    return share


def resolve_share(graph: Graph, costs, options: CompileOptions, share: float
                  ) -> tuple[CompileOptions, dict]:
    """``options`` with ``share`` of ``graph``'s baseline peak as its budget in bytes, and
    what the report says of it."""
    if options.nproc is not None:
        raise InputError(f"--budget {options.budget} with --nproc: give the per-rank budget "
                         "in bytes (memcc compile --budget min --nproc N finds the smallest)")
    # Imported here: a budget in bytes under the floor is refused without the simulator.
    from memcc.compiler.training_order import in_training_order
    from memcc.passes.planning.simulate import SimulationRules, simulate

    structure = StepStructure.of(graph)
    # The search judges the step in the order the planner is given it
    # (``compiler/training_order.py``); the report's baseline is the lower of that and the
    # order memcc train runs (``planning.as_trained``). The whole budget is the search's,
    # so that 100% holds the step as built with nothing recomputed.
    planned, _ = in_training_order(graph, options)
    searched, trained = (simulate(g, Plan(), costs, structure, rules).peak_bytes
                         for g, rules in ((planned, SimulationRules(options.device)),
                                          (graph, SimulationRules(options.device,
                                                                  host_copies=options.swaps,
                                                                  early_updates=True))))
    base = min(searched, trained)
    whole = user_budget(max(searched, trained), options, options.slack_for(graph))
    budget = max(int(whole * share), 1)
    return replace(options, budget=budget), {
        "asked": str(options.budget).strip(), "share": share,
        "baseline_peak_bytes": int(base), "as_built_budget_bytes": whole,
        "budget_bytes": budget}
