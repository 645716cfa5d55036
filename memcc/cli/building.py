"""``memcc build``: a forward ONNX model in, a training step (loss, backward, optimizer in
standard ONNX ops) written out, and one line saying what it holds."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from memcc.api import MemccError
from memcc.cli.app import err, fail, out, warn
from memcc.cli.options import (
    AttentionChunksOpt,
    BatchChunksOpt,
    ClassAxisOpt,
    DimOpt,
    FreezeOpt,
    GroupedUpdatesOpt,
    IgnoreIndexOpt,
    LossChunksOpt,
    LossOpt,
    LossScaleOpt,
    LrOpt,
    MlpChunksOpt,
    MomentumOpt,
    OptimizerOpt,
    PrecisionOpt,
    WeightDecayOpt,
    build_options,
)

if TYPE_CHECKING:
    from memcc.api import Graph


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
    """Build a complete training step (loss, backward, optimizer) in standard ONNX ops."""
    import warnings

    from memcc import api

    try:
        opts = build_options(locals())
        with err.status(f"building the training step of {model}"), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", api.ExportWarning)
            graph = api.build(model, output, dims=api.parse_dims(dim), options=opts)
    except MemccError as exc:
        fail(exc)
    for w in caught:
        if issubclass(w.category, api.ExportNote):
            err.print(f"note: {escape(str(w.message))}", highlight=False, soft_wrap=True)
        elif issubclass(w.category, api.ExportWarning):
            warn(str(w.message))
    out.print(_summary(graph, output, loss, optimizer))
    if opts.dynamic_loss_scale:
        err.print(f"note: {_loss_scale_note(graph)}", highlight=False, soft_wrap=True)


def _loss_scale_note(graph: Graph) -> str:
    """What the dynamic loss scale costs in memory, said where it is chosen: the overflow
    check reads every gradient, so none is freed before it (a loss-scaled fp16 ResNet-18
    peaked 25% above its float32 step, its gradients outweighing the halved activations)."""
    from memcc.api import TrainingStep, format_size

    grads = sum(graph.info[p].numel * 4 for p in TrainingStep.of(graph).parameters)
    return (f"the dynamic loss scale (--precision fp16's default) checks every gradient for "
            f"overflow before any update, so all of them ({format_size(grads)} here) live "
            "at once at the end of the backward: where they outweigh what 16-bit "
            "activations save, the step peaks above its float32 build (compare memcc "
            "analyze of the two). --precision bf16 needs no loss scale; --loss-scale none drops "
            "the check (and the protection from overflow)")


def _summary(graph: Graph, output: Path, loss: str, optimizer: str) -> str:
    """What the written step holds: nodes, parameters and where their names came from,
    and how many vector parameters are updated together (frontend/update_groups.py)."""
    from memcc.api import TrainingStep

    step = TrainingStep.of(graph)
    params = step.parameters
    n_params = sum(graph.info[p].numel for p in params)
    sources = step.parameter_sources()
    unnamed = sum(not s.get("named", True) for s in sources.values())
    copies = sum(bool(s.get("copy_op")) for s in sources.values())
    back = (f", {copies} of them copies the exporter folded from a parameter, which export "
            "writes back under its name" if copies else "")
    merged = sum(len(s.get("merged", ())) for s in sources.values())
    folded = len(step.folded_parameters())
    pytorch = (f"; they hold {len(step.state_dict_names())} PyTorch parameters, {merged} of "
               f"them merged into others by the exporter, and {folded} more have no "
               "trained value" if merged or folded else "")
    return (
        f"wrote {output}: {len(graph.nodes)} nodes, {len(params)} parameter tensors "
        f"({n_params:,} values; {len(params) - unnamed} under the model's own names (a "
        f"torch export's state_dict names), {unnamed} under names the exporter made "
        f"up{back}{pytorch}), loss={loss}, optimizer={optimizer}{_grouped(graph, step)}"
    )


def _grouped(graph: Graph, step) -> str:
    from memcc.api import update_units

    groups = [u for u in update_units(graph, step.state, step.parameters) if len(u) > 1]
    if not groups:
        return ""
    return (f" ({sum(map(len, groups))} vector parameters updated as "
            f"{len(groups)} joined vector{'s' if len(groups) > 1 else ''}: the same bits, "
            "fewer kernels)")
