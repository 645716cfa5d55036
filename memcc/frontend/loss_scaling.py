"""Dynamic loss scaling inside the training step, as ``torch.amp.GradScaler`` does it.

fp16 has a narrow range: gradients below about 6e-8 flush to zero. GradScaler multiplies the
loss by a large ``scale`` before the backward, divides every gradient by it before the
optimizer reads it, skips the step when a gradient came out infinite or NaN, and adapts the
scale: halve it on an overflow, double it after ``growth_interval`` steps without one. Here
the same rule is written into the step itself, so that it runs wherever the step runs (ORT,
a captured CUDA graph) with no host round trip:

- the scale is carried state, ``loss_scale.scale`` (float32 scalar, initially
  ``init_scale``), with ``loss_scale.growth_tracker`` (torch's ``_growth_tracker``, the
  clean steps since the last change; a float32 scalar, exact up to the 2^24 that
  ``growth_interval`` may reach, so that all carried state is float32): graph inputs
  whose new values are step outputs (``memcc.state``), so they are checkpointed,
  restored and resumed like momentum or ``adamw.step``;
- the backward is seeded with the scale instead of 1 (``scaled_seeds``); the loss output is
  the unscaled loss;
- ``found_inf``: some element of some gradient is not finite, read from the scaled
  gradients as torch does (a non-finite element makes ``sum(g * 0)`` NaN; one reduction
  per gradient, no gradient-sized flag tensor kept);
- every gradient is multiplied by ``1 / scale`` in float32 (``unscale``) and, for the
  optimizer, replaced by zeros when ``found_inf``;
- the optimizer reads its coefficients through ``Coefficients``: when ``found_inf`` each one
  takes the value that leaves its state unchanged (learning rate and weight decay 0, the
  momentum and Adam betas 1, the step count's increment 0). The update keeps its form,
  element-wise ``Add``/``Sub``/``Mul`` written in place (``passes.analysis.inplace``), and a
  skipped step returns every parameter and optimizer state equal to what it read (``==``:
  ``-0.0`` may come back as ``0.0``). A ``Where`` over whole tensors would have cost a
  buffer per parameter (the update could no longer be written in place) and, on ORT's CPU,
  two more temporaries per ``Where``;
- the scale and tracker are updated as ``torch._amp_update_scale_`` does (``update_scale``):
  on an overflow the scale times ``backoff_factor`` and the tracker 0; else the tracker + 1,
  and when it reaches ``growth_interval`` the scale times ``growth_factor`` (unless that is
  infinite) and the tracker 0. The products are taken in float64 and rounded to float32,
  as torch's kernel does with its double factors.

Memory: ``found_inf`` depends on every gradient, so no update may run before the whole
backward is done, and all gradients are live at once when the updates start (as in
PyTorch, where ``.grad`` holds them all). Without scaling, memcc runs each update right
after its gradient (``passes.analysis.update_schedule``) and frees the gradient there, so
the step's peak can rise by up to the parameters' size (float32), plus one gradient-sized
temporary at a time (``g * 0``, the unscaled and the zeroed gradient). The order needs no
special handling: every update reads ``found_inf``, so the early-update schedule places
them after it by the data dependency alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from memcc.errors import InputError
from memcc.frontend.build_options import BuildOptions
from memcc.frontend.emit import Emitter
from memcc.graph import Graph, TensorInfo

SCALE = "loss_scale.scale"
GROWTH_TRACKER = "loss_scale.growth_tracker"
FOUND_INF = "loss_scale.found_inf"  # an output with --optimizer none

_F32 = TensorProto.FLOAT
_SCALAR_F32 = TensorInfo(_F32, ())
_SCALAR_BOOL = TensorInfo(TensorProto.BOOL, ())


def add_scale_state(graph: Graph, opts: BuildOptions) -> str:
    """The scale and growth tracker as initializer-backed inputs; return the scale's name."""
    for name, value, ti in ((SCALE, np.asarray(opts.init_scale, np.float32), _SCALAR_F32),
                            (GROWTH_TRACKER, np.zeros((), np.float32), _SCALAR_F32)):
        if name in graph.info:
            raise InputError(f"cannot add the loss scaler's state '{name}': the name is taken")
        graph.initializers[name] = value
        graph.info[name] = ti
    return SCALE


def scaled_seeds(graph: Graph, emit: Emitter, loss: str, scale: str,
                 seeds: Mapping[str, str] | None) -> dict[str, str]:
    """The backward's seeds times the scale: the loss's gradient is ``scale`` (not 1); a
    chunked loss's gradients, already taken in the forward pass, are multiplied by it."""
    if seeds:
        return {v: emit.mul(g, emit.cast(scale, graph.info[g].dtype)) for v, g in seeds.items()}
    ti = graph.info[loss]
    return {loss: emit.expand(emit.cast(scale, ti.dtype), ti.shape)}


@dataclass(frozen=True)
class Unscaled:
    """``grads``: parameter -> its gradient divided by the scale; ``found_inf``: the bool
    scalar, true when some scaled gradient element is not finite."""

    grads: dict[str, str]
    found_inf: str


def unscale(emit: Emitter, grads: Mapping[str, str], scale: str, *,
            zero_on_inf: bool) -> Unscaled:
    """Check every gradient for non-finite elements, then divide each by the scale (times
    ``1 / scale`` in float32, as GradScaler's ``unscale_``). ``zero_on_inf``: the unscaled
    gradients are zeros when ``found_inf`` (for an optimizer, whose skipped update must
    stay finite); else they are as they came out (``--optimizer none``'s ``P.grad``)."""
    graph = emit.graph
    checks = []
    for g in dict.fromkeys(grads.values()):  # one check per value (tied parameters share)
        dt = graph.info[g].dtype
        nan_if_not_finite = emit.reduce_sum(emit.mul(g, emit.scalar(0.0, dt)), None,
                                            keepdims=False, info=TensorInfo(dt, ()))
        checks.append(emit.cast(nan_if_not_finite, _F32))
    if not checks:  # nothing trained: nothing can overflow
        found_inf = emit.const(np.asarray(False), name="found_inf")
    else:
        total = checks[0] if len(checks) == 1 else emit.op("Sum", checks, info=_SCALAR_F32)
        found_inf = emit.op("IsNaN", [total], info=_SCALAR_BOOL)
    inv = emit.op("Div", [emit.scalar(1.0, _F32), scale], info=_SCALAR_F32)
    zero = emit.scalar(0.0, _F32)
    out: dict[str, str] = {}
    done: dict[str, str] = {}
    for p, g in grads.items():
        if g not in done:
            dt = graph.info[g].dtype
            u = emit.mul(emit.cast(g, _F32), inv)
            if zero_on_inf:
                u = emit.op("Where", [found_inf, zero, u], info=graph.info[u])
            done[g] = emit.cast(u, dt)
        out[p] = done[g]
    return Unscaled(out, found_inf)


class Coefficients:
    """The optimizer's scalar coefficients: plain constants without loss scaling; with it,
    ``Where(found_inf, value_that_skips, value)``, so that an overflowing step leaves the
    state as it was (see the module docstring)."""

    def __init__(self, emit: Emitter, found_inf: str | None) -> None:
        self.emit = emit
        self.found_inf = found_inf
        self._made: dict[tuple, str] = {}

    def __call__(self, value: float, dtype: int, *, skipped: float | None = None) -> str:
        """``value`` in ``dtype``; ``skipped``: what it is on a skipped step (None: the
        same, for coefficients that multiply something already zero or unchanged)."""
        c = self.emit.scalar(value, dtype)
        if self.found_inf is None or skipped is None or skipped == value:
            return c
        key = (value, skipped, dtype)
        if key not in self._made:
            self._made[key] = self.emit.op(
                "Where", [self.found_inf, self.emit.scalar(skipped, dtype), c],
                info=TensorInfo(dtype, ()))
        return self._made[key]


def update_scale(emit: Emitter, state: dict[str, str], found_inf: str,
                 opts: BuildOptions) -> list[str]:
    """The scale and growth tracker of the next step (torch's ``_amp_update_scale_``);
    recorded in ``state``; returns the two outputs."""
    f64 = TensorProto.DOUBLE

    s64 = emit.cast(SCALE, f64)

    def times(factor: float) -> str:  # float32 scale * float64 factor, rounded to float32
        return emit.cast(emit.mul(s64, emit.scalar(factor, f64)), _F32)

    zero = emit.scalar(0.0, _F32)
    plus = emit.add(GROWTH_TRACKER, emit.scalar(1.0, _F32))
    at_interval = emit.op("Equal", [plus, emit.scalar(float(opts.growth_interval), _F32)],
                          info=_SCALAR_BOOL)
    grown = times(opts.growth_factor)
    finite = emit.op("Not", [emit.op("IsInf", [grown], info=_SCALAR_BOOL)], info=_SCALAR_BOOL)
    grow = emit.op("And", [at_interval, finite], info=_SCALAR_BOOL)
    kept_scale = emit.op("Where", [grow, grown, SCALE], info=_SCALAR_F32)
    kept_tracker = emit.op("Where", [at_interval, zero, plus], info=_SCALAR_F32)
    scale_new = emit.op("Where", [found_inf, times(opts.backoff_factor), kept_scale],
                        outputs=[f"{SCALE}.new"], info=_SCALAR_F32)
    tracker_new = emit.op("Where", [found_inf, zero, kept_tracker],
                          outputs=[f"{GROWTH_TRACKER}.new"], info=_SCALAR_F32)
    state[scale_new] = SCALE
    state[tracker_new] = GROWTH_TRACKER
    return [scale_new, tracker_new]


def metadata(opts: BuildOptions) -> dict | None:
    """The scaler's settings for the step's ``memcc.optimizer`` record (None: unscaled)."""
    if not opts.dynamic_loss_scale:
        return None
    return {"init_scale": opts.init_scale, "growth_factor": opts.growth_factor,
            "backoff_factor": opts.backoff_factor, "growth_interval": opts.growth_interval}
