"""Lowering: a ``Graph`` and a ``Plan`` in, the rewritten ``Graph`` out.

``lower.lower_plan`` runs the checked passes in one fixed order (variant substitution, then
recompute, then swap), each with the conditions it requires and ensures; ``offload_state``
moves optimizer state to host memory around its update.
"""
