"""The end of a training step: the optimizer update and the state carried to the next step.

In: the graph with its loss and backward, the trained parameters and their gradients, the
``BuildOptions`` (optimizer, learning rate, momentum, weight decay, betas). Out: the update
nodes appended (SGD with momentum or AdamW as torch.optim computes them, or ``P.grad``
outputs with ``--optimizer none``), optimizer state as initializer-backed inputs
(``P.momentum``, ``P.exp_avg``...), BatchNorm running statistics made carried state, and the
step outputs under the contract's names (``P.new``, ``stat.new``, ``P.grad``), given by
``OutputNamer`` without copies where it can. With dynamic loss scaling the gradients are
unscaled and checked first and the coefficients masked on overflow (``frontend.loss_scaling``
holds that rule; here only where each coefficient goes).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
from onnx import TensorProto

from memcc.errors import InputError
from memcc.frontend import loss_scaling
from memcc.frontend.build_options import BuildOptions
from memcc.frontend.emit import Emitter
from memcc.frontend.running_variance import unbiased_value
from memcc.frontend.update_groups import emit_joined, group_name, vector_groups
from memcc.graph import Graph, TensorInfo, node_label
from memcc.step import record_rule_io, rule_io


@dataclass(frozen=True)
class StepWriter:
    """Where the step's end is written: the graph, its emitter, ``state`` (each new value
    -> the input it replaces at the next step) and the namer of contract outputs."""

    graph: Graph
    emit: Emitter
    state: dict[str, str]
    namer: OutputNamer


def emit_update(out: StepWriter, params: list[str], grads: dict[str, str],
                opts: BuildOptions) -> list[str]:
    """The optimizer's update of every parameter (``opts.optimizer``: none writes the
    gradients as ``P.grad``), as torch.optim computes it; returns the step outputs it adds.
    With dynamic loss scaling the gradients are unscaled first, and an overflowing step
    skips the update and only adapts the scale (``frontend.loss_scaling``)."""
    graph, emit, namer = out.graph, out.emit, out.namer
    outputs: list[str] = []
    found_inf = None
    if opts.dynamic_loss_scale:
        unscaled = loss_scaling.unscale(emit, grads, loss_scaling.SCALE,
                                        zero_on_inf=opts.optimizer != "none")
        grads, found_inf = unscaled.grads, unscaled.found_inf
    u = _Update(out, opts, loss_scaling.Coefficients(emit, found_inf), outputs)
    adam = _adamw_step(u) if opts.optimizer == "adamw" else None
    groups = vector_groups(graph, params) \
        if opts.optimizer != "none" and opts.grouped_updates else []
    grouped = {p for ps in groups for p in ps}
    rule = _sgd if opts.optimizer == "sgd" else partial(_adamw, adam=adam)
    for p in params:
        if p in grouped:
            continue
        g = grads.get(p) or emit.zeros_like(p)  # None: on a path no gradient reaches
        if opts.optimizer == "none":
            outputs.append(namer.name(g, f"{p}.grad"))
        else:
            _carry(u, p, rule(u, p, g, p))
    for ps in groups:
        _grouped(u, ps, [grads.get(p) or emit.zeros_like(p) for p in ps], rule)
    if found_inf is not None:
        outputs += loss_scaling.update_scale(emit, out.state, found_inf, opts)
        if opts.optimizer == "none":  # the gradients are as they came: say whether finite
            outputs.append(emit.op("Identity", [found_inf], outputs=[loss_scaling.FOUND_INF],
                                   info=graph.info[found_inf]))
    return outputs


@dataclass(frozen=True)
class _Update:
    """What every parameter's update reads: where it is written, the options, the
    coefficients (masked on overflow with loss scaling), the step outputs it adds to."""

    out: StepWriter
    opts: BuildOptions
    coef: loss_scaling.Coefficients
    outputs: list[str]


def _carry(u: _Update, p: str, new_p: str) -> None:
    """``new_p`` is ``p``'s value at the next step: a step output."""
    u.out.state[new_p] = p
    u.outputs.append(new_p)


def _grouped(u: _Update, ps: list[str], gs: list[str], rule) -> None:
    """One ``rule`` update of the parameters ``ps`` joined, their new values split back
    (``frontend/update_groups.py``): the same arithmetic per element, a few kernels."""
    name = group_name(u.out.graph, u.out.graph.info[ps[0]].np_dtype)
    news = emit_joined(u.out.emit, [ps, gs], [f"{p}.new" for p in ps],
                       lambda joined, g: rule(u, joined, g, name), name=name)
    for p, new_p in zip(ps, news, strict=True):
        _carry(u, p, new_p)


def _sgd(u: _Update, p: str, g: str, name: str) -> str:
    """torch.optim.SGD: weight decay, momentum buffer, step (a skipped step keeps all);
    the new value, ``name.new``, whose state is ``name.momentum``."""
    graph, emit, state = u.out.graph, u.out.emit, u.out.state
    opts, coef, outputs = u.opts, u.coef, u.outputs
    ti = graph.info[p]
    if opts.decay:
        g = emit.add(g, emit.mul(coef(opts.decay, ti.dtype, skipped=0.0), p))
    step = g
    if opts.momentum:
        buf = _state_input(graph, f"{name}.momentum", ti)
        step = emit.op("Add", [emit.mul(coef(opts.momentum, ti.dtype, skipped=1.0), buf), g],
                       outputs=[f"{buf}.new"], info=ti)
        state[step] = buf
        outputs.append(step)
    return emit.op("Sub", [p, emit.mul(coef(opts.learning_rate, ti.dtype, skipped=0.0),
                                       step)],
                   outputs=[f"{name}.new"], info=ti)


@dataclass(frozen=True)
class _AdamStep:
    """AdamW's step count's bias corrections, shared by every parameter."""

    bc1: str
    bc2: str


def _adamw_step(u: _Update) -> _AdamStep:
    """The carried step count (``adamw.step``) and the bias corrections at the new count.
    A skipped step leaves the count, but the corrections are taken at count + 1 all the
    same: at count 0 they would be 0, and their quotient, multiplied by a zero learning
    rate, NaN."""
    graph, emit, state = u.out.graph, u.out.emit, u.out.state
    opts, coef, outputs = u.opts, u.coef, u.outputs
    f32 = TensorProto.FLOAT
    step_in = "adamw.step"
    graph.initializers[step_in] = np.zeros((), np.float32)
    graph.info[step_in] = TensorInfo(f32, ())
    one = emit.scalar(1.0, f32)
    if coef.found_inf is None:
        step_new = emit.op("Add", [step_in, one], outputs=[f"{step_in}.new"],
                           info=graph.info[step_in])
        count = step_new
    else:
        count = emit.add(step_in, one)
        step_new = emit.op("Add", [step_in, coef(1.0, f32, skipped=0.0)],
                           outputs=[f"{step_in}.new"], info=graph.info[step_in])
    state[step_new] = step_in
    outputs.append(step_new)
    b1, b2 = opts.betas
    return _AdamStep(emit.sub(one, emit.binary("Pow", emit.scalar(b1, f32), count)),
                     emit.sub(one, emit.binary("Pow", emit.scalar(b2, f32), count)))


def _adamw(u: _Update, p: str, g: str, name: str, *, adam: _AdamStep) -> str:
    """torch.optim.AdamW: the two moments, decoupled weight decay, the step; the new
    value, ``name.new``, whose state is ``name.exp_avg`` and ``name.exp_avg_sq``."""
    graph, emit, state = u.out.graph, u.out.emit, u.out.state
    opts, coef, outputs = u.opts, u.coef, u.outputs
    ti = graph.info[p]
    dt = ti.dtype
    lr, wd = opts.learning_rate, opts.decay
    m = _state_input(graph, f"{name}.exp_avg", ti)
    v = _state_input(graph, f"{name}.exp_avg_sq", ti)
    b1, b2 = opts.betas
    m_new = emit.op("Add", [emit.mul(coef(b1, dt, skipped=1.0), m),
                            emit.mul(coef(1 - b1, dt), g)],
                    outputs=[f"{m}.new"], info=ti)
    v_new = emit.op("Add", [emit.mul(coef(b2, dt, skipped=1.0), v),
                            emit.mul(coef(1 - b2, dt), emit.mul(g, g))],
                    outputs=[f"{v}.new"], info=ti)
    state[m_new] = m
    state[v_new] = v
    outputs += [m_new, v_new]
    m_hat = emit.div(m_new, emit.cast(adam.bc1, dt))
    v_hat = emit.div(v_new, emit.cast(adam.bc2, dt))
    denom = emit.add(emit.unary("Sqrt", v_hat), coef(opts.eps, dt))
    step = emit.mul(coef(lr, dt, skipped=0.0), emit.div(m_hat, denom))
    # Written last, right before its reader: a parameter-sized value (and where ``p`` is a
    # group's joined vector, one the scheduler's leaves rule would not defer).
    decayed = emit.mul(coef(1 - lr * wd, dt, skipped=1.0), p) if wd else p
    return emit.op("Sub", [decayed, step], outputs=[f"{name}.new"], info=ti)


def _state_input(graph: Graph, name: str, ti: TensorInfo) -> str:
    if name in graph.info:
        raise InputError(f"cannot add optimizer state '{name}': the name is taken")
    graph.initializers[name] = np.zeros(ti.shape, ti.np_dtype)
    graph.info[name] = ti
    return name


def carry_batchnorm_stats(out: StepWriter, bn_stats) -> list[str]:
    """BatchNorm in training mode updates its running stats: make them carried state (for
    a PyTorch model the variance as PyTorch updates it: ``frontend/running_variance.py``)."""
    graph, state, namer = out.graph, out.state, out.namer
    outputs = []
    for node, mean, var in bn_stats:
        if mean not in graph.initializers or var not in graph.initializers:
            raise InputError(
                f"{node_label(node)}: running statistics must be initializers to be carried "
                f"between steps ('{mean}' and '{var}' are computed in the graph, and its "
                "running outputs are read); export with the module's running buffers "
                "(track_running_stats=True), or in eval mode")
        while len(node.output) < 3:
            node.output.append("")
        for k, stat in ((1, mean), (2, var)):
            if stat in state.values():
                raise InputError(f"{node_label(node)}: running statistic '{stat}' is shared "
                                 "by several BatchNormalization nodes")
            new_name = f"{stat}.new"
            unbiased = unbiased_value(node, stat) if k == 2 else None
            if unbiased is not None:  # PyTorch's update (frontend/running_variance.py)
                new_name = namer.name(unbiased, new_name)
            elif node.output[k]:
                new_name = namer.name(node.output[k], new_name)
            else:
                node.output[k] = new_name
                graph.info[new_name] = graph.info[stat]
            state[new_name] = stat
            outputs.append(new_name)
    return outputs


class OutputNamer:
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
