"""What a compile is asked for (``CompileOptions``), checked once; the planner's request
built from it (``CompileOptions.plan_request``); and the budget arithmetic that turns a
user's budget into what plans aim at and back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from memcc.errors import InputError
from memcc.frontend.build import BuildOptions
from memcc.graph import Graph
from memcc.passes.analysis.liveness import heap_allowance_bytes
from memcc.passes.planning.request import STRATEGY_NAMES as STRATEGIES
from memcc.passes.planning.request import Budget, DecisionKinds, PlanRequest
from memcc.sizes import parse_size

COST_SOURCES = ("auto", "measured", "analytic")


BASE_SLACK_BYTES = 1024 * 1024
# Seconds compile's planner may spend unless --time-limit says otherwise.
DEFAULT_TIME_LIMIT = 60.0


@dataclass(frozen=True)
class CompileOptions:
    budget: str | int = "min"
    strategy: str = "auto"
    provider: str = "cpu"
    time_limit: float = DEFAULT_TIME_LIMIT
    cost: str = "auto"
    verify: bool = False
    # Plans target budget * (1 - margin) - slack: the liveness model ignores allocator
    # rounding and per-buffer headers, which the measurement sees (under 1% on the zoo; see
    # README). None: 1 MiB, plus the heap allowance of the step's small buffers where it
    # allocates from malloc (``slack_for``); a number is the slack exactly.
    margin: float = 0.02
    slack_bytes: int | None = None
    # The ILP may replace a node's default gradient rule by a variant
    # (passes/lowering/variant_substitution.py).
    variants: bool = True
    # Lossy-tier variants (bfloat16 storage of saved activations) only when asked for.
    allow_lossy: bool = False
    # Swap saved values to host memory: None = wherever it can save memory (the CUDA
    # provider); True asks for it (refused on the CPU provider, with why); False never.
    offload: bool | None = None
    # CPU: plan for ORT's CPU arena (the step then trains through it) instead of malloc.
    arena: bool = False
    build: BuildOptions = field(default_factory=BuildOptions)
    dims: Mapping[str, int] = field(default_factory=dict)
    # Data-parallel (``memcc train --nproc N``): plan the step one of ``nproc`` ranks runs,
    # with ZeRO stage ``zero`` (``compiler.ranks``); the budget is then per rank.
    nproc: int | None = None
    zero: int = 0
    # With ``nproc``: the ranks reduce their gradients by buckets of this many MB during the
    # backward (``memcc train --nproc N --bucket-mb B``, ``dist.bucket_memory``).
    bucket_mb: float | None = None
    # When the planning must end (a ``time.perf_counter()`` value; ``PlanRequest.deadline``):
    # set by compile for each row-chunk setting it plans, so that they share one
    # --time-limit (``compiler/chunk_clock.py``); None: ``time_limit`` from when planning
    # starts.
    deadline: float | None = None
    # False: where nothing fits, refuse without the smallest-peak search (compile's row-chunk
    # screens, ``compiler/chunk_choice.py``: a refusal there costs that search each).
    smallest_on_refusal: bool = True

    def __post_init__(self) -> None:
        # --provider auto plans for where the step would run here (as run and train do);
        # onnxruntime is asked only then (importing it is a tenth of a second of a refusal).
        provider = str(self.provider or "cpu").lower()
        if provider == "auto":
            from memcc.backend.session import planning_provider

            provider = planning_provider(provider)
        if provider in ("cpu", "cuda"):
            object.__setattr__(self, "provider", provider)
        if self.strategy not in STRATEGIES:
            raise InputError(f"--strategy '{self.strategy}': choose one of "
                             f"{', '.join(STRATEGIES)}")
        if self.cost not in COST_SOURCES:
            raise InputError(f"--cost '{self.cost}': choose one of {', '.join(COST_SOURCES)}")
        if self.time_limit <= 0:
            raise InputError(f"--time-limit {self.time_limit:g}: give a positive number of "
                             "seconds")
        if not 0.0 <= self.margin < 0.5:
            raise InputError(f"--margin {self.margin:g}: give a fraction in [0, 0.5), e.g. "
                             "0.02")
        if self.slack_bytes is not None and self.slack_bytes < 0:
            raise InputError("the slack must be zero or more bytes")
        if self.provider not in ("cpu", "cuda"):
            raise InputError(f"--provider '{self.provider}': choose cpu, cuda or auto")
        if self.arena and self.provider != "cpu":
            raise InputError("--arena is for --provider cpu: the CUDA provider always "
                             "allocates through its arena, and its plans are judged by it")
        self._check_ranks()
        if self.offload and self.provider == "cpu":
            raise InputError(
                "--offload with --provider cpu: on the CPU provider the host is the device "
                "(one memory), so copying a saved value to host memory frees nothing and only "
                "adds the copies' time. Plan for the GPU with --provider cuda --offload, or "
                "drop --offload.")

    def _check_ranks(self) -> None:
        """--nproc/--zero: what ``memcc train --nproc`` runs (gloo, CPU, malloc)."""
        if self.nproc is None:
            if self.zero:
                raise InputError(f"--zero {self.zero} plans sharded optimizer state across "
                                 "ranks: give --nproc N too")
            if self.bucket_mb is not None:
                raise InputError(f"--bucket-mb {self.bucket_mb:g} plans data-parallel ranks "
                                 "that reduce their gradients by buckets: give --nproc N too")
            return
        if not 1 <= self.nproc <= 64:
            raise InputError(f"--nproc {self.nproc}: give a number of ranks from 1 to 64")
        if self.zero not in (0, 1, 2):
            raise InputError(f"--zero {self.zero}: give 0 (every rank keeps all optimizer "
                             "state), 1 (each rank keeps its parameters' state) or 2 (and "
                             "only its parameters' averaged gradients)")
        from memcc.dist.buckets import bucket_bytes

        bucket_bytes(self.bucket_mb, self.zero)  # a bad --bucket-mb is refused now
        for on, what in ((self.provider != "cpu", f"--provider {self.provider}"),
                         (self.arena, "--arena"), (self.verify, "--verify")):
            if on:
                raise InputError(
                    f"{what} with --nproc: compile plans the ranks memcc train --nproc runs "
                    "on the CPU from malloc (a GPU rank's step is not planned per rank yet), "
                    "and --verify runs one process; plan with --provider cpu, no --arena, "
                    "and check each rank's measured peak with memcc train --nproc N --json "
                    "(distributed.step_peak_bytes_per_rank)")

    @property
    def ranks(self):
        """The ranks planned for (``passes.analysis.rank_step.Ranks``), or None."""
        from memcc.passes.analysis.rank_step import Ranks

        return None if self.nproc is None else Ranks(self.nproc, self.zero)

    @property
    def bucket_bytes(self) -> int | None:
        """``bucket_mb`` in bytes (as ``memcc train`` reads it), or None: one bucket."""
        from memcc.dist.buckets import bucket_bytes

        return bucket_bytes(self.bucket_mb, self.zero)

    @property
    def device(self) -> str:
        """Whose allocation rules plans are judged by (``passes.planning.simulate.DEVICES``)."""
        return "cpu-arena" if self.arena else self.provider

    @property
    def heap_room(self) -> bool:
        """Whether plans keep heap room for their small buffers: with the default slack,
        on the CPU with malloc (``slack_for`` holds the step's own; the planner weighs
        those a plan adds)."""
        return self.slack_bytes is None and self.device == "cpu"

    def slack_for(self, graph: Graph) -> int:
        """Bytes of the budget that plans for ``graph`` leave free besides ``margin``."""
        if self.slack_bytes is not None:
            return self.slack_bytes
        return BASE_SLACK_BYTES + (heap_allowance_bytes(graph) if self.heap_room else 0)

    @property
    def swaps(self) -> bool:
        """Whether the planner may swap saved values to host memory."""
        return self.provider == "cuda" if self.offload is None else self.offload

    @property
    def requested_budget(self) -> Budget:
        """The user's budget: ``Budget.MIN`` for ``min`` (the smallest budget memcc can
        reach), else its bytes."""
        if isinstance(self.budget, str) and self.budget.strip().lower() == "min":
            return Budget.MIN
        return Budget.of(parse_size(self.budget))

    def plan_request(self, budget: Budget) -> PlanRequest:
        """What the planner is asked under these options, at ``budget`` (what plans aim at:
        the user's budget less margin and slack, ``plan_budget_under``; or
        ``Budget.MIN``)."""
        return PlanRequest(
            budget=budget, strategy=self.strategy, time_limit=self.time_limit,
            deadline=self.deadline,
            kinds=DecisionKinds(variants=self.variants, lossy=self.allow_lossy,
                                offload=self.swaps),
            device=self.device, heap_room=self.heap_room,
            smallest_on_refusal=self.smallest_on_refusal)


def user_budget(planned_peak: int, options: CompileOptions, slack: int) -> int:
    """The budget a user must give for a plan whose simulated peak is ``planned_peak``."""
    return int((planned_peak + slack) / (1.0 - options.margin)) + 1


def plan_budget_under(budget: int, options: CompileOptions, slack: int) -> int:
    """What plans aim at under a user's ``budget``: less the margin and the slack."""
    return max(int(budget * (1.0 - options.margin)) - slack, 0)
