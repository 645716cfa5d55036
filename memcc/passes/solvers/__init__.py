"""Solvers: pure functions over arrays that never see the graph (see ``problem.py``)."""
