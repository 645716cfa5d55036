"""``memcc tune``: a forward model with a symbolic dimension in; the table of sizes, the
largest and the fastest that fit, and optionally the picked size's step and a plot."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer
from rich.console import Console

from memcc.api import MemccError
from memcc.cli.app import err, fail, interrupted, out, stamps
from memcc.cli.log_progress import progress_lines
from memcc.cli.options import (
    AttentionChunksOpt,
    BatchChunksOpt,
    ClassAxisOpt,
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
    OptimizerOpt,
    PlanProviderOpt,
    PrecisionOpt,
    StrategyOpt,
    WeightDecayOpt,
    build_options,
)

if TYPE_CHECKING:
    from memcc.api import TuneOptions, TuneResult


# Table rows settled by the sizes either side, without a plan of their own (their JSON
# ``peak_bytes`` is a sqrt(n) plan's, a bound that can exceed the budget of a size that fits).
EDGE_ROWS = ("below-edge", "above-edge")


def tune_cmd(
    model: Annotated[Path, typer.Argument(help="Forward ONNX model with a symbolic batch "
                                               "dimension.")],
    budget: Annotated[str, typer.Option(
        metavar="SIZE",
        help="Memory budget for the whole step: 6GB (10^9), 6GiB (2^30), MB/MiB/KB/KiB/TB/"
             "TiB or plain bytes.")],
    dim: Annotated[list[str], typer.Option(
        "--dim", "-d", metavar="NAME=LOW..HIGH|NAME=INT",
        help="The dimension to search, e.g. --dim batch=1..512 (once), and bindings of the "
             "other symbolic dimensions, e.g. --dim seq=128 (repeatable).")],
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--output", "-o", help="Write the compiled step of the picked size here.")] = None,
    pick: Annotated[Literal["fastest", "largest"], typer.Option(
        help="fastest (highest predicted samples/s) or largest: the size -o writes.")] = "fastest",
    points: Annotated[int, typer.Option(
        min=0, help="Sizes planned between the largest without rewriting and the largest "
                    "(each costs a compile).")] = 1,
    as_json: JsonOpt = False,
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Plot peak and predicted throughput against the size (.png, .svg, .pdf...).")
    ] = None,
    ref_batch: Annotated[Optional[int], typer.Option(  # noqa: UP045
        help="Batch size at which --ref-lr is known to work.")] = None,
    ref_lr: Annotated[Optional[float], typer.Option(  # noqa: UP045
        help="Learning rate known to work at --ref-batch; the suggestion for the picked "
             "size is built into the step.")] = None,
    lr_rule: Annotated[Literal["linear", "sqrt"], typer.Option(
        help="linear (lr * B/B_ref) or sqrt (lr * sqrt(B/B_ref)) scaling.")] = "linear",
    measure: Annotated[bool, typer.Option(
        "--measure", help="Run the sizes with the highest predicted throughput in ONNX "
                          "Runtime and report measured samples/s and peak next to the "
                          "prediction.")] = False,
    measure_top: Annotated[int, typer.Option(
        min=1, help="How many sizes --measure runs.")] = 3,
    strategy: StrategyOpt = "auto",
    provider: PlanProviderOpt = "cpu",
    time_limit: Annotated[float, typer.Option(
        help="Seconds each planner call may spend (compile's default is 60; tune makes "
             "several calls; a larger limit can find larger batches).")] = 10.0,
    cost: Annotated[Literal["analytic", "measured", "auto"], typer.Option(
        help="Node times: analytic (default here: measuring would run every size), "
             "measured or auto.")] = "analytic",
    margin: MarginOpt = 0.02,
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
) -> None:
    """Find the largest batch, and the fastest, whose training step fits a memory budget.

    Each size is built with memcc build's options (--loss ... --mlp-chunks); --lr may
    instead be derived from --ref-batch/--ref-lr."""
    from memcc.api import InputError, TuneOptions, parse_dims

    try:
        searched = _searched_range(dim)
        if lr is not None and ref_lr is not None:
            raise InputError("--lr and --ref-lr both set the learning rate: give one")
        opts = TuneOptions(
            strategy=strategy, cost=cost, provider=provider, time_limit=time_limit,
            margin=margin, build=build_options(locals()),
            dims=parse_dims([d for d in dim if ".." not in d]), pick=pick, points=points,
            ref_batch=ref_batch, ref_lr=ref_lr, lr_rule=lr_rule)
        writes = _TuneOutputs(output, plot, measure, measure_top, provider)
        result = _tune(model, budget, searched, opts, writes)
    except MemccError as exc:
        fail(exc)
    _print_tuned(result, writes, as_json=as_json)


@dataclass(frozen=True)
class _TuneOutputs:
    """What ``memcc tune`` does with its result besides the table: the picked size's step
    (``-o``), the plot, and the sizes run in ONNX Runtime (``--measure`` on ``provider``,
    as given)."""

    output: Path | None
    plot: Path | None
    measure: bool
    measure_top: int
    provider: str


def _searched_range(dim: list[str]) -> str:
    """The one ``--dim NAME=LOW..HIGH`` among the ``--dim`` flags."""
    from memcc.api import InputError

    ranges = [d for d in dim if ".." in d]
    if len(ranges) != 1:
        raise InputError(
            "--dim: give exactly one dimension to search as NAME=LOW..HIGH, e.g. "
            f"--dim batch=1..512 (got {len(ranges)}: {', '.join(ranges) or 'none'})")
    return ranges[0]


def _tune(model: Path, budget: str, searched: str, opts: TuneOptions,
          writes: _TuneOutputs) -> TuneResult:
    """Check the paths to write, search, measure, write the step and the plot; after
    Ctrl-C, say what was written."""
    output, plot = writes.output, writes.plot
    before = stamps(output, plot)
    try:
        return _tune_and_write(model, budget, searched, opts, writes)
    except KeyboardInterrupt:  # as compile says it (a walk-through's Ctrl-C got no word)
        interrupted([output, plot], before)


def _tune_and_write(model: Path, budget: str, searched: str, opts: TuneOptions,
                    writes: _TuneOutputs) -> TuneResult:
    from memcc.api import check_plot_path, check_writable, measure_tune, plot_tune, tune, write_step

    output, plot = writes.output, writes.plot
    reads = [("the model", model)]
    if output is not None:
        check_writable(output, "the compiled step", "--output/-o", inputs=reads)
    if plot is not None:
        check_plot_path(plot, inputs=[*reads, ("the compiled step (-o)", output)])
    with progress_lines(err, "tune") as say:
        result = tune(model, budget, searched, opts, progress=say)
        if writes.measure:
            result = measure_tune(result, top=writes.measure_top, provider=writes.provider,
                                  progress=say)
        if output is not None:
            say(f"writing {output}")
            write_step(result, output)
        if plot is not None:
            plot_tune(result, plot)
    return result


def _print_tuned(result: TuneResult, writes: _TuneOutputs, *, as_json: bool) -> None:
    """The JSON object, or the table, the answers and what was written."""
    output, plot = writes.output, writes.plot
    if as_json:
        data = result.to_json()
        data["output"] = None if output is None else str(output)
        data["plot"] = None if plot is None else str(plot)
        sys.stdout.write(json.dumps(data) + "\n")
        return
    _print_tune(result)
    if output is not None:
        out.print(f"wrote {output} ({result.range.dim}={result.picked_batch})",
                  highlight=False)
    if plot is not None:
        out.print(f"wrote {plot}", highlight=False)


def _print_tune(result: TuneResult) -> None:
    """The table and the answers (the largest, the largest without rewriting, the
    fastest, what was picked, the learning rate)."""
    from rich import box
    from rich.table import Table

    from memcc.api import format_size

    r = result
    out.print(f"{r.model}: {r.range.dim} {r.range.low}..{r.range.high}, budget "
              f"{format_size(r.budget_bytes)} (plans aim at "
              f"{format_size(r.planning_budget_bytes)})", highlight=False)
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    measured = any(c.measured_step_s is not None for c in r.candidates)
    cols = [r.range.dim, "fits", "peak MB", "as built MB", "step ms", "samples/s", "overhead"]
    cols += ["measured/s", "measured MB"] if measured else []
    for col in [*cols, "decided by"]:
        table.add_column(col, justify="left" if col in ("fits", "decided by") else "right",
                         no_wrap=True)

    def mb(n: int | None) -> str:
        return "-" if n is None else f"{n / 1e6:,.1f}"

    def rate(x: float | None) -> str:
        return "-" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"

    for c in r.candidates:
        extra = [rate(c.measured_samples_per_s), mb(c.measured_peak_bytes)] if measured else []
        table.add_row(
            str(c.batch), "yes" if c.fits else "no",
            "-" if c.decided_by in EDGE_ROWS else mb(c.peak_bytes),
            mb(c.baseline_peak_bytes), "-" if c.step_s is None else f"{c.step_s * 1000:,.1f}",
            rate(c.samples_per_s), "-" if c.overhead is None else f"{c.overhead:+.1%}",
            *extra, c.decided_by)
    # Rows stay whole (no wrapping) even where the console reports a narrow width (pipes).
    wide = Console(width=max(out.width, 132 if measured else 110), file=out.file,
                   force_terminal=out.is_terminal, no_color=out.no_color)
    wide.print(table)
    out.print("peak: of the plan (decided by plan, baseline), the smallest reachable "
              "(min-search), the smallest sqrt(n) one (sqrtn), or inputs, parameters and "
              "state alone (floor); below-edge/above-edge: settled by the sizes either side "
              "(a step's peak grows with the size), so only its step as built was looked at and "
              "no peak is shown. A size that does not fit may peak under what the plans aim "
              "at: the heap room its small buffers need is what misses", highlight=False)
    base = r.largest_batch_without_rewrite
    out.print(f"largest {r.range.dim}: {r.largest_batch} (without rewriting: "
              f"{base if base is not None else 'none fits'}"
              + (f", {r.largest_batch / base:.2f}x" if base else "") + ")", highlight=False)
    fast = r.candidate(r.fastest_batch)
    out.print(f"fastest {r.range.dim}: {r.fastest_batch} ({fast.samples_per_s:,.1f} samples/s "
              f"predicted, {r.cost_source} cost model)", highlight=False)
    out.print(f"picked ({r.pick}): {r.range.dim}={r.picked_batch}", highlight=False)
    if r.lr is not None:
        applied = "built into the step" if r.lr_applied else \
            "not applied: the step has no optimizer"
        out.print(f"learning rate for {r.range.dim}={r.picked_batch}: {r.lr:.6g} "
                  f"({r.lr_rule} scaling; {applied})", highlight=False)
    out.print(f"searched {r.stats['builds']} sizes: {r.stats['sqrtn_bounds']} sqrt(n) bounds, "
              f"{r.stats['plans']} plans, {r.stats['min_searches']} smallest-peak searches; "
              f"{r.time_s:.1f} s", highlight=False)

