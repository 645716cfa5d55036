"""Turn a forward model into one complete training step in standard ONNX ops.

The step takes the data (and labels), the parameters and the optimizer state as graph
inputs, and returns the loss plus everything that must be carried to the next step
(updated parameters, optimizer state, BatchNormalization running statistics). Parameters
and state are graph inputs whose initial values ship in the file as initializers of the
same name, so one file is both the program and its starting point. The metadata written
here (``memcc.*`` keys) is the contract the runner and the planner read.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from memcc.errors import InputError
from memcc.frontend.autodiff import differentiable_values, differentiate
from memcc.frontend.chunked_loss import ChunkedLoss, emit_chunked_loss
from memcc.frontend.dropout_masks import add_counter, counter_dropouts
from memcc.frontend.emit import Emitter
from memcc.frontend.exported import (
    EXPORT_MAP_KEY,
    export_map_of,
    parameter_sources,
    report_parameters,
    restore_training_batchnorm,
    signature_of,
)
from memcc.frontend.fuse import RULES as FUSION_RULES
from memcc.frontend.fuse import fuse_step
from memcc.frontend.row_chunks import ATTENTION, MLP, chunk_regions
from memcc.graph import Graph, TensorInfo, attr, node_label
from memcc.step import (  # the contract's keys live with its one reader, memcc.step
    DATA_KEY,
    FOLDED_PARAMS_KEY,
    FORWARD_OUTPUTS_KEY,
    GRADIENTS_KEY,
    INT_RANGES_KEY,
    KIND_KEY,
    LOSS_KEY,
    OPTIMIZER_KEY,
    PARAM_SOURCES_KEY,
    PARAMS_KEY,
    PROJECTION_KEY,
    ROW_CHUNKS_KEY,
    STATE_KEY,
    Role,
    record_rule_io,
    rule_io,
    tag_node,
)

__all__ = [
    "DATA_KEY", "INT_RANGES_KEY", "KIND_KEY", "LOSS_KEY", "OPTIMIZER_KEY", "PARAMS_KEY",
    "STATE_KEY", "BuildOptions", "build_training_step", "is_training_step",
]

LOSSES = ("cross-entropy", "mse", "none")
OPTIMIZERS = ("none", "sgd", "adamw")
DEFAULT_LR = {"none": 0.0, "sgd": 0.01, "adamw": 1e-3}

# torch buffers that exporters store as float initializers (never parameters).
BUFFER_SUFFIXES = ("inv_freq", "running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class BuildOptions:
    """What kind of step to build; the CLI fills this from ``memcc build`` flags."""

    loss: str = "cross-entropy"
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # fnmatch patterns over initializer names: parameters kept fixed (no gradient built)
    freeze: tuple[str, ...] = ()
    # > 1: cross-entropy and the vocabulary projection over that many row chunks, each
    # chunk's gradient taken right away (frontend/chunked_loss.py)
    loss_chunks: int | None = None
    # > 1: every attention's scores and probabilities, every MLP's hidden activations, over
    # that many row chunks (frontend/row_chunks.py)
    attention_chunks: int | None = None
    mlp_chunks: int | None = None
    # None (any of the three): not given. The step is built without those chunks (as 1);
    # ``memcc compile`` chooses them itself where they lower the plan's cost at the budget
    # (compiler/chunk_choice.py). A number given is kept as it is (1: never split).
    # memcc's fusions applied to the built step (frontend/fuse.py); () builds it unfused
    fusions: tuple[str, ...] = FUSION_RULES

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise InputError(f"--loss '{self.loss}': choose one of {', '.join(LOSSES)}")
        if self.loss_chunks is not None and self.loss_chunks < 1:
            raise InputError(f"--loss-chunks {self.loss_chunks}: give 1 (the plain loss) or "
                             "more")
        for flag, k in (("--attention-chunks", self.attention_chunks),
                        ("--mlp-chunks", self.mlp_chunks)):
            if k is not None and k < 1:
                raise InputError(f"{flag} {k}: give 1 (whole regions) or more")
        if (self.loss_chunks or 1) > 1 and self.loss != "cross-entropy":
            raise InputError(f"--loss-chunks applies to --loss cross-entropy, not "
                             f"'{self.loss}'")
        if self.optimizer not in OPTIMIZERS:
            raise InputError(
                f"--optimizer '{self.optimizer}': choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.lr is not None and self.lr < 0:
            raise InputError(f"--lr {self.lr:g}: the learning rate must not be negative")
        if self.momentum < 0:
            raise InputError(f"--momentum {self.momentum:g}: momentum must not be negative "
                             "(0 disables it; torch.optim.SGD's rule)")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise InputError(f"--weight-decay {self.weight_decay:g}: weight decay must not "
                             "be negative")

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    @property
    def decay(self) -> float:
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.01 if self.optimizer == "adamw" else 0.0


def is_training_step(graph: Graph) -> bool:
    return graph.metadata.get(KIND_KEY) == "training_step"


def build_training_step(forward: Graph, options: BuildOptions | None = None,
                        *, source: str = "<model>") -> Graph:
    """Return a new Graph: forward + loss + backward + optimizer update, in that order."""
    opts = options or BuildOptions()
    if is_training_step(forward):
        raise InputError(f"{source}: already a memcc training step; pass the forward model")
    if forward.opset < 13:
        raise InputError(
            f"{source}: opset {forward.opset} is older than 13, which memcc needs for its "
            "backward ops; re-export with opset_version >= 13"
        )
    graph = forward.copy()
    row_chunks = {kind: {"chunks": k,
                         "regions": chunk_regions(graph, kind, k, source)[1]["regions"]}
                  for kind, k in ((ATTENTION, opts.attention_chunks or 1),
                                  (MLP, opts.mlp_chunks or 1))
                  if k > 1}
    emit = Emitter(graph)
    logits = _first_float_output(graph, source)
    data_inputs = [i for i in graph.inputs if i not in graph.initializers]
    int_ranges = _index_ranges(graph, data_inputs)

    loss, extra_inputs, label_range, chunked = _emit_loss(graph, emit, logits, opts.loss,
                                                          source, opts.loss_chunks or 1)
    data_inputs += extra_inputs
    int_ranges.update(label_range)

    restore_training_batchnorm(graph, source)
    bn_stats = _batchnorm_running_stats(graph)
    params = _trainable_parameters(graph, loss, bn_stats)
    params = _apply_freeze(params, opts.freeze, source)
    if not params:
        raise InputError(
            f"{source}: no trainable parameters: no floating-point initializer lies on a "
            "differentiable path to the loss" + (" (or every one is frozen)" if opts.freeze
                                                else "")
        )
    sources = parameter_sources(graph, params)
    emap = export_map_of(graph)
    report_parameters(sources, source, signature_of(graph), emap)
    grads = differentiate(graph, loss, params, source=source,
                          seeds=chunked.seeds if chunked else None,
                          skip=chunked.nodes if chunked else ())

    state: dict[str, str] = {}
    namer = _OutputNamer(graph, emit)
    outputs = [loss]
    first_update = len(graph.nodes)
    outputs += _emit_update(graph, emit, params, grads, opts, state, namer)
    outputs += _carry_batchnorm_stats(graph, bn_stats, state, namer)
    namer.apply()
    for node in graph.nodes[first_update:]:  # provenance: TrainingStep.roles reads it
        tag_node(node, role=Role.UPDATE.value)
    # Dropout masks from (seed, step counter, element): a resumed run draws the same ones.
    if counter_dropouts(graph):
        outputs.append(add_counter(graph, state))

    graph.outputs = outputs
    graph.inputs = data_inputs + [p for p in params] + [
        s for s in state.values() if s not in params
    ]
    graph.metadata.update({
        KIND_KEY: "training_step",
        LOSS_KEY: loss,
        DATA_KEY: json.dumps(data_inputs),
        STATE_KEY: json.dumps(state),
        INT_RANGES_KEY: json.dumps(int_ranges),
        PARAMS_KEY: json.dumps(params),
        PARAM_SOURCES_KEY: json.dumps({p: s.to_json() for p, s in sources.items()}),
        **({FOLDED_PARAMS_KEY: json.dumps({**{n: "folded" for n in emap.folded},
                                           **{n: "unused" for n in emap.unused}})}
           if emap is not None and (emap.folded or emap.unused) else {}),
        FORWARD_OUTPUTS_KEY: json.dumps(list(forward.outputs)),
        **({PROJECTION_KEY: json.dumps(chunked.projection)} if chunked else {}),
        **({ROW_CHUNKS_KEY: json.dumps(row_chunks)} if row_chunks else {}),
        GRADIENTS_KEY: json.dumps({p: namer.renamed(g) for p, g in grads.items()}),
        OPTIMIZER_KEY: json.dumps({
            "name": opts.optimizer, "lr": opts.learning_rate, "loss": opts.loss,
            "momentum": opts.momentum if opts.optimizer == "sgd" else None,
            "weight_decay": opts.decay,
        }),
    })
    graph.metadata.pop(EXPORT_MAP_KEY, None)  # read into the two records above
    # memcc's own fusions, so that planning sees the step as ORT runs it (frontend/fuse.py).
    graph, _ = fuse_step(graph, opts.fusions)
    _drop_unused_initializers(graph)
    return graph


# ---------------------------------------------------------------------------- pieces
def _first_float_output(graph: Graph, source: str) -> str:
    for o in graph.outputs:
        ti = graph.info.get(o)
        if ti is not None and ti.is_float:
            return o
    raise InputError(
        f"{source}: the model has no floating-point output to train on (outputs: "
        f"{', '.join(graph.outputs) or 'none'}). memcc builds the loss from the first "
        "floating-point output (logits, or the scalar loss with --loss none)."
    )


def _index_ranges(graph: Graph, data_inputs: list[str]) -> dict[str, list[int]]:
    """Integer inputs used as Gather indices range over the gathered axis (token ids)."""
    ranges: dict[str, list[int]] = {}
    consumers = graph.consumers()
    for name in data_inputs:
        ti = graph.info[name]
        if ti.is_float or ti.dtype == TensorProto.BOOL:
            continue
        for node in _through_casts(graph, name, consumers):
            if node.op_type == "Gather" and len(node.input) > 1 and \
                    node.input[1] in _cast_chain(graph, name, consumers):
                table = graph.info[node.input[0]]
                axis = attr(node, "axis", 0) % len(table.shape)
                ranges[name] = [0, int(table.shape[axis])]
    return ranges


def _cast_chain(graph: Graph, name: str, consumers) -> set[str]:
    chain = {name}
    frontier = [name]
    while frontier:
        v = frontier.pop()
        for n in consumers.get(v, []):
            if n.op_type in ("Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze", "Flatten"):
                for o in n.output:
                    if o not in chain:
                        chain.add(o)
                        frontier.append(o)
    return chain


def _through_casts(graph: Graph, name: str, consumers):
    for v in _cast_chain(graph, name, consumers):
        yield from consumers.get(v, [])


_HALF = (TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _emit_loss(graph: Graph, emit: Emitter, logits: str, kind: str, source: str,
               chunks: int = 1) -> tuple[str, list[str], dict, ChunkedLoss | None]:
    """The loss value, the data inputs it adds, their integer ranges, and (``chunks`` > 1)
    the chunked loss whose gradients the autodiff takes as seeds."""
    ti = graph.info[logits]
    taken = set(graph.values())
    if ti.dtype in _HALF and kind != "none":
        # The model computes in its exported 16-bit type; the loss is taken in float32, as
        # torch's autocast does for cross-entropy and MSE (a 16-bit log-softmax over a large
        # vocabulary loses the small probabilities, and ORT's CPU provider has no 16-bit
        # ScatterElements-add for the loss gradient). The Cast's gradient brings it back.
        ti = TensorInfo(TensorProto.FLOAT, ti.shape)
        logits = emit.cast(logits, TensorProto.FLOAT)
    if "loss" in taken and kind != "none":
        raise InputError(
            f"{source}: the model already has a value named 'loss', the name --loss {kind} "
            "gives the loss it adds. If the model's first output already is the scalar loss, "
            "build with --loss none; otherwise rename that value in the model")
    if kind == "none":
        if ti.numel != 1:
            raise InputError(
                f"{source}: --loss none needs the first floating-point output to be the "
                f"scalar loss, but '{logits}' has shape {list(ti.shape)}"
            )
        loss = emit.op("Reshape", [logits, emit.ints([])], outputs=["loss"],
                       info=TensorInfo(ti.dtype, ())) if logits != "loss" else logits
        return loss, [], {}, None
    if kind == "mse":
        for name in ("target",):
            if name in taken:
                raise InputError(f"{source}: the model already has a value named '{name}'")
        graph.info["target"] = ti
        diff = emit.sub(logits, "target")
        sq = emit.mul(diff, diff)
        loss = emit.op("ReduceMean", [sq], outputs=["loss"], keepdims=0,
                       info=TensorInfo(ti.dtype, ()))
        return loss, ["target"], {}, None
    # cross-entropy over the last axis, mean over all positions (torch's default)
    if len(ti.shape) < 1 or ti.shape[-1] < 1:
        raise InputError(f"{source}: cross-entropy needs logits with a class axis; "
                         f"'{logits}' has shape {list(ti.shape)}")
    if "labels" in taken:
        raise InputError(f"{source}: the model already has a value named 'labels'")
    label_shape = ti.shape[:-1]
    graph.info["labels"] = TensorInfo(TensorProto.INT64, label_shape)
    ranges = {"labels": [0, int(ti.shape[-1])]}
    if chunks > 1:
        chunked = emit_chunked_loss(graph, emit, logits, chunks, source)
        return chunked.loss, ["labels"], ranges, chunked
    logp = emit.op("LogSoftmax", [logits], axis=-1, info=ti)
    idx = emit.unsqueeze("labels", [-1], info=TensorInfo(TensorProto.INT64, label_shape + (1,)))
    picked = emit.op("GatherElements", [logp, idx], axis=-1,
                     info=TensorInfo(ti.dtype, label_shape + (1,)))
    mean = emit.reduce_mean(picked, None, keepdims=False, info=TensorInfo(ti.dtype, ()))
    loss = emit.op("Neg", [mean], outputs=["loss"], info=TensorInfo(ti.dtype, ()))
    return loss, ["labels"], ranges, None


def _batchnorm_running_stats(graph: Graph) -> list[tuple[object, str, str]]:
    """(node, running_mean, running_var) of BatchNormalization nodes in training mode."""
    out = []
    for node in graph.nodes:
        if node.op_type != "BatchNormalization" or len(node.input) < 5:
            continue
        if attr(node, "training_mode", 0):
            out.append((node, node.input[3], node.input[4]))
    return out


def _trainable_parameters(graph: Graph, loss: str, bn_stats) -> list[str]:
    """Float initializers on a differentiable path to the loss, minus BN statistics.

    Scalar constants that exporters store as initializers (0-d tensors, and one-element
    tensors TorchScript names ``onnx::...``) are constants of the model, not parameters.
    Exporters also store pre-transposed copies of weights under made-up names
    (``onnx::MatMul_12``, ``val_3``): those are the parameters the graph uses, so they train.
    ONNX cannot tell a torch buffer from a parameter; buffers known by name (rotary
    ``inv_freq``, BatchNorm statistics) are not trained.
    """
    excluded = {s for _, m, v in bn_stats for s in (m, v)}
    excluded.update(n for n in graph.initializers if n.endswith(BUFFER_SUFFIXES))
    sig = signature_of(graph)
    if sig is not None:  # the dynamo exporter says which initializers are torch buffers
        excluded.update(sig.buffers)
    for node in graph.nodes:
        if node.op_type == "BatchNormalization" and len(node.input) >= 5:
            excluded.update(node.input[3:5])
    candidates = [
        n for n, a in graph.initializers.items()
        if n not in excluded and graph.info[n].is_float and np.ndim(a) > 0
        and not (n.startswith("onnx::") and np.size(a) == 1)
    ]
    reachable = differentiable_values(graph, loss, candidates)
    return [n for n in candidates if n in reachable]


def _apply_freeze(params: list[str], patterns: tuple[str, ...], source: str) -> list[str]:
    """Drop parameters matching any ``--freeze`` pattern; a pattern that matches nothing is
    an error (a typo would otherwise silently train everything)."""
    if not patterns:
        return params
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(p, pat) for p in params):
            raise InputError(
                f"{source}: --freeze '{pat}' matches no trainable parameter; parameters are "
                f"named like {', '.join(params[:3])}. Patterns use shell wildcards, e.g. "
                "--freeze 'embeddings.*'."
            )
    return [p for p in params if not any(fnmatch.fnmatchcase(p, pat) for pat in patterns)]


def _emit_update(graph: Graph, emit: Emitter, params: list[str], grads: dict[str, str],
                 opts: BuildOptions, state: dict[str, str], namer: _OutputNamer
                 ) -> list[str]:
    outputs: list[str] = []
    lr = opts.learning_rate
    wd = opts.decay
    if opts.optimizer == "adamw":
        step_in = "adamw.step"
        graph.initializers[step_in] = np.zeros((), np.float32)
        graph.info[step_in] = TensorInfo(TensorProto.FLOAT, ())
        step_new = emit.op("Add", [step_in, emit.scalar(1.0, TensorProto.FLOAT)],
                           outputs=[f"{step_in}.new"], info=graph.info[step_in])
        state[step_new] = step_in
        outputs.append(step_new)
        b1, b2 = opts.betas
        bc1 = emit.sub(emit.scalar(1.0, TensorProto.FLOAT),
                       emit.binary("Pow", emit.scalar(b1, TensorProto.FLOAT), step_new))
        bc2 = emit.sub(emit.scalar(1.0, TensorProto.FLOAT),
                       emit.binary("Pow", emit.scalar(b2, TensorProto.FLOAT), step_new))
    for p in params:
        g = grads.get(p)
        ti = graph.info[p]
        if g is None:  # parameter on a path that carries no gradient (e.g. masked out)
            g = emit.zeros_like(p)
        if opts.optimizer == "none":
            outputs.append(namer.name(g, f"{p}.grad"))
            continue

        def c(v: float, _dt: int = ti.dtype) -> str:
            return emit.scalar(v, _dt)

        if opts.optimizer == "sgd":
            if wd:
                g = emit.add(g, emit.mul(c(wd), p))
            step = g
            if opts.momentum:
                buf = _state_input(graph, f"{p}.momentum", ti)
                step = emit.op("Add", [emit.mul(c(opts.momentum), buf), g],
                               outputs=[f"{buf}.new"], info=ti)
                state[step] = buf
                outputs.append(step)
            new_p = emit.op("Sub", [p, emit.mul(c(lr), step)], outputs=[f"{p}.new"], info=ti)
        else:  # adamw, as torch.optim.AdamW
            m = _state_input(graph, f"{p}.exp_avg", ti)
            v = _state_input(graph, f"{p}.exp_avg_sq", ti)
            b1, b2 = opts.betas
            m_new = emit.op("Add", [emit.mul(c(b1), m), emit.mul(c(1 - b1), g)],
                            outputs=[f"{m}.new"], info=ti)
            v_new = emit.op("Add", [emit.mul(c(b2), v), emit.mul(c(1 - b2), emit.mul(g, g))],
                            outputs=[f"{v}.new"], info=ti)
            state[m_new] = m
            state[v_new] = v
            outputs += [m_new, v_new]
            m_hat = emit.div(m_new, emit.cast(bc1, ti.dtype))
            v_hat = emit.div(v_new, emit.cast(bc2, ti.dtype))
            denom = emit.add(emit.unary("Sqrt", v_hat), c(opts.eps))
            decayed = emit.mul(c(1 - lr * wd), p) if wd else p
            new_p = emit.op("Sub", [decayed, emit.mul(c(lr), emit.div(m_hat, denom))],
                            outputs=[f"{p}.new"], info=ti)
        state[new_p] = p
        outputs.append(new_p)
    return outputs


def _state_input(graph: Graph, name: str, ti: TensorInfo) -> str:
    if name in graph.info:
        raise InputError(f"cannot add optimizer state '{name}': the name is taken")
    graph.initializers[name] = np.zeros(ti.shape, ti.np_dtype)
    graph.info[name] = ti
    return name


def _carry_batchnorm_stats(graph: Graph, bn_stats, state, namer: _OutputNamer) -> list[str]:
    """BatchNorm in training mode updates its running stats: make them carried state."""
    outputs = []
    for node, mean, var in bn_stats:
        if mean not in graph.initializers or var not in graph.initializers:
            raise InputError(
                f"{node_label(node)}: running statistics must be initializers to be carried "
                "between steps"
            )
        while len(node.output) < 3:
            node.output.append("")
        for k, stat in ((1, mean), (2, var)):
            if stat in state.values():
                raise InputError(f"{node_label(node)}: running statistic '{stat}' is shared "
                                 "by several BatchNormalization nodes")
            new_name = f"{stat}.new"
            if node.output[k]:
                new_name = namer.name(node.output[k], new_name)
            else:
                node.output[k] = new_name
                graph.info[new_name] = graph.info[stat]
            state[new_name] = stat
            outputs.append(new_name)
    return outputs


class _OutputNamer:
    """Gives values the output names of the contract (``P.grad``, ``stat.new``).

    A value produced by a node is renamed in place (no copy, no extra node); renames are
    collected and applied in one pass over the graph at the end, because renaming one value
    at a time costs a pass per parameter. Graph inputs, initializers and values that already
    carry a contract name (one gradient shared by two parameters) get an Identity instead.
    """

    def __init__(self, graph: Graph, emit: Emitter) -> None:
        self.graph = graph
        self.emit = emit
        self.producers = graph.producers()
        self.renames: dict[str, str] = {}

    def name(self, value: str, name: str) -> str:
        graph = self.graph
        if name in graph.info:
            raise InputError(f"cannot name an output '{name}': the name is taken")
        reserved = value in graph.inputs or value in graph.outputs or \
            value in graph.initializers
        if value not in self.producers or reserved or value in self.renames or \
                value.endswith((".grad", ".new")):
            return self.emit.op("Identity", [self.renames.get(value, value)], outputs=[name],
                                info=graph.info[value])
        self.renames[value] = name
        graph.info[name] = graph.info[value]
        return name

    def renamed(self, value: str) -> str:
        """The name ``value`` has once the renames are applied."""
        return self.renames.get(value, value)

    def apply(self) -> None:
        if not self.renames:
            return
        for n in self.graph.nodes:
            for i, inp in enumerate(n.input):
                if inp in self.renames:
                    n.input[i] = self.renames[inp]
            for i, out in enumerate(n.output):
                if out in self.renames:
                    n.output[i] = self.renames[out]
            if n.metadata_props:
                _rename_rule_io(n, self.renames)
        for old in self.renames:
            self.graph.info.pop(old, None)


def _rename_rule_io(node, renames: dict[str, str]) -> None:
    """Keep a forward node's record of its rule's gradients (``step.rule_io``) in step with
    the renames, or a variant could not find the values it replaces."""
    io = rule_io(node)
    if io is None:
        return
    gouts, gins = io
    if any(g in renames for g in gouts + gins):
        record_rule_io(node, [renames.get(g, g) for g in gouts],
                       [renames.get(g, g) for g in gins])


def _drop_unused_initializers(graph: Graph) -> None:
    used = {i for n in graph.nodes for i in n.input} | set(graph.inputs) | set(graph.outputs)
    for name in [n for n in graph.initializers if n not in used]:
        del graph.initializers[name]
