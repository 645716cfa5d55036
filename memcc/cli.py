"""``memcc`` command line: fills option objects and calls ``memcc.api``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.console import Console
from rich.markup import escape

from memcc.errors import MemccError
from memcc.step import TrainingStep


class _FlagsWithoutPlaceholder:
    """typer's rich help gives every option a value placeholder, on/off flags too
    (``--verify <bool>``), although a flag takes no value: its row should read ``--verify``
    or ``--arena / --no-arena`` alone. An empty metavar shows nothing there; it changes
    nothing else (a flag's metavar is never used to parse or in messages)."""

    def get_params(self, ctx):  # noqa: ANN001, ANN201 - click's signature
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_FlagsWithoutPlaceholder, typer.core.TyperCommand):
    pass


class _Group(_FlagsWithoutPlaceholder, typer.core.TyperGroup):
    pass


class _App(typer.Typer):
    """Every command gets ``_Command`` (its help without flag placeholders), including
    commands added later with a plain ``@app.command()``."""

    def command(self, *args, cls=None, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _App(
    cls=_Group,
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

# memcc build's options, defined once: compile and tune take every one of them for forward
# models (which they build first), with the same names, defaults, choices and help.
# The choices are written out (importing the modules that own them would slow every
# command's start); tests/test_bad_inputs.py checks them against LOSSES, OPTIMIZERS, ...
LossOpt = Annotated[Literal["cross-entropy", "mse", "none"], typer.Option(
    help="cross-entropy (adds int64 input 'labels'), mse (adds float input 'target'), "
         "or none (the first output is already the scalar loss).")]
OptimizerOpt = Annotated[Literal["none", "sgd", "adamw"], typer.Option(
    help="none (outputs P.grad per parameter), sgd (momentum), or adamw.")]
LrOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    help="Learning rate (default: sgd 0.01, adamw 0.001).")]
MomentumOpt = Annotated[float, typer.Option(help="SGD momentum (0 disables).")]
WeightDecayOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    help="Weight decay (default: sgd 0, adamw 0.01).")]
FreezeOpt = Annotated[Optional[list[str]], typer.Option(  # noqa: UP045
    "--freeze", metavar="PATTERN",
    help="Keep parameters whose initializer names match this shell pattern fixed: "
         "their gradients are never built (repeatable), e.g. --freeze 'embeddings.*'.")]
LossChunksOpt = Annotated[int, typer.Option(
    "--loss-chunks", min=1,
    help="Cross-entropy and the vocabulary projection (a MatMul of the hidden states "
         "by the output weight) over this many row chunks, each chunk's gradient taken "
         "right away: the full logits are never held. For language models, whose "
         "logits are often the largest tensor; gradients within 1e-5 of the plain "
         "loss's.")]
AttentionChunksOpt = Annotated[int, typer.Option(
    "--attention-chunks", min=1,
    help="Every attention (queries-by-keys MatMul, Softmax, MatMul by the values) "
         "over this many query chunks: the backward, and a plan that recomputes the "
         "probabilities, then hold one chunk's scores at a time. For long sequences, "
         "whose batch x heads x tokens x tokens scores outgrow the rest of a layer; "
         "gradients within 1e-5 of whole attentions.")]
MlpChunksOpt = Annotated[int, typer.Option(
    "--mlp-chunks", min=1,
    help="Every MLP (MatMuls by 2-D weights around an activation or a gate) over this "
         "many token chunks: the backward, and a plan that recomputes the hidden "
         "activations, then hold one chunk's at a time. Gradients within 1e-5 of whole "
         "MLPs.")]
# compile: not given (None) = compile chooses (compiler/chunk_choice.py); a number overrides.
_CHOSEN = (" Not given: compile builds the step with and without it and keeps the plan that "
           "fits at the least added time (--budget min: the smallest); the report's "
           "row_chunks says what was tried.")
AutoLossChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--loss-chunks", min=1, help=LossChunksOpt.__metadata__[0].help + _CHOSEN)]
AutoAttentionChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--attention-chunks", min=1, help=AttentionChunksOpt.__metadata__[0].help + _CHOSEN)]
AutoMlpChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--mlp-chunks", min=1, help=MlpChunksOpt.__metadata__[0].help + _CHOSEN)]
NoChunksOpt = Annotated[bool, typer.Option(
    "--no-chunks",
    help="Keep the loss, every attention and every MLP whole (as --loss-chunks 1 "
         "--attention-chunks 1 --mlp-chunks 1): compile tries no row chunks.")]
# compile and tune plan for a provider; run and train run on one.
PlanProviderOpt = Annotated[Literal["cpu", "cuda", "auto"], typer.Option(
    case_sensitive=False,
    help="Provider to plan and measure for; auto: cuda where this onnxruntime runs CUDA, "
         "else cpu (as run and train resolve it).")]
RunProviderOpt = Annotated[Literal["cpu", "cuda", "auto"], typer.Option(
    case_sensitive=False,
    help="Where to run; auto: cuda where this onnxruntime runs CUDA, else cpu.")]
CudaGraphOpt = Annotated[Optional[bool], typer.Option(  # noqa: UP045
    "--cuda-graph/--no-cuda-graph",
    help="CUDA: run the step as one captured CUDA graph (ORT's enable_cuda_graph). Default: "
         "wherever every node runs on the CUDA provider with static shapes; --cuda-graph "
         "fails, naming the node, where that is not so.")]
DeterministicOpt = Annotated[bool, typer.Option(
    "--deterministic",
    help="CUDA: the same bits on every run: scatter-adds and leading-axis reductions "
         "rewritten without atomics (README, Reproducible runs; GPT-2 +7% step time on an "
         "H200). Default: PyTorch-like speed; runs may differ in the last bits.")]
StrategyOpt = Annotated[Literal["auto", "ilp", "sqrtn", "none"], typer.Option(
    help="auto (ILP, heuristics, exact polish; best fitting plan), ilp, sqrtn or none.")]


def _build_options(loss: str, optimizer: str, lr: float | None, momentum: float,
                   weight_decay: float | None, freeze: list[str] | None,
                   loss_chunks: int | None, attention_chunks: int | None,
                   mlp_chunks: int | None):
    """The BuildOptions of the shared build flags (build, and compile/tune for forward
    models), so that the three commands cannot drift apart."""
    from memcc.frontend.build import BuildOptions

    return BuildOptions(loss=loss, optimizer=optimizer, lr=lr, momentum=momentum,
                        weight_decay=weight_decay, freeze=tuple(freeze or ()),
                        loss_chunks=loss_chunks, attention_chunks=attention_chunks,
                        mlp_chunks=mlp_chunks)


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
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = None,
    dim: DimOpt = None,
    freeze: FreezeOpt = None,
    loss_chunks: LossChunksOpt = 1,
    attention_chunks: AttentionChunksOpt = 1,
    mlp_chunks: MlpChunksOpt = 1,
) -> None:
    """Build a complete training step (loss, backward, optimizer) in standard ONNX ops."""
    import warnings

    from memcc import api
    from memcc.frontend.exported import ExportNote, ExportWarning
    from memcc.frontend.load import parse_dims

    try:
        opts = _build_options(loss, optimizer, lr, momentum, weight_decay, freeze,
                              loss_chunks, attention_chunks, mlp_chunks)
        with err.status(f"building the training step of {model}"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ExportWarning)
            graph = api.build(model, output, dims=parse_dims(dim), options=opts)
    except MemccError as exc:
        _fail(exc)
        return
    for w in caught:
        if issubclass(w.category, ExportNote):
            err.print(f"note: {escape(str(w.message))}", highlight=False, soft_wrap=True)
        elif issubclass(w.category, ExportWarning):
            _warn(str(w.message))
    step = TrainingStep.of(graph)
    params = step.parameters
    n_params = sum(graph.info[p].numel for p in params)
    sources = step.parameter_sources()
    unnamed = sum(not s.get("named", True) for s in sources.values())
    merged = sum(len(s.get("merged", ())) for s in sources.values())
    folded = len(step.folded_parameters())
    pytorch = (f"; they hold {len(step.state_dict_names())} PyTorch parameters, {merged} of "
               f"them merged into others by the exporter, and {folded} more have no "
               "trained value" if merged or folded else "")
    out.print(
        f"wrote {output}: {len(graph.nodes)} nodes, {len(params)} parameter tensors "
        f"({n_params:,} values; {len(params) - unnamed} under PyTorch names, {unnamed} "
        f"under names the exporter made up{pytorch}), loss={loss}, optimizer={optimizer}"
    )


@app.command()
def run(
    model: Annotated[Path, typer.Argument(help="Training step written by memcc build/compile.")],
    steps: Annotated[int, typer.Option(min=1, help="Training steps to run.")] = 5,
    provider: RunProviderOpt = "cpu",
    seed: Annotated[int, typer.Option(help="Seed of the fixed synthetic batch.")] = 0,
    data: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help=".npz file with one array per data input (named like the inputs).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
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
    from memcc.backend.runner import run_steps

    try:
        result = run_steps(model, steps=steps, provider=provider, seed=seed, data=data,
                           in_place=in_place, arena=arena, cuda_graph=cuda_graph,
                           deterministic=deterministic)
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
    if result.traffic is not None:
        out.print(f"per step: {result.traffic.kernels:,} kernels, "
                  f"{_mb(result.traffic.bytes_moved)} read and written", highlight=False)
    if result.provider == "cuda":
        out.print(f"first step: measured {_mb(result.first_step_measured_bytes)}, predicted "
                  f"{_mb(result.first_step_predicted_bytes)}; CUDA graph: {result.cuda_graph}"
                  f"; deterministic: {result.deterministic}", highlight=False)


@app.command()
def train(
    model: Annotated[Path, typer.Argument(help="Training step written by memcc build/compile.")],
    data: Annotated[Path, typer.Option(
        help=".npz file, or a directory of .npz shards: one array per data input, named like "
             "it, first axis = samples.")],
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
    provider: RunProviderOpt = "cpu",
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
) -> None:
    """Train a step on real data, with checkpoints a crash cannot damage."""
    from memcc.trainer import TrainingInterrupted, TrainOptions, plan_training
    from memcc.trainer import train as run_training

    try:
        opts = TrainOptions(step=model, data=data, steps=steps, epochs=epochs, seed=seed,
                            checkpoint=checkpoint, save_every=save_every, resume=resume,
                            provider=provider, threads=threads, arena=arena,
                            cuda_graph=cuda_graph, deterministic=deterministic)
        if batch_size_check:
            plan = plan_training(opts)
            out.print(f"{model}: data {data} fits: {plan.describe()}", highlight=False)
            return
        result = _train_with_progress(opts, run_training, quiet=as_json)
    except MemccError as exc:
        _fail(exc)
        return
    except TrainingInterrupted as stop:
        _report_interrupted(stop, model=model, data=data, seed=seed, steps=steps,
                            epochs=epochs, as_json=as_json)
        raise typer.Exit(code=128 + stop.signum) from None
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the first step
        from memcc.backend.checkpoint import latest

        last = latest(checkpoint) if checkpoint is not None else None
        where = (f"newest checkpoint: {last} (continue with --resume)" if last
                 else "no checkpoint was written")
        err.print(f"interrupted; {where}", highlight=False)
        raise typer.Exit(code=130) from None
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
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
        out.print(f"memory: step peak {_mb(mem['measured_peak_bytes'])} measured "
                  f"({mem['allocator']}), plan {_mb(mem['predicted_peak_bytes'])}",
                  highlight=False)
    elif mem:
        rss = f"; the process holds {_mb(mem['rss_bytes'])} resident" \
            if mem.get("rss_bytes") else ""
        out.print(f"memory: plan {_mb(mem.get('predicted_peak_bytes'))}; the step's own peak "
                  f"is not measured with {mem.get('allocator')}{rss}", highlight=False)
    if result.checkpoint:
        out.print(f"checkpoint: {result.checkpoint}", highlight=False)


def _report_interrupted(stop, *, model: Path, data: Path, seed: int, steps: int | None,
                        epochs: int | None, as_json: bool) -> None:
    """What a run stopped by SIGINT/SIGTERM saved, and the command that continues it."""
    import shlex

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
    again = ["memcc", "train", str(model), "--data", str(data), "--checkpoint",
             str(directory), "--resume", "--seed", str(seed), *until]
    err.print(f"{r.interrupted}: stopped after step {r.steps_done} of {r.total_steps}; "
              f"checkpoint of step {r.steps_done}: {r.checkpoint}\ncontinue with: "
              f"{shlex.join(again)}", highlight=False, soft_wrap=True)


def _train_memory(memory: dict, step_peak: int | None, rss: int | None) -> str:
    """The progress bar's memory: the step's peak as the plan counts it, measured the way
    --verify measures it, next to the plan's prediction; with malloc (not measured that
    way) the process's resident size, named so."""
    plan = f"plan {_mb(memory.get('predicted_peak_bytes'))}"
    allocator = memory.get("allocator")
    if allocator == "arena":
        return f"arena step {_mb(step_peak) if step_peak else '-'} ({plan})"
    if allocator == "cuda-arena":
        return f"device step {_mb(step_peak)} ({plan})"
    return f"process rss {_mb(rss) if rss else '-'} ({plan}, malloc)"


def _train_with_progress(opts, run_training, *, quiet: bool):
    """Run ``memcc.trainer.train`` under a progress bar on stderr (loss, samples/s, memory)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train[/]"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
        TextColumn("{task.fields[mem]}"), TimeRemainingColumn(),
        console=err, disable=quiet, transient=False,
    )
    task = None
    memory: dict = {}

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
        task = progress.add_task("train", total=result.total_steps,
                                 completed=result.start_step, loss="-", rate="-",
                                 mem=_train_memory(memory, None, None))

    def on_step(p) -> None:
        progress.update(task, completed=p.step, loss=f"{p.loss:.4f}",
                        rate=f"{p.samples_per_s:,.0f}",
                        mem=_train_memory(memory, p.step_peak_bytes, p.memory_bytes))

    with progress:
        return run_training(opts, on_start=on_start, on_step=on_step)


@app.command(name="export")
def export_cmd(
    model: Annotated[Path, typer.Argument(help="The training step the checkpoint belongs to.")],
    checkpoint: Annotated[Path, typer.Option(
        help="Checkpoint file, or a directory (its newest checkpoint).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write.")],
    fmt: Annotated[Optional[Literal["onnx", "safetensors"]], typer.Option(  # noqa: UP045
        "--format", case_sensitive=False,
        help="onnx (the forward model with the trained weights; default unless OUT ends in "
             ".safetensors) or safetensors (the weights under the exported model's "
             "initializer names).")] = None,
) -> None:
    """Write the trained weights out: the forward ONNX model, or a safetensors file."""
    from memcc.trainer import export_checkpoint

    try:
        path = export_checkpoint(model, checkpoint, output, format=fmt, warn=_warn)
    except MemccError as exc:
        _fail(exc)
        return
    out.print(f"wrote {path}", highlight=False)


@app.command(name="compile")
def compile_cmd(
    model: Annotated[Path, typer.Argument(help="Training step, or forward model (built first).")],
    budget: Annotated[str, typer.Option(
        metavar="SIZE|min",
        help="Memory budget for the whole step: 6GB (10^9), 6GiB (2^30), MB/MiB/KB/KiB/TB/"
             "TiB, plain bytes, or 'min' for the smallest memcc can reach.")],
    output: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--output", "-o", help="Rewritten step (default: MODEL.memcc.onnx).")] = None,
    report: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Write the report JSON here (default: OUTPUT with .report.json).")] = None,
    strategy: StrategyOpt = "auto",
    provider: PlanProviderOpt = "cpu",
    time_limit: Annotated[float, typer.Option(help="Seconds the planner may spend.")] = 60.0,
    cost: Annotated[Literal["auto", "measured", "analytic"], typer.Option(
        help="Node times: auto (measure in ORT, estimate if that fails), measured, analytic."
    )] = "auto",
    verify: Annotated[bool, typer.Option(
        "--verify", help="Run original and rewritten step: same outputs, measured peak within "
                         "budget, planned order executed.")] = False,
    margin: Annotated[float, typer.Option(
        help="Safety margin: plan for budget*(1-margin) - slack; the slack is 1 MiB plus, "
             "on the CPU without --arena, 1 KiB of heap per buffer under 4 KiB.")] = 0.02,
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
    loss_chunks: AutoLossChunksOpt = None,
    attention_chunks: AutoAttentionChunksOpt = None,
    mlp_chunks: AutoMlpChunksOpt = None,
    no_chunks: NoChunksOpt = False,
    dim: DimOpt = None,
) -> None:
    """Rewrite a training step so that it fits a memory budget at the least added time.

    A forward model is built first, with memcc build's options (--loss ... --mlp-chunks);
    row chunks not given are chosen by compile where they lower the plan's cost. A
    training step keeps the options it was built with."""
    if no_chunks:
        loss_chunks, attention_chunks, mlp_chunks = (
            k or 1 for k in (loss_chunks, attention_chunks, mlp_chunks))
    from memcc.compiler import CompileOptions, VerificationError, compile_model, summary_lines
    from memcc.frontend.load import parse_dims

    out_path = output or model.with_name(model.stem + ".memcc.onnx")
    report_path = report or out_path.with_name(out_path.stem + ".report.json")
    try:
        opts = CompileOptions(
            budget=budget, strategy=strategy, provider=provider, time_limit=time_limit,
            cost=cost, verify=verify, margin=margin, variants=variants, offload=offload,
            allow_lossy=allow_lossy, arena=arena,
            build=_build_options(loss, optimizer, lr, momentum, weight_decay, freeze,
                                 loss_chunks, attention_chunks, mlp_chunks),
            dims=parse_dims(dim),
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


@app.command(name="tune")
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
        help="fastest (highest predicted samples/s) or largest: the size -o writes.")
    ] = "fastest",
    points: Annotated[int, typer.Option(
        min=0, help="Sizes planned between the largest without rewriting and the largest "
                    "(each costs a compile).")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Plot peak and predicted throughput against the size (PNG).")] = None,
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
    margin: Annotated[float, typer.Option(
        help="Safety margin: plan for budget*(1-margin) - slack; the slack is 1 MiB plus, "
             "on the CPU without --arena, 1 KiB of heap per buffer under 4 KiB.")] = 0.02,
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = None,
    freeze: FreezeOpt = None,
    loss_chunks: LossChunksOpt = 1,
    attention_chunks: AttentionChunksOpt = 1,
    mlp_chunks: MlpChunksOpt = 1,
) -> None:
    """Find the largest batch, and the fastest, whose training step fits a memory budget.

    Each size is built with memcc build's options (--loss ... --mlp-chunks); --lr may
    instead be derived from --ref-batch/--ref-lr."""
    from memcc.backend.onnx_file import check_writable
    from memcc.errors import InputError
    from memcc.frontend.load import parse_dims
    from memcc.report_view import check_plot_path
    from memcc.tune import TuneOptions, plot_tune, tune, write_step
    from memcc.tune import measure as measure_sizes

    try:
        ranges = [d for d in dim if ".." in d]
        if len(ranges) != 1:
            raise InputError(
                "--dim: give exactly one dimension to search as NAME=LOW..HIGH, e.g. "
                f"--dim batch=1..512 (got {len(ranges)}: {', '.join(ranges) or 'none'})")
        if lr is not None and ref_lr is not None:
            raise InputError("--lr and --ref-lr both set the learning rate: give one")
        opts = TuneOptions(
            strategy=strategy, cost=cost, provider=provider, time_limit=time_limit,
            margin=margin, build=_build_options(loss, optimizer, lr, momentum, weight_decay,
                                                freeze, loss_chunks, attention_chunks,
                                                mlp_chunks),
            dims=parse_dims([d for d in dim if ".." not in d]), pick=pick, points=points,
            ref_batch=ref_batch, ref_lr=ref_lr, lr_rule=lr_rule)
        reads = [("the model", model)]
        if output is not None:
            check_writable(output, "the compiled step", "--output/-o", inputs=reads)
        if plot is not None:
            check_plot_path(plot, inputs=[*reads, ("the compiled step (-o)", output)])
        with err.status("tune") as status:
            result = tune(model, budget, ranges[0], opts,
                          progress=lambda m: status.update(f"tune: {escape(m)}"))
            if measure:
                result = measure_sizes(result, top=measure_top, provider=provider,
                                       progress=lambda m: status.update(f"tune: {escape(m)}"))
            if output is not None:
                status.update(f"tune: writing {output}")
                write_step(result, output)
            if plot is not None:
                plot_tune(result, plot)
    except MemccError as exc:
        _fail(exc)
        return
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


def _print_tune(result) -> None:
    """The table and the answers (the largest, the largest without rewriting, the
    fastest, what was picked, the learning rate)."""
    from rich import box
    from rich.table import Table

    from memcc.sizes import format_size

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
            str(c.batch), "yes" if c.fits else "no", mb(c.peak_bytes),
            mb(c.baseline_peak_bytes), "-" if c.step_s is None else f"{c.step_s * 1000:,.1f}",
            rate(c.samples_per_s), "-" if c.overhead is None else f"{c.overhead:+.1%}",
            *extra, c.decided_by)
    # Rows stay whole (no wrapping) even where the console reports a narrow width (pipes).
    wide = Console(width=max(out.width, 132 if measured else 110), file=out.file,
                   force_terminal=out.is_terminal, no_color=out.no_color)
    wide.print(table)
    out.print("peak: of the plan (decided by plan, baseline), the smallest reachable "
              "(min-search), the smallest sqrt(n) one (sqrtn), or inputs, parameters and "
              "state alone (floor); below-edge/above-edge: only the step as built was looked "
              "at", highlight=False)
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


@app.command(name="analyze")
def analyze_cmd(
    model: Annotated[Path, typer.Argument(help="Training step, or forward model (built first).")],
    provider: PlanProviderOpt = "cpu",
    arena: Annotated[bool, typer.Option(
        "--arena", help="CPU: predict for ORT's CPU arena, as memcc compile --arena plans."
    )] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
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
    loss: LossOpt = "cross-entropy",
    optimizer: OptimizerOpt = "sgd",
    lr: LrOpt = None,
    momentum: MomentumOpt = 0.9,
    weight_decay: WeightDecayOpt = None,
    freeze: FreezeOpt = None,
    loss_chunks: LossChunksOpt = 1,
    attention_chunks: AttentionChunksOpt = 1,
    mlp_chunks: MlpChunksOpt = 1,
    dim: DimOpt = None,
) -> None:
    """Show the step as built: predicted peak, what it is made of, the smallest budget."""
    from memcc.analyze import DEFAULT_TIME_LIMIT, analyze, describe
    from memcc.compiler import CompileOptions
    from memcc.frontend.load import parse_dims

    try:
        opts = CompileOptions(
            budget="min", strategy=strategy, provider=provider,
            time_limit=DEFAULT_TIME_LIMIT if time_limit is None else time_limit, cost=cost,
            margin=margin, variants=variants, arena=arena,
            build=_build_options(loss, optimizer, lr, momentum, weight_decay, freeze,
                                 loss_chunks, attention_chunks, mlp_chunks),
            dims=parse_dims(dim))
        with err.status("analyze") as status:
            result = analyze(model, opts, smallest=smallest,
                             progress=lambda m: status.update(f"analyze: {escape(m)}"),
                             warn=_warn)
    except MemccError as exc:
        _fail(exc)
        return
    if as_json:
        sys.stdout.write(json.dumps(result.to_json()) + "\n")
        return
    for line in describe(result):
        out.print(line, highlight=False)


@app.command(name="report")
def report_cmd(
    report: Annotated[Path, typer.Argument(help="Report JSON written by memcc compile.")],
    plot: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        help="Also draw bytes live over the schedule (baseline, plan, budget) to this PNG.")
    ] = None,
) -> None:
    """Print a compile report as tables; optionally plot the memory timeline."""
    from memcc.errors import InputError
    from memcc.report_view import check_plot_path, load_report, plot_timeline, print_report

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
        _fail(exc)


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 1e6:,.1f} MB"


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
