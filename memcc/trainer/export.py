"""Getting trained weights out of a training step: the forward model inside the step with
the trained values as its weights (``forward_graph``, ``memcc export --format onnx``), or
those weights alone under the exported model's initializer (PyTorch) names
(``export_weights``, ``--format safetensors``), and what a PyTorch user must know about
the names (``weight_export_notes``).

A step graph and its carried values (a ``Trainer``'s live ones, or a checkpoint's) enter;
a written file leaves. Nothing here trains.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from memcc.backend import checkpoint as ckpt
from memcc.errors import InputError
from memcc.frontend.autocast import without_autocast
from memcc.frontend.dropout_masks import restore_dropouts
from memcc.frontend.export_signature import folding_arithmetic, is_made_up_name, signature_of
from memcc.frontend.exported import folded_batchnorms
from memcc.frontend.fold import has_fold_records, with_shape_computations
from memcc.frontend.load import load_graph
from memcc.frontend.parameters import BUFFER_SUFFIXES
from memcc.frontend.running_variance import PRODUCER_KEY, fed_as_stored
from memcc.frontend.symbolic_dims import recorded
from memcc.frontend.whole_rows import with_whole_rows
from memcc.graph import Graph, ancestors
from memcc.step import TrainingStep
from memcc.trainer.batchnorm_back import training_batchnorms_back
from memcc.trainer.checkpoints import step_signature
from memcc.trainer.eval_mode import inference_or_train_mode
from memcc.trainer.named_axes import FOLDED_BEFORE, OWN_REWRITE, with_named_axes

if TYPE_CHECKING:
    import onnx

EXPORT_FORMATS = ("onnx", "safetensors")


@dataclass(frozen=True)
class ExportRequest:
    """Where an export goes and in what form: ``output``; ``format`` ``onnx`` or
    ``safetensors`` (None: by ``output``'s suffix); ``inputs``, the files the export reads
    (the step, the checkpoint) as (what, path), which ``output`` must not overwrite
    (``check_writable``); ``eval_mode``, the ONNX model as inference runs it
    (``trainer/eval_mode.py``)."""

    output: str | os.PathLike
    format: str | None = None
    inputs: Iterable[tuple[str, str | os.PathLike]] = ()
    eval_mode: bool = False


def export_checkpoint(step_path: str | os.PathLike, checkpoint: str | os.PathLike,
                      output: str | os.PathLike, *, format: str | None = None,
                      warn: Callable[[str], None] | None = None,
                      eval_mode: bool = False) -> Path:
    """``memcc export``: the trained weights of ``checkpoint`` out of ``step_path``'s model.

    ``warn`` hears about parameters a PyTorch ``load_state_dict`` will not find by name, and
    about train-mode nodes an ONNX model keeps without ``eval_mode``."""
    path = Path(step_path)
    graph = load_graph(path)
    spec = TrainingStep.of(graph).validate(
        str(path), then="memcc train step.onnx --data DATA --checkpoint DIR; memcc export "
                        "reads the step a checkpoint was trained with, not the forward model")
    c = ckpt.load(checkpoint, sig=step_signature(graph, spec), purpose="export")
    out = export_weights(graph, spec, c.tensors,
                         ExportRequest(output, format, [("the training step", path),
                                                        ("the checkpoint", c.path)],
                                       eval_mode),
                         source=str(path), warn=warn)
    weights_only = (format or "").lower() == "safetensors" or \
        (format is None and out.suffix == ".safetensors")
    if warn is not None and weights_only:
        for message in weight_export_notes(spec):
            warn(message)
    return out


def weight_export_notes(spec: TrainingStep) -> list[str]:
    """What a user loading the written safetensors into PyTorch must know: weights under
    made-up names, PyTorch parameters merged into one trained value, ones without any."""
    notes: list[str] = []
    unnamed = made_up_names(spec)
    if unnamed:
        notes.append(f"{len(unnamed)} parameter(s) carry names the exporter made up (e.g. "
                     f"'{unnamed[0]}'); PyTorch's load_state_dict will not find them by "
                     "these names, so a module loaded from this file keeps its own values "
                     "there and computes something else than the trained model (the exported "
                     "ONNX model has them all). To load every weight by name, export the "
                     "model with torch.onnx.export(..., dynamo=True, optimize=False) and "
                     "build and train that")
    merged = {p: src["merged"] for p, src in spec.parameter_sources().items()
              if src.get("merged") and src.get("pytorch_names")}
    if merged:
        p, names = next(iter(merged.items()))
        notes.append(f"{sum(len(m) for m in merged.values())} PyTorch parameter(s) were merged "
                     f"by the exporter's optimizer and trained as one tied parameter with "
                     f"another (e.g. {', '.join(names[:2])} with {p}); each is written with "
                     "its group's trained value")
    bn = folded_batchnorms(spec.graph)
    if bn:
        notes.append(f"the exporter folded {len(bn)} BatchNorm(s) into the convolutions "
                     f"before them (e.g. '{bn[0]}'): the weights written under those "
                     "convolutions' names hold each BatchNorm's scale and shift too, so a "
                     "PyTorch module loading them, which runs its own BatchNorm, applies it "
                     "twice. Run the exported ONNX model instead, or export the module with "
                     "torch.onnx.export(..., dynamo=True, optimize=False) and train that")
    rows = {p: src["rows_of"] for p, src in spec.parameter_sources().items()
            if src.get("rows_of")}
    if rows:
        notes.append(lookup_note(rows))
    kinds = spec.folded_parameters()
    folded = sorted(set(kinds) - set(rows.values()))
    if folded:
        maybe = next((f" ('{n}' is not read by the exported model: {kinds[n]})"
                      for n in folded if kinds[n].startswith("unused;")), "")
        maybe += next((f" ('{n}' held the same values as another parameter at export: "
                       f"{kinds[n].split('; ', 1)[1]}; export with optimize=False to train "
                       "it on its own)" for n in folded if kinds[n].startswith("merged;")), "")
        notes.append(f"{len(folded)} PyTorch parameter(s) have no trained value (folded into "
                     f"constants by the exporter, or unused), e.g. '{folded[0]}'; they are not "
                     "written: load with load_state_dict(..., strict=False), and the module "
                     f"keeps the values it was exported with{maybe}")
    return notes


def lookup_note(rows: Mapping[str, str]) -> str:
    """What export says of PyTorch parameters the exporter's optimizer folded into a lookup
    of some of their rows (``rows``: the made-up parameter the step trains -> the PyTorch
    parameter), naming each: their tables are not written."""
    computed = {p: param for p, param in rows.items() if folding_arithmetic(p)}
    rows = {p: param for p, param in rows.items() if p not in computed}
    told = ", ".join(f"'{param}' (its rows trained as '{p}')" for p, param in rows.items())
    said = "; ".join(
        f"'{param}' was folded with constants the file does not keep into '{p}' (by "
        f"'{folding_arithmetic(p)}', as Gemma's RMSNorm computes 1 + weight), which memcc trained "
        "instead" for p, param in computed.items())
    if said:
        said = (f"{said}: export cannot compute a parameter back without those constants, "
                "so it is not written (load_state_dict(..., strict=False) keeps the module's "
                "own value; the exported ONNX model has the trained one). To train and "
                "export it, export with torch.onnx.export(..., dynamo=True, optimize=False)")
        if not rows:
            return said
        said += ". "
    return said + (f"{len(rows)} PyTorch parameter(s) were folded by the exporter's optimizer into "
            f"a lookup of some of their rows, which memcc trained under another name: "
            f"{told}. export cannot write a table back from the rows it looked up, so these "
            "parameters are not written: a module loaded with load_state_dict(..., "
            "strict=False) keeps its own values for them, and computes something else than "
            "the trained model (the exported ONNX model has the trained rows). To train "
            "and export them, export the model with torch.onnx.export(..., dynamo=True, "
            "optimize=False), or with dynamic shapes, and build and train that")


def export_weights(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray],
                   request: ExportRequest, *, source: str = "<step>",
                   warn: Callable[[str], None] | None = None) -> Path:
    """Write the forward model with ``state`` as its weights, or those weights alone, as
    ``request`` says; ``warn`` hears what an ONNX model keeps of train mode, or what
    ``eval_mode`` changed."""
    from memcc.backend.onnx_file import check_writable, save_model

    out, format, inputs = Path(request.output), request.format, request.inputs
    fmt = (format or ("safetensors" if out.suffix == ".safetensors" else "onnx")).lower()
    if fmt not in EXPORT_FORMATS:
        raise InputError(f"--format '{format}': choose one of {', '.join(EXPORT_FORMATS)}")
    if request.eval_mode and fmt != "onnx":
        raise InputError("--eval writes the ONNX model as inference runs it; a safetensors "
                         "file holds the weights and running statistics alone (PyTorch's "
                         "module.eval() does the rest): drop --eval, or write .onnx")
    check_writable(out, "the exported model", "--output/-o", inputs=inputs)
    notes: list[str] = []
    fwd = forward_graph(graph, spec, state, source=source, eval_mode=request.eval_mode,
                        notes=notes)
    if fmt == "onnx":
        model, fixed = _at_any_size(graph, spec, state, request, fwd)
        for note in [*notes, *([fixed] if fixed else [])]:
            if warn is not None:
                warn(note)
        return save_model(model, out)
    sources = spec.parameter_sources()
    weights: dict[str, np.ndarray] = {}
    for n in exported_weight_names(graph, spec, fwd):
        # Under every PyTorch name the value stands for (merged and tied parameters too),
        # so that a strict load_state_dict finds them all; a copy the exporter folded from
        # a parameter, through the inverse of its op under that parameter's name; else
        # under its own name. The value is the forward model's: ``state``'s for what the
        # step trains or carries, the step's own for what it keeps frozen (an inference-form
        # BatchNorm's statistics, which no checkpoint holds).
        src = sources.get(n, {})
        names, value = src.get("pytorch_names") or [n], np.asarray(fwd.initializers[n])
        if not src.get("pytorch_names") and src.get("copy_op") and \
                len(src.get("copy_of", ())) == 1:
            names, value = list(src["copy_of"]), undo_copy_op(src["copy_op"], value)
        for name in names:
            weights.setdefault(name, value)
    weights.update(_untrained_parameters(graph, spec, fwd, set(weights), warn))
    weights.update(_persistent_buffers(graph, fwd, state, set(weights), warn))
    return ckpt.write_safetensors(out, weights, {"format": "pt", "memcc.step_file": source})


def _untrained_parameters(graph: Graph, spec: TrainingStep, fwd: Graph, written: set[str],
                          warn: Callable[[str], None] | None) -> dict[str, np.ndarray]:
    """The model's parameters that the step does not train, with the values the forward
    model holds (those of the exported model): a second head off the loss path
    (torchvision's ``aux_classifier``, a two-head model's second output), or weights
    ``--freeze`` keeps fixed. Torch leaves them unchanged in such training too, and a
    strict ``load_state_dict`` wants them. Which initializers are parameters: with a dynamo
    export's graph signature, its ``PARAMETER`` names; without one (TorchScript), float
    initializers named by PyTorch, not by the exporter (``onnx::MatMul_12``,
    ``export_signature.is_made_up_name``), and not buffers known by name (a rotary
    ``inv_freq``, a BatchNorm's statistics: ``frontend.parameters.BUFFER_SUFFIXES``). A
    copy the exporter folded from such a parameter by a known op (a pre-transposed
    ``val_N``, recorded at build: ``memcc.untrained_copies``) is written back under the
    parameter's name through that op's inverse, as a trained copy is.
    ``warn`` hears of the written ones, and of a signature's parameters that are neither
    written nor said to be folded or unused (``memcc.folded_parameters``): no file holds
    their value (an exporter's copy of one off the loss path, under a made-up name)."""
    sig = signature_of(graph)
    trained = set(spec.parameters)
    kept: dict[str, np.ndarray] = {}
    for copy, src in spec.untrained_copies().items():  # a copy the exporter folded
        if copy in fwd.initializers and src.get("copy_of") not in written | set(kept):
            kept[str(src["copy_of"])] = undo_copy_op(str(src.get("copy_op", "")),
                                                    np.asarray(fwd.initializers[copy]))
    for name, value in fwd.initializers.items():
        if name in written or name in trained:
            continue
        a = np.asarray(value)
        if a.dtype.kind != "f" or a.ndim == 0:
            continue
        if (name in sig.parameters) if sig is not None else \
                (not is_made_up_name(name) and not name.endswith(BUFFER_SUFFIXES)):
            kept[name] = a
    if kept and warn is not None:
        names = sorted(kept)
        warn(f"{len(kept)} parameter(s) the step does not train (off the loss path, such as "
             f"a second head, or kept fixed by --freeze) are written with the values of the "
             "exported model, which training leaves unchanged, as torch does: "
             f"{', '.join(names[:6])}{' ...' if len(names) > 6 else ''}")
    if sig is not None and warn is not None:
        said = written | set(kept) | set(spec.folded_parameters())
        if gone := sorted(sig.parameters - said):
            warn(f"{len(gone)} PyTorch parameter(s) have no value in the step (the step "
                 "does not train them, and the exporter holds them under another name, or "
                 f"not at all): {', '.join(gone[:6])}{' ...' if len(gone) > 6 else ''}; they "
                 "are not written: load with load_state_dict(..., strict=False), and the "
                 "module keeps its own values")
    return kept


def _persistent_buffers(graph: Graph, fwd: Graph, state: Mapping[str, np.ndarray],
                        written: set[str], warn: Callable[[str], None] | None
                        ) -> dict[str, np.ndarray]:
    """The persistent buffers of a dynamo export (its graph signature's ``persistent=True``
    lines: in the module's ``state_dict``, so a strict load wants them) that the forward
    model holds, with the value it holds: constants memcc never trains (BART's
    ``final_logits_bias``); or that the step carries though the forward model does not
    read them (``spectral_norm``'s ``_u``, overwritten unread: ``buffer_updates``), with
    the value carried. ``warn`` hears of the others, which no file says the value of."""
    sig = signature_of(graph)
    names = sorted(sig.persistent_buffers - written) if sig is not None else []
    held = {n: np.asarray(fwd.initializers[n] if n in fwd.initializers else state[n])
            for n in names if n in fwd.initializers or n in state}
    # A BatchNorm's step counter is no state memcc keeps, and torch's BatchNorm loads a
    # state_dict without it, even strictly (it keeps its own): not worth a warning on every
    # convnet (snag 13 of session 38's walk-through).
    gone = [n for n in names if n not in held and not n.endswith(".num_batches_tracked")]
    if gone and warn is not None:
        warn(f"{len(gone)} persistent buffer(s) of the module are not in the step (the "
             f"exporter folded them into constants, or the model never reads them), e.g. "
             f"'{gone[0]}'; they are not written: load with load_state_dict(..., "
             "strict=False), and the module keeps its own values")
    return held


def _at_any_size(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray],
                 request: ExportRequest, fwd: Graph) -> tuple[onnx.ModelProto, str | None]:
    """The forward model with the named axes the user's model had, and what to say where it
    keeps the built sizes (``named_axes.with_named_axes``). First with row-chunked regions
    computed whole (``whole_rows.with_whole_rows``) and the exporter's shape computations
    that memcc folded put back (``fold.with_shape_computations``), which is what lets a
    transformer run at another batch or sequence; where that does not run at other sizes,
    ``fwd`` as it is (folded and chunked, at the built sizes)."""
    axes = recorded(graph.metadata)
    reason = OWN_REWRITE if has_fold_records(graph) else FOLDED_BEFORE
    if not axes:  # the user's model had fixed sizes: nothing to put back
        return fwd.to_model(), None
    # Dropouts back first: a chunk's Dropout records the chunk's names, renamed below.
    whole, regions = with_whole_rows(restore_dropouts(graph))
    unfolded, restored = with_shape_computations(whole)
    if restored or regions:
        try:
            model, fixed = with_named_axes(
                forward_graph(unfolded, spec, state, eval_mode=request.eval_mode).to_model(),
                axes, reason)
        except InputError:  # not a forward model any more: the step's own, below
            pass
        else:  # where it fails, why, said of the step's own forward (at the built sizes)
            return (model, None) if fixed is None else (fwd.to_model(), fixed)
    return with_named_axes(fwd.to_model(), axes, reason)


def made_up_names(spec: TrainingStep) -> list[str]:
    """Parameters whose names the exporter made up (``onnx::MatMul_12``, ``val_3``; recorded
    by ``memcc build``) and that export cannot write under a PyTorch name: a PyTorch
    ``load_state_dict`` will not find them. Rows looked up from a parameter (``rows_of``)
    are said apart, naming the parameter (``lookup_note``)."""
    return [p for p, src in spec.parameter_sources().items()
            if not src.get("named", True) and not src.get("copy_op")
            and not src.get("rows_of")]


def undo_copy_op(op: str, value: np.ndarray) -> np.ndarray:
    """The parameter a copy was made from by ``op`` (``ExportMap.copy_ops``): for
    ``Transpose(perm=p)``, the copy transposed by p's inverse."""
    perm = [int(d) for d in op.removeprefix("Transpose(perm=[").removesuffix("])").split(",")
            if d.strip().isdigit()] if op.startswith("Transpose(perm=[") else []
    if sorted(perm) != list(range(value.ndim)):
        raise InputError(f"cannot write a weight back through '{op}'; report it with the "
                         "model")
    return np.ascontiguousarray(np.transpose(value, np.argsort(perm)))


def exported_weight_names(graph: Graph, spec: TrainingStep, fwd: Graph) -> list[str]:
    """Parameters, other carried values the forward model reads, and BatchNorm statistics
    (carried in training mode, frozen in eval-mode exports: initializers of the step that
    no checkpoint holds); never optimizer state, which only update nodes read."""
    keep = set(spec.state.values()) | set(spec.parameters)
    keep |= {i for n in fwd.nodes if n.op_type == "BatchNormalization" for i in n.input[3:5]}
    return [n for n in fwd.initializers if n in keep]


def _with_projection(graph: Graph, spec: TrainingStep) -> Graph:
    """A step built with ``--loss-chunks`` never forms the logits; the forward model needs
    them, so the projection the chunks replaced is put back (a copy of the graph)."""
    import onnx

    proj = spec.loss_projection
    if not proj or proj["output"] in graph.def_use().producer:
        return graph
    out = graph.copy(with_index=False)
    name = proj["output"]
    if not proj.get("bias"):
        out.set_nodes([*out.nodes, onnx.helper.make_node(
            "MatMul", list(proj["inputs"]), [name], name=f"{name}.projection")])
        return out
    product = f"{name}.projection_product"
    out.set_nodes([*out.nodes,
                   onnx.helper.make_node("MatMul", list(proj["inputs"]), [product],
                                         name=f"{name}.projection"),
                   onnx.helper.make_node("Add", [product, proj["bias"]], [name],
                                         name=f"{name}.projection_bias")])
    return out


def forward_graph(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray], *,
                  source: str = "<step>", eval_mode: bool = False,
                  notes: list[str] | None = None) -> Graph:
    """The forward model inside a step: the nodes its outputs need, ``state`` as weights;
    with ``eval_mode`` as inference runs it. ``notes`` hears what train mode it keeps, or
    what ``eval_mode`` changed."""
    outputs = list(spec.forward_outputs)
    if not outputs:
        raise InputError(f"{source}: the step does not record its forward model's outputs "
                         "(memcc.forward_outputs, written by memcc build since this version)"
                         "; rebuild the step with memcc build to export it")
    # A rewritten Dropout goes back as the plain node (the counter is the step's alone).
    # A --precision bf16/fp16 step: the forward as exported, float32 (master weights).
    # A step compiled for CUDA: its BatchNorms as the model has them (batchnorm_back.py).
    graph = without_autocast(restore_dropouts(_with_projection(graph, spec)), keep=outputs)
    graph = fed_as_stored(training_batchnorms_back(graph, spec)[0])
    graph, note = inference_or_train_mode(graph, spec, outputs, eval_mode=eval_mode,
                                          source=source)
    if note and notes is not None:
        notes.append(note)
    du = graph.def_use()
    stored = set(graph.initializers) | set(state)
    reached, values = ancestors(outputs, du.producer)
    for v in values:
        if v not in du.producer and v not in stored and v not in graph.inputs:
            raise InputError(
                f"{source}: '{v}', which the forward model's outputs "
                f"({', '.join(outputs)}) read, is neither computed nor stored in the step, so "
                "the forward model cannot be written; rebuild the step with this memcc "
                "(memcc build or compile of the forward model), and if that fails too, "
                "report it with the model")
    needed = {id(n) for n in reached}
    import onnx

    nodes = []
    for n in graph.nodes:
        if id(n) in needed:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            keep = [p for p in c.metadata_props if not p.key.startswith("memcc.")]
            del c.metadata_props[:]
            c.metadata_props.extend(keep)
            nodes.append(c)
    used = {i for n in nodes for i in n.input if i} | set(outputs)
    _rename_running_outputs(nodes, used)
    produced = {o for n in nodes for o in n.output if o}
    values = used | produced
    # Carried values come from ``state`` (a Trainer drops their initial values).
    names = dict.fromkeys([*graph.inputs, *graph.initializers])
    inits = {n: np.asarray(state[n] if n in state else graph.initializers[n])
             for n in names if n in used and (n in state or n in graph.initializers)}
    inputs = [i for i in graph.inputs if i in used and i not in inits]
    return Graph(
        nodes=nodes, inputs=inputs, outputs=outputs, initializers=inits,
        info={k: v for k, v in graph.info.items() if k in values},
        opsets=dict(graph.opsets),
        # Whose BatchNorm semantics a step built again from this model follows.
        metadata={k: v for k, v in graph.metadata.items()
                  if not k.startswith("memcc.") or k == PRODUCER_KEY},
        name=graph.name,
    )


def _rename_running_outputs(nodes: list, used: set[str]) -> None:
    """A training-mode BatchNorm's running-statistics outputs, unread in the forward model,
    renamed ``Y.running_mean`` / ``Y.running_var`` after its output ``Y``: the step named them
    ``stat.new``, the name a step built again from this model gives them, which would then
    be taken (and ORT's shape inference wants all three outputs in training mode)."""
    for n in nodes:
        if n.op_type != "BatchNormalization":
            continue
        for k, what in ((1, "running_mean"), (2, "running_var")):
            if k < len(n.output) and n.output[k] and n.output[k] not in used:
                n.output[k] = f"{n.output[0]}.{what}"


# ---------------------------------------------------------------------------- memcc train
