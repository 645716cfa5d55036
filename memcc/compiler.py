"""``memcc compile``: load, analyse, plan, rewrite, (verify), write; one report for all.

The flow is the design card's: frontend (load, build the step when the model is forward
only), liveness of the step as written (the baseline), the cost model, the plan pass
(strategies judged by one simulator), the rewrite (the plan's lowering), and optionally the
proof by running. Each stage adds a ``PassReport``. Nothing is written until a plan that
fits exists, and files are written atomically, so a failed compile leaves nothing behind.

Both target paths are checked before any work (a read-only directory found after a long
compile wastes it), and the rewritten step and its report are renamed into place together
or not at all. A failed ``--verify`` is the one failure that writes: the report, with what
failed and what to try, and the rewritten step under ``OUT.unverified.onnx`` (for
inspection or a bug report; never at ``OUT``, where a later step or a build tool would
take it for a verified result).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from memcc.backend.determinism import racing_nodes
from memcc.backend.onnx_file import (
    Staged,
    check_writable,
    discard,
    same_file,
    stage_model,
    stage_text,
    write_together,
)
from memcc.backend.profiling import calibrate_cpu_rates, measured_costs
from memcc.backend.session import planning_provider
from memcc.errors import InputError, MemccError
from memcc.frontend.build import BuildOptions, build_training_step, is_training_step
from memcc.frontend.fuse import fuse_step
from memcc.frontend.load import load_graph
from memcc.frontend.row_chunks import ATTENTION, FLAGS, MLP, find_regions
from memcc.graph import Graph, node_label
from memcc.passes.batchnorm_for_cuda import for_provider
from memcc.passes.chunk_choice import choose_row_chunks, summary_line
from memcc.passes.cost_model import (
    CUDA_NOMINAL,
    CostModel,
    HostLink,
    analytic_costs,
    host_link_for,
)
from memcc.passes.cuda_node_times import default_calibration
from memcc.passes.floor import step_floor
from memcc.passes.liveness import HEAP_BYTES_PER_SMALL_BUFFER, heap_allowance_bytes
from memcc.passes.offload_state import offload_state, optimizer_state
from memcc.passes.phases import plan_origin, step_phases
from memcc.passes.plan import StepStructure
from memcc.passes.planner import (
    STRATEGIES,
    BudgetError,
    PlanOutcome,
    choose_plan,
    describe_variants,
)
from memcc.passes.simulate import Simulation, simulate
from memcc.passes.step_traffic import step_traffic
from memcc.sizes import format_size, parse_size
from memcc.step import ALLOCATOR_KEY, FUSIONS_KEY, PLAN_KEY, TrainingStep

COST_SOURCES = ("auto", "measured", "analytic")
BASE_SLACK_BYTES = 1024 * 1024
# Each round plans for less room than the last; the plan's own small buffers settle within
# one or two (a handful of recomputed values each time).
REPLANS_FOR_HEAP_ROOM = 3


@dataclass(frozen=True)
class CompileOptions:
    budget: str | int = "min"
    strategy: str = "auto"
    provider: str = "cpu"
    time_limit: float = 60.0
    cost: str = "auto"
    verify: bool = False
    # Plans target budget * (1 - margin) - slack: the liveness model ignores allocator
    # rounding and per-buffer headers, which the measurement sees (under 1% on the zoo; see
    # README). None: 1 MiB, plus the heap allowance of the step's small buffers where it
    # allocates from malloc (``slack_for``); a number is the slack exactly.
    margin: float = 0.02
    slack_bytes: int | None = None
    # The ILP may replace a node's default gradient rule by a variant (passes/variants.py).
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

    def __post_init__(self) -> None:
        # --provider auto plans for where the step would run here (as run and train do).
        object.__setattr__(self, "provider", planning_provider(self.provider))
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
        if self.offload and self.provider == "cpu":
            raise InputError(
                "--offload with --provider cpu: on the CPU provider the host is the device "
                "(one memory), so copying a saved value to host memory frees nothing and only "
                "adds the copies' time. Plan for the GPU with --provider cuda --offload, or "
                "drop --offload.")

    @property
    def device(self) -> str:
        """Whose allocation rules plans are judged by (``passes.simulate.DEVICES``)."""
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
    def budget_bytes(self) -> int | None:
        """None means: the smallest budget memcc can reach."""
        if isinstance(self.budget, str) and self.budget.strip().lower() == "min":
            return None
        return parse_size(self.budget)


@dataclass(frozen=True)
class PassReport:
    name: str
    time_s: float
    summary: dict

    def to_json(self) -> dict:
        return {"name": self.name, "time_s": round(self.time_s, 4), "summary": self.summary}


@dataclass
class CompileResult:
    graph: Graph
    report: dict
    outcome: PlanOutcome
    passes: list[PassReport]


Progress = Callable[[str], None]


def unverified_path(output: str | os.PathLike) -> Path:
    """Where a rewritten step that failed ``--verify`` is kept: ``OUT.unverified.onnx``."""
    out = Path(output)
    return out.with_name(f"{out.stem}.unverified{out.suffix or '.onnx'}")


def warning_sink(warn: Callable[[str], None] | None
                 ) -> tuple[list[str], Callable[[str], None]]:
    """A list the report keeps its warnings in, and the function that adds one to it and
    passes it on to ``warn`` (the CLI prints it as it happens)."""
    warnings: list[str] = []

    def warning(msg: str) -> None:
        warnings.append(msg)
        if warn is not None:
            warn(msg)

    return warnings, warning


def compile_model(model: str | os.PathLike, options: CompileOptions, *,
                  output: str | os.PathLike | None = None,
                  report_path: str | os.PathLike | None = None,
                  progress: Progress | None = None,
                  warn: Progress | None = None) -> CompileResult:
    """Compile ``model`` for ``options.budget``; write ``output``/``report_path`` if given.

    ``warn`` receives, as they happen, the things a user should know about a compile that
    still succeeds (e.g. costs estimated because CUDA is missing); the report keeps them
    under ``warnings``. A failed verification raises ``VerificationError`` after writing
    the report (and ``unverified_path(output)``).
    """
    say = progress or (lambda _msg: None)
    warnings, warning = warning_sink(warn)
    _check_targets(model, output, report_path)
    cuda_missing = _check_provider(options, warning)
    t_start = time.perf_counter()
    passes: list[PassReport] = []

    def timed(name: str, fn):
        say(f"{name} ...")
        t0 = time.perf_counter()
        value, summary = fn()
        passes.append(PassReport(name, time.perf_counter() - t0, summary))
        return value

    label = str(model) if isinstance(model, (str, os.PathLike)) else "<model>"
    budget = options.budget_bytes
    graph = timed("load", lambda: _load(model, label, options))
    if not passes[-1].summary["built_training_step"] and options.build != BuildOptions():
        warning(f"{label} is already a training step: the build options given (--loss, "
                "--optimizer, --lr, --freeze, ...) apply to forward models and are ignored; "
                "rebuild the step with memcc build to change them")
    structure = StepStructure.of(graph)
    if budget is not None:
        _check_floor(graph, budget, options, label, structure)
    racing = [node_label(n) for n in racing_nodes(graph)]
    if racing:
        warning(f"{label}: {len(racing)} node(s) from the model run an ONNX Runtime CPU kernel "
                f"that races across intra-op threads ({', '.join(racing[:3])}"
                f"{', ...' if len(racing) > 3 else ''}): their results, and every gradient "
                "that depends on them, can change from run to run, and --verify's bit-for-bit "
                "comparison can fail. Export ScatterND with a reduction as ScatterElements "
                "(docs/DETERMINISM.md).")
    costs = timed("cost_model", lambda: _costs(graph, options, warning, cuda_missing))

    offloads: dict[int, dict | None] = {}   # the rewritten step's id -> offloaded_state

    def plan_step(g: Graph, c: CostModel, opts: CompileOptions) -> tuple:
        *planned, offloaded = _plan_offloading_state(g, budget, c, opts, StepStructure.of(g),
                                                     timed, passes, say, label)
        offloads[id(planned[1])] = offloaded
        return tuple(planned)

    def rebuild(opts: CompileOptions) -> tuple[Graph, CostModel]:
        # Another build of the forward model (row chunks): its warnings were said once.
        def quiet(msg: str) -> None:
            if msg not in warnings:
                warning(msg)

        g = timed("load", lambda: _load(model, label, opts))
        return g, timed("cost_model", lambda: _costs(g, opts, quiet, cuda_missing))

    # Row chunks where they pay (passes/chunk_choice.py); the step as loaded is planned first.
    chosen = choose_row_chunks(
        model, label, graph, costs, options, budget, passes[0].summary["built_training_step"],
        plan_step, rebuild, passes, say, lambda peak, s: user_budget(peak, options, s))
    graph, costs, options = chosen.attempt.graph, chosen.attempt.costs, chosen.attempt.options
    outcome, rewritten, slack, plan_budget = chosen.attempt.planned
    offloaded = offloads.get(id(rewritten))
    plan_sim, base_sim = outcome.best, outcome.baseline
    final_budget = budget if budget is not None else user_budget(plan_sim.peak_bytes, options,
                                                                  slack)
    rewritten.metadata[PLAN_KEY] = json.dumps(plan_sim.plan.to_json(), sort_keys=True)
    if options.arena:
        rewritten.metadata[ALLOCATOR_KEY] = "arena"

    verification = None
    if options.verify:
        tolerance = _plan_tolerance(passes)
        verification = timed("verify", lambda: _verify(graph, rewritten, final_budget,
                                                       options, tolerance))

    report = _report(options, final_budget, plan_budget, slack, budget is None, base_sim,
                     plan_sim, outcome, costs, passes, time.perf_counter() - t_start,
                     verification)
    report["row_chunks"] = chosen.report
    report["offloaded_state"] = offloaded
    if offloaded is not None and offloaded["used"]:
        # the copies are in no node's measured time: add them to the plan's (predicted)
        plan = report["plan"]
        plan["compute_cost_s"] += offloaded["added_time_s"]
        base_cost = report["baseline"]["compute_cost_s"]
        plan["overhead"] = plan["compute_cost_s"] / base_cost - 1.0 if base_cost > 0 else 0.0
    report["warnings"] = warnings
    if verification is not None and not verification["ok"]:
        steps = next_steps(verification, options, plan_sim.peak_bytes, label, slack)
        kept = unverified_path(output) if output is not None else None
        verification["next_steps"] = steps
        verification["unverified_output"] = None if kept is None else str(kept)
        say("writing the report of the failed verification")
        _write(kept, rewritten, report_path, report)
        written = [str(x) for x in (report_path, kept) if x is not None]
        raise VerificationError(
            f"{label}: verification failed: " + "; ".join(verification["problems"]) + ". "
            + " ".join(steps)
            + (f" Wrote {' and '.join(written)}" if written else "")
            + (f"; {output} was not written (it would be unverified)." if output is not None
               else "."),
            report=report,
        )
    say(f"writing {output}" if output is not None else "writing the report")
    _write(output, rewritten, report_path, report)
    return CompileResult(rewritten, report, outcome, passes)


def _check_targets(model, output, report_path) -> None:
    """Before any work: both files can be written, and are two different files, neither of
    them the model (a rename over it would destroy the input before anything is checked)."""
    if isinstance(model, (str, os.PathLike)) and not Path(model).exists():
        raise InputError(f"{model}: no such file")
    reads = [("the model", model)]
    if output is not None:
        check_writable(output, "the rewritten step", "--output/-o", inputs=reads)
    if report_path is not None:
        check_writable(report_path, "the report", "--report", inputs=reads)
    if output is not None and report_path is not None and same_file(output, report_path):
        raise InputError(f"--output and --report are the same file ({output}); give the "
                         "report another name.")


def _check_floor(graph: Graph, budget: int, options: CompileOptions, label: str,
                 structure: StepStructure) -> None:
    """Refuse, before any search, a budget under the step's floor (``passes/floor.py``):
    what lives across the whole step (inputs, parameters, optimizer state; no plan frees
    them) plus the largest working set of one forward node (every plan runs it), with the
    margin and slack the budget keeps free. The search would say the same after its
    smallest-peak solve (tens of seconds on a large step) with the exact smallest budget;
    this says what is at least needed, in milliseconds (the error's ``smallest`` is that
    lower bound, never above what ``--budget min`` finds)."""
    floor = step_floor(graph, structure)
    if options.provider == "cuda" and options.swaps:  # what may wait in host memory
        moved = sum(b for _, b in optimizer_state(graph))
        floor = replace(floor, persistent_bytes=floor.persistent_bytes - moved)
    slack = options.slack_for(graph)
    if floor.total_bytes <= plan_budget_under(budget, options, slack):
        return
    need = user_budget(floor.total_bytes, options, slack)
    node = (f" + {format_size(floor.node_bytes)} that node {floor.node} ({floor.op_type}) "
            "reads and writes at once, the largest working set of any forward node (every "
            "plan runs it)" if floor.node is not None else "")
    raise BudgetError(
        f"{label}: --budget {options.budget} ({budget:,} bytes) cannot hold this step: no "
        f"plan peaks under {format_size(floor.total_bytes)} ({floor.total_bytes:,} bytes): "
        f"{format_size(floor.persistent_bytes)} of inputs, parameters and optimizer state, "
        f"live all step{node}; and the budget keeps {options.margin:.0%} + {slack:,} bytes "
        f"free besides (--margin). No budget under {format_size(need)} ({need:,} bytes) can "
        "fit: give at least that (--budget min finds the smallest that does), or shrink "
        "the step (a smaller batch; --freeze PATTERN trains fewer parameters; sgd keeps one "
        "state tensor per parameter, adamw two). Nothing was written.",
        budget=budget, smallest=need)


def _check_provider(options: CompileOptions, warning: Progress) -> str | None:
    """``--provider cuda`` without CUDA: an error where the user asked for something to run
    on CUDA (``--verify``, ``--cost measured``), a visible warning where memcc would
    otherwise quietly estimate instead of measuring (``--cost auto``). Returns why CUDA is
    missing, or None."""
    if options.provider != "cuda":
        return None
    from memcc.backend.session import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        return None
    if options.verify:
        raise InputError(f"--verify --provider cuda: CUDA is not available: {reason}. "
                         "--verify runs the step on CUDA: run this compile where CUDA works, "
                         "or verify here with --provider cpu. Nothing was compiled.")
    if options.cost == "measured":
        raise InputError(f"--cost measured --provider cuda: CUDA is not available: {reason}. "
                         "Use --cost analytic to plan for CUDA with estimated node times, or "
                         "run on the GPU machine. Nothing was compiled.")
    if options.cost == "auto":
        cal = default_calibration()
        basis = (f"node times measured on a GPU ({cal.gpu}, onnxruntime {cal.onnxruntime}, "
                 f"{cal.date}; {Path(cal.path or '').name})" if cal is not None else
                 "nominal GPU rates (no CUDA calibration ships with this memcc)")
        warning("--provider cuda: CUDA is not available, so node times are estimated from "
                f"{basis} instead of measured: the predicted added time is an estimate "
                "(--cost analytic says so and silences this warning). Why: "
                f"{reason}.")
    return reason


def _write(output, graph: Graph | None, report_path, report: dict) -> None:
    """The rewritten step and the report, renamed into place together or not at all."""
    staged: list[Staged] = []
    try:
        if output is not None and graph is not None:
            staged += stage_model(graph.to_model(), Path(output))
        if report_path is not None:
            staged += stage_text(json.dumps(report, indent=1, sort_keys=False) + "\n",
                                 Path(report_path))
    except OSError as exc:
        discard(staged)
        raise InputError(f"cannot write {exc.filename or output}: {exc.strerror or exc}. "
                         "Nothing was written.") from None
    except BaseException:
        discard(staged)
        raise
    try:
        write_together(staged)
    except OSError as exc:
        raise InputError(f"cannot write {exc.filename or output}: {exc.strerror or exc}. "
                         "Nothing was written.") from None


def next_steps(v: dict, options: CompileOptions, planned_peak: int, label: str,
               slack: int) -> list[str]:
    """What to try after a failed ``--verify``, one sentence per failed check (the report
    keeps them as ``verification.next_steps``)."""
    steps: list[str] = []
    if v.get("outputs_match") is False:
        if v.get("racing_nodes"):
            steps.append(
                "Outputs differ, and the model has nodes whose ONNX Runtime CPU kernel races "
                f"across intra-op threads ({', '.join(v['racing_nodes'][:3])}): their results "
                "change from run to run whatever the plan. Export ScatterND with a reduction "
                "as ScatterElements (docs/DETERMINISM.md).")
        elif v.get("comparison") == "bit-identical":
            steps.append(
                "Outputs differ: recomputation repeats the same kernels on the same inputs, "
                "so on CPU they should be bit-identical. Run the same command again: if the "
                "difference comes and goes, it is nondeterminism in ONNX Runtime's "
                "multi-threaded kernels, not the plan; if it stays, it is a memcc bug: "
                f"please report it with {label}, the command and the report.")
        else:
            steps.append(
                "Outputs differ beyond the CUDA tolerance: rtol 1e-5, or 4x what two runs "
                "of the step as built differ by on this GPU. Run the same command again: "
                "if the difference comes and goes, the step's own kernels are not "
                "reproducible (BENCHMARKS.md, 'CUDA on an H100'); if it stays, please "
                f"report it with {label}, the command and the report.")
    measured = v.get("measured_peak_bytes")
    budget = int(v.get("budget_bytes") or 0)
    if measured is None:
        steps.append(
            f"The peak could not be measured on {options.provider} "
            f"({v.get('measurement_method')}); install pynvml for CUDA, or verify with "
            "--provider cpu.")
    elif budget and measured > budget:
        ratio = measured / max(planned_peak, 1)
        # The margin at which this plan's measured/predicted ratio would still fit.
        need = 1.0 - (budget / ratio + slack) / budget
        margin = min(max(math.ceil((need + 0.01) * 100) / 100, options.margin + 0.01), 0.49)
        bigger = int((measured + slack) / (1.0 - options.margin)) + 1
        steps.append(
            f"The measured peak is {format_size(measured)}, {measured / budget - 1:.1%} over "
            f"the budget, and {ratio - 1:+.1%} off the predicted {format_size(planned_peak)}"
            f": compile again with a larger safety margin (--margin {margin:.2f}; now "
            f"{options.margin:.2f}) to keep the budget, or with a larger budget "
            f"(--budget {bigger} or more) if the device has room.")
    if v.get("order_matches_plan") is False:
        steps.append(
            "ONNX Runtime did not run the nodes in the planned order, so the measured peak "
            "does not test the plan. memcc relies on ORT's PRIORITY_BASED execution order "
            "(README, How memory is predicted and measured); this is a memcc bug or an "
            f"onnxruntime version that orders differently: please report it with {label}, "
            "the command and the report.")
    return steps


def _plan_in_budget(graph: Graph, budget: int | None, costs: CostModel,
                    options: CompileOptions, structure: StepStructure,
                    timed: Callable[[str, Callable[[], tuple]], object],
                    passes: list[PassReport], say: Progress, label: str
                    ) -> tuple[PlanOutcome, Graph, int, int | None]:
    """The plan pass and its rewrite, keeping heap room for the small buffers of the plan
    it returns (``CompileOptions.slack_for``): (outcome, rewritten step, slack, planning
    budget). The step as built has the fewest small buffers; recompute clones add some,
    which the planner weighs when it picks a plan (``Simulation.fit_bytes``) and, where the
    plan it returns still lacks room, compile plans again for less."""
    slack = base_slack = options.slack_for(graph)
    plan_budget = None if budget is None else plan_budget_under(budget, options, slack)

    def own_slack(outcome: PlanOutcome) -> int:
        return max(base_slack, options.slack_for(outcome.best.graph))

    def no_fit(exc: BudgetError, trained: PlanOutcome | None) -> BudgetError:
        # what --budget min gives: the smallest plan, as trained, with its own heap room
        room = slack if trained is None else own_slack(trained)
        need = user_budget(exc.smallest if trained is None else trained.best.peak_bytes,
                           options, room)
        return BudgetError(
            f"{label}: the training step does not fit in {format_size(budget)} "
            f"({budget:,} bytes). The smallest budget memcc can reach for it is "
            f"{format_size(need)} ({need:,} bytes; strategy {options.strategy}, with "
            f"{options.margin:.0%} + {room:,} bytes of safety margin). "
            f"Nothing was written. Use --budget {need} "
            "or more, --budget min, or a smaller batch."
            + _chunks_hint(next(p.summary for p in passes if p.name == "load")),
            budget=budget or 0, smallest=need,
        )

    def plan_for(target: int | None) -> PlanOutcome:
        """The plan for ``target``; where none fits it, the smallest plan if that fits the
        budget with the heap room of its own small buffers (a previous plan's may have been
        more), else the refusal, naming the budget that --budget min gives."""
        try:
            return timed("plan", lambda: _plan(graph, target, costs, options, structure))
        except BudgetError as exc:
            smallest = None if exc.outcome is None else as_trained(
                graph, exc.outcome, costs, options, structure)
            if smallest is None or budget is None or smallest.best.peak_bytes > plan_budget_under(
                    budget, options, own_slack(smallest)):
                raise no_fit(exc, smallest) from None
            return timed("plan", lambda: (smallest, _plan_summary(graph, smallest, costs,
                                                                  options, structure)))

    outcome = plan_for(plan_budget)
    plan_sim = outcome.best
    base_sim = outcome.baseline
    rewritten = timed("rewrite", lambda: _rewrite(plan_sim, base_sim))
    # Recomputed values are buffers too: keep heap room for the plan's own small buffers,
    # planning again, for less, while they leave the plan over its budget.
    for _ in range(REPLANS_FOR_HEAP_ROOM):
        own = own_slack(outcome)
        if plan_budget is None or plan_sim.peak_bytes <= plan_budget_under(budget, options, own):
            break
        first = {"peak_bytes": plan_sim.peak_bytes, "planning_budget_bytes": plan_budget,
                 "small_buffers_heap_bytes": own - slack}
        slack = own
        plan_budget = plan_budget_under(budget, options, slack)
        say(f"planning again, for {format_size(plan_budget)}: the plan's recomputed values "
            "need heap room of their own")
        del passes[-2:]  # that plan and its rewrite: the report keeps the one used
        outcome = plan_for(plan_budget)
        passes[-1].summary["planned_again"] = first
        plan_sim, base_sim = outcome.best, outcome.baseline
        rewritten = timed("rewrite", lambda p=plan_sim, b=base_sim: _rewrite(p, b))
    # What the report states: the room the returned plan keeps for its own small buffers.
    slack = own_slack(outcome)
    if budget is not None:
        plan_budget = plan_budget_under(budget, options, slack)
    return outcome, rewritten, slack, plan_budget


def _plan_offloading_state(graph: Graph, budget: int | None, costs: CostModel,
                           options: CompileOptions, structure: StepStructure,
                           timed, passes: list[PassReport], say: Progress, label: str):
    """``_plan_in_budget``, and on CUDA with offload on, the same with the optimizer state in
    host memory (``passes.offload_state``) where that reaches further or costs less: tried
    when the budget is not reached without it, for ``--budget min`` (the smaller peak wins),
    and when the plan without it adds more time than the state's copies would. Returns
    ``_plan_in_budget``'s tuple and the report's ``offloaded_state`` (None: not tried)."""
    state = optimizer_state(graph) if options.provider == "cuda" and options.swaps else []
    start = len(passes)
    try:
        plain = _plan_in_budget(graph, budget, costs, options, structure, timed, passes,
                                say, label)
        refusal = None
    except BudgetError as exc:
        if not state:
            raise
        plain, refusal = None, exc
    if not state:
        return (*plain, None)
    everything = [n for n, _ in state]
    tries = [everything]
    if plain is None and budget is not None:
        # out of reach by a known deficit: first the largest tensors that cover it, with
        # room for the update that visits the device (the rest then costs no copies)
        deficit, covered, prefix = refusal.smallest - budget, 0, []
        for name, nbytes in state:
            if covered >= 2 * deficit + state[0][1]:
                break
            prefix.append(name)
            covered += nbytes
        if len(prefix) < len(everything):
            tries.insert(0, prefix)
    middle = len(passes)
    off = moved = None
    for names in tries:
        moved = offload_state(graph, names)
        copies_s = moved.added_seconds(costs.link)
        if plain is not None and budget is not None and plain[0].best.added_time_s <= copies_s:
            return (*plain, None)  # fits, and adds less time than the copies alone would
        say(f"planning with {len(names)} optimizer state tensors in host memory "
            f"({format_size(moved.bytes)})")
        try:
            off = _plan_in_budget(moved.graph, budget, costs, options,
                                  StepStructure.of(moved.graph), timed, passes, say, label)
            break
        except BudgetError as exc:
            del passes[middle:]
            if names is tries[-1]:
                if plain is None:
                    raise exc from refusal
                return (*plain, None)

    def reach(result) -> int:
        return user_budget(result[0].best.peak_bytes, options, result[2])

    without = refusal.smallest if plain is None else reach(plain)
    off_time = off[0].best.added_time_s + copies_s
    use = plain is None or (off[0].best.peak_bytes < plain[0].best.peak_bytes
                            if budget is None else off_time < plain[0].best.added_time_s)
    if use:
        del passes[start:middle]
    else:
        del passes[middle:]
    report = moved.to_json(costs.link) | {
        "used": use, "smallest_budget_bytes": reach(off) if budget is None else None,
        "smallest_budget_without_bytes": without if budget is None or plain is None else None,
        "plan_added_time_s": round(off_time, 6),
        "method": "predicted (passes.offload_state + passes.device_memory), not measured"}
    return (*(off if use else plain), report)


def user_budget(planned_peak: int, options: CompileOptions, slack: int) -> int:
    """The budget a user must give for a plan whose simulated peak is ``planned_peak``."""
    return int((planned_peak + slack) / (1.0 - options.margin)) + 1


def plan_budget_under(budget: int, options: CompileOptions, slack: int) -> int:
    """What plans aim at under a user's ``budget``: less the margin and the slack."""
    return max(int(budget * (1.0 - options.margin)) - slack, 0)


class VerificationError(MemccError):
    def __init__(self, message: str, *, report: dict) -> None:
        super().__init__(message)
        self.report = report


def _margin_note(report: dict) -> str:
    """What the budget keeps free besides the plan's peak, where the heap takes a share."""
    heap = report.get("heap_allowance_bytes") or 0
    if not heap:
        return ""
    return (f"; margin {report['margin']:.0%} + {format_size(report['slack_bytes'])}, "
            f"{format_size(heap)} of it for the heap of "
            f"{heap // HEAP_BYTES_PER_SMALL_BUFFER:,} small buffers")


def _chunks_hint(load_summary: dict) -> str:
    """Where the model has attentions or MLPs left whole, the flags that split them."""
    found = load_summary.get("splittable") or {}
    if not found:
        return ""
    what = " and ".join(f"{n} {'attention' if kind == ATTENTION else 'MLP'}"
                        f"{'s' if n > 1 else ''} ({FLAGS[kind]} K)"
                        for kind, n in found.items())
    return (f" The model also has {what} that row chunks can split, which lowers the "
            "smallest budget where their tensors are the largest (docs/VARIANTS.md, "
            "\"Attentions and MLPs over row chunks\").")


# ---------------------------------------------------------------------------- stages
def _load(model, label: str, options: CompileOptions):
    graph = load_graph(model, options.dims, source=label)
    built = False
    splittable: dict[str, int] = {}
    if not is_training_step(graph):
        # What row chunks could split that this build leaves whole (a hint if nothing fits).
        for kind, k in ((ATTENTION, options.build.attention_chunks),
                        (MLP, options.build.mlp_chunks)):
            if (k or 1) == 1 and (n := len(find_regions(graph, kind))):
                splittable[kind] = n
        graph = build_training_step(graph, options.build, source=label)
        built = True
    elif FUSIONS_KEY not in graph.metadata:
        # A step built before memcc fused its steps: fused here, as build would have.
        graph = fuse_step(graph)
    graph, rewritten_for_cuda = for_provider(graph, options.provider)
    step = TrainingStep.of(graph)
    params = step.parameters
    return graph, {
        "model": label, "built_training_step": built, "nodes": len(graph.nodes),
        "parameters": len(params),
        "parameter_bytes": int(sum(graph.info[p].nbytes for p in params)),
        # Attentions / MLPs over row chunks (memcc build --attention-chunks/--mlp-chunks).
        **({"row_chunks": step.row_chunks} if step.row_chunks else {}),
        **({"splittable": splittable} if splittable else {}),
        # Training-mode BatchNorms written as the CUDA provider runs them
        # (passes/batchnorm_for_cuda.py).
        **({"batchnorm_rewritten": rewritten_for_cuda} if rewritten_for_cuda else {}),
        # memcc's fusions (frontend/fuse.py), as build recorded them.
        **({"fusions": json.loads(graph.metadata[FUSIONS_KEY])}
           if FUSIONS_KEY in graph.metadata else {}),
    }


def _costs(graph: Graph, options: CompileOptions, warning: Progress,
           cuda_missing: str | None) -> tuple[CostModel, dict]:
    """``cuda_missing``: why CUDA is not there (``_check_provider`` already warned)."""
    note = None
    if cuda_missing is not None and options.cost == "auto":
        note = f"CUDA is not available, estimated instead: {cuda_missing}"
    elif options.cost in ("auto", "measured"):
        try:
            cm = replace(measured_costs(graph, options.provider),
                         link=_measured_link(options.provider, warning))
            summary = {"source": "measured", "provider": options.provider,
                       "total_s": round(cm.total(graph), 6)}
            if cm.link is not None:
                summary["host_link"] = cm.link.to_json()
            return cm, summary
        except MemccError as exc:
            if options.cost == "measured":
                raise
            note = f"measuring failed, estimated instead: {exc}"
            warning(f"--cost auto: measuring node times failed ({exc}); they are estimated "
                    "instead, so the predicted added time is an estimate.")
    cal = default_calibration() if options.provider == "cuda" else None
    if cal is not None:
        # Estimated from node times measured on a GPU (passes/cuda_node_times.py).
        cm = replace(cal.costs(graph), link=host_link_for(options.provider))
        summary = {"source": cm.source, "provider": options.provider,
                   "calibration": cal.describe(), "total_s": round(cm.total(graph), 6)}
    else:
        rates = calibrate_cpu_rates() if options.provider == "cpu" else CUDA_NOMINAL
        cm = replace(analytic_costs(graph, rates), link=host_link_for(options.provider))
        summary = {"source": "analytic", "provider": options.provider,
                   "rates": rates.to_json(), "total_s": round(cm.total(graph), 6)}
    if cm.link is not None:
        summary["host_link"] = cm.link.to_json()
    if note:
        summary["note"] = note
    return cm, summary


def _measured_link(provider: str, warning: Progress) -> HostLink | None:
    """The swap copies' link measured on this machine (CUDA only: nothing is swapped on the
    CPU provider); the nominal PCIe figure, with a warning, when measuring fails."""
    if host_link_for(provider) is None:
        return None
    from memcc.backend.host_link import measure_host_link

    try:
        return measure_host_link(provider)
    except MemccError as exc:
        warning(f"measuring the host link failed ({exc}); swap copies are priced at the "
                "nominal PCIe rate instead.")
        return host_link_for(provider)


def _plan(graph, budget, costs, options, structure) -> tuple[PlanOutcome, dict]:
    # On CUDA, saved values may also be swapped to host memory (never on the CPU provider,
    # where host and device are one memory).
    outcome = choose_plan(graph, budget, costs, strategy=options.strategy,
                          time_limit=options.time_limit, structure=structure,
                          offload=options.swaps, variants=options.variants,
                          device=options.device, allow_lossy=options.allow_lossy,
                          heap_room=options.heap_room)
    outcome = as_trained(graph, outcome, costs, options, structure)
    return outcome, _plan_summary(graph, outcome, costs, options, structure)


def as_trained(graph: Graph, outcome: PlanOutcome, costs: CostModel, options: CompileOptions,
               structure: StepStructure) -> PlanOutcome:
    """The chosen plan and the step as built, judged in the order ``memcc train`` runs them:
    updates in place and each moved to just after its gradient where that lowers the peak
    (``simulate(early_updates=True)``). The search judges candidates in the file's order
    (a bound on this one, at a third of the analysis); the step compile writes is this
    order, so the peak it reports is the peak of the step as trained, never above the one
    the search accepted."""
    def trained(sim: Simulation) -> Simulation:
        again = simulate(graph, sim.plan, costs, structure, host_copies=options.swaps,
                         device=options.device, early_updates=True)
        return replace(again, heap_room=sim.heap_room) \
            if again.peak_bytes <= sim.peak_bytes else sim

    return replace(outcome, best=trained(outcome.best), baseline=trained(outcome.baseline))


def _plan_summary(graph, outcome: PlanOutcome, costs, options, structure) -> dict:
    best, base = outcome.best, outcome.baseline
    variants = describe_variants(graph, best, costs, structure,
                                 host_copies=options.provider == "cuda",
                                 device=options.device)
    saved = {v: graph.info[v].nbytes for v in best.recomputed_values}
    summary = {
        "strategy": outcome.strategy,
        "strategy_label": outcome.label,
        "recomputed_nodes": len(best.plan.recompute),
        "recomputed_values": len(best.recomputed_values),
        "recomputed_value_bytes": int(sum(saved.values())),
        "peak_bytes": best.peak_bytes,
        "baseline_peak_bytes": base.peak_bytes,
        "bytes_saved": base.peak_bytes - best.peak_bytes,
        "predicted_added_time_s": round(best.added_time_s, 6),
        "variant_nodes": len(variants["chosen"]),
        "exactness": variants["exactness"],
        "variants": variants,
        "smallest_peak_bytes": outcome.smallest_peak,
        "solver": outcome.solver,
        "candidates": outcome.candidates,
        "runs": outcome.runs,
    }
    return summary


def _rewrite(plan_sim: Simulation, base_sim: Simulation) -> tuple[Graph, dict]:
    g = plan_sim.graph
    return g, {
        "nodes_before": len(base_sim.graph.nodes), "nodes_after": len(g.nodes),
        "cloned_nodes": len(plan_sim.cloned_nodes),
        "recomputed": list(plan_sim.recomputed_values),
    }


def _plan_tolerance(passes: list[PassReport]) -> float | None:
    """None when every rewrite repeats the same arithmetic (compare bit for bit), else the
    largest relative error the chosen variants state (``equivalent`` tier)."""
    plan = next((p.summary for p in passes if p.name == "plan"), {})
    v = plan.get("variants") or {}
    return None if v.get("exactness", "exact") == "exact" else float(v["tolerance"])


def _verify(original: Graph, rewritten: Graph, budget: int, options: CompileOptions,
            tolerance: float | None = None):
    from memcc.backend.verify import verify_rewrite

    result = verify_rewrite(original, rewritten, budget=budget, provider=options.provider,
                            tolerance=tolerance, arena=options.arena)
    return result, result


# ---------------------------------------------------------------------------- report
def _calibration_of(passes) -> dict:
    """The CUDA calibration the node times were estimated from, as the cost pass said."""
    for p in passes:
        if p.name == "cost_model" and p.summary.get("calibration"):
            return {"calibration": p.summary["calibration"]}
    return {}


def _report(options, budget, plan_budget, slack, was_min, base: Simulation, plan: Simulation,
            outcome: PlanOutcome, costs: CostModel, passes, compile_time, verification) -> dict:
    base_cost = base.compute_cost_s
    plan_cost = plan.compute_cost_s
    live = plan.liveness
    # Kernels and bytes moved per step (passes/step_traffic.py): the plan's rewritten step
    # counts its recompute clones and swap copies.
    base_traffic, plan_traffic = step_traffic(base.graph), step_traffic(plan.graph)
    return {
        "budget_bytes": int(budget),
        "budget_was_min": was_min,
        "margin": options.margin,
        "slack_bytes": int(slack),
        "heap_allowance_bytes": int(max(slack - BASE_SLACK_BYTES, 0)
                                    if options.slack_bytes is None else 0),
        "planning_budget_bytes": int(plan_budget if plan_budget is not None else plan.peak_bytes),
        "baseline": {
            "peak_bytes": base.peak_bytes,
            "compute_cost_s": base_cost,
            "breakdown_at_peak": dict(base.liveness.breakdown),
            "peak_node": base.liveness.peak_node,
            "kernels": base_traffic.kernels,
            "bytes_moved": base_traffic.bytes_moved,
        },
        "plan": {
            "peak_bytes": plan.peak_bytes,
            "compute_cost_s": plan_cost,
            "kernels": plan_traffic.kernels,
            "bytes_moved": plan_traffic.bytes_moved,
            "overhead": (plan_cost / base_cost - 1.0) if base_cost > 0 else 0.0,
            "fits": plan.peak_bytes <= budget,
            "strategy": outcome.strategy,
            "requested_strategy": outcome.requested,
            "picked_strategy": outcome.picked,
            "strategy_label": outcome.label,
            "breakdown_at_peak": dict(live.breakdown),
            "peak_node": live.peak_node,
            "recomputed_values": list(plan.recomputed_values),
            "recomputed_nodes": sorted(plan.plan.recompute),
            "recompute_again_nodes": sorted(plan.plan.recompute_again),
            "offloaded_values": sorted(plan.plan.offload),
            "variants": next((p.summary["variants"] for p in passes if p.name == "plan"
                              and "variants" in p.summary), None),
            "host_peak_bytes": live.host_peak_bytes,
            "device_arena": plan.arena.to_json() if plan.arena is not None else None,
            "device": ({k: v for k, v in plan.device.to_json().items() if k != "arena"}
                       if plan.device is not None else None),
            "live_peak_bytes": live.peak_bytes,
        },
        "passes": [p.to_json() for p in passes],
        "compile_time_s": compile_time,
        "solver": {k: outcome.solver.get(k) for k in ("name", "status", "gap")}
        | {k: v for k, v in outcome.solver.items() if k not in ("name", "status", "gap")},
        # Every strategy that ran and what it returned; ``solver`` is the last ILP solve
        # only, which need not be where the plan came from.
        "strategies": outcome.runs,
        "cost_model": {"source": costs.source, "provider": options.provider}
        | ({"host_link": costs.link.to_json()} if costs.link is not None else {})
        | _calibration_of(passes),
        "timeline": {
            "baseline": list(base.liveness.live_during),
            "plan": list(live.live_during),
            "phases": step_phases(base.graph),
            "plan_origin": plan_origin(base.graph, plan.graph),
        },
        "verification": verification,
        "options": {"strategy": options.strategy, "provider": options.provider,
                    "arena": options.arena, "time_limit": options.time_limit,
                    "cost": options.cost},
    }


def summary_lines(report: dict) -> list[str]:
    """The few lines ``memcc compile`` prints: budget, peaks, strategy, and with --verify
    each of the three checks (a user should not need the JSON to see what was proven)."""
    b, p = report["baseline"], report["plan"]
    lines = [
        f"budget   {format_size(report['budget_bytes'])}"
        + (" (smallest reachable)" if report.get("budget_was_min") else "")
        + _margin_note(report),
        f"baseline peak {format_size(b['peak_bytes'])}  ->  plan peak "
        f"{format_size(p['peak_bytes'])}  ({'fits' if p['fits'] else 'DOES NOT FIT'})",
        f"strategy {p.get('strategy_label', p['strategy'])}: "
        f"{len(p['recomputed_values'])} values recomputed"
        + (f" ({len(p['recompute_again_nodes'])} nodes rebuilt again for later readers)"
           if p.get("recompute_again_nodes") else "")
        + f", predicted added time {p['overhead'] * 100:.1f}%",
    ]
    o = report.get("offloaded_state")
    if o and o["used"]:
        reach = (f"; smallest budget {format_size(o['smallest_budget_bytes'])} with it, "
                 if o.get("smallest_budget_bytes") else "; ")
        without = o.get("smallest_budget_without_bytes")
        lines.append(f"offload  optimizer state in host memory: {len(o['tensors'])} tensors, "
                     f"{format_size(o['bytes'])}, copies add {o['added_time_s'] * 1e3:.1f} ms"
                     + (f"{reach}{format_size(without)} without (predicted)" if without
                        else ""))
    if (chunks := summary_line(report)) is not None:
        lines.append(chunks)
    v = report.get("verification")
    if v:
        lines.append(f"verify   {'OK' if v['ok'] else 'FAILED'}: " + "; ".join(verify_checks(v)))
    return lines


def verify_checks(v: dict) -> list[str]:
    """The three verification checks in words, e.g. for ``summary_lines``."""
    n = v.get("outputs_compared")
    if v.get("outputs_match", not any("output" in p for p in v.get("problems", []))):
        outputs = f"{n} outputs {v.get('comparison')}"
    else:
        outputs = (f"{v.get('outputs_differing', '?')} of {n} outputs differ "
                   f"(expected {v.get('comparison')})")
    measured, budget = v.get("measured_peak_bytes"), v.get("budget_bytes")
    if measured is None:
        peak = f"peak not measured ({v.get('measurement_method')})"
    elif budget is None:
        peak = f"measured peak {format_size(measured)}"
    else:
        sign = "<=" if measured <= budget else ">"
        peak = f"measured peak {format_size(measured)} {sign} budget {format_size(budget)}"
    order = ("executed order = planned order" if v.get("order_matches_plan")
             else "executed order differs from the plan")
    return [outputs, peak, order]
