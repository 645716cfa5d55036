"""Turn a forward model into one complete training step in standard ONNX ops.

The step takes the data (and labels), the parameters and the optimizer state as graph
inputs, and returns the loss plus everything that must be carried to the next step
(updated parameters, optimizer state, BatchNormalization running statistics). Parameters
and state are graph inputs whose initial values ship in the file as initializers of the
same name, so one file is both the program and its starting point. The metadata written
here (``memcc.*`` keys) is the contract the runner and the planner read.

In: a forward ``Graph`` and ``BuildOptions``. Out: a new ``Graph``, the training step,
built in this order: row chunks (``frontend.row_chunks``), the loss (``frontend.loss``),
the parameters (``frontend.parameters``), the stem over batch chunks
(``frontend.batch_chunks``), the backward (``frontend.autodiff``; of the
scaled loss with ``--loss-scale dynamic``, ``frontend.loss_scaling``), the update and carried
state (``frontend.update``), the contract's metadata, memcc's fusions
(``frontend.fuse``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from memcc.errors import InputError
from memcc.frontend.autocast import AutocastSummary, autocast, recast_in_backward
from memcc.frontend.autodiff import differentiate
from memcc.frontend.batch_chunks import BATCH, chunk_stems, emit_backward
from memcc.frontend.buffer_updates import (
    BufferUpdates,
    buffer_updates,
    carry_buffer_updates,
    warn_last_batch_statistics,
)
from memcc.frontend.build_options import LOSSES, OPTIMIZERS, BuildOptions
from memcc.frontend.dropout_masks import add_counter, counter_dropouts, warn_inactive_dropouts
from memcc.frontend.emit import Emitter
from memcc.frontend.export_map import EXPORT_MAP_KEY, ExportMap, export_map_of
from memcc.frontend.export_signature import signature_of
from memcc.frontend.exported import (
    ParameterSource,
    parameter_sources,
    restore_training_batchnorm,
)
from memcc.frontend.fuse import fuse_step
from memcc.frontend.loss import StepLoss, add_loss
from memcc.frontend.loss_scaling import add_scale_state, scaled_seeds
from memcc.frontend.loss_scaling import metadata as loss_scale_record
from memcc.frontend.model_types import (
    refuse_unloadable_types,
    sixteen_bit_already,
    warn_sixteen_bit_parameters,
    widen_mixed_sixteen_bit,
)
from memcc.frontend.parameter_report import report_parameters
from memcc.frontend.parameters import batchnorm_running_stats, choose_parameters
from memcc.frontend.row_chunks import ATTENTION, MLP, chunk_regions
from memcc.frontend.running_variance import unbias_running_var
from memcc.frontend.update import OutputNamer, StepWriter, carry_batchnorm_stats, emit_update
from memcc.graph import Graph
from memcc.step import (  # the contract's keys live with its one reader, memcc.step
    DATA_KEY,
    FOLDED_PARAMS_KEY,
    FORWARD_OUTPUTS_KEY,
    GRADIENTS_KEY,
    IGNORED_KEY,
    INT_RANGES_KEY,
    KIND_KEY,
    LOSS_KEY,
    OPTIMIZER_KEY,
    PARAM_SOURCES_KEY,
    PARAMS_KEY,
    PRECISION_KEY,
    PROJECTION_KEY,
    ROW_CHUNKS_KEY,
    STATE_KEY,
    UNTRAINED_COPIES_KEY,
    Role,
    tag_node,
)

__all__ = [
    "DATA_KEY", "INT_RANGES_KEY", "KIND_KEY", "LOSS_KEY", "LOSSES", "OPTIMIZER_KEY",
    "OPTIMIZERS", "PARAMS_KEY", "STATE_KEY", "BuildOptions", "build_training_step",
    "is_training_step",
]


def is_training_step(graph: Graph) -> bool:
    return graph.metadata.get(KIND_KEY) == "training_step"


@dataclass(frozen=True)
class _Built:
    """What the build learnt on its way, for the contract's metadata."""

    step_loss: StepLoss
    params: list[str]
    sources: dict[str, ParameterSource]
    emap: ExportMap | None
    grads: dict[str, str]
    row_chunks: dict[str, dict[str, int]]
    precision: AutocastSummary


def build_training_step(forward: Graph, options: BuildOptions | None = None,
                        *, source: str = "<model>") -> Graph:
    """Return a new Graph: forward + loss + backward + optimizer update, in that order."""
    opts = options or BuildOptions()
    _check_forward(forward, source)
    graph = forward.copy()
    # torch.autocast's exported LayerNorm in float32; any other op fed two types refused
    widen_mixed_sixteen_bit(graph, source)
    refuse_unloadable_types(graph, source, taken=False)
    row_chunks = _chunk_rows(graph, opts, source)
    # Before the loss: the loss is taken in float32 whatever the forward computes in.
    graph, casts = autocast(graph, opts.precision)
    if opts.precision != "fp32" and not casts.by_type:
        raise InputError(f"{source}: --precision {opts.precision}: the model has no float32 "
                         "matrix product or convolution (MatMul, Gemm, Conv, ConvTranspose, "
                         "Einsum) to compute in 16-bit, so the step would be the float32 one; "
                         f"build it without --precision{sixteen_bit_already(graph)}")
    emit = Emitter(graph)
    step_loss = add_loss(graph, emit, opts, source)
    loss, chunked = step_loss.loss, step_loss.chunked

    restore_training_batchnorm(graph, source)
    warn_inactive_dropouts(graph, source)
    bn_stats = batchnorm_running_stats(graph)
    unbias_running_var(graph, bn_stats)  # PyTorch's running variance, for its models
    warn_last_batch_statistics(bn_stats, source)
    written = buffer_updates(graph, bn_stats, source, loss)  # other buffers the forward writes
    emap = export_map_of(graph)
    params = choose_parameters(graph, loss, bn_stats, opts.freeze, source, emap)
    sources = parameter_sources(graph, params)
    report_parameters(sources, source, signature_of(graph), emap)
    warn_sixteen_bit_parameters(graph, params, opts.optimizer, source)
    # The stem over batch chunks (frontend/batch_chunks.py): its forward is rewritten here,
    # after the parameters are known, and its backward written after the autodiff's.
    stems = chunk_stems(graph, opts.batch_chunks or 1, source)
    if stems:
        row_chunks[BATCH] = {"chunks": opts.batch_chunks, "regions": len(stems)}
    seeds = chunked.seeds if chunked else None
    if opts.dynamic_loss_scale:  # the backward of scale * loss (frontend/loss_scaling.py)
        seeds = scaled_seeds(graph, emit, loss, add_scale_state(graph, opts), seeds)
    first_backward = len(graph.nodes)
    stem_outputs = [s.stem.output for s in stems]
    grads = differentiate(graph, loss, params + stem_outputs, source=source, seeds=seeds,
                          skip=[*(chunked.nodes if chunked else ()),
                                *(n for s in stems for n in s.skip)])
    for s in stems:
        grads.update(emit_backward(graph, s, grads.pop(s.stem.output, None), set(params)))
    if opts.precision != "fp32":
        casts.recast_in_backward = recast_in_backward(graph, first_backward, [loss])

    out = StepWriter(graph, emit, {}, OutputNamer(graph, emit))
    graph.outputs = _emit_step_end(out, step_loss.loss, params, grads, opts,
                                   (bn_stats, written))
    graph.inputs = step_loss.data_inputs + [p for p in params] + [
        s for s in out.state.values() if s not in params
    ]
    built = _Built(step_loss, params, sources, emap, grads, row_chunks, casts)
    graph.metadata.update(_contract(forward, built, out, opts))
    graph.metadata.pop(EXPORT_MAP_KEY, None)  # read into the two records above
    # memcc's own fusions, so that planning sees the step as ORT runs it (frontend/fuse.py).
    graph, _ = fuse_step(graph, opts.fusions)
    _drop_unused_initializers(graph)
    return graph


def _check_forward(forward: Graph, source: str) -> None:
    """A forward model at opset 13 or later, not a step already."""
    if is_training_step(forward):
        raise InputError(f"{source}: already a memcc training step; pass the forward model")
    if forward.opset < 13:
        raise InputError(
            f"{source}: opset {forward.opset} is older than 13, which memcc needs for its "
            "backward ops; re-export with opset_version >= 13"
        )


def _chunk_rows(graph: Graph, opts: BuildOptions, source: str) -> dict[str, dict[str, int]]:
    """Rewrite attentions and MLPs over row chunks where asked; the record of what was."""
    return {kind: {"chunks": k,
                   "regions": chunk_regions(graph, kind, k, source)[1]["regions"]}
            for kind, k in ((ATTENTION, opts.attention_chunks or 1),
                            (MLP, opts.mlp_chunks or 1))
            if k > 1}


def _emit_step_end(out: StepWriter, loss: str, params: list[str], grads: dict[str, str],
                   opts: BuildOptions, carried: tuple[list, BufferUpdates]) -> list[str]:
    """The update, the carried statistics and written buffers (``carried``) and the dropout
    counter; the step's outputs."""
    graph = out.graph
    outputs = [loss]
    first_update = len(graph.nodes)
    outputs += emit_update(out, params, grads, opts)
    bn_stats, written = carried
    outputs += carry_batchnorm_stats(out, bn_stats)
    outputs += carry_buffer_updates(out, written)
    out.namer.apply()
    for node in graph.nodes[first_update:]:  # provenance: TrainingStep.roles reads it
        tag_node(node, role=Role.UPDATE.value)
    # Dropout masks from (seed, step counter, element): a resumed run draws the same ones.
    if counter_dropouts(graph):
        outputs.append(add_counter(graph, out.state))
    return outputs


def _contract(forward: Graph, built: _Built, out: StepWriter, opts: BuildOptions) -> dict:
    """The ``memcc.*`` metadata the runner and the planner read (``memcc.step``)."""
    step_loss, emap, chunked = built.step_loss, built.emap, built.step_loss.chunked
    return {
        KIND_KEY: "training_step",
        LOSS_KEY: step_loss.loss,
        DATA_KEY: json.dumps(step_loss.data_inputs),
        STATE_KEY: json.dumps(out.state),
        INT_RANGES_KEY: json.dumps(step_loss.int_ranges),
        **({IGNORED_KEY: json.dumps(step_loss.ignored)} if step_loss.ignored else {}),
        PARAMS_KEY: json.dumps(built.params),
        PARAM_SOURCES_KEY: json.dumps({p: s.to_json() for p, s in built.sources.items()}),
        **({FOLDED_PARAMS_KEY: json.dumps(unwritten)}
           if (unwritten := _unwritten(emap)) else {}),
        **({UNTRAINED_COPIES_KEY: json.dumps(untrained)}
           if (untrained := _untrained_copies(emap, built.params)) else {}),
        FORWARD_OUTPUTS_KEY: json.dumps(list(forward.outputs)),
        **({PROJECTION_KEY: json.dumps(chunked.projection)} if chunked else {}),
        **({ROW_CHUNKS_KEY: json.dumps(built.row_chunks)} if built.row_chunks else {}),
        **({PRECISION_KEY: json.dumps(built.precision.as_dict())}
           if built.precision.precision != "fp32" else {}),
        GRADIENTS_KEY: json.dumps({p: out.namer.renamed(g) for p, g in built.grads.items()}),
        OPTIMIZER_KEY: json.dumps({
            "name": opts.optimizer, "lr": opts.learning_rate, "loss": opts.loss,
            "momentum": opts.momentum if opts.optimizer == "sgd" else None,
            "weight_decay": opts.decay,
            **({"loss_scale": loss_scale_record(opts)} if opts.dynamic_loss_scale else {}),
        }),
    }


def _untrained_copies(emap: ExportMap | None, params: list[str]) -> dict[str, dict]:
    """Copies of one parameter by a known op that the step does not train (a second head's
    pre-transposed weight, off the loss path): what ``memcc.untrained_copies`` records, so
    that ``memcc export`` writes them back under the parameter's name."""
    if emap is None:
        return {}
    return {c: {"copy_of": emap.copies[c][0], "copy_op": op}
            for c, op in emap.copy_ops.items()
            if c not in params and len(emap.copies.get(c, ())) == 1}


def _drop_unused_initializers(graph: Graph) -> None:
    used = {i for n in graph.nodes for i in n.input} | set(graph.inputs) | set(graph.outputs)
    for name in [n for n in graph.initializers if n not in used]:
        del graph.initializers[name]


def _unwritten(emap: ExportMap | None) -> dict[str, str]:
    """What ``memcc.folded_parameters`` records: the PyTorch parameters no step parameter
    holds under their name, each with why (folded, unused, or merged into a constant folded
    from another parameter, which the step trains under a made-up name)."""
    if emap is None:
        return {}
    def source(c: str) -> str:
        return emap.lookups.get(c) or ", ".join(emap.copies.get(c, ())) or "another parameter"

    merged = {n: f"merged; with {source(c)} into '{c}', trained as one"
              for c, names in emap.merged.items() if c not in emap.stands_for for n in names}
    return {**{n: "folded" for n in emap.folded}, **{n: _unused(emap, n) for n in emap.unused},
            **merged}


def _unused(emap: ExportMap, name: str) -> str:
    """What ``memcc.folded_parameters`` says of a parameter the exported model never reads:
    ``unused``, and the parameters it may be a second name of where the records say several
    (``ExportMap.maybe_tied``)."""
    maybe = emap.maybe_tied.get(name)
    return f"unused; maybe a second name of one of {', '.join(maybe)}" if maybe else "unused"
