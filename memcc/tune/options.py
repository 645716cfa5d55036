"""What ``memcc tune`` is asked: its options (``TuneOptions``: planning, building, the
sizes to tabulate, the learning-rate rule) and the dimension to search (``SearchRange``,
parsed from ``"batch=1..512"``).

Kept apart from the search so that the CLI, the search and the results read one definition
of each choice (``PICKS``, ``LR_RULES``) and one check of each option.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from memcc.compiler import CompileOptions
from memcc.errors import InputError
from memcc.frontend.build import BuildOptions

PICKS = ("fastest", "largest")
LR_RULES = ("linear", "sqrt")
RECOMPUTING = ("auto", "ilp", "sqrtn")  # strategies whose candidates include sqrt(n) plans
_RANGE = re.compile(r"^\s*([A-Za-z_][\w.:/-]*)\s*=\s*(-?\d+)\s*\.\.\s*(-?\d+)\s*$")

Say = Callable[[str], None]


@dataclass(frozen=True)
class TuneOptions:
    """What ``memcc tune`` plans with; the CLI fills it from its flags.

    ``dims`` binds the other symbolic dimensions; ``points`` is how many sizes between the
    largest batch without rewriting and the largest batch get a full plan (each costs a
    compile: they are where a faster batch than both edges could hide)."""

    strategy: str = "auto"
    cost: str = "analytic"   # analytic by default: a measured cost model times every size
    provider: str = "cpu"
    # Seconds per planner call. Lower than compile's 60: tune makes several planner calls
    # near the edge, where on large steps the ILP's smallest-peak solve runs to half of this
    # limit (ResNet-50, 1 GB: 10 s per call -> 57 s in all, largest batch 409; 20 s -> 229 s,
    # 439; BENCHMARKS.md). A larger limit can only find more.
    time_limit: float = 10.0
    margin: float = 0.02
    # None: as compile's default (1 MiB, plus the heap allowance of the step's small
    # buffers on the CPU, counted at the range's smallest size, which has the most).
    slack_bytes: int | None = None
    build: BuildOptions = field(default_factory=BuildOptions)
    dims: Mapping[str, int] = field(default_factory=dict)
    pick: str = "fastest"
    points: int = 1
    ref_batch: int | None = None
    ref_lr: float | None = None
    lr_rule: str = "linear"

    def compile_options(self) -> CompileOptions:
        """The options tune shares with compile, as compile takes them."""
        return CompileOptions(strategy=self.strategy, provider=self.provider, cost=self.cost,
                              time_limit=self.time_limit, margin=self.margin,
                              slack_bytes=self.slack_bytes, build=self.build,
                              dims=self.dims)

    def __post_init__(self) -> None:
        # The options tune shares with compile are checked by compile's own rules, and
        # --provider auto resolves as there.
        object.__setattr__(self, "provider", self.compile_options().provider)
        if self.pick not in PICKS:
            raise InputError(f"--pick '{self.pick}': choose one of {', '.join(PICKS)}")
        if self.points < 0:
            raise InputError("--points must not be negative")
        if self.lr_rule not in LR_RULES:
            raise InputError(f"--lr-rule '{self.lr_rule}': choose one of {', '.join(LR_RULES)}")
        if (self.ref_batch is None) != (self.ref_lr is None):
            raise InputError("--ref-batch and --ref-lr go together: the learning rate that "
                             "worked (--ref-lr) at which batch size (--ref-batch)")
        if self.ref_batch is not None and self.ref_batch <= 0:
            raise InputError("--ref-batch must be positive")
        if self.ref_lr is not None and self.ref_lr <= 0:
            raise InputError("--ref-lr must be positive")

    def lr_for(self, batch: int) -> float | None:
        """The learning rate suggested for ``batch`` by the rule (None without a reference):
        linear scaling (Goyal et al.) for SGD-like training, square-root scaling (Krizhevsky;
        Hoffer et al.) often preferred for Adam-like optimizers."""
        if self.ref_batch is None or self.ref_lr is None:
            return None
        ratio = batch / self.ref_batch
        return self.ref_lr * (ratio if self.lr_rule == "linear" else math.sqrt(ratio))


@dataclass(frozen=True)
class SearchRange:
    """``batch=1..512``: the symbolic dimension searched and its inclusive bounds."""

    dim: str
    low: int
    high: int


def parse_range(text: str) -> SearchRange:
    """``"batch=1..512"`` -> SearchRange; errors say what a range looks like."""
    m = _RANGE.match(text or "")
    if m is None:
        raise InputError(f"--dim '{text}': expected NAME=LOW..HIGH for the dimension to "
                         "search, e.g. --dim batch=1..512 (other dimensions are bound as "
                         "usual: --dim seq=128)")
    name, low, high = m.group(1), int(m.group(2)), int(m.group(3))
    if low < 1:
        raise InputError(f"--dim '{text}': sizes start at 1, not {low}")
    if high < low:
        raise InputError(f"--dim '{text}': the range is empty ({low} > {high}); write "
                         f"{name}={high}..{low}")
    return SearchRange(name, low, high)


