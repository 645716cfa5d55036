"""``memcc`` command line: fills option objects and calls ``memcc.api``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from memcc.errors import MemccError

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
    err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
    raise typer.Exit(code=2)


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
        graph = api.build(model, output, dims=parse_dims(dim), options=opts)
    except MemccError as exc:
        _fail(exc)
        return
    params = json.loads(graph.metadata["memcc.parameters"])
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


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
