"""Planning: a ``Graph``, its costs and a budget in; a ``PlanOutcome`` (the chosen ``Plan``
with its simulation and every run tried) out.

``planner`` is the entry (``choose_plan``); ``strategies`` are registered by name and each
returns candidate plans; ``simulate`` judges every candidate the same way (lower it, then
analyse the step as it trains); ``floor`` refuses budgets below any plan's reach before a
search; ``model/`` turns the graph into the array problem and ``solvers/`` solve it without
seeing the graph.
"""
