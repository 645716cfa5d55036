"""Every ``memcc`` option that more than one command takes, declared once (typer
``Annotated`` aliases): the same name, type, default, choices and help wherever it appears,
so that the commands cannot drift apart (tests/test_bad_inputs.py compares them). An option
only one command takes is declared with that command.

``build_options`` turns memcc build's flags, wherever they are given (build, compile, tune,
analyze), into the one ``BuildOptions``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional

import typer

if TYPE_CHECKING:
    from memcc.api import BuildOptions


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
    help="Keep parameters whose names (initializer names, or any PyTorch name they stand "
         "for: tied aliases) match this shell pattern fixed: "
         "their gradients are never built (repeatable), e.g. --freeze 'embeddings.*'.")]
LossChunksOpt = Annotated[int, typer.Option(
    "--loss-chunks", min=1,
    help="Cross-entropy and the vocabulary projection (a MatMul of the hidden states "
         "by the output weight) over this many row chunks, each chunk's gradient taken "
         "right away: the full logits are never held. For language models, whose "
         "logits are often the largest tensor; gradients within 1e-5 of the plain "
         "loss's.")]
ClassAxisOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--class-axis", metavar="AXIS",
    help="Cross-entropy's class axis in the first output (default: the last, as a "
         "language model's [batch, tokens, vocabulary] logits have it). PyTorch's "
         "segmentation models give [N, C, H, W]: --class-axis 1, labels [N, H, W].")]
IgnoreIndexOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--ignore-index", metavar="INT",
    help="Cross-entropy: positions whose label is INT count for nothing (torch's "
         "ignore_index; the loss is the mean over the other positions, and the data "
         "check accepts INT in labels). Not assumed: without the flag no value is "
         "ignored, unlike torch's default -100. -100 for HuggingFace language-model "
         "labels, 255 for Pascal VOC's void pixels. Not with --loss-chunks.")]
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
BatchChunksOpt = Annotated[int, typer.Option(
    "--batch-chunks", min=1,
    help="A convnet's stem (a Conv of the image, a training-mode BatchNorm, an activation "
         "(Relu, Clip, LeakyRelu, HardSwish, Sigmoid, Tanh, Elu, Selu, Celu, Softplus, Gelu, "
         "SiLU; README lists the forms), optionally a MaxPool) over this many batch "
         "chunks, forward and backward, with the batch "
         "statistics summed over the chunks: its full-resolution activations are then "
         "held one chunk at a time, at the price of the stem's convolution run four times. "
         "Gradients within 1e-4 of the whole stem's.")]
PrecisionOpt = Annotated[Literal["fp32", "bf16", "fp16"], typer.Option(
    help="fp32 (as exported), or bf16 / fp16 autocast as torch.autocast does it: matrix "
         "products and convolutions in 16-bit, softmax, norms, reductions and the loss in "
         "fp32, parameters and optimizer state kept in fp32 (master weights). A provider "
         "without a 16-bit kernel for an op computes it in fp32 between 16-bit casts "
         "(README, Mixed precision).")]
LossScaleOpt = Annotated[Optional[Literal["dynamic", "none"]], typer.Option(  # noqa: UP045
    "--loss-scale",
    help="dynamic: scale the loss, unscale the gradients, skip a step whose gradients "
         "overflow and adapt the scale, as torch.amp.GradScaler does, inside the step "
         "(the scale is carried state, checkpointed). none: no scaling. Default: dynamic "
         "with --precision fp16, else none.")]
VerifyOpt = Annotated[bool, typer.Option(
    "--verify", help="Run original and rewritten step: same outputs, measured peak within "
                     "budget, planned order executed.")]
GroupedUpdatesOpt = Annotated[bool, typer.Option(
    "--grouped-updates/--no-grouped-updates",
    help="Update the vector parameters (biases, norm scales and shifts) together, up to 32 "
         "at once over their concatenation: the same bits in fewer kernels, the optimizer "
         "state of each group joined in the step (checkpoints hold it per parameter). "
         "--no-grouped-updates: an update per parameter.")]
# compile: not given (None) = compile chooses (compiler/chunk_choice.py); a number overrides.
_CHOSEN = (" Not given: compile plans the step without it first, and also builds and plans "
           "the step with it where that does not fit the budget, with --budget min, or where "
           "the plan adds time and a quick estimate says the split would add less; it keeps "
           "the plan that fits at the least added time (--budget min: the smallest); the "
           "report's row_chunks says what was tried.")
AutoLossChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--loss-chunks", min=1, help=LossChunksOpt.__metadata__[0].help + _CHOSEN)]
AutoAttentionChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--attention-chunks", min=1, help=AttentionChunksOpt.__metadata__[0].help + _CHOSEN)]
AutoMlpChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--mlp-chunks", min=1, help=MlpChunksOpt.__metadata__[0].help + _CHOSEN)]
AutoBatchChunksOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    "--batch-chunks", min=1, help=BatchChunksOpt.__metadata__[0].help + _CHOSEN)]
NoChunksOpt = Annotated[bool, typer.Option(
    "--no-chunks",
    help="Keep the loss, every attention, every MLP and the stem whole (as --loss-chunks 1 "
         "--attention-chunks 1 --mlp-chunks 1 --batch-chunks 1): compile tries no chunks.")]
# compile and tune plan for a provider; run and train run on one.
PlanProviderOpt = Annotated[Literal["cpu", "cuda", "auto"], typer.Option(
    case_sensitive=False,
    help="Provider to plan and measure for; auto: cuda where this onnxruntime runs CUDA, "
         "else cpu (as run and train resolve it).")]
RunProviderOpt = Annotated[Optional[Literal["cpu", "cuda", "auto"]], typer.Option(  # noqa: UP045
    case_sensitive=False,
    help="Where to run; auto: cuda where this onnxruntime runs CUDA, else cpu. Default: "
         "where the step was planned (memcc compile --provider; a CUDA plan runs on the CPU, "
         "with a note, where CUDA is missing), else cpu.")]
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
# memcc compile --nproc N [--zero Z]: the step planned as a data-parallel rank runs it.
PlanNprocOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    help="Plan the step one of N data-parallel ranks runs (memcc train --nproc N): "
         "gradients held in the all-reduce bucket, each rank's own optimizer state with "
         "--zero 1 (and its own gradients only with --zero 2). --budget is then per rank.")]
PlanZeroOpt = Annotated[int, typer.Option(
    help="With --nproc: 0 = every rank keeps all optimizer state; 1 = each keeps its "
         "parameters' (ZeRO-1); 2 = and only its parameters' averaged gradients (ZeRO-2), "
         "as memcc train --nproc N --zero Z runs it.")]
CompileCostOpt = Annotated[Literal["auto", "measured", "analytic"], typer.Option(
    help="Node times: auto (measure them in ORT, cached, where running the step 7 times "
         "takes at most a quarter of --time-limit by estimate or this step was measured "
         "before; else estimate them and warn), measured (always), analytic (estimate; "
         "nothing runs).")]
PlanBucketOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    "--bucket-mb",
    help="With --nproc (ZeRO 0 or 1): plan ranks that reduce their gradients in buckets of "
         "B MB during the backward and free them after their updates, as memcc train "
         "--nproc N --bucket-mb B runs them (no gradient held all step).")]
# memcc train --nproc N: the data-parallel run.
TrainNprocOpt = Annotated[Optional[int], typer.Option(  # noqa: UP045
    help="Data-parallel: start N local ranks (torch.distributed, gloo; needs torch: pip "
         "install '.\\[dist]' in memcc's checkout). "
         "Each rank trains on the step's batch, so a step takes N x batch samples; "
         "under torchrun the ranks are torchrun's.")]
TrainZeroOpt = Annotated[int, typer.Option(
    help="With --nproc: 0 = every rank keeps all optimizer state; 1 = each keeps its "
         "parameters' (ZeRO-1); 2 = and gradients are reduced to the rank that owns "
         "them, which alone keeps them (ZeRO-2).")]
TrainBucketOpt = Annotated[Optional[float], typer.Option(  # noqa: UP045
    help="With --nproc (ZeRO 0 or 1): reduce the gradients in buckets of this many MB "
         "while the backward goes on, each bucket's parameters updated and its "
         "gradients freed once it is reduced (DDP's default is 25). Default: one "
         "reduction after the backward, every gradient held until then.")]
MeasureMemoryOpt = Annotated[bool, typer.Option(
    "--measure-memory",
    help="With --nproc on the CPU: measure each rank's step peak, the ranks started "
         "with the allocation rules plans count (every buffer of 4 KiB or more its own "
         "mapping). Slower: 2 ranks of a small GPT-2 on 2 cores trained at 0.55x the speed. "
         "Default: the ranks allocate as memcc train does, and their resident sizes "
         "are shown.")]
StrategyOpt = Annotated[Literal["auto", "ilp", "sqrtn", "none"], typer.Option(
    help="auto (ILP, heuristics, exact polish; best fitting plan), ilp, sqrtn or none.")]

# The file a command reads: a training step (run, train), or either (compile, analyze).
StepArg = Annotated[Path, typer.Argument(help="Training step written by memcc build/compile.")]
StepOrModelArg = Annotated[Path, typer.Argument(
    help="Training step, or forward model (built first).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
MarginOpt = Annotated[float, typer.Option(
    help="Safety margin: plan for budget*(1-margin) - slack; the slack is 1 MiB plus, "
         "on the CPU without --arena, 1 KiB of heap per buffer under 4 KiB.")]

# The parameters of a command that hold memcc build's flags (LossOpt ... MlpChunksOpt).
BUILD_FLAGS = ("loss", "optimizer", "lr", "momentum", "weight_decay", "freeze",
               "class_axis", "ignore_index", "loss_chunks", "attention_chunks", "mlp_chunks",
               "batch_chunks", "precision", "loss_scale", "grouped_updates")


def build_options(given: Mapping[str, Any]) -> BuildOptions:
    """The ``BuildOptions`` of memcc build's flags among a command's parameters (pass the
    command's ``locals()``): one construction for build, compile, tune and analyze, so that
    they cannot drift apart. A command without one of the flags fails here, at once."""
    from memcc.api import BuildOptions

    values = {name: given[name] for name in BUILD_FLAGS}
    values["freeze"] = tuple(values["freeze"] or ())
    return BuildOptions(**values)
