"""One half of a split step as an ORT session whose inputs and outputs are tensors we own.

The same session machinery as ``memcc.Trainer`` (``runner.session_graph``: every stored
value fed as an input; ``backend.session.make_session``: memcc's execution contract), but
every input and output is bound (IOBinding) to a tensor the caller gives, on the rank's
device (``dist.tensors``: DLPack, no copy): the halves of a data-parallel step share their
buffers that way. The gradient step writes each gradient straight into its slice of the
flat all-reduce bucket, torch reduces the bucket where it lies, and the update step reads
the slices. An update that ``passes.analysis.inplace`` proves safe is written over the
value it replaces; any other is written to a buffer of its own and copied back after the
run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from memcc.backend.runner import session_graph
from memcc.backend.session import make_session
from memcc.dist.placement import Placement
from memcc.dist.tensors import RankDevice
from memcc.errors import RuntimeFailure
from memcc.graph import Graph
from memcc.passes.analysis.inplace import analyze_in_place


@dataclass(frozen=True)
class Unbound:
    """Values a ``BoundGraph`` does not bind to the caller's tensors once for all:
    ``transient`` outputs ORT allocates at each run (``BoundGraph.release`` frees them);
    ``per_run`` inputs and outputs bound anew at each ``run_with`` (a segment's gradients
    in a bucket made for that step, values another segment made)."""

    transient: Collection[str] = ()
    per_run: Collection[str] = ()


class BoundGraph:
    """``graph`` bound to ``buffers`` (value name -> contiguous tensor on ``place``'s
    device, inputs and outputs alike); ``updates``: output -> the input it replaces (written
    in place where proven, else copied back after each run). Stored values not in
    ``buffers`` are fed from the graph's initializers (copied to the device once).
    Outputs not in ``buffers`` get tensors of their own (``outputs``), but for
    ``transient`` ones: ORT allocates those while it runs (when their producer runs, not
    before the step), ``run`` hands them over as tensors (``transient_outputs``: views of
    ORT's buffers, no copy) and ``release`` frees them (ZeRO-2: the gradients a rank sends
    to their owners, held only from the backward to their reduction)."""

    def __init__(self, graph: Graph, buffers: Mapping[str, torch.Tensor], *,
                 updates: Mapping[str, str] | None = None, place: Placement | None = None,
                 source: str = "<step>", unbound: Unbound | None = None) -> None:
        unbound = unbound or Unbound()
        self.place = place = place or Placement()
        self.device = device = RankDevice.of(place)
        self.source = source
        self.per_run = set(unbound.per_run)
        updates = dict(updates or {})
        sgraph, stored = session_graph(graph)
        self.aliased = dict(analyze_in_place(graph, updates).aliased) if updates else {}
        self.copied = {o: i for o, i in updates.items() if o not in self.aliased}
        self.outputs: dict[str, torch.Tensor] = {}
        self.session = make_session(sgraph.to_model(), place.kind, place.session_settings())
        self._keep = []  # tensors the bound OrtValues point into
        binding = self.session.io_binding()
        self._dtypes = {o: graph.info[o].np_dtype for o in sgraph.outputs}
        # What a per-run input is bound to between runs (ORT checks shapes only when it runs).
        self._placeholder = self._value(device.zeros((1,), np.float32))
        for name in sgraph.inputs:
            if name in self.per_run:
                binding.bind_ortvalue_input(name, self._placeholder)
                continue
            t = buffers[name] if name in buffers else \
                (device.place(stored[name]) if name in stored else None)
            if t is None:
                raise RuntimeFailure(f"{source}: nothing bound to the input '{name}'")
            binding.bind_ortvalue_input(name, self._value(t))
        self._transient = {o: k for k, o in enumerate(sgraph.outputs)
                           if o in set(unbound.transient)}
        self.transient_outputs: dict[str, torch.Tensor] = {}
        for out in sgraph.outputs:
            if out in self.per_run or out in self._transient:  # bound now: the order is kept
                binding.bind_output(out, *device.ort_output())
                continue
            if out in self.aliased:
                t = buffers[self.aliased[out]]
            elif out in buffers and out not in self.copied:
                t = buffers[out]
            else:
                t = device.zeros(graph.info[out].shape, graph.info[out].np_dtype)
                self.outputs[out] = t
            binding.bind_ortvalue_output(out, self._value(t))
        self._buffers = buffers
        self._binding = binding
        self._output_order = list(sgraph.outputs)

    def _value(self, t: torch.Tensor):
        self._keep.append(t)
        try:
            return self.device.ortvalue(t)
        except Exception as exc:
            raise RuntimeFailure(f"{self.source}: a bound buffer cannot be handed to ONNX "
                                 f"Runtime: {exc}") from exc

    def run(self) -> None:
        """One run; updates not written in place are copied over their inputs after it."""
        self.device.synchronize()  # what torch wrote (batch, reductions) is there
        try:
            self.session.run_with_iobinding(self._binding)
        except Exception as exc:  # pybind raises ORT's own exception types
            raise RuntimeFailure(f"{self.source}: ONNX Runtime failed while running the "
                                 f"step: {exc}") from exc
        if self.device.on_gpu:  # ORT's stream done with the outputs before torch reads them
            self._binding.synchronize_outputs()
        for out, inp in self.copied.items():
            self._buffers[inp].copy_(self.outputs[out])
        if self._transient:
            values = self._binding.get_outputs()  # the binding's order: sgraph.outputs'
            self.transient_outputs = {o: self.device.tensor(values[k], self._dtypes[o])
                                      for o, k in self._transient.items()}

    def run_with(self, inputs: Mapping[str, object], outputs: Mapping[str, torch.Tensor],
                 take: Collection[str] = ()) -> dict[str, object]:
        """One run with ``per_run`` values bound for it only: ``inputs`` (tensors, or ORT
        values another session made: no copy), ``outputs`` written into the tensors given,
        ``take`` allocated by ORT and handed back as ORT values. The binding keeps none of
        them afterwards, so what the caller drops is freed."""
        import onnxruntime as ort

        b, where = self._binding, self.device.ort_output()
        for name, v in inputs.items():
            b.bind_ortvalue_input(name, v if isinstance(v, ort.OrtValue)
                                  else self.device.ortvalue(v))
        for name, t in outputs.items():
            b.bind_ortvalue_output(name, self.device.ortvalue(t))
        for name in take:
            b.bind_output(name, *where)
        self.run()
        wanted = set(take)
        values = {o: v for o, v in zip(self._output_order, b.get_outputs(), strict=True)
                  if o in wanted} if wanted else {}
        for name in inputs:
            b.bind_ortvalue_input(name, self._placeholder)
        for name in (*outputs, *take):
            b.bind_output(name, *where)
        return values

    def release(self) -> None:
        """Free the transient outputs of the last run: the tensors handed over are dropped
        (the caller keeps none) and each output bound again without a buffer, which drops
        the binding's reference to ORT's."""
        self.transient_outputs = {}
        for out in self._transient:
            self._binding.bind_output(out, *self.device.ort_output())


def flat_arrays(names: list[str], info, extra: int = 0, device: RankDevice | None = None
                ) -> tuple[dict[str, torch.Tensor], dict[np.dtype, torch.Tensor]]:
    """One flat tensor per dtype on ``device`` holding ``names`` in order (plus ``extra``
    float32 slots): name -> its view, and dtype -> the flat tensor. Not zeroed
    (``RankDevice.unwritten``): every slot is written before it is read (gradients by ORT,
    parameters copied in, the loss by ORT and the stop flag before each reduction)."""
    device = device or RankDevice()
    sizes: dict[np.dtype, int] = {}
    for n in names:
        sizes[info[n].np_dtype] = sizes.get(info[n].np_dtype, 0) + info[n].numel
    if extra:
        sizes[np.dtype(np.float32)] = sizes.get(np.dtype(np.float32), 0) + extra
    flats = {dt: device.unwritten((k,), dt) for dt, k in sizes.items()}
    at = dict.fromkeys(flats, 0)
    views = {}
    for n in names:
        ti = info[n]
        dt = ti.np_dtype
        views[n] = flats[dt][at[dt]:at[dt] + ti.numel].view(tuple(ti.shape))
        at[dt] += ti.numel
    return views, flats
