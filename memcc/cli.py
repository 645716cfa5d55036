"""``memcc`` command line: fills option objects and calls ``memcc.api``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from memcc.errors import MemccError
from memcc.step import TrainingStep

app = typer.Typer(
    help="memcc: fit neural-network training steps (ONNX) into a memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True)
out = Console(soft_wrap=True)

DimOpt = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional on py3.10
    typer.Option("--dim", "-d", metavar="NAME=INT",
                 help="Bind a symbolic input dimension, e.g. --dim batch=8 (repeatable)."),
]


def _fail(exc: MemccError) -> None:
    err.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


def _warn(message: str) -> None:
    """A compile goes on, but the user should know (e.g. costs estimated, not measured)."""
    err.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _print_version(value: bool) -> None:
    """Print the installed package's version (its metadata, so it cannot drift from
    pyproject.toml) and stop before any command runs."""
    if value:
        from importlib.metadata import version

        out.print(f"memcc {version('memcc')}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="Print memcc's version and exit.")] = False,
) -> None:
    """memcc: fit neural-network training steps (ONNX) into a memory budget."""


@app.command()
def build(
    model: Annotated[Path, typer.Argument(help="Forward ONNX model (e.g. from torch.onnx).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the step.")],
    loss: Annotated[str, typer.Option(
        help="cross-entropy (adds int64 input 'labels'), mse (adds float input 'target'), "
             "or none (the first output is already the scalar loss).")] = "cross-entropy",
    optimizer: Annotated[str, typer.Option(
        help="none (outputs P.grad per parameter), sgd (momentum), or adamw.")] = "sgd",
    lr: Annotated[Optional[float], typer.Option(  # noqa: UP045
        help="Learning rate (default: sgd 0.01, adamw 0.001).")] = None,
    momentum: Annotated[float, typer.Option(help="SGD momentum (0 disables).")] = 0.9,
    weight_decay: Annotated[Optional[float], typer.Option(  # noqa: UP045
        help="Weight decay (default: sgd 0, adamw 0.01).")] = None,
    dim: DimOpt = None,
) -> None:
    """Build a complete training step (loss, backward, optimizer) in standard ONNX ops."""
    from memcc import api
    from memcc.frontend.build import BuildOptions
    from memcc.frontend.load import parse_dims

    try:
        opts = BuildOptions(loss=loss, optimizer=optimizer, lr=lr, momentum=momentum,
                            weight_decay=weight_decay)
        with err.status(f"building the training step of {model}"):
            graph = api.build(model, output, dims=parse_dims(dim), options=opts)
    except MemccError as exc:
        _fail(exc)
        return
    params = TrainingStep.of(graph).parameters
    n_params = sum(graph.info[p].numel for p in params)
    out.print(
        f"wrote {output}: {len(graph.nodes)} nodes, {len(params)} parameter tensors "
        f"({n_params:,} values), loss={loss}, optimizer={optimizer}"
    )


@app.command()
def run(
    model: Annotated[Path, typer.Argument(help="Training step written by memcc build/compile.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to run.")] = 5,
    provider: Annotated[str, typer.Option(help="cpu, cuda or auto.")] = "cpu",
    seed: Annotated[int, typer.Option(help="Seed of the fixed synthetic batch.")] = 0,
    data: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help=".npz file with one array per data input (named like the inputs).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Run training steps in ONNX Runtime; print loss, time and memory per step."""
    from memcc.backend.runner import run_steps

    try:
        result = run_steps(model, steps=steps, provider=provider, seed=seed, data=data)
    except MemccError as exc:
        _fail(exc)
        return
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    for i, (loss_v, t) in enumerate(zip(result.losses, result.step_times_s, strict=False)):
        out.print(f"step {i + 1:>4}  loss {loss_v:.6f}  time {t * 1000:.1f} ms")
    out.print(
        f"median step {result.step_time_s * 1000:.1f} ms; measured peak "
        f"{_mb(result.measured_peak_bytes)}; predicted peak "
        f"{_mb(result.predicted_peak_bytes)}; order matches plan: {result.order_matches_plan}"
    )


@app.command(name="compile")
def compile_cmd(
    model: Annotated[Path, typer.Argument(help="Training step, or forward model (built first).")],
    budget: Annotated[str, typer.Option(
        help="Memory budget for the whole step: 6GB (10^9), 6GiB (2^30), MB/MiB/KB/KiB/TB/"
             "TiB, plain bytes, or 'min' for the smallest memcc can reach.")],
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--output", "-o", help="Rewritten step (default: MODEL.memcc.onnx).")] = None,
    report: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write the report JSON here (default: OUTPUT with .report.json).")] = None,
    strategy: Annotated[str, typer.Option(
        help="auto (ILP, heuristics, exact polish; best fitting plan), ilp, sqrtn or none."
    )] = "auto",
    provider: Annotated[str, typer.Option(help="Provider to plan and measure for: cpu, cuda.")
                        ] = "cpu",
    time_limit: Annotated[float, typer.Option(help="Seconds the planner may spend.")] = 60.0,
    cost: Annotated[str, typer.Option(
        help="Node times: auto (measure in ORT, estimate if that fails), measured, analytic."
    )] = "auto",
    verify: Annotated[bool, typer.Option(
        "--verify", help="Run original and rewritten step: same outputs, measured peak within "
                         "budget, planned order executed.")] = False,
    margin: Annotated[float, typer.Option(
        help="Safety margin: plan for budget*(1-margin) - 1 MiB.")] = 0.02,
    loss: Annotated[str, typer.Option(help="(forward models) as in memcc build.")
                    ] = "cross-entropy",
    optimizer: Annotated[str, typer.Option(help="(forward models) as in memcc build.")
                         ] = "sgd",
    lr: Annotated[Optional[float], typer.Option(  # noqa: UP045
        help="(forward models) as in memcc build.")] = None,
    dim: DimOpt = None,
) -> None:
    """Rewrite a training step so that it fits a memory budget at the least added time."""
    from memcc.compiler import CompileOptions, VerificationError, compile_model, summary_lines
    from memcc.frontend.build import BuildOptions
    from memcc.frontend.load import parse_dims

    out_path = output or model.with_name(model.stem + ".memcc.onnx")
    report_path = report or out_path.with_name(out_path.stem + ".report.json")
    try:
        opts = CompileOptions(
            budget=budget, strategy=strategy, provider=provider, time_limit=time_limit,
            cost=cost, verify=verify, margin=margin,
            build=BuildOptions(loss=loss, optimizer=optimizer, lr=lr), dims=parse_dims(dim),
        )
        with err.status("compiling") as status:
            result = compile_model(model, opts, output=out_path, report_path=report_path,
                                   progress=lambda m: status.update(f"compiling: {m}"),
                                   warn=_warn)
    except VerificationError as exc:
        # The summary says which checks failed; the error, what to try and what was written.
        for line in summary_lines(exc.report):
            out.print(line, highlight=False)
        _fail(exc)
        return
    except MemccError as exc:
        _fail(exc)
        return
    for line in summary_lines(result.report):
        out.print(line, highlight=False)
    out.print(f"wrote {out_path} and {report_path}", highlight=False)


@app.command(name="report")
def report_cmd(
    report: Annotated[Path, typer.Argument(help="Report JSON written by memcc compile.")],
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Also draw bytes live over the schedule (baseline, plan, budget) to this PNG.")
    ] = None,
) -> None:
    """Print a compile report as tables; optionally plot the memory timeline."""
    from memcc.report import load_report, plot_timeline, print_report

    try:
        data = load_report(report)
        print_report(data, out)
        if plot is not None:
            plot_timeline(data, plot)
            out.print(f"wrote {plot}")
    except MemccError as exc:
        _fail(exc)


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
