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
import os
import time
from dataclasses import dataclass, replace
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
from memcc.compiler.advice import next_steps
from memcc.compiler.chunk_choice import RowChunkSearch, choose_row_chunks
from memcc.compiler.options import CompileOptions, user_budget
from memcc.compiler.planning import StageHooks, check_floor, plan_offloading_state
from memcc.compiler.progress import PassReport, Progress, warning_sink
from memcc.compiler.report import build_report
from memcc.errors import InputError, MemccError
from memcc.frontend.build import BuildOptions, build_training_step, is_training_step
from memcc.frontend.fuse import fuse_step
from memcc.frontend.load import load_graph
from memcc.frontend.row_chunks import ATTENTION, MLP, find_regions
from memcc.graph import Graph, node_label
from memcc.passes.analysis.cost_model import (
    CUDA_NOMINAL,
    CostModel,
    HostLink,
    analytic_costs,
    host_link_for,
)
from memcc.passes.analysis.cuda_node_times import default_calibration
from memcc.passes.plan import StepStructure
from memcc.passes.planning.planner import PlanOutcome
from memcc.passes.providers.batchnorm_for_cuda import for_provider
from memcc.step import ALLOCATOR_KEY, FUSIONS_KEY, PLAN_KEY, TrainingStep


@dataclass
class CompileResult:
    graph: Graph
    report: dict
    outcome: PlanOutcome
    passes: list[PassReport]


def unverified_path(output: str | os.PathLike) -> Path:
    """Where a rewritten step that failed ``--verify`` is kept: ``OUT.unverified.onnx``."""
    out = Path(output)
    return out.with_name(f"{out.stem}.unverified{out.suffix or '.onnx'}")


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
    cuda_missing = check_provider(options, warning)
    t_start = time.perf_counter()
    passes: list[PassReport] = []

    def timed(name: str, fn):
        say(f"{name} ...")
        t0 = time.perf_counter()
        value, summary = fn()
        passes.append(PassReport(name, time.perf_counter() - t0, summary))
        return value

    label = str(model) if isinstance(model, (str, os.PathLike)) else "<model>"
    budget = options.requested_budget
    graph = timed("load", lambda: load_step(model, label, options))
    if not passes[-1].summary["built_training_step"] and options.build != BuildOptions():
        warning(f"{label} is already a training step: the build options given (--loss, "
                "--optimizer, --lr, --freeze, ...) apply to forward models and are ignored; "
                "rebuild the step with memcc build to change them")
    structure = StepStructure.of(graph)
    if not budget.is_min:
        check_floor(graph, budget.bytes, options, label, structure)
    racing = [node_label(n) for n in racing_nodes(graph)]
    if racing:
        warning(f"{label}: {len(racing)} node(s) from the model run an ONNX Runtime CPU kernel "
                f"that races across intra-op threads ({', '.join(racing[:3])}"
                f"{', ...' if len(racing) > 3 else ''}): their results, and every gradient "
                "that depends on them, can change from run to run, and --verify's bit-for-bit "
                "comparison can fail. Export ScatterND with a reduction as ScatterElements "
                "(docs/DETERMINISM.md).")
    costs = timed("cost_model", lambda: node_costs(graph, options, warning, cuda_missing))

    offloads: dict[int, dict | None] = {}   # the rewritten step's id -> offloaded_state

    hooks = StageHooks(timed, passes, say, label)

    def plan_step(g: Graph, c: CostModel, opts: CompileOptions) -> tuple:
        planned, offloaded = plan_offloading_state(g, budget, c, opts, StepStructure.of(g),
                                                   hooks)
        offloads[id(planned.step)] = offloaded
        return planned

    def rebuild(opts: CompileOptions) -> tuple[Graph, CostModel]:
        # Another build of the forward model (row chunks): its warnings were said once.
        def quiet(msg: str) -> None:
            if msg not in warnings:
                warning(msg)

        g = timed("load", lambda: load_step(model, label, opts))
        return g, timed("cost_model", lambda: node_costs(g, opts, quiet, cuda_missing))

    # Row chunks where they pay (passes/chunk_choice.py); the step as loaded is planned first.
    chosen = choose_row_chunks(
        RowChunkSearch(model, label, passes[0].summary["built_training_step"], plan_step,
                       rebuild, passes, say, lambda peak, s: user_budget(peak, options, s)),
        graph, costs, options, budget)
    graph, costs, options = chosen.attempt.graph, chosen.attempt.costs, chosen.attempt.options
    outcome, rewritten, slack, plan_budget = chosen.attempt.planned
    offloaded = offloads.get(id(rewritten))
    plan_sim, base_sim = outcome.best, outcome.baseline
    final_budget = budget.bytes if not budget.is_min else user_budget(plan_sim.peak_bytes,
                                                                       options, slack)
    rewritten.metadata[PLAN_KEY] = json.dumps(plan_sim.plan.to_json(), sort_keys=True)
    if options.arena:
        rewritten.metadata[ALLOCATOR_KEY] = "arena"

    verification = None
    if options.verify:
        tolerance = _plan_tolerance(passes)
        verification = timed("verify", lambda: _verify(graph, rewritten, final_budget,
                                                       options, tolerance))

    report = build_report(options, final_budget, plan_budget, slack, budget.is_min, base_sim,
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


def check_provider(options: CompileOptions, warning: Progress) -> str | None:
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


class VerificationError(MemccError):
    def __init__(self, message: str, *, report: dict) -> None:
        super().__init__(message)
        self.report = report


def load_step(model, label: str, options: CompileOptions):
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
        # (passes/providers/batchnorm_for_cuda.py).
        **({"batchnorm_rewritten": rewritten_for_cuda} if rewritten_for_cuda else {}),
        # memcc's fusions (frontend/fuse.py), as build recorded them.
        **({"fusions": json.loads(graph.metadata[FUSIONS_KEY])}
           if FUSIONS_KEY in graph.metadata else {}),
    }


def node_costs(graph: Graph, options: CompileOptions, warning: Progress,
           cuda_missing: str | None) -> tuple[CostModel, dict]:
    """``cuda_missing``: why CUDA is not there (``check_provider`` already warned)."""
    note = None
    if cuda_missing is not None and options.cost == "auto":
        note = f"CUDA is not available, estimated instead: {cuda_missing}"
    elif options.cost in ("auto", "measured"):
        try:
            cm = replace(measured_costs(graph, options.provider),
                         link=measured_link(options.provider, warning))
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
        # Estimated from node times measured on a GPU (passes/analysis/cuda_node_times.py).
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


def measured_link(provider: str, warning: Progress) -> HostLink | None:
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
