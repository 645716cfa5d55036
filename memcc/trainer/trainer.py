"""Train a memcc training step for real: ``memcc.Trainer`` and the ``memcc train`` loop.

``Trainer`` owns one ONNX Runtime session of the step and the step's carried values
(parameters, optimizer state, BatchNorm statistics). ``step(batch)`` runs one training step
and returns the loss; the carried values are updated where they live:

- Updates in place. Every input and output is bound with ORT's IOBinding. An update that
  ``passes.analysis.inplace`` proves safe (an element-wise update that runs after the last reader of
  the old value: every SGD, momentum and Adam update ``memcc build`` emits) is bound to the
  buffer of the input it replaces, so ORT writes the new value over the old one and the step
  holds one copy of that state instead of two. Any other update (BatchNorm running
  statistics, written by the BatchNormalization kernel) gets a second buffer of its own, and
  the two buffers swap roles after each step: still no copy, and the same memory as
  ``memcc run``. The kernels are the same either way, so the numbers are bit-identical to
  ``memcc run``'s copying loop (tests/test_trainer.py checks it).
- Every run goes through ``backend.device_step.DeviceStep``, the one runtime path ``memcc
  run`` uses too: on CUDA the carried values are device buffers, bound once; only the batch
  goes to the device and only the loss comes back; no arena shrink; a CUDA graph where the
  step can be captured (measured on an H200: BENCHMARKS.md, "Issue 29 on an H200").

The session is made under memcc's execution contract (``backend.session``), from the same
graph ``memcc run`` gives ORT: no tensor data in the graph, every stored value fed as an
input (``runner.session_graph``).

``state_dict()`` returns the carried values under the names of the step's inputs, which for
parameters and BatchNorm statistics are the initializer names of the model ``memcc build``
started from (for a ``torch.onnx`` export, the PyTorch ``state_dict`` names); optimizer state
is ``P.momentum``, ``P.exp_avg``, ``P.exp_avg_sq``, ``adamw.step``. ``save``/``resume`` write
and read checkpoints (``backend.checkpoint``), ``export`` writes the trained forward model or
its weights.

``train(TrainOptions)`` is ``memcc train``: data checked before any step
(``backend.data``), batches in a seeded order that a resumed run continues exactly,
checkpoints every ``save_every`` steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import DataInput, as_step_dtype, data_inputs
from memcc.backend.device_step import DeviceSettings, DeviceStep, StepRoles, step_for_provider
from memcc.backend.memory import device_baseline, fix_mmap_threshold, trim_heap
from memcc.backend.session import provider_as_planned
from memcc.backend.step_feeds import refuse_bfloat16_feeds
from memcc.errors import InputError
from memcc.frontend.dropout_masks import COUNTER, checkpoint_counter
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.passes.analysis.arrange import ArrangedStep, arrange_step
from memcc.passes.analysis.device_memory import DevicePrediction, predict_device
from memcc.passes.analysis.inplace import InPlaceUpdates
from memcc.step import RANKS_KEY, TrainingStep
from memcc.trainer.checkpoints import checkpoint_tensors, step_signature, step_tensors
from memcc.trainer.export import ExportRequest, export_weights


@dataclass(frozen=True)
class TrainerOptions:
    """How a ``Trainer`` runs its step (``Trainer``'s docstring says what each does).

    ``Trainer`` also takes these as keywords (``memcc.Trainer(path, provider="cuda")``),
    the form README documents; this type gathers them where they travel together."""

    provider: str | None = None      # None: where the plan was made, else the CPU
    threads: int | None = None
    in_place: bool = True
    early_updates: bool = True
    arena: bool | None = None        # None: as the plan was compiled
    cuda_graph: bool | None = None   # None: captured where possible (``DeviceStep``)
    deterministic: bool = False


class Trainer:
    """One training step file, ready to train: ``step(batch) -> loss`` and checkpoints.

    ``provider``: ``cpu``, ``cuda`` or ``auto``; None (default): where the plan was made
    (``memcc compile --provider``), else the CPU, with a note in ``provider_note`` where that
    differs from the plan's (``backend.session.provider_as_planned``). ``threads``: ORT
    intra-op threads (default: ORT's choice; results are bit-identical run to run at one
    count, not always across counts: ORT's small MatMuls, docs/DETERMINISM.md).
    ``in_place=False`` gives every update its own buffer (the copying behaviour of
    ``memcc run``), for comparisons; ``early_updates=False`` keeps the file's node order
    (``passes.analysis.arrange`` moves updates early only where that predicts a lower peak).
    ``predicted_peak_bytes`` is the liveness prediction of the arrangement that runs.
    A resumed run needs no session of its own: Dropout masks depend on the step's carried
    counter (``frontend.dropout_masks``), which a checkpoint restores.
    ``arena`` (CPU): allocate through ORT's CPU arena; by default wherever the plan was
    compiled for it (``memcc compile --arena``). Without it glibc's heap can hold several
    times the plan's peak between steps (BENCHMARKS.md, "Allocators").
    """

    def __init__(self, step_path: str | os.PathLike, options: TrainerOptions | None = None,
                 *, graph: Graph | None = None, **settings: Any) -> None:
        """``settings``: ``TrainerOptions`` fields as keywords, over ``options``. ``graph``:
        the step already loaded from ``step_path`` (``memcc train`` has read it)."""
        opts = replace(options or TrainerOptions(), **settings)
        provider, threads, arena = opts.provider, opts.threads, opts.arena
        deterministic = opts.deterministic
        self.path = Path(step_path)
        loaded = graph if graph is not None else load_graph(self.path)
        self.provider, self.provider_note = provider_as_planned(
            provider, TrainingStep.of(loaded).planned_provider)
        # On CUDA, training-mode BatchNorm is written as standard ops (passes/
        # batchnorm_for_cuda.py); ``export`` writes the step's own form back out.
        # What to know about how it runs (the provider note first; a 16-bit step's nodes
        # without kernels here).
        self.notes: list[str] = [self.provider_note] if self.provider_note else []
        ranks = _planned_ranks(loaded)
        if ranks:
            self.notes.append(ranks)
        self.graph, self._rewritten_for_provider = step_for_provider(
            loaded, self.provider, deterministic=deterministic, notes=self.notes)
        self.spec = TrainingStep.of(self.graph).validate(
            str(self.path), then="memcc.Trainer('step.onnx')")
        refuse_bfloat16_feeds(self.graph, source=str(self.path), doing="train the step")
        if arena and self.provider != "cpu":
            raise InputError("--arena is for the CPU provider: CUDA always allocates through "
                             "its arena")
        self.arena = self.provider == "cpu" and (
            self.spec.allocator == "arena" if arena is None else arena)
        self.threads = threads
        self.inputs: list[DataInput] = data_inputs(self.graph, self.spec)
        self.steps_done = 0
        self.data_state: dict = {}
        self.updates: dict[str, str] = dict(self.spec.state)  # output -> input it replaces
        self._device_prediction: DevicePrediction | None = None
        # NVML's reading before this trainer's session exists (CUDA, with pynvml).
        self.device_baseline = device_baseline() if self.provider == "cuda" else None
        self.arrangement: ArrangedStep = arrange_step(self.graph, self.spec,
                                                     in_place=opts.in_place,
                                                     early_updates=opts.early_updates,
                                                     host_copies=self.provider == "cuda")
        self.in_place: InPlaceUpdates = self.arrangement.in_place
        self._step = DeviceStep(
            self.arrangement.graph,
            StepRoles(loss=self.spec.loss, updates=self.updates,
                      aliased=self.in_place.aliased),
            DeviceSettings(provider=self.provider, threads=threads, cpu_arena=self.arena,
                           cuda_graph=opts.cuda_graph),
            source=str(self.path))
        self.deterministic = bool(deterministic)
        # The initial values stored in the file are not needed any more (state_dict and
        # export read the live ones): without this the process holds the state twice.
        for n in self._step.state:
            self.graph.initializers.pop(n, None)
        trim_heap()  # and give the freed loading buffers back (glibc keeps them otherwise)
        if self.provider == "cpu" and self.arena:
            # Kernel heap buffers freed in a step go back at once, as the arena model counts
            # them (``backend.memory.fix_mmap_threshold``).
            fix_mmap_threshold()

    # ------------------------------------------------------------------ values
    @property
    def predicted_peak_bytes(self) -> int:
        """The liveness prediction of the arrangement that runs (CUDA: the device model,
        ``device_prediction``, steady state)."""
        if self.provider == "cuda":
            return self.device_prediction.steady_bytes
        return self.arrangement.prediction.peak_bytes

    @property
    def device_prediction(self) -> DevicePrediction:
        """What the step holds on the device from its second step on, and in its first
        (``passes.analysis.device_memory.predict_device``); computed once, when first asked."""
        if self._device_prediction is None:
            a = self.arrangement
            self._device_prediction = predict_device(a.graph, a.prediction,
                                                     aliased=a.in_place.aliased,
                                                     updates=self.updates)
        return self._device_prediction

    @property
    def cuda_graph(self) -> str:
        """Whether the step runs as a captured CUDA graph, or why not."""
        if self.provider != "cuda":
            return "not applicable (CPU)"
        return "captured" if self._step.captured else (self._step.cuda_graph_note or "off")

    @property
    def batch_size(self) -> int:
        return self.inputs[0].batch_size if self.inputs else 1

    def held_bytes(self) -> int:
        """Bytes of the arrays the trainer holds for its session: state, bound batch and
        outputs, constants (what a memory meter with a baseline after loading must add)."""
        return self._step.held_bytes()

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of every carried value (parameters, optimizer state, BN statistics) as
        the step carries them: a grouped update's optimizer state joined
        (``grouped.float32.momentum``; checkpoints hold it per parameter,
        ``trainer.checkpoints.checkpoint_tensors``)."""
        return self._step.state_dict()

    def state_value(self, name: str) -> np.ndarray:
        """A copy of one carried value (e.g. ``loss_scale.scale``), without copying the rest."""
        return self._step.value(name)

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters only."""
        sd = self.state_dict()
        return {p: sd[p] for p in self.spec.parameters if p in sd}

    def load_state_dict(self, tensors: Mapping[str, np.ndarray], *, source: str = "state"
                        ) -> None:
        """Overwrite every carried value; names, dtypes and shapes must match exactly (a
        grouped update's optimizer state joined, as ``state_dict`` gives it, or per
        parameter, as checkpoints hold it)."""
        tensors = step_tensors(self.graph, self.spec, tensors)
        missing = sorted(set(self._step.state) - set(tensors))
        extra = sorted(set(tensors) - set(self._step.state))
        if missing or extra:
            raise InputError(f"{source}: carried values differ from the step's: missing "
                             f"{missing[:5]}, unexpected {extra[:5]}")
        for name, arr in tensors.items():
            want = self._host_type(name)
            a = np.asarray(arr)
            if (a.dtype, tuple(a.shape)) != want:
                raise InputError(f"{source}: '{name}' is {a.dtype} {list(a.shape)}; the step "
                                 f"carries {want[0]} {list(want[1])}")
        self._step.load_state(tensors)  # into the buffers ORT reads: the bindings stay valid

    def _host_type(self, name: str) -> tuple[np.dtype, tuple[int, ...]]:
        ti = self.graph.info[name]
        return ti.np_dtype, tuple(ti.shape)

    def signature(self) -> dict:
        return step_signature(self.graph, self.spec)

    # ------------------------------------------------------------------ training
    def check_batch(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch as C-contiguous arrays in the step's types, or an error naming the
        array at fault. Types convert as ``memcc train --data`` converts them
        (``as_step_dtype``: int32 labels, numpy's float64), so that a loop over the same
        arrays trains in Python as on the command line."""
        feeds = {}
        for d in self.inputs:
            if d.name not in batch:
                raise InputError(f"batch: no array '{d.name}' (the step's data inputs are "
                                 f"{[x.name for x in self.inputs]})")
            a = np.asarray(batch[d.name])
            want = (d.batch_size, *d.sample_shape)
            if tuple(a.shape) != want:
                raise InputError(f"batch: array '{d.name}' has shape {list(a.shape)} dtype "
                                 f"{a.dtype}; the step expects shape {list(want)} dtype "
                                 f"{d.dtype}")
            a = as_step_dtype(a, d.dtype, f"batch: array '{d.name}' is {a.dtype}")
            feeds[d.name] = np.asarray(a, order="C")
        return feeds

    def step(self, batch: Mapping[str, np.ndarray]) -> float:
        """Run one training step on ``batch`` (name -> array); return the loss."""
        loss = self._step.run(self.check_batch(batch)).loss
        self.steps_done += 1
        return loss

    # ------------------------------------------------------------------ checkpoints
    def save(self, directory: str | os.PathLike, *, data_state: Mapping | None = None,
             keep: int = 2) -> Path:
        """Write a checkpoint of the current state into ``directory`` (atomically)."""
        if data_state is not None:
            self.data_state = dict(data_state)
        # On CPU the live arrays go straight to the writer (no copy: nothing runs meanwhile).
        state = checkpoint_tensors(self.graph, self.spec, self._step.host_state())
        return ckpt.save(directory, state, ckpt.CheckpointInfo(
            step=self.steps_done, sig=self.signature(), data_state=self.data_state,
            step_file=str(self.path.resolve())), keep=keep)

    def restore(self, checkpoint: str | os.PathLike | ckpt.Checkpoint) -> ckpt.Checkpoint:
        """Load a checkpoint (file, directory = its newest, or a loaded one) into this run.

        Dropout masks need nothing else: they are drawn from the step's carried counter
        (``dropout.step``, restored with the other carried values), so a resumed run
        draws the uninterrupted run's masks in the same session."""
        c = self.checked(checkpoint)
        self.load_state_dict(c.tensors, source=str(c.path))
        self.steps_done = c.step
        self.data_state = dict(c.data_state)
        return c

    def checked(self, checkpoint: str | os.PathLike | ckpt.Checkpoint) -> ckpt.Checkpoint:
        """The checkpoint, refused unless it belongs to this step. One written for the same
        step before Dropout masks had a counter holds no ``dropout.step``: it is accepted,
        with the counter set to its step (``dropout_masks.checkpoint_counter``)."""
        c = checkpoint if isinstance(checkpoint, ckpt.Checkpoint) else ckpt.load(checkpoint)
        sig = self.signature()
        if COUNTER in sig["state"] and c.fingerprint == ckpt.fingerprint(
                {**sig, "state": {k: v for k, v in sig["state"].items() if k != COUNTER}}):
            return replace(c, tensors=checkpoint_counter(c.tensors, c.step, set(self._step.state)))
        c.check_step(sig)
        return c

    @classmethod
    def resume(cls, directory: str | os.PathLike, step_path: str | os.PathLike | None = None,
               **options) -> Trainer:
        """A trainer continuing from the newest checkpoint in ``directory``.

        ``step_path`` defaults to the step file the checkpoint was written from (a compiled
        version of the same step works too: the checkpoint belongs to the carried values,
        not to the schedule)."""
        c = ckpt.load(directory)
        path = step_path if step_path is not None else c.step_file
        if path is None:
            raise InputError(f"{c.path}: does not record its step file; pass step_path")
        trainer = cls(path, **options)
        trainer.restore(c)
        return trainer

    # ------------------------------------------------------------------ export
    def export(self, path: str | os.PathLike, *, format: str | None = None,
               eval_mode: bool = False) -> Path:
        """Write the trained forward model (``onnx``; with ``eval_mode`` as inference runs
        it, ``memcc export --eval``) or its weights (``safetensors``); the format defaults
        to the file suffix."""
        graph, spec = self.graph, self.spec
        if self._rewritten_for_provider:
            graph = load_graph(self.path)
            spec = TrainingStep.of(graph)
        return export_weights(graph, spec, self.state_dict(),
                              ExportRequest(path, format, [("the training step", self.path)],
                                            eval_mode),
                              source=str(self.path))


def _planned_ranks(graph: Graph) -> str | None:
    """A note where the step was compiled for data-parallel ranks (``memcc compile --nproc``)
    and one process trains it: the plan checked a rank's step, not this one (the data-parallel
    run warns of other ranks; one process said nothing)."""
    text = graph.metadata.get(RANKS_KEY)
    if not text:
        return None
    try:
        r = json.loads(text)
        return (f"this step was planned for {int(r['world_size'])} data-parallel ranks "
                f"(memcc compile --nproc {int(r['world_size'])} --zero {int(r['zero'])}), "
                "and one process trains it: the plan's per-rank budget was not checked for "
                "this step (train with --nproc, or compile without it)")
    except (ValueError, KeyError, TypeError):
        return None


def describe_in_place(trainer: Trainer) -> str:
    """One line: how many updates are written in place, and why the others are not."""
    n, m = len(trainer.in_place.aliased), len(trainer.updates)
    if not trainer.in_place.refused:
        return f"{n}/{m} updates in place"
    first = next(iter(trainer.in_place.refused.items()))
    return f"{n}/{m} updates in place ('{first[0]}' not: {first[1]})"

