"""Passes over a training step: what memcc knows about it, decides for it, and writes into it.

Rooms, each importing only from those above it in this list (and from ``memcc.graph``,
``memcc.step``, ``memcc.frontend``):

- ``plan``: the one decision type (``Plan``) planning hands to lowering, and the step facts
  (``StepStructure``) both read.
- ``analysis/``: a ``Graph`` in, numbers out (liveness and peaks, the arena's replay, node
  costs, which updates may run in place, the early-update order). Nothing here rewrites.
- ``providers/``: ``Graph`` in, ``Graph`` out: rewrites that make a step run (or run
  deterministically) on one execution provider; the arithmetic is unchanged.
- ``lowering/``: ``Graph`` + ``Plan`` in, ``Graph`` out: recompute clones, swap copies,
  variant substitution, optimizer state in host memory, as checked passes in a fixed order.
- ``planning/``: ``Graph`` + budget in, ``PlanOutcome`` out: the strategies, the simulator
  that judges their plans (lowering, then analysis), the array model of the choice
  (``model/``) and the solvers that never see the graph (``solvers/``).
"""
