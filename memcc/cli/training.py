"""``memcc run``, ``memcc train`` and ``memcc export``: a training step in, run in ONNX
Runtime (``run``: a fixed synthetic batch, loss, time and memory per step; ``train``: real
data, a progress bar, checkpoints, SIGINT/SIGTERM after a complete step), and the trained
weights out (``export``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, Optional

import typer

from memcc.api import MemccError
from memcc.cli.app import err, fail, mb, out, warn
from memcc.cli.options import (
    CudaGraphOpt,
    DeterministicOpt,
    JsonOpt,
    MeasureMemoryOpt,
    RunProviderOpt,
    StepArg,
    TrainBucketOpt,
    TrainNprocOpt,
    TrainZeroOpt,
)

if TYPE_CHECKING:
    from memcc.api import TrainingInterrupted, TrainOptions, TrainResult


def run(
    model: StepArg,
    steps: Annotated[int, typer.Option(min=1, help="Training steps to run.")] = 5,
    provider: RunProviderOpt = None,
    seed: Annotated[int, typer.Option(help="Seed of the fixed synthetic batch.")] = 0,
    data: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help=".npz file with one array per data input (named like the inputs).")] = None,
    as_json: JsonOpt = False,
    in_place: Annotated[bool, typer.Option(
        "--in-place/--copying", help="--in-place (default): run as memcc train runs and memcc "
                                     "compile plans the step: updates written over the "
                                     "values they replace, each update as early as it may "
                                     "run (predicted and measured that way). --copying: "
                                     "every update in a buffer of its own (CPU; for "
                                     "comparison).")] = True,
    arena: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--arena/--no-arena",
        help="CPU: allocate through ORT's arena with the CUDA provider's settings and "
             "predict with the arena model (CUDA's allocation rules, measured on a machine "
             "without a GPU). Default: as the step was compiled (memcc compile --arena).")
    ] = None,
    cuda_graph: CudaGraphOpt = None,
    deterministic: DeterministicOpt = False,
) -> None:
    """Run training steps in ONNX Runtime; print loss, time and memory per step."""
    from memcc.api import RunRequest, run_steps

    try:
        result = run_steps(model, RunRequest(steps=steps, provider=provider, seed=seed,
                                             data=data, in_place=in_place, arena=arena,
                                             cuda_graph=cuda_graph, deterministic=deterministic),
                           say=None if as_json else
                           lambda m: err.print(m, highlight=False, soft_wrap=True))
    except MemccError as exc:
        fail(exc)
    for note in result.notes:
        warn(note)
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    for i, (loss_v, t) in enumerate(zip(result.losses, result.step_times_s, strict=False)):
        out.print(f"step {i + 1:>4}  loss {loss_v:.6f}  time {t * 1000:.1f} ms")
    out.print(
        f"median step {result.step_time_s * 1000:.1f} ms; measured peak "
        f"{mb(result.measured_peak_bytes)}; predicted peak "
        f"{mb(result.predicted_peak_bytes)}; order matches plan: {result.order_matches_plan}"
    )
    if result.traffic is not None:
        out.print(f"per step: {result.traffic.kernels:,} kernels, "
                  f"{mb(result.traffic.bytes_moved)} read and written", highlight=False)
    if result.provider == "cuda":
        out.print(f"first step: measured {mb(result.first_step_measured_bytes)}, predicted "
                  f"{mb(result.first_step_predicted_bytes)}; CUDA graph: {result.cuda_graph}"
                  f"; deterministic: {result.deterministic}", highlight=False)


def train(
    model: StepArg,
    data: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help=".npz file, or a directory of .npz shards: one array per data input, named like "
             "it, first axis = samples (left out, train says what the step takes).")] = None,
    steps: Annotated[Optional[int], typer.Option(  # noqa: UP045
        help="Train until this many steps in all (a resumed run counts its earlier steps).")
    ] = None,
    epochs: Annotated[Optional[int], typer.Option(  # noqa: UP045
        help="Train this many epochs in all (default 1 when --steps is not given).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the shuffled data order.")] = 0,
    checkpoint: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Directory for checkpoints (the newest is kept with one older).")] = None,
    save_every: Annotated[Optional[int], typer.Option(  # noqa: UP045
        help="Write a checkpoint every K steps (and always at the end).")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in --checkpoint (a fresh start "
                         "if it holds none).")] = False,
    provider: RunProviderOpt = None,
    threads: Annotated[Optional[int], typer.Option(  # noqa: UP045
        min=1, help="ONNX Runtime intra-op threads (default: ORT's choice).")] = None,
    arena: Annotated[Optional[bool], typer.Option(  # noqa: UP045
        "--arena/--no-arena",
        help="CPU: allocate through ORT's CPU arena. Default: as the step was compiled "
             "(memcc compile --arena), else straight from malloc, where glibc's heap can hold "
             "several times the plan's peak.")] = None,
    cuda_graph: CudaGraphOpt = None,
    deterministic: DeterministicOpt = False,
    batch_size_check: Annotated[bool, typer.Option(
        "--batch-size-check", help="Check the data against the step, print the batch size, "
                                   "batches per epoch and steps, and stop before training.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object at the end.")
                       ] = False,
    nproc: TrainNprocOpt = None,
    zero: TrainZeroOpt = 0,
    bucket_mb: TrainBucketOpt = None,
    measure_memory: MeasureMemoryOpt = False,
) -> None:
    """Train a step on real data, with checkpoints a crash cannot damage."""
    from memcc.api import (
        TrainingInterrupted,
        TrainOptions,
        launched_by_torchrun,
    )

    try:
        if data is None:
            _say_data_wanted(model, batch_size_check)
            return
        opts = TrainOptions(step=model, data=data, steps=steps, epochs=epochs, seed=seed,
                            checkpoint=checkpoint, save_every=save_every, resume=resume,
                            provider=provider, threads=threads, arena=arena,
                            cuda_graph=cuda_graph, deterministic=deterministic)
        if batch_size_check:
            _say_batch_size(opts, nproc)
            return
        if nproc is not None or launched_by_torchrun() is not None:
            _train_data_parallel(opts, nproc, zero, as_json=as_json, bucket_mb=bucket_mb,
                                 measure_memory=measure_memory)
            return
        _refuse_rank_options(zero, bucket_mb, measure_memory)
        result = _train_with_progress(opts, quiet=as_json)
    except MemccError as exc:
        fail(exc)
    except TrainingInterrupted as stop:
        _report_interrupted(stop, opts, as_json=as_json)
        raise typer.Exit(code=128 + stop.signum) from None
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step
        _report_given_up(checkpoint)
        raise typer.Exit(code=130) from None
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    _print_trained(result)


def _say_data_wanted(model: Path, check_only: bool) -> None:
    """No ``--data``: what it must hold. An error, except for ``--batch-size-check``, which
    asks just that (README: write the arrays in the shapes and dtypes it names)."""
    from memcc.api import InputError, describe_data

    wanted = describe_data(model)
    if not check_only:
        raise InputError(f"--data is missing: give {wanted}")
    out.print(f"{model}: no --data given; the step takes {wanted}", highlight=False)


def _refuse_rank_options(zero: int, bucket_mb: float | None, measure_memory: bool) -> None:
    """Options that mean something only with ``--nproc``."""
    from memcc.api import InputError

    if measure_memory:
        raise InputError("--measure-memory measures data-parallel ranks' step peaks: give "
                         "--nproc N (one process measures its step's peak with --arena on "
                         "the CPU, and always on CUDA)")
    if zero:
        raise InputError("--zero shards optimizer state across ranks: give --nproc N")
    if bucket_mb is not None:
        raise InputError("--bucket-mb buckets the gradients data-parallel ranks average: "
                         "give --nproc N")


def _say_batch_size(opts: TrainOptions, nproc: int | None) -> None:
    """``--batch-size-check``: what the data gives (per rank with ``--nproc``), no step."""
    from memcc.api import describe_distributed_plan, plan_training

    said = describe_distributed_plan(opts, nproc) if nproc is not None \
        else plan_training(opts).describe()
    out.print(f"{opts.step}: data {opts.data} fits: {said}", highlight=False)


def _train_data_parallel(opts: TrainOptions, nproc: int | None, zero: int, *,
                         as_json: bool, bucket_mb: float | None = None,
                         measure_memory: bool = False) -> None:
    """``--nproc N`` / torchrun: train on N ranks (``memcc.dist``); rank 0 reports."""
    from memcc.api import TrainingInterrupted, train_distributed

    try:
        out_ = train_distributed(opts, nproc, zero=zero, quiet=as_json, bucket_mb=bucket_mb,
                                 measure_memory=measure_memory)
    except TrainingInterrupted as stop:
        r = stop.result
        if as_json:
            sys.stdout.write(json.dumps(r.to_json()) + "\n")
        again = ["--resume", "--nproc", str(nproc or "N"), "--zero", str(zero),
                 *(["--bucket-mb", f"{bucket_mb:g}"] if bucket_mb is not None else [])]
        err.print(f"{r.interrupted}: all ranks stopped after step {r.steps_done} of "
                  f"{r.total_steps}; checkpoint: {r.checkpoint or 'none (no --checkpoint)'}"
                  + (f"\ncontinue with the same command and {' '.join(again)}"
                     if r.checkpoint else ""), highlight=False, soft_wrap=True)
        raise typer.Exit(code=128 + stop.signum) from None
    if out_ is None:  # a rank other than 0 under torchrun
        return
    result, info = out_
    if as_json:
        sys.stdout.write(json.dumps({**result.to_json(), "distributed": info}) + "\n")
        return
    if result.resumed_from:   # one process says it before its first step; the ranks, here
        out.print(f"resumed from {result.resumed_from} (step {result.start_step})",
                  highlight=False)
    _print_trained(result)
    from memcc.api import format_size

    out.print(f"data-parallel: {info['world_size']} ranks x {info['rank_batch']} = "
              f"{info['global_batch']} samples a step; ZeRO-{info['zero']}"
              + (f", gradients in buckets of {format_size(info['bucket_bytes'])}"
                 if info.get("bucket_bytes") else "") + "; optimizer state "
              + _by_rank(info["optimizer_state_bytes_per_rank"]), highlight=False)
    measured = info.get("step_peak_bytes_per_rank") or []
    predicted = info["predicted_peak_bytes_per_rank"]
    if any(m is not None for m in measured):
        planned = info.get("planned") or {}
        out.print("step peak measured / predicted: " + _by_rank(measured, predicted)
                  + (f"; budget {mb(planned['budget_bytes'])} per rank (memcc compile "
                     f"--nproc {planned['world_size']})" if planned else ""),
                  highlight=False)
    elif info.get("rss_bytes_per_rank"):
        out.print("step peak predicted / the process resident: "
                  + _by_rank(predicted, info["rss_bytes_per_rank"])
                  + " (each step's own peak is measured with --measure-memory)",
                  highlight=False)


def _by_rank(*columns: list[int | None]) -> str:
    """``rank 0 A / B, rank 1 A / B, ...``: one figure per column for each rank."""
    return ", ".join(f"rank {r} " + " / ".join(mb(c[r]) for c in columns)
                     for r in range(len(columns[0])))


def _print_trained(result: TrainResult) -> None:
    """What the run did: the steps, the final loss and speed, memory, the checkpoint."""
    if result.steps_done == result.start_step:
        out.print(f"nothing to do: already at step {result.steps_done} of "
                  f"{result.total_steps}", highlight=False)
    else:
        out.print(
            f"trained steps {result.start_step + 1}-{result.steps_done} of {result.total_steps}"
            f"; final loss {result.losses[-1]:.6f}; {result.samples_per_s or 0:,.1f} samples/s",
            highlight=False)
    mem = result.memory or {}
    if mem.get("measured_peak_bytes") is not None:
        out.print(f"memory: step peak {mb(mem['measured_peak_bytes'])} measured "
                  f"({mem['allocator']}), {mb(mem['predicted_peak_bytes'])} predicted for "
                  "this meter (compile's plan peak also counts the arena regions the step "
                  "before left reserved)",
                  highlight=False)
    elif mem:
        rss = (f"; the process holds {mb(mem['rss_bytes'])} resident, Python, ONNX Runtime "
               "and the data included") if mem.get("rss_bytes") else ""
        out.print(f"memory: plan {mb(mem.get('predicted_peak_bytes'))}; the step's own peak "
                  f"is not measured with {mem.get('allocator')} (compile and train with "
                  f"--arena to measure it){rss}", highlight=False)
    if result.loss_scale:
        skipped = result.loss_scale["skipped_steps"]
        out.print(f"loss scale: {result.loss_scale['scale']:g} at the end; steps of this run "
                  f"skipped because their 16-bit gradients overflowed: {skipped} (the scale "
                  "halves at each, as torch.amp.GradScaler's does)", highlight=False)
    if result.checkpoint:
        out.print(f"checkpoint: {result.checkpoint}", highlight=False)


def _report_given_up(checkpoint: Path | None) -> None:
    """A second Ctrl-C gave up on the running step (or one came before the first): the
    newest checkpoint stands."""
    from memcc.api import latest_checkpoint

    last = latest_checkpoint(checkpoint) if checkpoint is not None else None
    where = (f"newest checkpoint: {last} (continue with --resume)" if last
             else "no checkpoint was written")
    err.print(f"interrupted; {where}", highlight=False)


def _report_interrupted(stop: TrainingInterrupted, opts: TrainOptions, *, as_json: bool
                        ) -> None:
    """What a run stopped by SIGINT/SIGTERM saved, and the command that continues it."""
    import shlex

    steps, epochs = opts.steps, opts.epochs
    r = stop.result
    if as_json:
        sys.stdout.write(json.dumps(r.to_json()) + "\n")
    if r.checkpoint is None:
        err.print(f"{r.interrupted}: stopped after step {r.steps_done} of {r.total_steps}; "
                  "nothing saved (no --checkpoint was given)", highlight=False)
        return
    directory = Path(r.checkpoint).parent
    until = ["--steps", str(steps)] if steps is not None else \
        ["--epochs", str(epochs)] if epochs is not None else []
    again = ["memcc", "train", str(opts.step), "--data", str(opts.data), "--checkpoint",
             str(directory), "--resume", "--seed", str(opts.seed), *until]
    err.print(f"{r.interrupted}: stopped after step {r.steps_done} of {r.total_steps}; "
              f"checkpoint of step {r.steps_done}: {r.checkpoint}\ncontinue with: "
              f"{shlex.join(again)}", highlight=False, soft_wrap=True)


def _train_memory(memory: dict, step_peak: int | None, rss: int | None) -> str:
    """The progress bar's memory: the step's peak as the plan counts it, measured the way
    --verify measures it, next to the plan's prediction; with malloc (not measured that
    way) the process's resident size, named so."""
    plan = f"plan {mb(memory.get('predicted_peak_bytes'))}"
    allocator = memory.get("allocator")
    if allocator == "arena":  # the arena model as the meter sees it (_print_trained)
        return (f"arena step {mb(step_peak) if step_peak else '-'} (predicted "
                f"{mb(memory.get('predicted_peak_bytes'))})")
    if allocator == "cuda-arena":
        return f"device step {mb(step_peak)} ({plan})"
    return f"process rss {mb(rss) if rss else '-'} ({plan}, malloc)"


def _train_with_progress(opts: TrainOptions, *, quiet: bool) -> TrainResult:
    """Run ``memcc.api.train`` under a progress bar on stderr (loss, samples/s, memory)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from memcc import api

    # Off a terminal (a log, a pipe) the bar's last frame was cut at 80 columns with "...":
    # there, a plain line every tenth of the run instead.
    logged = not quiet and not err.is_terminal
    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
        TextColumn("{task.fields[mem]}"), TimeRemainingColumn(),
        console=err, disable=quiet or logged, transient=False,
    )
    task = None
    memory: dict = {}
    started: list[bool] = []
    total: list[int] = []

    def on_start(result) -> None:
        nonlocal task
        if result.resumed_from:
            err.print(f"resuming from {result.resumed_from} (step {result.start_step})",
                      highlight=False)
        elif opts.resume:
            err.print(f"no checkpoint in {opts.checkpoint}: starting at step 0",
                      highlight=False)
        for note in result.notes:
            err.print(f"note: {note}", highlight=False)
        memory.update(result.memory)
        progress.start()   # only now: an error before the first step prints alone
        started.append(True)
        task = progress.add_task("train", total=result.total_steps,
                                 completed=result.start_step, loss="-", rate="-",
                                 mem=_train_memory(memory, None, None))
        total.append(result.total_steps)

    def on_step(p) -> None:
        fields = dict(loss=f"{p.loss:.4f}", rate=f"{p.samples_per_s:,.0f}",
                      mem=_train_memory(memory, p.step_peak_bytes, p.memory_bytes))
        progress.update(task, completed=p.step, **fields)
        n = total[0] if total else p.step
        if logged and (p.step >= n or p.step % max(n // 10, 1) == 0):
            err.print(f"train {p.step}/{n} loss {fields['loss']} {fields['rate']} samples/s "
                      f"{fields['mem']}", highlight=False, soft_wrap=True)

    try:
        return api.train(opts, on_start=on_start, on_step=on_step)
    finally:
        if started:   # a progress never started still prints a line when stopped
            progress.stop()


def export_cmd(
    model: Annotated[Path, typer.Argument(help="The training step the checkpoint belongs to.")],
    checkpoint: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Checkpoint file, or a directory (its newest checkpoint): what memcc train "
             "--checkpoint wrote.")] = None,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write.")] = ...,
    fmt: Annotated[Optional[Literal["onnx", "safetensors"]], typer.Option(  # noqa: UP045
        "--format", case_sensitive=False,
        help="onnx (the forward model with the trained weights; default unless OUT ends in "
             ".safetensors) or safetensors (the weights under the exported model's "
             "initializer names).")] = None,
    eval_mode: Annotated[bool, typer.Option(
        "--eval", help="Write the ONNX model as inference runs it, as PyTorch's module.eval() "
                       "does: training-mode BatchNorms read the trained running statistics, "
                       "Dropouts (and dropout masks such as stochastic depth) pass their "
                       "input through. Refused where the model draws other random numbers "
                       "(a noise layer). Without it a model exported in train mode keeps "
                       "train mode, and export says so.")] = False,
) -> None:
    """Write the trained weights out: the forward ONNX model, or a safetensors file."""
    from memcc.api import EVAL_NOTE, export_checkpoint

    def said(message: str) -> None:
        if message.startswith(EVAL_NOTE):
            out.print(message, highlight=False)
        else:
            warn(message)

    if checkpoint is None:
        fail(_no_checkpoint(model))
    suffix = output.suffix.lower()
    if fmt is not None and suffix in (".onnx", ".safetensors") and suffix != f".{fmt.lower()}":
        warn(f"--format {fmt} writes {fmt} into {output}, whose name says {suffix[1:]}: "
             f"name it .{fmt.lower()} unless you mean it")
    elif fmt is None and suffix not in (".onnx", ".safetensors"):
        warn(f"{output}: the format follows the name, and a name that does not end in "
             ".safetensors gets the ONNX model; for the weights (a PyTorch state_dict) name "
             "it .safetensors or give --format safetensors")
    try:
        path = export_checkpoint(model, checkpoint, output, format=fmt, warn=said,
                                 eval_mode=eval_mode)
    except MemccError as exc:
        fail(exc)
    out.print(f"wrote {path}", highlight=False)


def _no_checkpoint(model: Path) -> MemccError:
    """The refusal of an export without ``--checkpoint``, saying where the checkpoint goes
    where the argument given is one (a directory or a .safetensors file)."""
    from memcc.api import InputError

    if model.is_dir() or model.suffix.lower() == ".safetensors":
        return InputError(f"{model} is a checkpoint, where export wants the training step "
                          "first: memcc export STEP.onnx --checkpoint "
                          f"{model} -o OUT")
    return InputError(f"give --checkpoint: the checkpoint of {model} to export (the "
                      "directory memcc train --checkpoint wrote, or one of its files)")

