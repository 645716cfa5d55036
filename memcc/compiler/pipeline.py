"""``memcc compile``: load, cost, plan, rewrite, (verify), write; one report for all.

In: a model (a path or an ``onnx.ModelProto``), ``CompileOptions``, the two targets
(``--output``, ``--report``) and where progress lines and warnings go. Out: a
``CompileResult`` (the rewritten step, the report dict, the plan outcome, the passes'
reports) and, where targets are given, the two files.

The flow is the design card's, one stage after another, each a pass of the compile's
``PassRunner`` (``memcc/pass_contract.py``) and one entry of the report's ``passes``:

    load (compiler/loading.py: the frontend, building the step when the model is forward
      only, and the provider's rewrites)
    cost_model (compiler/costing.py)
    plan, rewrite (compiler/planning.py; per row-chunk setting, compiler/chunk_choice.py)
    verify (the proof by running; optional)
    write (compiler/writing.py; the report is compiler/report.py's, the advice
      compiler/advice.py's)

Nothing is written until a plan that fits exists, and files are written atomically, so a
failed compile leaves nothing behind. Both target paths are checked before any work, and
the rewritten step and its report are renamed into place together or not at all. A failed
``--verify`` is the one failure that writes: the report, with what failed and what to try,
and the rewritten step under ``OUT.unverified.onnx`` (for inspection or a bug report;
never at ``OUT``, where a later step or a build tool would take it for a verified result).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from onnx import TensorProto

from memcc.compiler.budget_share import budget_share, resolve_share
from memcc.compiler.floor_check import check_floor
from memcc.compiler.loading import EarlierLoads, check_provider, load_step_warned
from memcc.compiler.options import CompileOptions, user_budget
from memcc.compiler.progress import Progress, warning_sink
from memcc.compiler.verifying import VerificationError, plan_tolerance, verify_plan
from memcc.compiler.writing import Model, Target, check_targets, unverified_path, write_outputs
from memcc.frontend.build import BuildOptions
from memcc.frontend.weights_apart import own_weights
from memcc.graph import Graph, node_label
from memcc.pass_contract import PassReport, PassRunner
from memcc.passes.plan import StepStructure
from memcc.passes.planning.work import few_full_collections
from memcc.sizes import format_size
from memcc.step import ALLOCATOR_KEY, PLAN_KEY, PROVIDER_KEY, RANKS_KEY

if TYPE_CHECKING:
    from collections.abc import Callable

    from memcc.compiler.chunk_choice import Estimate
    from memcc.passes.analysis.cost_model import CostModel
    from memcc.passes.planning.planner import PlanOutcome
    from memcc.passes.planning.request import Budget

# The stages after ``load`` (costs, planning, report) are imported where they run: a budget
# under the step's floor is refused after ``load``, and importing the planner, the cost
# model and onnxruntime took a third of a second of that refusal.


@dataclass
class CompileResult:
    graph: Graph
    report: dict
    outcome: PlanOutcome
    passes: list[PassReport]


@dataclass
class CompileRun:
    """One compile as it goes: what was asked, where it writes and says things, and its
    passes so far (``runner.reports``: the report's ``passes``)."""

    model: Model
    label: str                   # the model as messages name it
    options: CompileOptions      # as asked (the row chunks chosen may change its build)
    output: Target
    report_path: Target
    say: Progress                # progress lines ("load ...")
    runner: PassRunner           # says each stage, times it, keeps its report
    warnings: list[str]          # the report's ``warnings``
    warning: Progress            # adds one to ``warnings`` and passes it on to the caller
    cuda_missing: str | None     # why --provider cuda cannot run here (None: it can)
    started: float               # time.perf_counter() when the work began
    # What the loads said about the export, said once though compile builds a forward model
    # again for each row-chunk setting it plans, and that model as read, read once.
    earlier: EarlierLoads = field(default_factory=EarlierLoads)
    # What ``check_provider`` warned of (CUDA missing), said once the budget is past its
    # floor: a refusal does not depend on it, and came after two long warnings.
    provider_notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Planned:
    """What the planning stages hand on: the step planned (``verify`` compares with it),
    its costs and options (those of the row chunks chosen), the plan outcome and its
    rewritten step, the budget facts, and the report's row-chunk and offloaded-state
    sections."""

    graph: Graph
    costs: CostModel
    options: CompileOptions
    outcome: PlanOutcome
    rewritten: Graph
    slack: int
    plan_budget: int | None      # what the planner planned for (None: --budget min)
    budget: int                  # the user's, or the one --budget min reached
    row_chunks: dict
    offloaded: dict | None
    data_parallel: dict | None = None   # compiler/ranks.py's section (None: no --nproc)


def compile_model(model: Model, options: CompileOptions, *,
                  output: Target = None,
                  report_path: Target = None,
                  progress: Progress | None = None,
                  warn: Progress | None = None) -> CompileResult:
    """Compile ``model`` for ``options.budget``; write ``output``/``report_path`` if given.

    ``warn`` receives, as they happen, the things a user should know about a compile that
    still succeeds (e.g. costs estimated because CUDA is missing); the report keeps them
    under ``warnings``. A failed verification raises ``VerificationError`` after writing
    the report (and ``unverified_path(output)``).
    """
    run = _start(model, options, output, report_path, progress, warn)
    graph = _load(run)
    _refuse_bfloat16_runs(run, graph)
    from memcc.compiler.costing import node_costs
    from memcc.compiler.report import ReportInputs, build_report

    # A share is resolved, and under the floor refused, before the node times: its bytes
    # come from the step as built's peak, which they do not change, and measuring them
    # took 36 s of a 124M-parameter GPT-2's refusal at --budget 50%.
    share = _resolve_share(run, graph)
    for note in run.provider_notes:
        run.warning(note)
    costs = run.runner.stage("cost_model", lambda: node_costs(graph, run.options,
                                                              run.warning, run.cuda_missing))
    with few_full_collections():   # the plans' garbage goes by reference counts
        planned = _plan(run, graph, costs)
    verification = _verify_stage(run, planned)
    report = build_report(ReportInputs(
        options=planned.options, budget=planned.budget, plan_budget=planned.plan_budget,
        slack=planned.slack, was_min=run.options.requested_budget.is_min,
        outcome=planned.outcome,
        costs=planned.costs, passes=run.runner.reports,
        compile_time_s=time.perf_counter() - run.started, verification=verification,
        row_chunks=planned.row_chunks, offloaded_state=planned.offloaded,
        warnings=run.warnings, data_parallel=planned.data_parallel))
    if share is not None:
        report["budget_share"] = share
    _write(run, planned, report, verification)
    return CompileResult(planned.rewritten, report, planned.outcome, run.runner.reports)


def _start(model: Model, options: CompileOptions, output: Target, report_path: Target,
           progress: Progress | None, warn: Progress | None) -> CompileRun:
    """Before any work: the targets can be written, the provider can run what was asked."""
    if budget_share(options.budget) is None:  # a budget memcc cannot read: before loading
        _ = options.requested_budget
    say = progress or (lambda _msg: None)
    warnings, warning = warning_sink(warn)
    check_targets(model, output, report_path)
    notes: list[str] = []
    cuda_missing = check_provider(options, notes.append)
    label = str(model) if isinstance(model, (str, os.PathLike)) else "<model>"
    return CompileRun(model, label, options, output, report_path, say, PassRunner(say),
                      warnings, warning, cuda_missing, time.perf_counter(),
                      provider_notes=notes)


def _refuse_bfloat16_runs(run: CompileRun, graph: Graph) -> None:
    """A step with bfloat16 inputs or outputs (a model exported in bfloat16) cannot be run
    from Python (``step_feeds.refuse_bfloat16_feeds``): --verify and --cost measured, which
    run it, are refused before anything is planned (--cost auto estimates instead)."""
    from memcc.backend.step_feeds import refuse_bfloat16_feeds

    if run.options.verify:
        refuse_bfloat16_feeds(graph, source=run.label, doing="verify the plan (--verify "
                              "runs the step)", instead="Without --verify, compile plans it "
                              "(its node times estimated with --cost analytic or auto)")
    if run.options.cost == "measured":
        refuse_bfloat16_feeds(graph, source=run.label, doing="measure its node times "
                              "(--cost measured runs the step)", instead="--cost analytic "
                              "(or auto) estimates them without running it")


def _load(run: CompileRun) -> Graph:
    """The ``load`` stage, then what can be said of the step before planning: build
    options that a training step ignores, a budget under its floor, racing kernels. The
    file's weights are read only once the budget is not refused (``load_graph``'s
    ``mapped``: the refusal needs their shapes alone)."""
    options, label = run.options, run.label
    graph = run.runner.stage(
        "load", lambda: load_step_warned(run.model, label, options, run.warning,
                                         mapped=True, earlier=run.earlier))
    if not run.runner.reports[-1].summary["built_training_step"] \
            and options.build != BuildOptions():
        run.warning(f"{label} is already a training step: the build options given (--loss, "
                    "--optimizer, --lr, --freeze, ...) apply to forward models and are "
                    "ignored; rebuild the step with memcc build to change them")
    _say_sixteen_bit_emulated(run, run.runner.reports[-1].summary, graph.opset)
    if budget_share(options.budget) is None:  # a share is checked once it is bytes
        _check_floor(graph, options, label)
    own_weights(graph)
    from memcc.backend.determinism import racing_nodes

    racing = [node_label(n) for n in racing_nodes(graph)]
    if racing:
        run.warning(
            f"{label}: {len(racing)} node(s) from the model run an ONNX Runtime CPU kernel "
            f"that races across intra-op threads ({', '.join(racing[:3])}"
            f"{', ...' if len(racing) > 3 else ''}): their results, and every gradient "
            "that depends on them, can change from run to run, and --verify's bit-for-bit "
            "comparison can fail. Export ScatterND with a reduction as ScatterElements "
            "(docs/DETERMINISM.md).")
    return graph


def _check_floor(graph: Graph, options: CompileOptions, label: str,
                 asked: str | None = None) -> None:
    """A budget under the step's floor refused before any search (``floor_check``);
    ``asked``: the budget as the user wrote it, where that was not bytes."""
    budget = options.requested_budget
    if budget.is_min:
        return
    # With --nproc, the floor of the rank keeping the most state (compiler/ranks.py).
    if options.ranks is None:
        planned = graph
    else:
        from memcc.compiler.ranks import floor_view

        planned = floor_view(graph, options)
    check_floor(planned, budget.bytes, options, label, StepStructure.of(planned), asked)


def _resolve_share(run: CompileRun, graph: Graph) -> dict | None:
    """``--budget 50%``: the budget in bytes from the step's baseline peak
    (``compiler/budget_share.py``; simulated with a unit cost per node: a peak does not
    depend on node times), then the floor check the bytes get; what the report says of it
    (None for a budget in bytes or ``min``)."""
    from memcc.passes.analysis.cost_model import unit_costs

    share = budget_share(run.options.budget)
    if share is None:
        return None
    run.options, said = resolve_share(graph, unit_costs(graph), run.options, share)
    words = (f"{said['asked']} of the {format_size(said['as_built_budget_bytes'])} the step "
             "as built needs")
    run.say(f"budget {words} = {format_size(said['budget_bytes'])}")
    _check_floor(graph, run.options, run.label, words)
    return said


def _say_sixteen_bit_emulated(run: CompileRun, summary: dict, opset: int) -> None:
    """A 16-bit step whose provider lacks 16-bit kernels for some of its nodes: they
    compute in float32 between casts (passes/providers/sixteen_bit.py), which keeps the
    memory of a 16-bit step but not its speed: said, not hidden. Where the other 16-bit
    type has kernels for them (ORT's CUDA provider: float16 convolutions, no bfloat16
    ones), the warning says so."""
    emulated = summary.get("sixteen_bit_emulated") or {}
    if not emulated:
        return
    from memcc.frontend.kernel_coverage import has_kernel_for
    from memcc.passes.providers.sixteen_bit import describe_emulated

    precision = summary.get("precision", {}).get("precision", "16-bit")
    provider = run.options.provider
    other = {"bf16": ("fp16", TensorProto.FLOAT16), "fp16": ("bf16", TensorProto.BFLOAT16)}
    hint = ""
    if precision in other:
        name, dtype = other[precision]
        there = [op for op in emulated if has_kernel_for(op, opset, dtype, provider)]
        if there:
            hint = (f" With --precision {name} the provider has kernels for "
                    f"{', '.join(sorted(there))}.")
    run.warning(f"{run.label}: the {provider} provider of this onnxruntime has "
                f"no {precision} kernel for {describe_emulated(emulated)}: memcc "
                "computes them in float32 between 16-bit casts, so the step holds 16-bit "
                "values (the memory of a 16-bit step) but runs slower than its float32 build "
                f"(README, \"Mixed precision\"; docs/PRECISION.md lists the kernels).{hint}")


def _plan(run: CompileRun, graph: Graph, costs: CostModel) -> Planned:
    """The ``plan`` and ``rewrite`` stages: row chunks where they pay
    (``compiler/chunk_choice.py``; the step as loaded is planned first), each setting
    planned under the budget (``compiler/planning.py``); the plan chosen recorded in the
    rewritten step's metadata."""
    from memcc.compiler.chunk_choice import KINDS, RowChunkSearch, choose_row_chunks, trim_chunks
    from memcc.compiler.costing import node_costs
    from memcc.compiler.min_replan import replan_chosen
    from memcc.compiler.planning import StageHooks, plan_offloading_state
    from memcc.compiler.ranks import plan_for_ranks

    options, label, runner = run.options, run.label, run.runner
    budget = options.requested_budget
    hooks = StageHooks(runner.stage, runner.reports, run.say, label)
    offloads: dict[int, dict | None] = {}   # the rewritten step's id -> offloaded_state
    ranks: dict[int, dict] = {}             # the same -> its data_parallel section

    def plan_step(g: Graph, c: CostModel, opts: CompileOptions, at: Budget = budget) -> tuple:
        def plan_one(view: Graph) -> tuple:
            return plan_offloading_state(view, at, c, opts, StepStructure.of(view), hooks)

        if opts.ranks is None:
            planned, offloaded = plan_one(g)
        else:  # the step as a rank runs it, per-rank budget (compiler/ranks.py)
            planned, offloaded, ranks_section = plan_for_ranks(g, c, opts, plan_one)
            ranks[id(planned.step)] = ranks_section
        offloads[id(planned.step)] = offloaded
        return planned

    # Steps the row-chunk screen built: (step, load summary, its priced cost model and
    # that stage's summary), by chunk counts (``_estimator``).
    built: dict[tuple, tuple[Graph, dict, CostModel, dict]] = {}
    price_setting = _pricing(graph, costs)

    def rebuild(opts: CompileOptions) -> tuple[Graph, CostModel]:
        # Another build of the forward model (row chunks): its warnings were said once.
        def quiet(msg: str) -> None:
            if msg not in run.warnings:
                run.warning(msg)

        screened = built.pop(_chunk_key(opts), None)
        if screened is not None:
            g = runner.stage("load", lambda: screened[:2])
            return g, runner.stage("cost_model", lambda: screened[2:])
        g = runner.stage("load", lambda: load_step_warned(run.model, label, opts, run.warning,
                                                          earlier=run.earlier))
        if opts.cost == "auto":
            # Priced by the step as loaded's cost model, not measured again: a profile of
            # the whole step, outside --time-limit (50 s of a 124M-parameter GPT-2's
            # compile with its row chunks), and its times compare with the step as loaded's.
            return g, runner.stage("cost_model", lambda: price_setting(g))
        return g, runner.stage("cost_model",
                               lambda: node_costs(g, opts, quiet, run.cuda_missing))

    load_summary = runner.reports[0].summary
    chosen = choose_row_chunks(
        RowChunkSearch(run.model, label, load_summary["built_training_step"],
                       plan_step, rebuild, runner.reports, run.say,
                       lambda peak, s: user_budget(peak, options, s),
                       _estimator(run, (graph, costs), price_setting, built),
                       trim_chunks({k: (load_summary.get("splittable") or {}).get(k, 0)
                                    for k in KINDS}, least=1),
                       load_summary.get("splittable_rows")),
        graph, costs, options, budget)
    attempt = chosen.attempt
    if budget.is_min and options.ranks is None:
        replan_chosen(attempt, plan_step, runner.reports)
    outcome, rewritten, slack, plan_budget = attempt.planned
    final_budget = budget.bytes if not budget.is_min else user_budget(
        outcome.best.peak_bytes, attempt.options, slack)
    section = ranks.get(id(rewritten))
    _record_plan(rewritten, outcome, attempt.options, section, final_budget)
    return Planned(attempt.graph, attempt.costs, attempt.options, outcome, rewritten, slack,
                   plan_budget, final_budget, chosen.report, offloads.get(id(rewritten)),
                   section)


def _record_plan(rewritten: Graph, outcome: PlanOutcome, options: CompileOptions,
                 ranks: dict | None, budget: int) -> None:
    """What the rewritten step says of its plan (``memcc run``/``train`` read it): the
    plan, the provider and allocator it was made for, and with ``--nproc`` the ranks."""
    rewritten.metadata[PLAN_KEY] = json.dumps(outcome.best.plan.to_json(), sort_keys=True)
    rewritten.metadata[PROVIDER_KEY] = options.provider
    if options.arena:
        rewritten.metadata[ALLOCATOR_KEY] = "arena"
    if ranks is not None:
        rewritten.metadata[RANKS_KEY] = json.dumps(
            {k: ranks[k] for k in ("world_size", "zero", "bucket_bytes",
                                   "peak_bytes_per_rank")}
            | {"budget_bytes": budget})


def _chunk_key(opts: CompileOptions) -> tuple:
    from memcc.compiler.chunk_choice import chunks_of

    return tuple(chunks_of(opts.build).values())


def _pricing(graph: Graph, costs: CostModel) -> Callable[[Graph], tuple[CostModel, dict]]:
    """Another build of the model (a row-chunk setting) priced by the step as loaded's cost
    model without its measured times (the analytic estimate times the calibration fitted on
    the measured nodes; node names are not stable across builds, so a measured time cannot
    be reused by name), scaled so that the step as loaded's priced total is its cost
    model's total; with the cost model stage's summary."""
    base: list = []   # (the pricing model, the scale): on first use

    def price(g: Graph) -> tuple[CostModel, dict]:
        if not base:
            priced = replace(costs.calibrated(graph), seconds={})
            as_loaded = sum(priced.price(n, graph) for n in graph.nodes)
            base.extend((priced, costs.total(graph) / as_loaded if as_loaded > 0 else 1.0))
        priced, scale = base
        seconds = {n.name: priced.price(n, g) * scale for n in g.nodes}
        return replace(priced, seconds=seconds), {
            "source": costs.source, "provider": costs.provider,
            "total_s": round(sum(seconds.values()), 6), "priced_from_step_as_loaded": True}

    return price


def _estimator(run: CompileRun, as_loaded: tuple[Graph, CostModel],
               price: Callable[[Graph], tuple[CostModel, dict]], built: dict) -> Estimate:
    """A row-chunk setting's added time as built, before any plan: the step built with it,
    less the step as loaded, both priced by the step as loaded's cost model (``price``,
    ``_pricing``). The step is kept in ``built`` with that pricing as its cost model, for
    its plan if it gets one: a step that fits as built is not measured again for a setting
    (a profile of the whole step, a minute on a transformers GPT-2, which --time-limit
    could not bound)."""
    from memcc.passes.analysis.liveness import analyze_liveness

    graph, costs = as_loaded
    peak: list[int] = []   # the step as loaded's, on first use

    def estimate(opts: CompileOptions) -> tuple[float, int, int]:
        if not peak:
            peak.append(analyze_liveness(graph).peak_bytes)
        g, summary = load_step_warned(run.model, run.label, opts, run.warning,
                                      earlier=run.earlier)
        priced, cost_summary = price(g)
        built.clear()   # one kept at a time: the search plans the last one built, if any
        built[_chunk_key(opts)] = (g, summary, priced, cost_summary)
        return (priced.total(g) - costs.total(graph), len(g.nodes),
                peak[0] - analyze_liveness(g).peak_bytes)

    return estimate


def _verify_stage(run: CompileRun, planned: Planned) -> dict | None:
    """The ``verify`` stage (``--verify``): the rewritten step run against the step as
    planned; None without ``--verify``."""
    if not planned.options.verify:
        return None
    tolerance = plan_tolerance(run.runner.reports)
    return run.runner.stage("verify", lambda: verify_plan(planned.graph, planned.rewritten,
                                                          planned.budget, planned.options,
                                                          (tolerance, run.cuda_missing)))


def _write(run: CompileRun, planned: Planned, report: dict, verification: dict | None
           ) -> None:
    """Write the step and its report; after a failed verification, the report (with what
    to try next) and the step as ``OUT.unverified.onnx``, then raise."""
    output, report_path = run.output, run.report_path
    if verification is not None and not verification["ok"]:
        from memcc.compiler.advice import next_steps

        steps = next_steps(verification, planned.options, planned.outcome.best.peak_bytes,
                           run.label, planned.slack)
        kept = unverified_path(output) if output is not None else None
        verification["next_steps"] = steps
        verification["unverified_output"] = None if kept is None else str(kept)
        run.say("writing the report of the failed verification")
        write_outputs(kept, planned.rewritten, report_path, report)
        written = [str(x) for x in (report_path, kept) if x is not None]
        raise VerificationError(
            f"{run.label}: verification failed: " + "; ".join(verification["problems"]) + ". "
            + " ".join(steps)
            + (f" Wrote {' and '.join(written)}" if written else "")
            + (f"; {output} was not written (it would be unverified)." if output is not None
               else "."),
            report=report,
        )
    run.say(f"writing {output}" if output is not None else "writing the report")
    write_outputs(output, planned.rewritten, report_path, report)
