"""Recurrent ops (``LSTM``, ``GRU``, ``RNN``) unrolled over their time steps at load time.

Why: ORT's released packages have no gradient kernels, and a recurrent op's backward
(backpropagation through time) is a loop over the steps that needs every step's gates. Once
dimensions are bound the sequence length is static, so the op is the same arithmetic as a
fixed chain of per-step ``MatMul`` / ``Add`` / activation / ``Mul`` nodes, each of which has
a gradient rule. Unrolled, the planner also sees each step's gates as values of their own,
so it can keep or recompute them step by step (the memory question Chen et al.'s sqrt(n)
checkpointing was first posed on).

How: one ``MatMul`` projects every step's input at once (``X`` by ``W``, plus the biases that
add outside the recurrence); a ``Split`` hands out the steps; each step adds its hidden
state times ``R`` and applies the gates as the ONNX operator defines them (gate orders
``i o f c`` for LSTM and ``z r h`` for GRU, peepholes, ``clip``, ``linear_before_reset``,
``activations`` with their alphas and betas, both layouts, ``reverse`` and
``bidirectional``); a ``Concat`` gathers the hidden states into ``Y``. Shapes go through
``Reshape`` (valid at every opset the ops exist at). Not exact: ORT's kernel sums in
another order, so outputs agree to float rounding (``tests/test_recurrent.py`` measures it
against ORT and the gradients against torch's).

Refused with an ``InputError`` naming the node: ``sequence_lens`` that are not all the full
length (packed sequences), ``input_forget``, and activations memcc has no gradient for.

In: one recurrent node, the model's static types and a namer. Out: the nodes that replace
it. Called by ``canonicalize``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from memcc.errors import InputError
from memcc.frontend.static_values import (
    Namer,
    StaticValues,
    ValueTypes,
    const_node,
    node_attr,
)
from memcc.graph import node_label, text_attr

RECURRENT_OPS = frozenset({"LSTM", "GRU", "RNN"})
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_DEFAULT_ACTIVATIONS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"],
                        "RNN": ["tanh"]}
# activation -> (defaults of the alpha and beta it reads, in order)
_ACTIVATIONS: dict[str, tuple[float, ...]] = {
    "sigmoid": (), "tanh": (), "relu": (), "softplus": (), "leakyrelu": (0.01,),
    "elu": (1.0,), "hardsigmoid": (0.2, 0.5), "affine": (1.0, 0.0),
    "scaledtanh": (1.0, 1.0)}


@dataclass
class _Emit:
    """The nodes of one unrolled op, named apart from the model and from each other."""

    fresh: Namer
    base: str
    dtype: np.dtype
    opset: int
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    consts: dict[tuple, str] = field(default_factory=dict)

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1,
           **attrs) -> list[str]:
        outs = outputs if isinstance(outputs, list) else \
            [self.fresh(f"{self.base}/{op_type.lower()}") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outs,
                                           name=self.fresh(f"{self.base}/{op_type}"), **attrs))
        return outs

    def one(self, op_type: str, *inputs: str, **attrs) -> str:
        return self.op(op_type, list(inputs), **attrs)[0]

    def const(self, value, dtype=None) -> str:
        """One Constant per value (every step splits and clips by the same ones)."""
        arr = np.asarray(value, dtype if dtype is not None else self.dtype)
        key = (arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self.consts:
            node = const_node(self.fresh, arr)
            self.nodes.append(node)
            self.consts[key] = node.output[0]
        return self.consts[key]

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.one("Reshape", x, self.const(shape, np.int64))

    def split(self, x: str, axis: int, sizes: list[int]) -> list[str]:
        if len(sizes) == 1:
            return [x]
        if self.opset >= 13:
            return self.op("Split", [x, self.const(sizes, np.int64)], len(sizes), axis=axis)
        return self.op("Split", [x], len(sizes), axis=axis, split=sizes)

    def clip(self, x: str, bound: float | None) -> str:
        if bound is None:
            return x
        if self.opset >= 11:
            return self.one("Clip", x, self.const(-bound), self.const(bound))
        return self.one("Clip", x, min=-bound, max=bound)

    def activation(self, x: str, act: tuple[str, tuple[float, ...]]) -> str:
        name, params = act
        simple = {"sigmoid": "Sigmoid", "tanh": "Tanh", "relu": "Relu",
                  "softplus": "Softplus"}
        if name in simple:
            return self.one(simple[name], x)
        if name == "leakyrelu":
            return self.one("LeakyRelu", x, alpha=params[0])
        if name == "elu":
            return self.one("Elu", x, alpha=params[0])
        if name == "hardsigmoid":
            return self.one("HardSigmoid", x, alpha=params[0], beta=params[1])
        if name == "affine":
            return self.one("Add", self.one("Mul", x, self.const(params[0])),
                            self.const(params[1]))
        # scaledtanh: alpha * tanh(beta * x)
        return self.one("Mul", self.one("Tanh", self.one("Mul", x, self.const(params[1]))),
                        self.const(params[0]))

    def gate(self, x: str, cell: _Cell, k: int) -> str:
        """Activation ``k`` of the cell on a gate's pre-activation, clipped first."""
        return self.activation(self.clip(x, cell.clip), cell.activations[k])


@dataclass
class _Cell:
    """What every step of one direction reads: the op, its sizes and attributes."""

    op: str
    hidden: int
    batch: int
    activations: list[tuple[str, tuple[float, ...]]]
    clip: float | None
    linear_before_reset: bool


@dataclass
class _Weights:
    """One direction's weights as each step reads them, every product a ``Gemm`` with
    ``transB``: ``w`` is W as [gates * hidden, input], ``bias_x`` the bias added to the
    input's product, ``r`` R's rows (a GRU's split into its update/reset and its candidate
    rows), ``bias_rh`` a GRU's candidate recurrence bias under ``linear_before_reset``,
    ``peep`` the LSTM peepholes i, o, f."""

    w: str
    r: list[str]
    bias_x: str | None = None
    bias_rh: str | None = None
    peep: list[str] | None = None


def unroll_recurrent(node: onnx.NodeProto, types: ValueTypes, consts: StaticValues,
                     fresh: Namer, where: str) -> list[onnx.NodeProto]:
    """The nodes that compute ``node``'s outputs step by step."""
    x_type = types.get(node.input[0])
    if x_type is None or x_type[1] is None or len(x_type[1]) != 3:
        raise InputError(f"{where}: {node_label(node)}: the shape of its input "
                         f"'{node.input[0]}' is not known; bind every symbolic dimension "
                         "with --dim")
    layout = node_attr(node, "layout", 0)
    seq, batch = (x_type[1][1], x_type[1][0]) if layout else x_type[1][:2]
    _refuse_unsupported(node, consts, seq, where)
    direction = text_attr(node, "direction", "forward")
    dirs = 2 if direction == "bidirectional" else 1
    emit = _Emit(fresh, node.name or node.output[0] or node.op_type,
                 helper.tensor_dtype_to_np_dtype(x_type[0]), consts.opset)
    cells = _cells(node, batch, dirs, where)
    x = node.input[0]
    if layout:
        x = emit.one("Transpose", x, perm=[1, 0, 2])
    # Each step's input on its own (one Split, shared by both directions): a step's input
    # product is then a value of that step, which a plan recomputes from the step's input
    # rather than holding every step's gates from one product over the whole sequence.
    xs = emit.split(emit.reshape(x, [seq * batch, -1]), 0, [batch] * seq)
    per_dir = [_per_direction(node, k, dirs, layout, emit) for k in range(len(node.input))]
    ys, h_last, c_last = [], [], []
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        inputs = {k: parts[d] for k, parts in enumerate(per_dir) if parts}
        y, h, c = _direction(cells[d], xs, inputs, reverse, emit)
        ys.append(y)
        h_last.append(h)
        c_last.append(c)
    _outputs(node, [ys, h_last, c_last], (seq, batch, cells[0].hidden), layout, emit)
    return emit.nodes


def _refuse_unsupported(node: onnx.NodeProto, consts: StaticValues, seq: int,
                        where: str) -> None:
    if node_attr(node, "input_forget", 0):
        raise InputError(f"{where}: {node_label(node)}: input_forget=1 (coupled input and "
                         "forget gates) is not supported; export the LSTM without it")
    if len(node.input) > 4 and node.input[4]:
        lens = consts.value(node.input[4])
        if lens is None or not np.all(np.asarray(lens) == seq):
            raise InputError(
                f"{where}: {node_label(node)}: sequence_lens '{node.input[4]}' are not all "
                f"the full length {seq} (packed or padded sequences of varying length); "
                "memcc unrolls recurrent ops over a fixed number of steps. Pad the batch "
                "and mask the loss instead of packing it")


def _cells(node: onnx.NodeProto, batch: int, dirs: int, where: str) -> list[_Cell]:
    op = node.op_type
    per_dir = len(_DEFAULT_ACTIVATIONS[op])
    names = [(a.decode() if isinstance(a, bytes) else a).lower()
             for a in node_attr(node, "activations", [])]
    names = names or _DEFAULT_ACTIVATIONS[op] * dirs
    if len(names) != per_dir * dirs:
        raise InputError(f"{where}: {node_label(node)}: {len(names)} activations for "
                         f"{dirs} direction(s); the operator takes {per_dir} per direction")
    alphas = list(node_attr(node, "activation_alpha", []))
    betas = list(node_attr(node, "activation_beta", []))
    acts: list[tuple[str, tuple[float, ...]]] = []
    for name in names:
        if name not in _ACTIVATIONS:
            raise InputError(f"{where}: {node_label(node)}: activation '{name}' has no "
                             f"gradient rule in memcc (supported: "
                             f"{', '.join(sorted(_ACTIVATIONS))})")
        params = list(_ACTIVATIONS[name])
        if params and alphas:
            params[0] = alphas.pop(0)
        if len(params) > 1 and betas:
            params[1] = betas.pop(0)
        acts.append((name, tuple(params)))
    hidden = int(node_attr(node, "hidden_size", 0))
    if hidden <= 0:
        raise InputError(f"{where}: {node_label(node)}: no hidden_size attribute")
    clip = node_attr(node, "clip", None)
    lbr = bool(node_attr(node, "linear_before_reset", 0))
    return [_Cell(op, hidden, batch, acts[d * per_dir:(d + 1) * per_dir], clip, lbr)
            for d in range(dirs)]


def _per_direction(node: onnx.NodeProto, k: int, dirs: int, layout: int,
                   emit: _Emit) -> list[str] | None:
    """Input ``k`` (W, R, B, initial_h, initial_c, P; not X or sequence_lens) split into
    one part per direction, each still with a leading axis of 1."""
    if k in (0, 4) or not node.input[k]:
        return None
    v = node.input[k]
    if layout and k in (5, 6):  # initial states are [batch, dirs, hidden] in layout 1
        v = emit.one("Transpose", v, perm=[1, 0, 2])
    return emit.split(v, 0, [1] * dirs)


def _direction(cell: _Cell, xs: list[str], inputs: dict[int, str], reverse: bool,
               emit: _Emit) -> tuple[str, str, str | None]:
    """One direction over every step: its Y as [seq * batch, hidden] in time order, its
    last hidden state and (LSTM) its last cell state, each [batch, hidden]. A state the
    node does not give starts at zero, and the first step skips what reads it."""
    g, h, batch = _GATES[cell.op], cell.hidden, cell.batch
    r = emit.reshape(inputs[2], [g * h, h])
    weights = _Weights(emit.reshape(inputs[1], [g * h, -1]),
                       emit.split(r, 0, [2 * h, h]) if cell.op == "GRU" else [r])
    if 3 in inputs:
        weights.bias_x, weights.bias_rh = _biases(cell, inputs[3], emit)
    elif emit.opset < 11:   # Gemm's C is optional from opset 11 on
        weights.bias_x = emit.const(np.zeros(g * h))
        if cell.op == "GRU" and cell.linear_before_reset:
            weights.bias_rh = emit.const(np.zeros(h))
    if 7 in inputs:
        weights.peep = emit.split(emit.reshape(inputs[7], [3 * h]), 0, [h] * 3)
    state = emit.reshape(inputs[5], [batch, h]) if 5 in inputs else None
    cell_state = emit.reshape(inputs[6], [batch, h]) if 6 in inputs else None
    ys: list[str] = [""] * len(xs)
    for t in (reversed(range(len(xs))) if reverse else range(len(xs))):
        xw = emit.one("Gemm", *([xs[t], weights.w] + ([weights.bias_x] if weights.bias_x
                                                      else [])), transB=1)
        if cell.op == "LSTM":
            state, cell_state = _lstm_step(cell, xw, (state, cell_state), weights, emit)
        elif cell.op == "GRU":
            state = _gru_step(cell, xw, state, weights, emit)
        else:
            state = emit.gate(_recur(emit, state, weights.r[0], xw), cell, 0)
        ys[t] = state
    y = emit.one("Concat", *ys, axis=0) if len(ys) > 1 else ys[0]
    return y, state, cell_state


def _recur(emit: _Emit, h_prev: str | None, r: str, added: str) -> str:
    """``h_prev @ r.T + added``; ``added`` alone where the state is zero."""
    return added if h_prev is None else emit.one("Gemm", h_prev, r, added, transB=1)


def _biases(cell: _Cell, b: str, emit: _Emit) -> tuple[str, str | None]:
    """B's part added to the input product, and a GRU's candidate recurrence bias that
    ``linear_before_reset`` keeps inside the reset gate's product."""
    g, h = _GATES[cell.op], cell.hidden
    wb, rb = emit.split(emit.reshape(b, [2 * g * h]), 0, [g * h, g * h])
    if cell.op == "GRU" and cell.linear_before_reset:
        wb_zr, wb_h = emit.split(wb, 0, [2 * h, h])
        rb_zr, rb_h = emit.split(rb, 0, [2 * h, h])
        return emit.one("Concat", emit.one("Add", wb_zr, rb_zr), wb_h, axis=0), rb_h
    return emit.one("Add", wb, rb), None


def _lstm_step(cell: _Cell, xw: str, states: tuple[str | None, str | None],
               weights: _Weights, emit: _Emit) -> tuple[str, str]:
    """Gates i, o, f, c (ONNX's order); peepholes read C(t-1) for i and f, C(t) for o."""
    h_prev, c_prev = states
    pre = _recur(emit, h_prev, weights.r[0], xw)
    i, o, f, c = emit.split(pre, 1, [cell.hidden] * 4)
    if weights.peep and c_prev is not None:
        i = emit.one("Add", i, emit.one("Mul", weights.peep[0], c_prev))
        f = emit.one("Add", f, emit.one("Mul", weights.peep[2], c_prev))
    i, c = emit.gate(i, cell, 0), emit.gate(c, cell, 1)
    c_new = emit.one("Mul", i, c)
    if c_prev is not None:   # f * 0 adds nothing: the forget gate is not even computed
        c_new = emit.one("Add", emit.one("Mul", emit.gate(f, cell, 0), c_prev), c_new)
    if weights.peep:
        o = emit.one("Add", o, emit.one("Mul", weights.peep[1], c_new))
    o = emit.gate(o, cell, 0)
    h_new = emit.one("Mul", o, emit.activation(c_new, cell.activations[2]))
    return h_new, c_new


def _gru_step(cell: _Cell, xw: str, h_prev: str | None, weights: _Weights,
              emit: _Emit) -> str:
    """Gates z, r, h (ONNX's order); H(t) = h + z * (H(t-1) - h), i.e. (1 - z) h + z H."""
    h = cell.hidden
    x_zr, x_h = emit.split(xw, 1, [2 * h, h])
    zr = emit.gate(_recur(emit, h_prev, weights.r[0], x_zr), cell, 0)
    z, r = emit.split(zr, 1, [h, h])
    if cell.linear_before_reset:
        hh = weights.bias_rh if h_prev is None else emit.one(
            "Gemm", *([h_prev, weights.r[1]] + ([weights.bias_rh] if weights.bias_rh
                                                 else [])), transB=1)
        pre_h = x_h if hh is None else emit.one("Add", x_h, emit.one("Mul", r, hh))
    else:
        pre_h = x_h if h_prev is None else _recur(emit, emit.one("Mul", r, h_prev),
                                                  weights.r[1], x_h)
    cand = emit.gate(pre_h, cell, 1)
    if h_prev is None:
        return emit.one("Sub", cand, emit.one("Mul", z, cand))
    return emit.one("Add", cand, emit.one("Mul", z, emit.one("Sub", h_prev, cand)))


def _outputs(node: onnx.NodeProto, per_dir: list[list], sizes: tuple[int, int, int],
             layout: int, emit: _Emit) -> None:
    """Y [seq, dirs, batch, hidden] (layout 1: [batch, seq, dirs, hidden]), Y_h and Y_c
    [dirs, batch, hidden] (layout 1: [batch, dirs, hidden]) under the node's own names."""
    seq, batch, h = sizes
    ys, h_last, c_last = per_dir
    for k, parts in enumerate((ys, h_last, c_last)):
        if len(node.output) <= k or not node.output[k]:
            continue
        shape = [seq, 1, batch, h] if k == 0 else [1, batch, h]
        parts = [emit.reshape(p, shape) for p in parts]
        axis = 1 if k == 0 else 0
        perm = ([2, 0, 1, 3] if k == 0 else [1, 0, 2]) if layout else None
        whole = emit.one("Concat", *parts, axis=axis) if len(parts) > 1 else parts[0]
        if perm:
            emit.op("Transpose", [whole], [node.output[k]], perm=perm)
        else:
            emit.op("Identity", [whole], [node.output[k]])
