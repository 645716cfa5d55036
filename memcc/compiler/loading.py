"""Compile's first stage, ``load``, and the provider check before it.

In: the model (a path or an ``onnx.ModelProto``) and ``CompileOptions``. Out: the training
step as the provider runs it (a ``Graph``) and the ``load`` pass's summary (model, whether
the step was built here, nodes, parameters, row chunks, splittable sites, BatchNorms
rewritten for CUDA, fusions). ``check_provider`` refuses, or warns about, ``--provider
cuda`` where CUDA is missing, before any work.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from memcc.compiler.options import CompileOptions
from memcc.compiler.progress import Progress
from memcc.errors import InputError
from memcc.frontend.batch_chunks import BATCH, splittable_stems
from memcc.frontend.build import BuildOptions, build_training_step, is_training_step
from memcc.frontend.chunked_loss import projection_of
from memcc.frontend.export_signature import ExportNote, ExportWarning
from memcc.frontend.fuse import fuse_step
from memcc.frontend.load import load_graph
from memcc.frontend.loss import first_float_output, moves_classes
from memcc.frontend.row_chunks import ATTENTION, MLP, find_regions
from memcc.frontend.weights_apart import own_weights
from memcc.graph import Graph
from memcc.pass_contract import Pass, PassRunner
from memcc.passes.providers.provider_step import for_provider
from memcc.step import FUSIONS_KEY, PRECISION_KEY, TrainingStep

# The loss as a row-chunk site (compiler/chunk_choice.py counts it with the others).
LOSS = "loss"


def loss_sites(forward: Graph, build: BuildOptions) -> int:
    """1 where ``--loss-chunks`` could split ``forward``'s loss (a cross-entropy over the
    logits of a vocabulary projection), else 0. 0 with ``--ignore-index``: the chunked loss
    averages over every position, so a build with it is never given loss chunks."""
    if build.loss != "cross-entropy" or forward.opset < 16 or build.ignore_index is not None:
        return 0
    try:
        logits = first_float_output(forward, "")
    except InputError:
        return 0
    if moves_classes(build.class_axis, len(forward.info[logits].shape)):
        return 0      # the classes are moved last by a Transpose: no projection to split
    return int(projection_of(forward, logits) is not None)


def check_provider(options: CompileOptions, warning: Progress) -> str | None:
    """``--provider cuda`` without CUDA: an error where the user asked for something only
    CUDA can do (``--cost measured``), a visible warning where memcc would otherwise quietly
    estimate instead of measuring (``--cost auto``) or check less (``--verify``: the
    numbers on the CPU, no device peak). Returns why CUDA is missing, or None."""
    if options.provider != "cuda":
        return None
    from memcc.backend.session import cuda_unavailable_reason

    reason = cuda_unavailable_reason()
    if reason is None:
        return None
    if options.verify:
        warning(f"--verify --provider cuda: CUDA is not available here ({reason}): the "
                "plan's outputs are compared with the step as built on the CPU provider, "
                "and its device peak is not measured; run the compile where CUDA works "
                "to check that too")
    if options.cost == "measured":
        raise InputError(f"--cost measured --provider cuda: CUDA is not available: {reason}. "
                         "Use --cost analytic to plan for CUDA with estimated node times, or "
                         "run on the GPU machine. Nothing was compiled.")
    if options.cost == "auto":
        from memcc.passes.analysis.cuda_node_times import default_calibration

        cal = default_calibration()
        basis = (f"node times measured on a GPU ({cal.gpu}, onnxruntime {cal.onnxruntime}, "
                 f"{cal.date}; {Path(cal.path or '').name})" if cal is not None else
                 "nominal GPU rates (no CUDA calibration ships with this memcc)")
        warning("--provider cuda: CUDA is not available, so node times are estimated from "
                f"{basis} instead of measured: the predicted added time is an estimate "
                "(--cost analytic says so and silences this warning). Why: "
                f"{reason}.")
    return reason


def read_once(model: str | os.PathLike | onnx.ModelProto, label: str, options: CompileOptions,
              mapped: bool, kept: dict | None) -> Graph:
    """``load_graph``'s graph of ``model``; with ``kept`` (one compile's), a forward model
    read once for all its builds (each row-chunk setting builds it again, and reading it
    again, its ORT run for shapes included, was 3-5 s of a 124M GPT-2's compile). The
    build copies the graph it is given, so the one kept stays as read; its weights may be
    views into the file (``mapped``): a step built from it owns them unless ``mapped``."""
    key = (str(model), tuple(sorted(options.dims.items()))) \
        if kept is not None and isinstance(model, (str, os.PathLike)) else None
    if key in (kept or {}):
        return kept[key]
    graph = load_graph(model, options.dims, source=label, mapped=mapped)
    if key is not None and not is_training_step(graph):
        kept[key] = graph
    return graph


def load_step(model: str | os.PathLike | onnx.ModelProto, label: str,
              options: CompileOptions, *, mapped: bool = False,
              kept: dict | None = None) -> tuple[Graph, dict]:
    """The ``load`` stage: the model read (``frontend.load``), built into a training step
    when it is a forward model, fused when an older memcc built it, and rewritten for the
    provider; with the ``load`` pass's summary. ``mapped``: the file's weights stay views
    into it (``load_graph``; the caller owns them before the file could change). ``kept``:
    the forward models this compile read (``read_once``)."""
    graph = read_once(model, label, options, mapped, kept)
    built = False
    splittable: dict[str, int] = {}
    rows: dict[str, int] = {}  # the most rows a region of each kind has
    rewrites = PassRunner()  # the step's graph-to-graph rewrites (their reports stay here)
    if not is_training_step(graph):
        # What row chunks could split that this build leaves whole (a hint if nothing fits).
        for kind, k in ((ATTENTION, options.build.attention_chunks),
                        (MLP, options.build.mlp_chunks)):
            if (k or 1) == 1 and (regions := find_regions(graph, kind)):
                splittable[kind] = len(regions)
                rows[kind] = max(r.rows for r in regions)
        if (options.build.loss_chunks or 1) == 1 and loss_sites(graph, options.build):
            splittable[LOSS] = 1
        if (options.build.batch_chunks or 1) == 1 and (n := splittable_stems(graph)):
            splittable[BATCH] = n
        graph = build_training_step(graph, options.build, source=label)
        built = True
        if not mapped:
            own_weights(graph)   # where the forward model kept holds views into the file
    elif FUSIONS_KEY not in graph.metadata:
        # A step built before memcc fused its steps: fused here, as build would have.
        graph = rewrites.apply(Pass("fuse", fuse_step), graph)
    graph = rewrites.apply(Pass("for-provider", lambda g: for_provider(g, options.provider)),
                           graph)
    rewritten_for_cuda = rewrites.reports[-1].summary["batchnorm_rewritten"]
    emulated = rewrites.reports[-1].summary.get("sixteen_bit_emulated")
    as_patches = rewrites.reports[-1].summary.get("conv_weight_grads_as_patches")
    patch_bytes = rewrites.reports[-1].summary.get("patch_bytes_max")
    concats_split = rewrites.reports[-1].summary.get("concats_split")
    step = TrainingStep.of(graph)
    params = step.parameters
    return graph, {
        "model": label, "built_training_step": built, "nodes": len(graph.nodes),
        "parameters": len(params),
        "parameter_bytes": int(sum(graph.info[p].nbytes for p in params)),
        # Attentions / MLPs over row chunks (memcc build --attention-chunks/--mlp-chunks).
        **({"row_chunks": step.row_chunks} if step.row_chunks else {}),
        **({"splittable": splittable} if splittable else {}),
        # More chunks than rows split no further (row_chunks clips them): compile's
        # settings are clipped the same way, so that none is planned twice.
        **({"splittable_rows": rows} if rows else {}),
        # Training-mode BatchNorms written as the CUDA provider runs them
        # (passes/providers/batchnorm_for_cuda.py).
        **({"batchnorm_rewritten": rewritten_for_cuda} if rewritten_for_cuda else {}),
        # Convolution weight gradients as a MatMul over patches on CUDA, and the largest
        # chunk's patches (passes/providers/conv_weight_grad_cuda.py).
        **({"conv_weight_grads_as_patches": as_patches, "patch_bytes_max": patch_bytes}
           if as_patches else {}),
        # Concats of more than 32 inputs nested, so that a CUDA graph captures them
        # (passes/providers/concat_for_cuda_graphs.py).
        **({"concats_split": concats_split} if concats_split else {}),
        # --precision bf16/fp16: what autocast did (memcc.precision), and the ops this
        # provider has no 16-bit kernel for, computed in float32 between casts
        # (passes/providers/sixteen_bit.py).
        **({"precision": json.loads(graph.metadata[PRECISION_KEY])}
           if PRECISION_KEY in graph.metadata else {}),
        **({"sixteen_bit_emulated": emulated} if emulated else {}),
        # memcc's fusions (frontend/fuse.py), as build recorded them.
        **({"fusions": json.loads(graph.metadata[FUSIONS_KEY])}
           if FUSIONS_KEY in graph.metadata else {}),
    }


@dataclass
class EarlierLoads:
    """What one compile's loads of its model share (it builds a forward model again for
    each row-chunk setting it plans): the messages said (``load_step_warned``) and the
    forward model as read (``read_once``)."""

    said: set[str] = field(default_factory=set)
    kept: dict = field(default_factory=dict)


def load_step_warned(model: str | os.PathLike | onnx.ModelProto, label: str,
                     options: CompileOptions, warning: Callable[[str], None], *,
                     mapped: bool = False, earlier: EarlierLoads | None = None
                     ) -> tuple[Graph, dict]:
    """``load_step``, its build's warnings about the export (``ExportWarning``: made-up
    names, merged or folded parameters) said through ``warning``, so that they are in the
    report's and analyze's ``warnings`` like every other thing said on stderr (they went to
    stderr only, as Python warnings). Notes and other warnings go on as they came.

    ``earlier``: what earlier loads of the same model left (compile builds a forward model
    once per row-chunk setting it plans): the messages they said are not said again, and
    this load's are added to them, so that a compile names each folded parameter or
    made-up name once; the forward model they read is read no more (``read_once``).
    Said again means the same up to counts and quoted names: a row-chunk setting's build
    finds the same idle Dropouts as 8 chunk copies (``'.../Dropout/r0'``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        out = load_step(model, label, options, mapped=mapped,
                        kept=earlier.kept if earlier is not None else None)
    said = earlier.said if earlier is not None else None
    earlier_said = set(said or ())
    for w in caught:
        if said is not None:
            if _gist(str(w.message)) in earlier_said:
                continue
            said.add(_gist(str(w.message)))
        if issubclass(w.category, ExportWarning) and not issubclass(w.category, ExportNote):
            warning(str(w.message))
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


def _gist(message: str) -> str:
    """``message`` without its counts and quoted names."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'_'", message))
