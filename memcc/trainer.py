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

import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import DataInput, Dataset, data_inputs, load_dataset
from memcc.backend.device_step import (
    DeviceSettings,
    DeviceStep,
    StepRoles,
    step_for_provider,
)
from memcc.backend.memory import device_baseline, trim_heap
from memcc.backend.session import resolve_provider
from memcc.errors import InputError, RuntimeFailure
from memcc.frontend.dropout_masks import COUNTER, checkpoint_counter, restore_dropouts
from memcc.frontend.load import load_graph
from memcc.graph import Graph, ancestors
from memcc.passes.analysis.arrange import ArrangedStep, arrange_step
from memcc.passes.analysis.device_memory import DevicePrediction, predict_device
from memcc.passes.analysis.inplace import InPlaceUpdates
from memcc.step import PLAN_KEY, TrainingStep

EXPORT_FORMATS = ("onnx", "safetensors")


class Trainer:
    """One training step file, ready to train: ``step(batch) -> loss`` and checkpoints.

    ``provider``: ``cpu``, ``cuda`` or ``auto``. ``threads``: ORT intra-op threads (default:
    ORT's choice; results are bit-identical at any count, docs/DETERMINISM.md).
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

    def __init__(self, step_path: str | os.PathLike, *, provider: str = "cpu",
                 threads: int | None = None, in_place: bool = True,
                 early_updates: bool = True, graph: Graph | None = None,
                 arena: bool | None = None, cuda_graph: bool | None = None,
                 deterministic: bool = False) -> None:
        self.path = Path(step_path)
        self.provider = resolve_provider(provider)
        # On CUDA, training-mode BatchNorm is written as standard ops (passes/
        # batchnorm_for_cuda.py); ``export`` writes the step's own form back out.
        self.graph, self._rewritten_for_provider = step_for_provider(
            graph if graph is not None else load_graph(self.path), self.provider,
            deterministic=deterministic)
        self.spec = TrainingStep.of(self.graph).validate(
            str(self.path), then="memcc.Trainer('step.onnx')")
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
        self.arrangement: ArrangedStep = arrange_step(self.graph, self.spec, in_place=in_place,
                                                     early_updates=early_updates,
                                                     host_copies=self.provider == "cuda")
        self.in_place: InPlaceUpdates = self.arrangement.in_place
        self._step = DeviceStep(
            self.arrangement.graph,
            StepRoles(loss=self.spec.loss, updates=self.updates,
                      aliased=self.in_place.aliased),
            DeviceSettings(provider=self.provider, threads=threads, cpu_arena=self.arena,
                           cuda_graph=cuda_graph),
            source=str(self.path))
        self.deterministic = bool(deterministic)
        # The initial values stored in the file are not needed any more (state_dict and
        # export read the live ones): without this the process holds the state twice.
        for n in self._step.state:
            self.graph.initializers.pop(n, None)
        trim_heap()  # and give the freed loading buffers back (glibc keeps them otherwise)

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
        """Copies of every carried value (parameters, optimizer state, BN statistics)."""
        return self._step.state_dict()

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters only."""
        sd = self.state_dict()
        return {p: sd[p] for p in self.spec.parameters if p in sd}

    def load_state_dict(self, tensors: Mapping[str, np.ndarray], *, source: str = "state"
                        ) -> None:
        """Overwrite every carried value; names, dtypes and shapes must match exactly."""
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
        """The batch as C-contiguous arrays, or an error naming the array at fault."""
        feeds = {}
        for d in self.inputs:
            if d.name not in batch:
                raise InputError(f"batch: no array '{d.name}' (the step's data inputs are "
                                 f"{[x.name for x in self.inputs]})")
            a = np.asarray(batch[d.name])
            want = (d.batch_size, *d.sample_shape)
            if tuple(a.shape) != want or a.dtype != d.dtype:
                raise InputError(f"batch: array '{d.name}' has shape {list(a.shape)} dtype "
                                 f"{a.dtype}; the step expects shape {list(want)} dtype "
                                 f"{d.dtype}")
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
        state = self._step.host_state()
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
    def export(self, path: str | os.PathLike, *, format: str | None = None) -> Path:
        """Write the trained forward model (``onnx``) or its weights (``safetensors``);
        the format defaults to the file suffix."""
        graph, spec = self.graph, self.spec
        if self._rewritten_for_provider:
            graph = load_graph(self.path)
            spec = TrainingStep.of(graph)
        return export_weights(graph, spec, self.state_dict(), path, format=format,
                              source=str(self.path),
                              inputs=[("the training step", self.path)])


def step_signature(graph: Graph, spec: TrainingStep) -> dict:
    """What a checkpoint must share with a step to belong to it (``backend.checkpoint``)."""
    carried = {inp: (graph.info[inp].np_dtype, tuple(graph.info[inp].shape))
               for inp in spec.state.values()}
    data = {n: [str(graph.info[n].np_dtype), list(graph.info[n].shape)]
            for n in spec.data_or_free_inputs() if n in graph.info}
    return ckpt.signature(carried, {"optimizer": spec.optimizer.get("name"),
                                    "loss": spec.loss, "data_inputs": data})


# ---------------------------------------------------------------------------- export
def export_checkpoint(step_path: str | os.PathLike, checkpoint: str | os.PathLike,
                      output: str | os.PathLike, *, format: str | None = None,
                      warn: Callable[[str], None] | None = None) -> Path:
    """``memcc export``: the trained weights of ``checkpoint`` out of ``step_path``'s model.

    ``warn`` hears about parameters a PyTorch ``load_state_dict`` will not find by name."""
    path = Path(step_path)
    graph = load_graph(path)
    spec = TrainingStep.of(graph).validate(
        str(path), then="memcc train step.onnx --data DATA --checkpoint DIR; memcc export "
                        "reads the step a checkpoint was trained with, not the forward model")
    c = ckpt.load(checkpoint, sig=step_signature(graph, spec), purpose="export")
    out = export_weights(graph, spec, c.tensors, output, format=format, source=str(path),
                         inputs=[("the training step", path), ("the checkpoint", c.path)])
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
                     "these names")
    merged = {p: src["merged"] for p, src in spec.parameter_sources().items()
              if src.get("merged")}
    if merged:
        p, names = next(iter(merged.items()))
        notes.append(f"{sum(len(m) for m in merged.values())} PyTorch parameter(s) were merged "
                     f"by the exporter's optimizer and trained as one tied parameter with "
                     f"another (e.g. {', '.join(names[:2])} with {p}); each is written with "
                     "its group's trained value")
    folded = sorted(spec.folded_parameters())
    if folded:
        notes.append(f"{len(folded)} PyTorch parameter(s) have no trained value (folded into "
                     f"constants by the exporter, or unused), e.g. '{folded[0]}'; they are not "
                     "written: load with load_state_dict(..., strict=False), and the module "
                     "keeps the values it was exported with")
    return notes


def export_weights(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray],
                   output: str | os.PathLike, *, format: str | None = None,
                   source: str = "<step>",
                   inputs: Iterable[tuple[str, str | os.PathLike]] = ()) -> Path:
    """Write the forward model with ``state`` as its weights, or those weights alone.
    ``inputs``: the files the export reads (the step, the checkpoint), which ``output``
    must not overwrite (``check_writable``)."""
    from memcc.backend.onnx_file import check_writable, save_graph

    out = Path(output)
    fmt = (format or ("safetensors" if out.suffix == ".safetensors" else "onnx")).lower()
    if fmt not in EXPORT_FORMATS:
        raise InputError(f"--format '{format}': choose one of {', '.join(EXPORT_FORMATS)}")
    check_writable(out, "the exported model", "--output/-o", inputs=inputs)
    fwd = forward_graph(graph, spec, state, source=source)
    if fmt == "onnx":
        return save_graph(fwd, out)
    sources = spec.parameter_sources()
    weights: dict[str, np.ndarray] = {}
    for n in exported_weight_names(graph, spec, fwd):
        # Under every PyTorch name the value stands for (merged and tied parameters too),
        # so that a strict load_state_dict finds them all; else under its own name.
        for name in sources.get(n, {}).get("pytorch_names") or [n]:
            weights.setdefault(name, np.asarray(state[n]))
    return ckpt.write_safetensors(out, weights, {"format": "pt", "memcc.step_file": source})


def made_up_names(spec: TrainingStep) -> list[str]:
    """Parameters whose names the exporter made up (``onnx::MatMul_12``, ``val_3``; recorded
    by ``memcc build``): a PyTorch ``load_state_dict`` will not find them by these names."""
    return [p for p, src in spec.parameter_sources().items() if not src.get("named", True)]


def exported_weight_names(graph: Graph, spec: TrainingStep, fwd: Graph) -> list[str]:
    """Parameters, other carried values the forward model reads, and BatchNorm statistics
    (carried in training mode, frozen in eval-mode exports); never optimizer state, which
    only update nodes read."""
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
    out.set_nodes([*out.nodes, onnx.helper.make_node(
        "MatMul", list(proj["inputs"]), [proj["output"]], name=f"{proj['output']}.projection")])
    return out


def forward_graph(graph: Graph, spec: TrainingStep, state: Mapping[str, np.ndarray], *,
                  source: str = "<step>") -> Graph:
    """The forward model inside a step: the nodes its outputs need, ``state`` as weights."""
    outputs = list(spec.forward_outputs)
    if not outputs:
        raise InputError(f"{source}: the step does not record its forward model's outputs "
                         "(memcc.forward_outputs, written by memcc build since this version)"
                         "; rebuild the step with memcc build to export it")
    # A rewritten Dropout goes back as the plain node (the counter is the step's alone).
    graph = restore_dropouts(_with_projection(graph, spec))
    du = graph.def_use()
    stored = set(graph.initializers) | set(state)
    reached, values = ancestors(outputs, du.producer)
    for v in values:
        if v not in du.producer and v not in stored and v not in graph.inputs:
            raise InputError(f"{source}: forward output '{v}' is not computed in the step")
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
        metadata={k: v for k, v in graph.metadata.items() if not k.startswith("memcc.")},
        name=graph.name,
    )


# ---------------------------------------------------------------------------- memcc train
@dataclass(frozen=True)
class TrainOptions:
    """``memcc train``'s options (the CLI fills this)."""

    step: Path
    data: Path
    steps: int | None = None
    epochs: int | None = None
    seed: int = 0
    checkpoint: Path | None = None
    save_every: int | None = None
    resume: bool = False
    provider: str = "cpu"
    threads: int | None = None
    keep: int = 2
    arena: bool | None = None   # None: as the plan was compiled (``Trainer``)
    cuda_graph: bool | None = None   # None: captured where possible (``DeviceStep``)
    deterministic: bool = False

    def __post_init__(self) -> None:
        if self.steps is not None and self.epochs is not None:
            raise InputError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise InputError("--steps must be at least 1")
        if self.epochs is not None and self.epochs < 1:
            raise InputError("--epochs must be at least 1")
        if self.save_every is not None and self.save_every < 1:
            raise InputError("--save-every must be at least 1")
        if (self.save_every is not None or self.resume) and self.checkpoint is None:
            raise InputError("--save-every and --resume need --checkpoint DIR")


@dataclass
class TrainProgress:
    """What the progress callback gets after every step."""

    step: int
    total: int
    loss: float
    samples_per_s: float
    memory_bytes: int | None      # the process's resident memory (CPU), else None
    # The memory the plan counts, measured around this step (``StepMemory``): CPU with the
    # arena and CUDA with pynvml; None where it is not measured (malloc: see ``memory_bytes``).
    step_peak_bytes: int | None = None


@dataclass
class TrainResult:
    start_step: int
    steps_done: int
    total_steps: int
    losses: list[float] = field(default_factory=list)
    checkpoint: str | None = None
    resumed_from: str | None = None
    samples_per_s: float | None = None
    batch_size: int = 0
    batches_per_epoch: int = 0
    allocator: str = "malloc"    # CPU: "arena" or "malloc"; "cuda-arena" on CUDA
    # What a user should know before the first step (a plan made for another allocator).
    notes: list[str] = field(default_factory=list)
    # The signal that stopped the run early (``SIGINT``, ``SIGTERM``), else None.
    interrupted: str | None = None
    # ``StepMemory.to_json``: what the plan predicts for the step as it trains, what was
    # measured, and how.
    memory: dict = field(default_factory=dict)
    # How the step runs: "captured" as a CUDA graph, or why not; and deterministic compute.
    cuda_graph: str | None = None
    deterministic: bool = False

    def to_json(self) -> dict:
        return {
            "start_step": self.start_step, "steps": self.steps_done,
            "total_steps": self.total_steps, "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else None,
            "checkpoint": self.checkpoint, "resumed_from": self.resumed_from,
            "samples_per_s": self.samples_per_s, "batch_size": self.batch_size,
            "batches_per_epoch": self.batches_per_epoch, "allocator": self.allocator,
            "notes": self.notes, "interrupted": self.interrupted, "memory": self.memory,
            "cuda_graph": self.cuda_graph, "deterministic": self.deterministic,
        }


@dataclass(frozen=True)
class TrainPlan:
    """What a run will do, known before any step: ``memcc train --batch-size-check``."""

    dataset: Dataset
    inputs: list[DataInput]
    total_steps: int

    def describe(self) -> str:
        d = self.dataset
        return (f"{d.num_samples} samples in {len(d.files)} file(s), batch size "
                f"{d.batch_size}: {d.batches_per_epoch} batches per epoch "
                f"({d.dropped_per_epoch} samples dropped per epoch), {self.total_steps} steps")


def plan_training(opts: TrainOptions, graph: Graph | None = None) -> TrainPlan:
    """Check the step and the data against each other; nothing runs."""
    graph = graph if graph is not None else load_graph(opts.step)
    spec = TrainingStep.of(graph).validate(str(opts.step),
                                           then=f"memcc train step.onnx --data {opts.data}")
    inputs = data_inputs(graph, spec)
    dataset = load_dataset(opts.data, inputs)
    total = opts.steps if opts.steps is not None else \
        (opts.epochs or 1) * dataset.batches_per_epoch
    return TrainPlan(dataset, inputs, total)


def train(opts: TrainOptions, *, on_start: Callable[[TrainResult], None] | None = None,
          on_step: Callable[[TrainProgress], None] | None = None) -> TrainResult:
    """``memcc train``: check everything, resume if asked, train, checkpoint."""
    graph = load_graph(opts.step)
    plan = plan_training(opts, graph)
    dataset = plan.dataset
    data_fp = dataset.fingerprint()
    start = None
    if opts.resume:
        assert opts.checkpoint is not None
        start = ckpt.latest(opts.checkpoint)
    elif opts.checkpoint is not None and ckpt.latest(opts.checkpoint) is not None:
        raise InputError(
            f"--checkpoint {opts.checkpoint}: already holds a run's checkpoints (newest: "
            f"{ckpt.latest(opts.checkpoint).name}). Pass --resume to continue it, or choose "
            "an empty directory for a new run.")
    if opts.checkpoint is not None:
        ckpt.check_directory(opts.checkpoint)  # now, not after the steps before the first save
    loaded = ckpt.load(start) if start is not None else None
    trainer = Trainer(opts.step, provider=opts.provider, threads=opts.threads, graph=graph,
                      arena=opts.arena, cuda_graph=opts.cuda_graph,
                      deterministic=opts.deterministic)
    if loaded is not None:
        loaded = trainer.checked(loaded)
        _check_data_state(loaded, opts.seed, data_fp)
        trainer.restore(loaded)
    position = int(trainer.data_state.get("batches_consumed", trainer.steps_done))
    result = TrainResult(start_step=trainer.steps_done, steps_done=trainer.steps_done,
                         total_steps=plan.total_steps,
                         resumed_from=str(loaded.path) if loaded is not None else None,
                         batch_size=dataset.batch_size,
                         batches_per_epoch=dataset.batches_per_epoch,
                         allocator=_allocator(trainer), notes=_allocator_notes(trainer),
                         cuda_graph=trainer.cuda_graph if trainer.provider == "cuda" else None,
                         deterministic=trainer.deterministic)
    if trainer.provider == "cuda":
        same = ("yes (--deterministic)" if trainer.deterministic else
                "no: runs may differ in the last bits (--deterministic)")
        result.notes.append(f"CUDA graph: {trainer.cuda_graph}; reproducible: {same}")
    meter = StepMemory(trainer)
    result.memory = meter.to_json()
    if on_start is not None:
        on_start(result)
    last_saved = trainer.steps_done if loaded is not None else None
    t0 = time.perf_counter()
    done_here = 0
    with _stop_requests() as stop:
        while trainer.steps_done < plan.total_steps and not stop:
            batch = dataset.batch(position, opts.seed)
            meter.start(batch)
            loss = trainer.step(batch)
            step_peak = meter.stop()
            del batch
            position += 1
            done_here += 1
            result.losses.append(loss)
            result.steps_done = trainer.steps_done
            elapsed = time.perf_counter() - t0
            rate = done_here * dataset.batch_size / elapsed if elapsed > 0 else 0.0
            result.samples_per_s = rate
            if opts.checkpoint is not None and opts.save_every and \
                    trainer.steps_done % opts.save_every == 0:
                result.checkpoint = str(trainer.save(
                    opts.checkpoint,
                    data_state=_data_state(opts.seed, position, dataset, data_fp),
                    keep=opts.keep))
                last_saved = trainer.steps_done
            if on_step is not None:
                on_step(TrainProgress(trainer.steps_done, plan.total_steps, loss, rate,
                                      _memory_bytes(opts.provider), step_peak))
        # The last completed step is saved here, at the end or when a signal stopped the
        # loop early (still under ``_stop_requests``: a signal now does not cut the write).
        if opts.checkpoint is not None and last_saved != trainer.steps_done:
            result.checkpoint = str(trainer.save(
                opts.checkpoint, data_state=_data_state(opts.seed, position, dataset, data_fp),
                keep=opts.keep))
        elif opts.checkpoint is not None and result.checkpoint is None:
            latest = ckpt.latest(opts.checkpoint)
            result.checkpoint = str(latest) if latest is not None else None
    result.memory = meter.to_json()
    if stop and result.steps_done < result.total_steps:
        result.interrupted = stop.name
        raise TrainingInterrupted(result, stop.signum)
    return result


class TrainingInterrupted(Exception):
    """``memcc train`` stopped on SIGINT or SIGTERM after a completed step; ``result`` says
    which step, and ``result.checkpoint`` is that step's checkpoint (None without
    ``--checkpoint``). Not a ``MemccError``: nothing was wrong with the input."""

    def __init__(self, result: TrainResult, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step "
                         f"{result.steps_done}")
        self.result = result
        self.signum = signum


class _StopRequest:
    """Set by the first SIGINT or SIGTERM; true once a stop was asked for."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


@contextmanager
def _stop_requests() -> Iterator[_StopRequest]:
    """Turn SIGINT and SIGTERM into a request to stop after the running step.

    A signal that raised ``KeyboardInterrupt`` inside ``Trainer.step`` could land between
    ORT writing the new state in place and the step count moving on, and a checkpoint
    saved then would pair the new parameters with the old step. So the first signal only
    asks the loop to stop once the running step is complete (the loop then saves that
    step); a second SIGINT gives up on the step at once (``KeyboardInterrupt``, nothing
    saved: the last checkpoint stands). Python lets only the main thread set handlers;
    elsewhere (a training thread of the user's) signals keep their own handlers."""
    stop = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def on_signal(signum: int, frame) -> None:
        if stop and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.signum = stop.signum or signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _data_state(seed: int, position: int, dataset: Dataset, fingerprint: str) -> dict:
    epoch, batch = divmod(position, dataset.batches_per_epoch)
    return {"seed": seed, "batches_consumed": position, "epoch": epoch,
            "batch_in_epoch": batch, "batches_per_epoch": dataset.batches_per_epoch,
            "data": fingerprint, "samples": dataset.num_samples}


def _check_data_state(c: ckpt.Checkpoint, seed: int, fingerprint: str) -> None:
    ds = c.data_state
    if not ds:
        return
    if ds.get("seed") != seed:
        raise InputError(f"{c.path}: this run was started with --seed {ds.get('seed')}; resume "
                         f"it with the same seed (got --seed {seed}) so the data order "
                         "continues where it stopped")
    if ds.get("data") != fingerprint:
        raise InputError(f"{c.path}: this run was trained on other data ({ds.get('samples')} "
                         "samples, another content digest); resume it with the same --data")


def _allocator(trainer: Trainer) -> str:
    if trainer.provider != "cpu":
        return "cuda-arena"
    return "arena" if trainer.arena else "malloc"


def _allocator_notes(trainer: Trainer) -> list[str]:
    """A compiled plan trained straight from malloc: the plan holds, glibc's heap need not."""
    if trainer.provider != "cpu" or trainer.arena or PLAN_KEY not in trainer.graph.metadata:
        return []
    return [f"{trainer.path}: this plan was compiled for malloc, and glibc's heap can hold "
            "several times a plan's peak between steps (BENCHMARKS.md, \"Allocators\"), "
            "so the memory shown is the process's resident size, not the step's; to "
            "train within the budget, and see the step's own peak, compile with --arena (or "
            "train with --arena, whose peak the plan did not check)"]


class StepMemory:
    """The memory a plan counts, measured around each training step the way ``--verify``
    measures it (``backend.memory``), next to what the plan predicts for the step as the
    trainer runs it (updates in place, ``passes.analysis.arrange``).

    A process's resident size is not that figure: it holds the session, ORT's thread pools
    and, with malloc, whatever glibc keeps of freed buffers. So:

    - CPU with the arena (``compile --arena``): before the step the free heap is given back
      (``trim_heap``; the arena returned its regions after the last step anyway) and the
      high-water mark reset; after it, the growth of the high-water mark plus the arrays the
      trainer holds and feeds (parameters, optimizer state, constants, the batch), as the
      measuring child counts its feeds. Predicted by ``passes.analysis.arena.cpu_arena_peak`` (the
      meter's view), which matched this within 2% on the quick start's GPT-2 plan.
    - CUDA: the device memory used at the step's worst moment (NVML, sampled; needs
      ``pynvml``) over the reading before the trainer's session existed
      (``memory.device_baseline``): state, batch, arena and ORT's own workspaces. Predicted
      by ``passes.analysis.device_memory.predict_device`` (the arena keeps its regions between
      steps, so this is the steady state from the second step on).
    - CPU with malloc: not measured (trimming the heap every step would change what it
      measures); the progress shows the resident size, labelled so, and ``train`` notes
      that glibc's heap can hold several times the plan.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.allocator = _allocator(trainer)
        self.held = trainer._step.held_bytes() if self.allocator != "cuda-arena" else 0
        self.predicted = trainer.predicted_peak_bytes
        self.prediction = "live bytes (passes.analysis.liveness)"
        self.first_step_predicted: int | None = None
        if self.allocator == "arena":
            from memcc.passes.analysis.arena import cpu_arena_peak

            a = trainer.arrangement
            self.predicted = cpu_arena_peak(a.graph, a.prediction, meter=True)[1]
            self.prediction = "CPU arena model (passes.analysis.arena.cpu_arena_peak)"
        self._nvml = None
        if self.allocator == "cuda-arena":
            from memcc.backend.memory import NvmlPeakMeter
            from memcc.passes.analysis.device_memory import PREDICTION_METHOD

            self.prediction = PREDICTION_METHOD
            self.first_step_predicted = trainer.device_prediction.first_step_bytes
            try:
                self._nvml = NvmlPeakMeter()
                self._nvml.baseline = trainer.device_baseline
            except Exception:  # NVML present but unusable: show the prediction only
                self._nvml = None
            if self._nvml is not None and trainer.device_baseline is None:
                self._nvml = None
        self.peak: int | None = None
        self.first_step: int | None = None
        self._steps = 0
        self._before = 0
        self._batch = 0

    @property
    def method(self) -> str:
        if self.allocator == "arena":
            return ("cpu-vmhwm: growth of VmHWM over the step (heap trimmed before it) plus "
                    "the arrays the trainer holds and feeds")
        if self.allocator == "cuda-arena":
            return self._nvml.method if self._nvml is not None else "none"
        return "none: malloc (the resident size is shown instead)"

    def start(self, batch: Mapping[str, np.ndarray]) -> None:
        self._batch = int(sum(np.asarray(a).nbytes for a in batch.values()))
        if self.allocator == "arena":
            from memcc.backend.memory import reset_peak_rss, rss_bytes

            try:
                trim_heap()
                reset_peak_rss()
                self._before = rss_bytes()
            except (OSError, RuntimeFailure):  # no /proc: nothing measured
                self.allocator = "arena-unmeasured"
        elif self._nvml is not None and self._nvml.available:
            self._nvml.start()

    def stop(self) -> int | None:
        """This step's measured peak (None where not measured); the run's largest is kept."""
        grew = None
        if self.allocator == "arena":
            from memcc.backend.memory import peak_rss_bytes

            grew = peak_rss_bytes() - self._before
        elif self._nvml is not None and self._nvml.available:
            grew = self._nvml.stop()
        if grew is None:
            return None
        # CUDA: the reading already holds everything bound to the step; elsewhere the
        # growth of the heap is added to what the trainer holds and feeds.
        step = grew if self.allocator == "cuda-arena" else grew + self.held + self._batch
        # The process's first step also creates thread pools, kernel caches and packing
        # buffers, which the measuring child leaves out (its baseline follows a warm-up
        # step): it is shown, but the run's peak comes from the steps after it.
        self._steps += 1
        if self._steps == 1:
            self.first_step = step
        self.peak = step if self._steps <= 2 else max(self.peak or 0, step)
        return step

    def to_json(self) -> dict:
        return {"allocator": self.allocator, "predicted_peak_bytes": self.predicted,
                "prediction": self.prediction, "measured_peak_bytes": self.peak,
                "first_step_predicted_bytes": self.first_step_predicted,
                "first_step_measured_bytes": self.first_step,
                "measured_steps": self._steps, "measurement_method": self.method,
                "rss_bytes": _memory_bytes("cuda" if self.allocator == "cuda-arena"
                                           else "cpu")}


def _memory_bytes(provider: str) -> int | None:
    """Resident memory of this process (CPU); None on CUDA (device memory is not read)."""
    if provider != "cpu":
        return None
    from memcc.backend.memory import rss_bytes

    try:
        return rss_bytes()
    except Exception:  # no /proc: show nothing rather than fail a training run
        return None


def describe_in_place(trainer: Trainer) -> str:
    """One line: how many updates are written in place, and why the others are not."""
    n, m = len(trainer.in_place.aliased), len(trainer.updates)
    if not trainer.in_place.refused:
        return f"{n}/{m} updates in place"
    first = next(iter(trainer.in_place.refused.items()))
    return f"{n}/{m} updates in place ('{first[0]}' not: {first[1]})"

