"""``memcc tune``: the largest batch, and the fastest one, whose training step fits a budget.

What enters: a forward model with a symbolic dimension, a budget, the range to search
(``"batch=1..512"``) and ``TuneOptions``. What leaves: a ``TuneResult`` (a row per size
looked at, the answers, the picked size's compiled step). The package keeps the search
apart from what is done with its result:

- ``options``: ``TuneOptions``, ``SearchRange`` (the question);
- ``probe``: one size at a time, "does it fit?" by the cheapest question that settles it;
- ``search``: ``tune`` itself, the edges over the range and the table (docs/TUNE.md);
- ``results``: ``Candidate``, ``TuneResult`` (the answer);
- ``measurement``: ``measure``, the top sizes run in ONNX Runtime (``--measure``);
- ``plots``: ``plot_tune``, ``tune_figure`` (``--plot``).
"""

from memcc.tune.measurement import measure
from memcc.tune.options import LR_RULES, PICKS, SearchRange, TuneOptions, parse_range
from memcc.tune.plots import plot_tune, tune_figure
from memcc.tune.results import Candidate, TuneResult
from memcc.tune.search import tune, write_step

__all__ = ["LR_RULES", "PICKS", "Candidate", "SearchRange", "TuneOptions", "TuneResult",
           "measure", "parse_range", "plot_tune", "tune", "tune_figure", "write_step"]
