"""What the plan pass is asked: one ``PlanRequest``, built once from the options and passed
whole (``compiler.CompileOptions.plan_request``, which ``analyze`` uses too; ``tune`` builds
its own from its options).

A request says how much memory the step may use (a ``Budget``: bytes, or ``Budget.MIN``,
the smallest peak memcc can reach), which strategy searches, for how long, which decision
kinds a plan may use besides recompute, and whose allocation rules its peak follows. It
holds no graph: the same request plans every step a compile builds (row chunks), and a
refusal's smallest-budget search is the same request at ``Budget.MIN``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any, ClassVar

# The strategies the planner registers (``planner.STRATEGIES``, which checks it equals this):
# named here for the options to check without importing every strategy.
STRATEGY_NAMES = ("auto", "ilp", "none", "sqrtn")


@dataclass(frozen=True)
class Budget:
    """A planning budget: a number of bytes, or ``Budget.MIN`` (the smallest peak memcc can
    reach). Build one with ``Budget.of(n)``; read the bytes with ``bytes`` (never on MIN)."""

    limit: int | None = None   # None only in MIN; use ``bytes`` / ``is_min`` to read it
    MIN: ClassVar[Budget]

    @classmethod
    def of(cls, nbytes: int) -> Budget:
        """A budget of ``nbytes`` bytes."""
        return cls(int(nbytes))

    @property
    def is_min(self) -> bool:
        """Whether this asks for the smallest peak rather than a number of bytes."""
        return self.limit is None

    @property
    def bytes(self) -> int:
        """The budget in bytes; a ``ValueError`` for ``MIN``, which has none."""
        if self.limit is None:
            raise ValueError("Budget.MIN has no number of bytes")
        return self.limit

    def holds(self, nbytes: int) -> bool:
        """Whether ``nbytes`` fit a budget of bytes (``MIN`` holds nothing in advance: only
        a search says what the smallest peak is)."""
        return self.limit is not None and nbytes <= self.limit

    def __str__(self) -> str:
        return "min" if self.limit is None else f"{self.limit:,} bytes"


Budget.MIN = Budget(None)


@dataclass(frozen=True)
class DecisionKinds:
    """The decision kinds a plan may use besides recompute (always allowed)."""

    # A gradient-rule variant per node (passes/lowering/variant_substitution.py).
    variants: bool = True
    lossy: bool = False        # the lossy-tier variants too (16-bit storage), only when asked
    # Swap saved values to host memory: a device provider only (``costs.link`` prices the
    # copies); never on the CPU provider, where host and device are one memory.
    offload: bool = False


@dataclass(frozen=True)
class PlanRequest:
    """Everything ``planner.choose_plan`` is asked, in one frozen value.

    ``heap_room``: a plan fits where its peak and the heap room of the small buffers it
    adds do (``Simulation.fit_bytes``; CPU with malloc). ``regions``: where the smallest
    peak is searched (``Budget.MIN``, or nothing fits), plan once more over the step with
    its region variants in place. ``smallest_on_refusal=False``: where nothing fits (over
    the region variants too), refuse without searching the smallest peak (the error's
    ``smallest`` is then only the smallest peak of the plans tried).

    ``time_limit`` is the work the call is given (the polish's count of simulations is
    derived from it, so it must not come from the clock); ``deadline`` (a
    ``time.perf_counter()`` value) is when the call must end, the safety net every stage
    stops at: None means ``time_limit`` from when the planning starts. Compile gives each
    row-chunk setting a share of ``--time-limit`` as its ``time_limit`` and the one
    deadline of the compile (``compiler/chunk_clock.py``)."""

    budget: Budget = Budget.MIN
    # The rest by keyword only: a field added among them (``deadline``) shifted positional
    # callers silently (tune passed its kinds as the deadline and crashed).
    _: KW_ONLY
    strategy: str = "auto"
    time_limit: float = 60.0
    deadline: float | None = None
    kinds: DecisionKinds = field(default_factory=DecisionKinds)
    device: str = "cpu"        # whose allocation rules a peak follows (simulate.DEVICES)
    heap_room: bool = False
    regions: bool = True
    smallest_on_refusal: bool = True
    # How many sqrt(n) segment counts to simulate; None: as many as ``time_limit``'s work
    # buys (``planner.segment_counts``). The region search is given its caller's count, so
    # that its small share of the limit does not thin its segmentations.
    segment_counts: int | None = None

    def at(self, budget: Budget) -> PlanRequest:
        """The same request at another budget."""
        return replace(self, budget=budget)


def stopped_by_clock(run: Mapping[str, Any], *, polish: bool = True) -> bool:
    """Whether --time-limit stopped one strategy run (a row of ``PlanOutcome.runs``): a solve
    the clock cut (``limit_hit``) or left unrun (its ``status``), or, with ``polish``, a
    polish or segmentation it cut (``cut_by_time_limit``), which sheds recompute at the same
    peak and so never moves a smallest peak."""
    return (run.get("limit_hit") == "time" or "time limit" in str(run.get("status") or "")
            or (polish and bool(run.get("cut_by_time_limit"))))
