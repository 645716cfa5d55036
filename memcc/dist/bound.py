"""One half of a split step as an ORT session whose inputs and outputs are arrays we own.

The same session machinery as ``memcc.Trainer`` (``runner.session_graph``: every stored
value fed as an input; ``backend.session.make_session``: memcc's execution contract), but
every input and output is bound (IOBinding) to a numpy array the caller gives: the halves
of a data-parallel step share their buffers that way. The gradient step writes each
gradient straight into its slice of the flat all-reduce bucket, torch reduces the bucket
where it lies (``torch.from_numpy``: no copy), and the update step reads the slices. An
update that ``passes.analysis.inplace`` proves safe is written over the value it
replaces; any other is written to a buffer of its own and copied back after the run.

CPU only: on CUDA the arrays would be device buffers crossing through DLPack (not built).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from memcc.backend.runner import session_graph
from memcc.backend.session import SessionSettings, make_session
from memcc.errors import RuntimeFailure
from memcc.graph import Graph
from memcc.passes.analysis.inplace import analyze_in_place


@dataclass(frozen=True)
class Unbound:
    """Values a ``BoundGraph`` does not bind to the caller's arrays once for all:
    ``transient`` outputs ORT allocates at each run (``BoundGraph.release`` frees them);
    ``per_run`` inputs and outputs bound anew at each ``run_with`` (a segment's gradients
    in a bucket made for that step, values another segment made)."""

    transient: Collection[str] = ()
    per_run: Collection[str] = ()


class BoundGraph:
    """``graph`` bound to ``buffers`` (value name -> C-contiguous array, inputs and outputs
    alike); ``updates``: output -> the input it replaces (written in place where proven,
    else copied back after each run). Stored values not in ``buffers`` are fed from the
    graph's initializers. Outputs not in ``buffers`` get arrays of their own (``outputs``),
    but for ``transient`` ones: ORT allocates those while it runs (when their producer
    runs, not before the step), ``run`` hands them over as arrays (``transient_outputs``:
    views of ORT's buffers, no copy) and ``release`` frees them (ZeRO-2: the gradients a
    rank sends to their owners, held only from the backward to their reduction)."""

    def __init__(self, graph: Graph, buffers: Mapping[str, np.ndarray], *,
                 updates: Mapping[str, str] | None = None, threads: int | None = None,
                 source: str = "<step>", unbound: Unbound | None = None) -> None:
        unbound = unbound or Unbound()
        transient = unbound.transient
        self.source = source
        self.per_run = set(unbound.per_run)
        updates = dict(updates or {})
        sgraph, stored = session_graph(graph)
        self.aliased = dict(analyze_in_place(graph, updates).aliased) if updates else {}
        self.copied = {o: i for o, i in updates.items() if o not in self.aliased}
        self.outputs: dict[str, np.ndarray] = {}
        self.session = make_session(sgraph.to_model(), "cpu",
                                    SessionSettings(intra_op_threads=threads))
        self._keep = []  # arrays the bound OrtValues point into
        binding = self.session.io_binding()
        import onnxruntime as ort

        # What a per-run input is bound to between runs (ORT checks shapes only when it runs).
        self._placeholder = ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.float32))
        for name in sgraph.inputs:
            if name in self.per_run:
                binding.bind_ortvalue_input(name, self._placeholder)
                continue
            arr = buffers[name] if name in buffers else stored.get(name)
            if arr is None:
                raise RuntimeFailure(f"{source}: nothing bound to the input '{name}'")
            binding.bind_ortvalue_input(name, self._value(arr))
        self._transient = {o: k for k, o in enumerate(sgraph.outputs) if o in set(transient)}
        self.transient_outputs: dict[str, np.ndarray] = {}
        for out in sgraph.outputs:
            if out in self.per_run or out in self._transient:  # bound now: the order is kept
                binding.bind_output(out, "cpu")
                continue
            if out in self.aliased:
                arr = buffers[self.aliased[out]]
            elif out in buffers and out not in self.copied:
                arr = buffers[out]
            else:
                ti = graph.info[out]
                arr = np.zeros(ti.shape, ti.np_dtype)
                self.outputs[out] = arr
            binding.bind_ortvalue_output(out, self._value(arr))
        self._buffers = buffers
        self._binding = binding
        self._output_order = list(sgraph.outputs)

    def _value(self, arr: np.ndarray):
        import onnxruntime as ort

        if not arr.flags.c_contiguous:
            raise RuntimeFailure(f"{self.source}: a bound buffer is not C-contiguous")
        self._keep.append(arr)
        return ort.OrtValue.ortvalue_from_numpy(arr)

    def run(self) -> None:
        """One run; updates not written in place are copied over their inputs after it."""
        try:
            self.session.run_with_iobinding(self._binding)
        except Exception as exc:  # pybind raises ORT's own exception types
            raise RuntimeFailure(f"{self.source}: ONNX Runtime failed while running the "
                                 f"step: {exc}") from exc
        for out, inp in self.copied.items():
            np.copyto(self._buffers[inp], self.outputs[out])
        if self._transient:
            values = self._binding.get_outputs()  # the binding's order: sgraph.outputs'
            self.transient_outputs = {o: values[k].numpy() for o, k in self._transient.items()}

    def run_with(self, inputs: Mapping[str, object], outputs: Mapping[str, np.ndarray],
                 take: Collection[str] = ()) -> dict[str, object]:
        """One run with ``per_run`` values bound for it only: ``inputs`` (arrays, or ORT
        values another session made: no copy), ``outputs`` written into the arrays given,
        ``take`` allocated by ORT and handed back as ORT values. The binding keeps none of
        them afterwards, so what the caller drops is freed."""
        import onnxruntime as ort

        b = self._binding
        for name, v in inputs.items():
            b.bind_ortvalue_input(name, v if isinstance(v, ort.OrtValue)
                                  else ort.OrtValue.ortvalue_from_numpy(v))
        for name, arr in outputs.items():
            b.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(arr))
        for name in take:
            b.bind_output(name, "cpu")
        self.run()
        wanted = set(take)
        values = {o: v for o, v in zip(self._output_order, b.get_outputs(), strict=True)
                  if o in wanted} if wanted else {}
        for name in inputs:
            b.bind_ortvalue_input(name, self._placeholder)
        for name in (*outputs, *take):
            b.bind_output(name, "cpu")
        return values

    def release(self) -> None:
        """Free the transient outputs of the last run: the arrays handed over are dropped
        (the caller keeps none) and each output bound again without a buffer, which drops
        the binding's reference to ORT's."""
        self.transient_outputs = {}
        for out in self._transient:
            self._binding.bind_output(out, "cpu")


def flat_arrays(names: list[str], info, extra: int = 0) -> tuple[dict[str, np.ndarray], dict]:
    """One flat array per dtype holding ``names`` in order (plus ``extra`` float32 slots):
    name -> its view, and dtype -> the flat array."""
    sizes: dict[np.dtype, int] = {}
    for n in names:
        sizes[info[n].np_dtype] = sizes.get(info[n].np_dtype, 0) + info[n].numel
    if extra:
        sizes[np.dtype(np.float32)] = sizes.get(np.dtype(np.float32), 0) + extra
    flats = {dt: np.zeros(k, dt) for dt, k in sizes.items()}
    at = dict.fromkeys(flats, 0)
    views = {}
    for n in names:
        ti = info[n]
        dt = ti.np_dtype
        views[n] = flats[dt][at[dt]:at[dt] + ti.numel].reshape(ti.shape)
        at[dt] += ti.numel
    return views, flats
