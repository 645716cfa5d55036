"""Planning: a ``Graph``, its costs and a ``PlanRequest`` in; a ``PlanOutcome`` (the chosen
``Plan`` with its simulation and every run tried) out, or a ``BudgetError`` with the numbers.

``request`` is what is asked (``PlanRequest``: a ``Budget``, ``Budget.MIN`` for the smallest
peak; the strategy; the decision kinds allowed; the device); ``planner`` is the entry
(``choose_plan``); ``context`` is the contract with the strategies (a ``PlanningContext``
in, a ``StrategyResult`` out), which are registered by name in ``strategies``, one module
per family (``segmented``, ``exact``, ``polish``); ``simulate`` judges every candidate the
same way (lower it, then analyse the step as it trains, by ``SimulationRules``); ``floor``
refuses budgets below any plan's reach before a search; ``model/`` turns the graph into the
array problem (``PlanModel``) and ``solvers/`` solve it without seeing the graph.
"""
