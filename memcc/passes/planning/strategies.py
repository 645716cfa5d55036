"""Planning strategies, registered by name (``context.REGISTRY``): each is a function of
(a ``PlanningContext``, a ``Budget``) returning a ``StrategyResult`` (``context.py`` states
the contract). Importing this module registers every strategy memcc ships, one module per
family: ``segmented`` (``none``, ``sqrtn``), ``exact`` (``ilp``), ``polish`` (``auto``).
``--strategy`` lists whatever is registered.
"""

from __future__ import annotations

from memcc.passes.planning import exact, polish, segmented
from memcc.passes.planning.context import (
    REGISTRY,
    PlanModel,
    PlanningContext,
    Strategy,
    StrategyResult,
    StrategyRun,
    strategy,
)

__all__ = ["REGISTRY", "PlanModel", "PlanningContext", "Strategy", "StrategyResult",
           "StrategyRun", "exact", "polish", "segmented", "strategy"]
