"""Analyses: a ``Graph`` in, facts out (peaks, replays, costs, orders); no pass here rewrites.

``liveness`` is the base every other analysis and the planner's simulator stand on (with
``kernel_scratch``: what a kernel allocates inside itself, and ``node_table``: the nodes'
fields read once per analysis); ``arena`` replays its
allocations through ``bfc_arena``, a model of ORT's BFC arena; ``cost_model`` (with
``cuda_node_times``) prices nodes; ``inplace``, ``update_schedule`` and ``arrange`` say how
the step is arranged to run with its updates in place; ``host_state`` says which carried
values live in host memory; ``device_memory`` is what a CUDA step holds; ``phases`` and
``step_traffic`` feed the report.
"""
