"""Provider rewrites: a ``Graph`` in, a ``Graph`` out that one execution provider runs as
intended (training-mode BatchNorm and deterministic reductions and scatters on CUDA), with the
same arithmetic. Applied by the frontend before planning, so the plan sees the step as it runs.

``deterministic_scatter`` is the entry for scatters: ``scatter_forms`` decides each one's
form, ``scatter_emission`` writes it out.
"""
