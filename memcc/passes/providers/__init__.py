"""Provider rewrites: a ``Graph`` in, a ``Graph`` out that one execution provider runs as
intended (training-mode BatchNorm and deterministic reductions and scatters on CUDA; on any
provider, 16-bit nodes it has no kernel for computed in float32 between casts), with the
same arithmetic. ``provider_step.for_provider`` applies them in order; compile applies it
before planning, so the plan sees the step as it runs.

``deterministic_scatter`` is the entry for scatters: ``scatter_forms`` decides each one's
form, ``scatter_emission`` writes it out.
"""
