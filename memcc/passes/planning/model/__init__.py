"""The planning problem in array form (``problem.Problem``) and the term generators that
build it from a graph, one per decision kind: recompute, variants, offload."""
