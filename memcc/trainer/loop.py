"""``memcc train``: the loop around a ``Trainer``.

``TrainOptions`` enter; the data is checked against the step before any step runs
(``plan_training``, ``backend.data``), the run resumes from a checkpoint where asked, the
batches come in a seeded order that a resumed run continues exactly, and checkpoints are
written every ``save_every`` steps and at the end. A ``TrainResult`` leaves, or
``TrainingInterrupted`` after SIGINT/SIGTERM once the running step is complete and saved
(a checkpoint written mid-step would pair new parameters with the old step).
"""

from __future__ import annotations

import math
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import DataInput, Dataset, data_inputs, load_dataset
from memcc.backend.step_feeds import refuse_bfloat16_feeds
from memcc.errors import InputError, RuntimeFailure
from memcc.frontend.load import load_graph
from memcc.frontend.loss_scaling import SCALE
from memcc.graph import Graph
from memcc.step import TrainingStep
from memcc.trainer.checkpoints import check_run_data_state, run_data_state
from memcc.trainer.loss_scale_watch import LossScaleWatch
from memcc.trainer.memory import StepMemory, allocator_notes, allocator_of, process_memory_bytes
from memcc.trainer.throughput import Throughput
from memcc.trainer.trainer import Trainer


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
    provider: str | None = None   # None: where the plan was made, else the CPU (``Trainer``)
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
    # Over the steps after the first (``trainer.throughput``); None with one step.
    steady_samples_per_s: float | None = None
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
    # A dynamic loss scale's value at the end and the steps of this run it skipped
    # (``loss_scale_watch``); None without one.
    loss_scale: dict | None = None

    def to_json(self) -> dict:
        return {
            "start_step": self.start_step, "steps": self.steps_done,
            "total_steps": self.total_steps, "losses": self.losses,
            "final_loss": self.losses[-1] if self.losses else None,
            "checkpoint": self.checkpoint, "resumed_from": self.resumed_from,
            "samples_per_s": self.samples_per_s,
            "steady_samples_per_s": self.steady_samples_per_s, "batch_size": self.batch_size,
            "batches_per_epoch": self.batches_per_epoch, "allocator": self.allocator,
            "notes": self.notes, "interrupted": self.interrupted, "memory": self.memory,
            "cuda_graph": self.cuda_graph, "deterministic": self.deterministic,
            "loss_scale": self.loss_scale,
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
                f"({d.dropped_per_epoch} samples dropped per epoch), {self.total_steps} steps; "
                "per sample: " + ", ".join(f"{i.name} {list(i.sample_shape)} {i.dtype}"
                                           for i in self.inputs))


def plan_training(opts: TrainOptions, graph: Graph | None = None) -> TrainPlan:
    """Check the step and the data against each other; nothing runs."""
    graph = graph if graph is not None else load_graph(opts.step)
    spec = TrainingStep.of(graph).validate(str(opts.step),
                                           then=f"memcc train step.onnx --data {opts.data}")
    # Before the data: its check would ask for bfloat16 arrays, which no .npz holds.
    refuse_bfloat16_feeds(graph, source=str(opts.step), doing="train the step")
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
    data_fp = plan.dataset.fingerprint()
    trainer, loaded = _open_run(opts, graph, data_fp)
    result = _result_before_training(trainer, plan, loaded)
    meter = StepMemory(trainer)
    result.memory = meter.to_json()
    if on_start is not None:
        on_start(result)
    run = _Run(opts, trainer, plan, data_fp, result, meter,
               position=int(trainer.data_state.get("batches_consumed", trainer.steps_done)),
               last_saved=trainer.steps_done if loaded is not None else None)
    rates = Throughput(plan.dataset.batch_size)
    scale = LossScaleWatch(trainer)
    diverged = False
    with stop_requests() as stop:
        while trainer.steps_done < plan.total_steps and not stop:
            progress = run.step(rates)
            scale.after_step(trainer)
            if on_step is not None:
                on_step(progress)
            diverged = run.diverged(progress.loss)
            if diverged:
                break
        if not diverged:
            run.finish()  # still under ``stop_requests``: a signal now does not cut the write
    result.memory = meter.to_json()
    result.loss_scale = scale.to_json()
    if diverged:
        raise RuntimeFailure(diverged_message(result, opts))
    if stop and result.steps_done < result.total_steps:
        result.interrupted = stop.name
        raise TrainingInterrupted(result, stop.signum)
    return result


def _open_run(opts: TrainOptions, graph: Graph, data_fp: str
              ) -> tuple[Trainer, ckpt.Checkpoint | None]:
    """The trainer of the run, restored from the newest checkpoint with ``--resume``; a
    checkpoint directory that already holds another run is refused before anything runs."""
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
        check_run_data_state(loaded, opts.seed, data_fp)
        trainer.restore(loaded)
    return trainer, loaded


def _result_before_training(trainer: Trainer, plan: TrainPlan,
                            loaded: ckpt.Checkpoint | None) -> TrainResult:
    """What ``on_start`` hears: where the run starts and ends, and the notes to read first."""
    dataset = plan.dataset
    result = TrainResult(start_step=trainer.steps_done, steps_done=trainer.steps_done,
                         total_steps=plan.total_steps,
                         resumed_from=str(loaded.path) if loaded is not None else None,
                         batch_size=dataset.batch_size,
                         batches_per_epoch=dataset.batches_per_epoch,
                         allocator=allocator_of(trainer), notes=allocator_notes(trainer),
                         cuda_graph=trainer.cuda_graph if trainer.provider == "cuda" else None,
                         deterministic=trainer.deterministic)
    result.notes.extend(dataset.notes)
    result.notes.extend(trainer.notes)
    if trainer.provider == "cuda":
        same = ("yes (--deterministic)" if trainer.deterministic else
                "no: runs may differ in the last bits (--deterministic)")
        result.notes.append(f"CUDA graph: {trainer.cuda_graph}; reproducible: {same}")
    return result


def diverges(loss: float, spec: TrainingStep) -> bool:
    """A loss that is no number, where no loss scale skips such a step instead."""
    return not math.isfinite(loss) and SCALE not in spec.state.values()


def diverged_message(result: TrainResult, opts: TrainOptions) -> str:
    """Why training stopped at a loss that is not a number: the parameters the step wrote
    are not either, so no checkpoint of them is written (nor one of the steps after, which
    would push the good ones out of ``--keep``)."""
    shown = ", ".join(f"{v:.4g}" for v in result.losses[-5:])
    latest = ckpt.latest(opts.checkpoint) if opts.checkpoint is not None else None
    kept = (f"the newest checkpoint, {latest}, is from before it (continue from it with "
            "--resume after changing what diverged)" if latest is not None else
            "no checkpoint was written")
    return (f"{opts.step}: step {result.steps_done}: the loss is {result.losses[-1]} (the "
            f"last losses: {shown}), so the parameters the step wrote are not finite either: "
            f"training stopped, and nothing of this step was saved; {kept}. A learning rate "
            "too large for the model diverges so (memcc build --lr), and so does data with "
            "nan or inf in it")


@dataclass
class _Run:
    """One ``memcc train`` run under way: where in the data it stands (``position``, in
    batches), the last step saved, and the result it fills."""

    opts: TrainOptions
    trainer: Trainer
    plan: TrainPlan
    data_fp: str
    result: TrainResult
    meter: StepMemory
    position: int
    last_saved: int | None
    done_here: int = 0

    def diverged(self, loss: float) -> bool:
        return diverges(loss, self.trainer.spec)

    def step(self, rates: Throughput) -> TrainProgress:
        """Train on the next batch, checkpoint every ``save_every`` steps."""
        opts, trainer, result = self.opts, self.trainer, self.result
        batch = self.plan.dataset.batch(self.position, opts.seed)
        self.meter.start(batch)
        loss = trainer.step(batch)
        step_peak = self.meter.stop()
        del batch
        self.position += 1
        self.done_here += 1
        result.losses.append(loss)
        result.steps_done = trainer.steps_done
        rate, result.steady_samples_per_s = rates.step_done()
        result.samples_per_s = rate
        if opts.checkpoint is not None and opts.save_every and \
                trainer.steps_done % opts.save_every == 0 and not self.diverged(loss):
            result.checkpoint = self.save()
            self.last_saved = trainer.steps_done
        return TrainProgress(trainer.steps_done, self.plan.total_steps, loss, rate,
                             process_memory_bytes(trainer.provider), step_peak)

    def save(self) -> str:
        opts = self.opts
        return str(self.trainer.save(
            opts.checkpoint,
            data_state=run_data_state(opts.seed, self.position, self.plan.dataset,
                                      self.data_fp),
            keep=opts.keep))

    def finish(self) -> None:
        """The last completed step is saved, at the end or when a signal stopped the loop
        early; where it was saved already, the result names the newest checkpoint."""
        opts, result = self.opts, self.result
        if opts.checkpoint is not None and self.last_saved != self.trainer.steps_done:
            result.checkpoint = self.save()
        elif opts.checkpoint is not None and result.checkpoint is None:
            latest = ckpt.latest(opts.checkpoint)
            result.checkpoint = str(latest) if latest is not None else None


class TrainingInterrupted(Exception):
    """``memcc train`` stopped on SIGINT or SIGTERM after a completed step; ``result`` says
    which step, and ``result.checkpoint`` is that step's checkpoint (None without
    ``--checkpoint``). Not a ``MemccError``: nothing was wrong with the input."""

    def __init__(self, result: TrainResult, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step "
                         f"{result.steps_done}")
        self.result = result
        self.signum = signum


class StopRequest:
    """Set by the first SIGINT or SIGTERM; true once a stop was asked for."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __bool__(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str | None:
        return None if self.signum is None else signal.Signals(self.signum).name


@contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Turn SIGINT and SIGTERM into a request to stop after the running step.

    A signal that raised ``KeyboardInterrupt`` inside ``Trainer.step`` could land between
    ORT writing the new state in place and the step count moving on, and a checkpoint
    saved then would pair the new parameters with the old step. So the first signal only
    asks the loop to stop once the running step is complete (the loop then saves that
    step); a second SIGINT gives up on the step at once (``KeyboardInterrupt``, nothing
    saved: the last checkpoint stands). Python lets only the main thread set handlers;
    elsewhere (a training thread of the user's) signals keep their own handlers."""
    stop = StopRequest()
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


