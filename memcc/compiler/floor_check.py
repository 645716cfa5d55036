"""Compile's refusal of a budget under the step's floor, right after the ``load`` stage.

In: the step as loaded, the user's budget in bytes and the options. Out: nothing, or a
``BudgetError`` that names the bound in bytes, what it is made of and what to give. It sits
apart from ``compiler/planning.py`` so that this refusal imports nothing of the planner:
``memcc compile --budget 1KB`` is answered in the time it takes to load the step.
"""

from __future__ import annotations

from dataclasses import replace

from memcc.compiler.options import CompileOptions, plan_budget_under, user_budget
from memcc.graph import Graph
from memcc.passes.plan import StepStructure
from memcc.passes.planning.floor import SESSION_HELD, runtime_bytes, step_floor
from memcc.passes.planning.refusal import BudgetError
from memcc.sizes import format_size


def check_floor(graph: Graph, budget: int, options: CompileOptions, label: str,
                 structure: StepStructure, asked: str | None = None) -> None:
    """Refuse, before any search, a budget under the step's floor (``passes/planning/floor.py``):
    what lives across the whole step (inputs, parameters, optimizer state; no plan frees
    them) plus the largest working set of one forward node (every plan runs it), with the
    margin and slack the budget keeps free. The search would say the same after its
    smallest-peak solve (tens of seconds on a large step) with the exact smallest budget;
    this says what is at least needed, in milliseconds (the error's ``smallest`` is that
    lower bound, never above what ``--budget min`` finds)."""
    floor = step_floor(graph, structure)
    held = "inputs, parameters and optimizer state"
    if options.provider == "cuda" and options.swaps:  # what may wait in host memory
        from memcc.passes.lowering.offload_state import optimizer_state

        moved = sum(b for _, b in optimizer_state(graph))
        floor = replace(floor, persistent_bytes=floor.persistent_bytes - moved)
        if moved:
            held = (f"inputs and parameters (the {format_size(moved)} of optimizer state "
                    "may wait in host memory)")
    floor = replace(floor, runtime_bytes=runtime_bytes(options.provider))
    slack = options.slack_for(graph)
    if floor.total_bytes <= plan_budget_under(budget, options, slack):
        return
    need = user_budget(floor.total_bytes, options, slack)
    node = (f" + {format_size(floor.node_bytes)} that node {floor.node} ({floor.op_type}) "
            "reads and writes at once, the largest working set of any forward node (every "
            "plan runs it)" if floor.node is not None else "")
    runtime = (f" + {format_size(floor.runtime_bytes)} {SESSION_HELD}, whatever the plan"
               if floor.runtime_bytes else "")
    raise BudgetError(
        f"{label}: --budget {asked or options.budget} ({budget:,} bytes"
        f"{_bare_number_hint(str(asked or options.budget))}) cannot hold this "
        f"step: no plan peaks under {format_size(floor.total_bytes)} "
        f"({floor.total_bytes:,} bytes): {format_size(floor.persistent_bytes)} of {held}, "
        f"live all step{node}{runtime}; and the budget keeps {options.margin:.0%} + "
        f"{slack:,} bytes free besides (--margin). No budget under {format_size(need)} "
        f"({need:,} bytes) can fit: give at least that (--budget min finds the smallest "
        "that does), or shrink the step (a smaller batch; --freeze PATTERN trains fewer "
        "parameters; sgd keeps one state tensor per parameter, adamw two). Nothing was "
        "written.",
        budget=budget, smallest=need)


def _bare_number_hint(given: str) -> str:
    """For ``--budget 50`` or ``0.5`` (50 bytes, 0 bytes): what the user likely meant."""
    text = given.strip()
    if not text.replace(".", "", 1).isdigit() or float(text) >= 1e6:
        return ""
    share = f"{float(text) * 100:g}%" if float(text) < 1 else f"{text}%"
    return (f"; a number without a unit is bytes: for a share of the step as built write "
            f"{share}, for megabytes {text}MB")
