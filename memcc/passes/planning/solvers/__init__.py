"""Solvers: pure functions over a ``model.problem.Problem`` that never see the graph."""
