"""Load an ONNX file into a ``Graph`` in which every value has a concrete shape and dtype.

Exporters leave batch and sequence dimensions symbolic and compute shapes at run time
(Shape -> Gather -> Concat -> Reshape). memcc plans memory ahead of time, so it binds every
symbolic dimension (``--dim NAME=INT``), runs ONNX shape inference with data propagation,
and, where inference still gives up, evaluates the model once in ORT to read the remaining
shapes. A value whose shape stays unknown is an error that names it.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from onnx import TensorProto, helper, shape_inference

from memcc.errors import InputError, ShapeError
from memcc.frontend.batchnorm_opset13 import lift_training_batchnorm
from memcc.frontend.canonicalize import (
    canonicalize,
    needs_canonicalizing,
    seed_dropouts,
    shapes_needed,
)
from memcc.frontend.cast_chains import drop_cast_chains
from memcc.frontend.conv3d_bias import drop_zero_conv3d_bias
from memcc.frontend.deduplicated import kept_tied, untie_deduplicated
from memcc.frontend.dropout_masks import upgrade_step
from memcc.frontend.export_map import EXPORT_MAP_KEY, read_export_map
from memcc.frontend.export_signature import (
    SIGNATURE_KEY,
    ExportNote,
    ExportWarning,
    read_signature,
)
from memcc.frontend.fold import fold_shape_computations
from memcc.frontend.folded_values import folded_values_as_torch_has_them
from memcc.frontend.function_ops import expand_function_ops
from memcc.frontend.model_types import refuse_unloadable_types, refuse_unrunnable_sixteen_bit
from memcc.frontend.ort_kernels import inlined_by_ort
from memcc.frontend.running_variance import PRODUCER_KEY
from memcc.frontend.sequences import EMBEDDING_BAG, embedding_bag_hint
from memcc.frontend.symbolic_dims import SYMBOLIC_DIMS_KEY, symbolic_dims_of
from memcc.frontend.weights_apart import STUB_BYTES, Arrays, own_weights, read_apart, with_weights
from memcc.graph import Graph, TensorInfo, node_label
from memcc.pass_contract import Pass, PassRunner
from memcc.step import KIND_KEY, TRAINING_STEP

_CANONICAL_ROUNDS = 4


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse an ONNX file (with its external data), with errors that say what to do."""
    p = _existing(path)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:
        raise InputError(
            f"{p}: not an ONNX model ({type(exc).__name__}). Pass a file written by "
            "onnx.save or torch.onnx.export."
        ) from exc
    _check_read(model, p)
    return model


def read_model_apart(path: str | os.PathLike) -> tuple[onnx.ModelProto, Arrays]:
    """``read_model``, with the large float weights left in the file: stubs in the model,
    their values views into the mapped file (``frontend/weights_apart.py``); the whole
    file parsed where that reader cannot read it."""
    p = _existing(path)
    apart = read_apart(p)
    if apart is None:
        return read_model(p), {}
    _check_read(apart[0], p)
    return apart


def _existing(path: str | os.PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise InputError(f"{p}: no such file")
    if p.is_dir():
        raise InputError(f"{p}: is a directory, expected an .onnx file")
    return p


def _check_read(model: onnx.ModelProto, p: Path) -> None:
    """A parsed file holds a graph; its external data is read (in place)."""
    if not model.graph.node and not model.graph.output:
        raise InputError(f"{p}: not an ONNX model (the file parsed but holds no graph)")
    try:
        onnx.load_external_data_for_model(model, str(p.parent))
    except Exception as exc:
        hint = (" onnx reads no external data through a symbolic link: copy the data file "
                "next to the model instead of linking it." if "symbolic link" in str(exc)
                else "")
        raise InputError(f"{p}: cannot read its external data next to the file: {exc}{hint}"
                         ) from exc


def parse_dims(items: list[str] | None) -> dict[str, int]:
    """``["batch=8", "seq=128"]`` -> ``{"batch": 8, "seq": 128}``."""
    dims: dict[str, int] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise InputError(f"--dim '{item}': expected NAME=INT, e.g. --dim batch=8")
        try:
            v = int(value)
        except ValueError:
            raise InputError(f"--dim '{item}': '{value}' is not an integer") from None
        if v <= 0:
            raise InputError(f"--dim '{item}': a dimension must be positive")
        if dims.get(name.strip(), v) != v:
            raise InputError(f"--dim {name.strip()} is given twice ({dims[name.strip()]} and "
                             f"{v}); give it once")
        dims[name.strip()] = v
    return dims


def load_graph(
    path_or_model: str | os.PathLike | onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    *,
    source: str | None = None,
    mapped: bool = False,
    weights: Arrays | None = None,
) -> Graph:
    """Read, bind symbolic dimensions, infer every shape; return a static ``Graph``.

    A file's large float weights are read once, as the graph takes them; with ``mapped``,
    not even that: they stay views into the mapped file, read when something reads them
    (compile's refusal of a budget under the step's floor reads none). The caller then
    calls ``weights_apart.own_weights`` before the file could change. ``weights``: the
    values of the stubs of a model given as a ``ModelProto`` (``read_model_apart``'s; the
    graph holds these very arrays, mapped or not, and owns mapped ones unless ``mapped``)."""
    arrays: Arrays = dict(weights or {})  # a copy: the folded copies' check adds to it
    if isinstance(path_or_model, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(path_or_model)
        where = source or "<model>"
    else:
        model, arrays = read_model_apart(path_or_model)
        where = source or str(path_or_model)
    _untie(model, arrays, where)
    export_map = read_export_map(model)  # from the file as written, before any rewrite
    if export_map is not None:  # folded copies of a parameter: computed from it again
        export_map = folded_values_as_torch_has_them(model, export_map, arrays, where)
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    lift_training_batchnorm(model, where)  # opset 13's training BatchNorm: opset 14's form
    drop_zero_conv3d_bias(model)  # dynamo's [M, 2] zero bias of a Conv3d: ORT refuses it
    symbolic = symbolic_dims_of(model)  # before binding: the exported model's own axes
    _bind_input_dims(model, dict(dims or {}), where)
    model = _infer(model, where)
    expanded = expand_function_ops(model, _differentiable_as_is() - _inlined_by_ort(model))
    if expanded is not None:
        model = _infer(expanded, where)
    for _ in range(_CANONICAL_ROUNDS):  # a folded If may uncover another
        if not needs_canonicalizing(model):
            break
        unknown = shapes_needed(model)
        if unknown:
            _add_types_by_running(model, unknown, arrays)
        model, canonical = canonicalize(model, where)
        if not canonical["changed"]:
            break
        model = _infer(model, where)
    _check_supported_structure(model, where)
    graph = Graph.from_model(model, weights=arrays)
    if symbolic:  # memcc export writes the forward model with them again
        graph.metadata.setdefault(SYMBOLIC_DIMS_KEY, json.dumps(symbolic))
    if model.producer_name:  # whose BatchNorm semantics the step follows
        graph.metadata.setdefault(PRODUCER_KEY, model.producer_name)
    signature = read_signature(model)
    if signature is not None:  # the builder reads which initializers are torch buffers
        graph.metadata[SIGNATURE_KEY] = signature.to_json()
    if export_map is not None:  # ... and which PyTorch parameters each initializer holds
        graph.metadata[EXPORT_MAP_KEY] = export_map.to_json()
    name_nodes(graph)
    seed_dropouts(graph.nodes)
    if graph.metadata.get(KIND_KEY) == TRAINING_STEP:   # built before counter-based masks
        upgrade_step(graph)
    missing = _unknown_values(graph)
    failed = None
    if missing:
        failed = _shapes_by_running(model, graph, missing, arrays)
        missing = _unknown_values(graph)
    if missing:
        _refuse_unknown_shapes(graph, missing, failed, where)
    graph = PassRunner().run((Pass("fold", fold_shape_computations),
                              Pass("cast-chains", drop_cast_chains)), graph)
    if not mapped:
        own_weights(graph)
    return graph


def _untie(model: onnx.ModelProto, arrays: Arrays, where: str) -> None:
    """Parameters TorchScript's eval-mode export stored once for their equal fresh values
    get their own initializers again (``frontend/deduplicated.py``), with a note; those of
    other equal values stay tied, with a warning."""
    untied = untie_deduplicated(model, arrays)
    if untied:
        shown = ", ".join(untied[:4]) + (f" (+{len(untied) - 4} more)" if len(untied) > 4
                                         else "")
        warnings.warn(
            f"{where}: {len(untied)} parameter(s) and buffer(s) the exporter stored as "
            "copies of another that held the same constant value at export (TorchScript's "
            f"eval-mode deduplication of fresh weights): {shown}. memcc gives each its own "
            "initializer again: they train apart, as in torch.", ExportNote, stacklevel=3)
    tied = kept_tied(model, arrays)
    if tied:
        shown = "; ".join(f"{c} -> {p}" for c, p in tied[:4]) + (
            f" (+{len(tied) - 4} more)" if len(tied) > 4 else "")
        warnings.warn(
            f"{where}: {len(tied)} parameter(s) the exporter stored as copies of another that "
            f"held the same values at export (TorchScript's eval-mode deduplication): {shown}. "
            "memcc trains each group as one tied parameter, as torch does where they share "
            "storage; layers deep-copied at construction (nn.TransformerEncoder's and "
            "nn.TransformerDecoder's layers, copy.deepcopy) torch trains apart, and this step "
            "would not. Export with training=torch.onnx.TrainingMode.TRAINING, or with "
            "dynamo=True, optimize=False, to keep them apart.", ExportWarning, stacklevel=3)


def _differentiable_as_is() -> frozenset[str]:
    """Op types kept as they are: those with a gradient rule or never differentiated."""
    from memcc.frontend.gradients import load_rules
    from memcc.frontend.gradients.registry import NON_DIFFERENTIABLE, RULES

    load_rules()
    return frozenset(RULES) | frozenset(NON_DIFFERENTIABLE)


def _inlined_by_ort(model: onnx.ModelProto) -> frozenset[str]:
    """The model's ops that ORT has no kernel for and runs as their ONNX function body:
    memcc expands them itself, even those it has a gradient rule for, so that it plans the
    nodes ORT runs (``frontend.ort_kernels``)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    ops = {n.op_type for n in model.graph.node if n.domain in ("", "ai.onnx")}
    return inlined_by_ort(ops, opset)


def name_nodes(graph: Graph) -> None:
    """Give every node a unique name: profiling, plans and reports refer to nodes by name."""
    seen: set[str] = set()
    for i, node in enumerate(graph.nodes):
        if not node.name or node.name in seen:
            base = node.name or f"{node.op_type}_{i}"
            name, k = base, 0
            while name in seen:
                k += 1
                name = f"{base}__{k}"
            node.name = name
        seen.add(node.name)


def _check_supported_structure(model: onnx.ModelProto, where: str) -> None:
    for node in model.graph.node:
        for a in node.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                what = ("its condition depends on the input data, not only on shapes"
                        if node.op_type == "If" else "memcc handles graphs without loops")
                hint = embedding_bag_hint(node) or (
                    f"A Loop may also come from {EMBEDDING_BAG}"
                    if node.op_type == "Loop" else "")
                raise InputError(
                    f"{where}: {node_label(node)} holds a subgraph and {what}. memcc folds "
                    "an If whose condition is fixed once dimensions are bound; export the "
                    "model without data-dependent control flow (no torch.cond, no scripted "
                    "loops)." + (f" {hint}" if hint else "")
                )


def _bind_input_dims(model: onnx.ModelProto, dims: dict[str, int], where: str) -> None:
    inits = {t.name for t in model.graph.initializer}
    unbound: dict[str, list[str]] = {}
    used: set[str] = set()
    # Named before binding: binding clears them, and the message below lists them.
    known = sorted({d.dim_param for vi in model.graph.input if vi.name not in inits
                    for d in vi.type.tensor_type.shape.dim if d.dim_param})
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        if not tt.HasField("shape"):
            raise ShapeError(f"{where}: graph input '{vi.name}' has no shape (not even a rank)")
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                continue
            key = d.dim_param if d.HasField("dim_param") and d.dim_param else None
            if key is not None and key in dims:
                d.Clear()
                d.dim_value = dims[key]
                used.add(key)
            else:
                unbound.setdefault(key or f"{vi.name}[{i}]", []).append(vi.name)
    extra = set(dims) - used
    if unbound:
        parts = [f"'{k}' (in {', '.join(sorted(set(v)))})" for k, v in unbound.items()]
        hint = " ".join(f"--dim {k}=INT" for k in unbound if "[" not in k)
        # A misspelt --dim (bach=4) leaves its dimension unbound: name it.
        typo = (f" (--dim {', '.join(sorted(extra))} names none of this model's "
                "dimensions)") if extra else ""
        raise ShapeError(
            f"{where}: unbound symbolic dimension(s): {'; '.join(parts)}{typo}. memcc plans "
            f"with concrete sizes: bind each one, e.g. {hint or '--dim NAME=INT'}."
        )
    if extra:
        raise InputError(
            f"{where}: --dim names no symbolic dimension of this model: {sorted(extra)}; "
            + (f"its symbolic dimensions are {known}" if known else
               "it has none (every size is fixed in the file), so drop --dim; to train at "
               "other sizes, export the model with dynamic axes")
        )


def _infer(model: onnx.ModelProto, where: str) -> onnx.ModelProto:
    # Drop shapes written by the exporter: they carry symbolic dims that now conflict.
    del model.graph.value_info[:]
    for vi in model.graph.output:
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            tt.ClearField("shape")
    light = _without_weights(model)
    try:
        inferred = shape_inference.infer_shapes(light, strict_mode=False, data_prop=True)
    except Exception as exc:
        raise ShapeError(f"{where}: ONNX shape inference failed: {exc}") from exc
    # What inference adds: value types, the outputs' types (and those inside functions).
    for name in ("value_info", "output"):
        field_ = getattr(model.graph, name)
        del field_[:]
        field_.extend(getattr(inferred.graph, name))
    del model.functions[:]
    model.functions.extend(inferred.functions)
    return model


# Float initializers at least this large go to shape inference as stubs (name, type, dims,
# no data): inference reads a tensor's values only to compute shapes (Reshape targets,
# Resize scales: small tensors), and serializing the weights for it took seconds on a
# GPT-2-size model, every time the loader inferred shapes. A file's are stubs already
# (``frontend/weights_apart.py``, the same size): they stay stubs, marked external.
_STUB_BYTES = STUB_BYTES
_FLOAT_BYTES = {TensorProto.FLOAT: 4, TensorProto.DOUBLE: 8, TensorProto.FLOAT16: 2,
                TensorProto.BFLOAT16: 2}


def _without_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its large float initializers as stubs marked external (inference
    neither reads nor needs their data), everything else copied."""
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    for fd, value in model.graph.ListFields():
        if fd.name != "initializer":
            _copy_field(light.graph, fd, value)
    for t in model.graph.initializer:
        size = _FLOAT_BYTES.get(t.data_type, 0) * int(np.prod(t.dims, dtype=np.int64))
        if size < _STUB_BYTES or t.data_location == TensorProto.EXTERNAL:
            light.graph.initializer.add().CopyFrom(t)
            continue
        stub = light.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims,
                                           data_location=TensorProto.EXTERNAL)
        stub.external_data.add(key="location", value="memcc-shape-inference-stub")
    return light


def _copy_field(dest: Message, fd: FieldDescriptor, value: object) -> None:
    """Copy one set field into ``dest`` (protobuf has no copy of all fields but one)."""
    if isinstance(value, Message):
        getattr(dest, fd.name).CopyFrom(value)
    elif isinstance(value, (str, bytes, int, float)):
        setattr(dest, fd.name, value)
    else:  # a repeated field
        getattr(dest, fd.name).extend(value)


def _refuse_unknown_shapes(graph: Graph, missing: list[str], failed: str | None,
                           where: str) -> None:
    """The ``ShapeError`` for values without a shape: where the run that reads them failed
    at the bound sizes (``failed``: ORT's reason), that reason and the sizes to check."""
    name = missing[0]
    producer = graph.producers().get(name)
    at = f" (output of {node_label(producer)})" if producer is not None else ""
    if failed:  # ORT's reason may be a type the file's op does not take: say that first
        refuse_unloadable_types(graph, where)
        refuse_unrunnable_sixteen_bit(graph, failed, where)
        raise ShapeError(
            f"{where}: value '{name}'{at} has no concrete shape from ONNX shape inference "
            f"({len(missing)} value(s) unknown), and running the model once at the bound "
            f"sizes to read them failed: {failed}. Check the sizes bound with --dim against "
            "what the model supports (a sequence longer than its position embeddings fails "
            "this way).")
    raise ShapeError(
        f"{where}: value '{name}'{at} has no concrete shape although every symbolic "
        f"input dimension is bound ({len(missing)} value(s) unknown): neither ONNX shape "
        "inference nor a run in ONNX Runtime could fix it, so it depends on the input "
        "data or is not a plain tensor. memcc plans static shapes: export the model so "
        "that this value's shape follows from the input shapes.")


def _unknown_values(graph: Graph) -> list[str]:
    return [v for v in graph.values() if v not in graph.info]


def _shapes_by_running(model: onnx.ModelProto, graph: Graph, missing: list[str],
                       arrays: Arrays) -> str | None:
    """Run the forward graph once on dummy inputs and read the shapes inference missed;
    why the run failed, None where it ran."""
    found, failed = _run_for_types(model, missing, arrays)
    for name, (dtype, shape) in found.items():
        graph.info[name] = TensorInfo(dtype, shape)
    return failed


def _add_types_by_running(model: onnx.ModelProto, names: list[str], arrays: Arrays) -> None:
    """Record in ``model.graph.value_info`` the types ORT computes for ``names``: the
    load-time rewrites need shapes that inference leaves unknown (data-dependent Reshape
    targets in front of a SplitToSequence)."""
    for name, (dtype, shape) in _run_for_types(model, names, arrays)[0].items():
        model.graph.value_info.append(helper.make_tensor_value_info(name, dtype, shape))


def _run_for_types(model: onnx.ModelProto, names: list[str], arrays: Arrays
                   ) -> tuple[dict[str, tuple[int, tuple[int, ...]]], str | None]:
    """Run the model once in ORT on zero inputs; return (dtype, shape) of the tensors
    ``names`` that it produced, and why the run failed (None where it ran; nothing found
    then: the caller reports). ORT's own log stays quiet: the reason is in the error."""

    m = with_weights(model, arrays)  # a copy, its stubs filled
    # ORT plans buffers by the shapes recorded in value_info: one that inference merged
    # wrongly (a SequenceAt of unequal parts, timm's EfficientViT-M0 by dynamo) fails the
    # run ("Shape mismatch attempting to re-use buffer"); ORT infers what it needs itself.
    del m.graph.value_info[:]
    existing = {o.name for o in m.graph.output}
    for name in names:
        if name not in existing:
            m.graph.output.append(helper.make_empty_tensor_value_info(name))
    m.ir_version = min(m.ir_version, 10)
    inits = {t.name for t in m.graph.initializer}
    feeds = {}
    for vi in m.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value for d in tt.shape.dim]
        if not tt.elem_type or any(d <= 0 for d in dims):
            return {}, None
        feeds[vi.name] = np.zeros(dims, dtype=helper.tensor_dtype_to_np_dtype(tt.elem_type))
    try:
        out_names, results = run_quietly(m, feeds)
    except Exception as exc:  # ORT's message: the node and what it refused
        return {}, ort_reason(exc)
    wanted = set(names)
    found: dict[str, tuple[int, tuple[int, ...]]] = {}
    for name, arr in zip(out_names, results, strict=True):
        if name in wanted and isinstance(arr, np.ndarray):
            dtype = (helper.np_dtype_to_tensor_dtype(arr.dtype)
                     if arr.dtype != np.bool_ else TensorProto.BOOL)
            found[name] = (dtype, tuple(int(d) for d in arr.shape))
    return found, None


def run_quietly(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
                ) -> tuple[list[str], list]:
    """Every output of ``model`` on ``feeds`` in a CPU session with ORT's logging off (a
    failure is an answer to the caller, raised, not an error line on stderr) and its graph
    optimizations off."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    run = ort.RunOptions()
    run.log_severity_level = 4
    sess = ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return names, sess.run(names, dict(feeds), run)


def ort_reason(exc: Exception) -> str:
    """ORT's error without its prefixes: "Non-zero status code returned while running
    Gather node. Name:'x' Status Message: indices element out of data bounds, ..."."""
    text = " ".join(str(exc).split())
    return re.sub(r"^\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*\w+\s*:\s*", "", text)[:400]
