"""Analyses: a ``Graph`` in, facts out (peaks, replays, costs, orders); no pass here rewrites.

``liveness`` is the base every other analysis and the planner's simulator stand on; ``arena``
replays its allocations through ORT's BFC arena; ``cost_model`` (with ``cuda_node_times``)
prices nodes; ``inplace``, ``update_schedule`` and ``arrange`` say how the step is arranged
to run with its updates in place; ``device_memory`` is what a CUDA step holds;
``phases`` and ``step_traffic`` feed the report.
"""
