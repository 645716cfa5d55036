"""``memcc compile``, ``memcc analyze`` and ``memcc report``: a training step (or a forward
model, built first) in; the rewritten step and its report written (``compile``), the step
as built described (``analyze``), or a written report printed and plotted (``report``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer
from rich.markup import escape

from memcc.api import MemccError
from memcc.cli.app import err, fail, interrupted, out, stamps, warn
from memcc.cli.log_progress import LogProgress, progress_lines
from memcc.cli.options import (
    AttentionChunksOpt,
    AutoAttentionChunksOpt,
    AutoBatchChunksOpt,
    AutoLossChunksOpt,
    AutoMlpChunksOpt,
    BatchChunksOpt,
    ClassAxisOpt,
    CompileCostOpt,
    DimOpt,
    FreezeOpt,
    GroupedUpdatesOpt,
    IgnoreIndexOpt,
    JsonOpt,
    LossChunksOpt,
    LossOpt,
    LossScaleOpt,
    LrOpt,
    MarginOpt,
    MlpChunksOpt,
    MomentumOpt,
    NoChunksOpt,
    OptimizerOpt,
    PlanBucketOpt,
    PlanNprocOpt,
    PlanProviderOpt,
    PlanZeroOpt,
    PrecisionOpt,
    StepOrModelArg,
    StrategyOpt,
    VerifyOpt,
    WeightDecayOpt,
    build_options,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.status import Status

    from memcc.api import CompileOptions


def compile_cmd(
    model: StepOrModelArg,
    budget: Annotated[str, typer.Option(metavar="SIZE|min|P%", help=(
        "Memory budget for the whole step: 6GB (10^9), 6GiB (2^30), MB/MiB/KB/KiB/TB/TiB, "
        "bytes, 'min' (the smallest memcc can reach), or 50% of what the step needs."))],
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--output", "-o", help="Rewritten step (default: MODEL.memcc.onnx).")] = None,
    report: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write the report JSON here (default: OUTPUT with .report.json).")] = None,
    strategy: StrategyOpt = "auto",
    provider: PlanProviderOpt = "cpu",
    time_limit: Annotated[float, typer.Option(help="Seconds the planner may spend.")] = 60.0,
    cost: CompileCostOpt = "auto",
    verify: VerifyOpt = False,
    margin: MarginOpt = 0.02,
    offload: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--offload/--no-offload",
        help="Swap saved values to host memory where that is cheaper than recomputing. "
             "Default: on with --provider cuda, off with cpu (one memory there: asking for "
             "it with --provider cpu is refused, with why).")] = None,
    variants: Annotated[bool, typer.Option(
        "--variants/--no-variants",
        help="Let the planner replace gradient rules by leaner variants (masks, chunked "
             "convolution weight gradients, inverted normalisation) where that is cheaper "
             "than recomputing; --no-variants plans with the default rules only.")] = True,
    allow_lossy: Annotated[bool, typer.Option(
        "--allow-lossy",
        help="Also offer lossy variants: saved activations kept in bfloat16 (the inputs "
             "of convolutions, matrix products and normalisations, the outputs of Softmax, "
             "Sigmoid, Tanh and the like; gradients within 2e-2 relative of the default "
             "rule's, 5e-2 for BatchNorm; docs/VARIANTS.md). Never by default.")] = False,
    arena: Annotated[bool, typer.Option(
        "--arena",
        help="CPU: plan for ORT's CPU arena (its 256-byte rounding and regions, as on "
             "CUDA), verify through it, and mark the step so that memcc train and run "
             "allocate through it: no page faults each step, and the process holds the "
             "plan's peak, where glibc's heap can hold several times it.")] = False,
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = None,
    freeze: FreezeOpt = None,
    class_axis: ClassAxisOpt = None,
    ignore_index: IgnoreIndexOpt = None,
    loss_chunks: AutoLossChunksOpt = None,
    attention_chunks: AutoAttentionChunksOpt = None,
    mlp_chunks: AutoMlpChunksOpt = None,
    batch_chunks: AutoBatchChunksOpt = None,
    precision: PrecisionOpt = "fp32",
    loss_scale: LossScaleOpt = None,
    grouped_updates: GroupedUpdatesOpt = True,
    no_chunks: NoChunksOpt = False,
    dim: DimOpt = None,
    nproc: PlanNprocOpt = None,
    zero: PlanZeroOpt = 0,
    bucket_mb: PlanBucketOpt = None,
) -> None:
    """Rewrite a training step so that it fits a memory budget at the least added time.

    A forward model is built first, with memcc build's options; chunks not given are chosen
    by compile where they lower the plan's cost. A step keeps the options it was built with."""
    if no_chunks:
        loss_chunks, attention_chunks, mlp_chunks, batch_chunks = (
            k or 1 for k in (loss_chunks, attention_chunks, mlp_chunks, batch_chunks))
    from memcc.api import CompileOptions, parse_dims

    out_path = output or model.with_name(model.stem + ".memcc.onnx")
    report_path = report or out_path.with_name(out_path.stem + ".report.json")
    try:
        opts = CompileOptions(
            budget=budget, strategy=strategy, provider=provider, time_limit=time_limit,
            cost=cost, verify=verify, margin=margin, variants=variants, offload=offload,
            allow_lossy=allow_lossy, arena=arena, build=build_options(locals()),
            dims=parse_dims(dim), nproc=nproc, zero=zero, bucket_mb=bucket_mb,
        )
    except MemccError as exc:
        fail(exc)
    _compile(model, opts, out_path, report_path)


def _progress(status: Status | None, log: LogProgress | None) -> Callable[[str], None]:
    """Compile's progress: each stage on the status line, and each row-chunk setting compile
    builds and plans as a line of its own (each is a whole plan: minutes on large models).
    The status line shows only the newest message, and only on a terminal: the setting's
    line was replaced at once by the stages of its plan. Off a terminal, the stages are
    lines too, with the seconds since the compile began (``log``: ``cli/log_progress.py``),
    and there is no status line (None: it would show nothing)."""
    def say(message: str) -> None:
        if message.startswith("row chunks:"):
            err.print(escape(message), highlight=False, soft_wrap=True)
        elif log is not None:
            log(message)
        if status is not None:
            status.update(f"compiling: {escape(message)}")
    return say


def _compile(model: Path, opts: CompileOptions, out_path: Path, report_path: Path) -> None:
    """Compile under a status line; the summary, then what was written (or the error)."""
    from memcc.api import VerificationError, compile_model, summary_lines

    log = None if err.is_terminal else LogProgress(
        "compiling", lambda line: err.print(escape(line), highlight=False, soft_wrap=True))
    before = stamps(out_path, report_path)
    try:
        with log or err.status("compiling") as shown:  # off a terminal, no status line
            status = None if log else shown
            result = compile_model(model, opts, output=out_path, report_path=report_path,
                                   progress=_progress(status, log), warn=warn)
    except KeyboardInterrupt:
        interrupted([out_path, report_path], before)
    except VerificationError as exc:
        # The summary says which checks failed; the error, what to try and what was written.
        for line in summary_lines(exc.report):
            out.print(line, highlight=False)
        fail(exc)
    except MemccError as exc:
        fail(exc)
    for line in summary_lines(result.report):
        out.print(line, highlight=False)
    out.print(f"wrote {out_path} and {report_path}", highlight=False)


def analyze_cmd(
    model: StepOrModelArg,
    provider: PlanProviderOpt = "cpu",
    arena: Annotated[bool, typer.Option(
        "--arena", help="CPU: predict for ORT's CPU arena, as memcc compile --arena plans."
    )] = False,
    as_json: JsonOpt = False,
    smallest: Annotated[bool, typer.Option(
        "--smallest/--no-smallest",
        help="Search the smallest peak memcc can reach (--budget min's answer) within "
             "--time-limit.")] = True,
    time_limit: Annotated[Optional[float], typer.Option(  # noqa: UP045
        help="Seconds the smallest-peak search may spend (default 1; past it the answer is "
             "an upper bound, and says so).")] = None,
    strategy: StrategyOpt = "auto",
    cost: Annotated[Literal["analytic", "measured", "auto"], typer.Option(
        help="Node times: analytic (default here, nothing runs), measured or auto.")
    ] = "analytic",
    margin: Annotated[float, typer.Option(
        help="As in memcc compile: the smallest budget is the peak with this margin and the "
             "slack.")] = 0.02,
    variants: Annotated[bool, typer.Option(
        "--variants/--no-variants", help="As in memcc compile.")] = True,
    offload: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--offload/--no-offload",
        help="As in memcc compile: with --provider cuda (on by default) the smallest budget "
             "also counts the optimizer state waiting in host memory.")] = None,
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = None,
    freeze: FreezeOpt = None,
    class_axis: ClassAxisOpt = None,
    ignore_index: IgnoreIndexOpt = None,
    loss_chunks: LossChunksOpt = 1,
    attention_chunks: AttentionChunksOpt = 1,
    mlp_chunks: MlpChunksOpt = 1,
    batch_chunks: BatchChunksOpt = 1,
    precision: PrecisionOpt = "fp32",
    loss_scale: LossScaleOpt = None,
    grouped_updates: GroupedUpdatesOpt = True,
    dim: DimOpt = None,
) -> None:
    """Show the step as built: predicted peak, what it is made of, the smallest budget."""
    from memcc.api import ANALYZE_TIME_LIMIT, CompileOptions, analyze, describe_analysis, parse_dims

    try:
        opts = CompileOptions(
            budget="min", strategy=strategy, provider=provider,
            time_limit=ANALYZE_TIME_LIMIT if time_limit is None else time_limit, cost=cost,
            margin=margin, variants=variants, arena=arena, offload=offload,
            build=build_options(locals()), dims=parse_dims(dim))
        with progress_lines(err, "analyze") as say:
            result = analyze(model, opts, smallest=smallest, progress=say, warn=warn)
    except MemccError as exc:
        fail(exc)
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    for line in describe_analysis(result):
        out.print(line, highlight=False)


def report_cmd(
    report: Annotated[Path, typer.Argument(help="Report JSON written by memcc compile.")],
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Also draw bytes live over the schedule (baseline, plan, budget) to this image "
             "(.png, .svg, .pdf: any format matplotlib writes).")
    ] = None,
) -> None:
    """Print a compile report as tables; optionally plot the memory timeline."""
    from memcc.api import InputError, check_plot_path, load_report, plot_timeline, print_report

    try:
        data = load_report(report)
        if plot is not None:  # before the tables: an error must not follow them
            check_plot_path(plot, inputs=[("the report", report)])
            if not (data.get("timeline") or {}).get("baseline"):
                raise InputError(f"{report}: the report has no timeline to plot (written by "
                                 "an older memcc?); compile again for one, or drop --plot")
        print_report(data, out)
        if plot is not None:
            plot_timeline(data, plot)
            out.print(f"wrote {plot}")
    except MemccError as exc:
        fail(exc)
