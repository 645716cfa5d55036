"""``memcc train --nproc N``: one rank's training loop, and the checkpoints it shares.

Batches: the step's batch size ``B`` is each rank's; the run's global batch is ``N x B``.
Global step ``k`` takes batch ``k`` of the data's seeded order at batch size ``N x B``
(``backend.data.Dataset``), and rank ``r`` its ``r``-th slice of ``B`` samples, so N ranks
at batch B see what one process sees at batch N x B, and the data position of a run is
counted in global batches.

Checkpoints: consolidated on rank 0 (with ZeRO-1 and 2 the optimizer state is gathered there
first) and written by ``backend.checkpoint`` as ``memcc train`` writes them (atomic, the
newest ``keep`` kept). The signature they carry is the step's with the data inputs at the
global batch: a checkpoint belongs to a run at a global batch size, so it resumes on any
number of ranks whose ranks' batches add up to it, including one process running the
same step built at batch N x B (plain ``memcc train --resume``), and back. Each rank reads
the consolidated file and takes its own shard (``Replica.load``): re-sharding is free.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from memcc.backend import checkpoint as ckpt
from memcc.backend.data import Dataset, data_inputs, load_dataset
from memcc.backend.device_step import step_for_provider
from memcc.backend.memory import rss_bytes, trim_heap
from memcc.backend.session import resolve_provider
from memcc.backend.step_feeds import refuse_bfloat16_feeds
from memcc.dist.memory import RankMemory, predicted_rank_peak
from memcc.dist.placement import Placement
from memcc.dist.split import check_zero2, split_step
from memcc.errors import InputError, RuntimeFailure
from memcc.frontend.load import load_graph
from memcc.graph import Graph
from memcc.step import RANKS_KEY, TrainingStep
from memcc.trainer.checkpoints import (
    check_run_data_state,
    checkpoint_tensors,
    run_data_state,
    step_signature,
    step_tensors,
)
from memcc.trainer.loop import (
    StopRequest,
    TrainOptions,
    TrainResult,
    diverged_message,
    diverges,
    stop_requests,
)
from memcc.trainer.throughput import Throughput

if TYPE_CHECKING:
    from memcc.dist.replica import Replica


@dataclass(frozen=True)
class DistOptions:
    """``memcc train``'s options plus the group: ``world`` ranks, ZeRO stage ``zero``."""

    train: TrainOptions
    world: int
    zero: int = 0
    quiet: bool = False
    # Gradient buckets reduced during the backward (``--bucket-mb``); None: one, after it.
    bucket_bytes: int | None = None
    # Each rank's step peak measured (``--measure-memory``: ranks under ``MEMORY_ENV``).
    measure_memory: bool = False


@dataclass
class RankRun:
    """What one rank trains with: the step cut in two, the data at the global batch."""

    graph: Graph
    spec: TrainingStep
    dataset: Dataset       # at the global batch size
    rank_batch: int
    total_steps: int
    sig: dict
    data_fp: str


def prepare(opts: DistOptions) -> RankRun:
    """Everything checked before a rank trains (also run once before ranks are started)."""
    t = opts.train
    try:
        provider = resolve_provider(t.provider)
    except RuntimeFailure as exc:  # no CUDA here: nothing a rank could run
        raise InputError(f"--nproc: {exc}") from None
    unsupported = [flag for flag, on in (("--arena", t.arena), ("--cuda-graph", t.cuda_graph))
                   if on]
    if unsupported:
        raise InputError(f"{unsupported[0]} is not supported with --nproc yet: each rank runs "
                         "its step as separate sessions bound to its own buffers; leave it "
                         "out")
    # As the Trainer runs it: the provider's rewrites (on the CPU, a 16-bit step's nodes
    # without CPU kernels in float32 between casts).
    graph, _ = step_for_provider(load_graph(t.step), provider)
    spec = TrainingStep.of(graph).validate(str(t.step), then=f"memcc train step.onnx --data "
                                                            f"{t.data} --nproc {opts.world}")
    refuse_bfloat16_feeds(graph, source=str(t.step), doing="train the step")
    split = split_step(graph, spec, str(t.step))  # refused now rather than in every rank
    if opts.zero == 2:
        check_zero2(graph, spec, str(t.step))
    odd = [g for g in split.gradients.values()
           if graph.info[g].np_dtype not in (np.float16, np.float32, np.float64)]
    if odd:
        raise InputError(f"{t.step}: gradient '{odd[0]}' is {graph.info[odd[0]].np_dtype}; "
                         "--nproc all-reduces float16, float32 and float64 gradients only")
    data = load_dataset(t.data, data_inputs(graph, spec))
    b = data.batch_size
    glob = replace(data, batch_size=b * opts.world, _orders={})
    if glob.batches_per_epoch < 1:
        raise InputError(f"--data {t.data}: {data.num_samples} samples, fewer than one global "
                         f"batch ({opts.world} ranks x {b})")
    total = t.steps if t.steps is not None else (t.epochs or 1) * glob.batches_per_epoch
    return RankRun(graph, spec, glob, b, total, step_signature(graph, spec, b * opts.world),
                   glob.fingerprint())


def describe_plan(t: TrainOptions, world: int) -> str:
    """``memcc train --nproc N --batch-size-check``: the run's batches, nothing started."""
    from memcc.dist.launch import check_nproc

    check_nproc(world)
    run = prepare(DistOptions(t, world))
    d = run.dataset
    return (f"{d.num_samples} samples in {len(d.files)} file(s), {world} ranks x batch "
            f"{run.rank_batch} = {d.batch_size} samples a step: {d.batches_per_epoch} steps "
            f"per epoch ({d.dropped_per_epoch} samples dropped per epoch), "
            f"{run.total_steps} steps")


def checkpoint_to_resume(opts: DistOptions, run: RankRun) -> ckpt.Checkpoint | None:
    """The checkpoint a ``--resume`` run starts from, checked against this run (global
    batch, seed, data); refuses a directory holding another run without ``--resume``."""
    t = opts.train
    if t.checkpoint is None:
        return None
    newest = ckpt.latest(t.checkpoint)
    if not t.resume and newest is not None:
        raise InputError(f"--checkpoint {t.checkpoint}: already holds a run's checkpoints "
                         f"(newest: {newest.name}). Pass --resume to continue it, or choose "
                         "an empty directory for a new run.")
    ckpt.check_directory(t.checkpoint)
    if newest is None:
        return None
    c = ckpt.load(newest)
    if c.fingerprint != ckpt.fingerprint(run.sig):
        raise InputError(f"{c.path}: written for another training step or global batch "
                         f"size (this run: {opts.world} ranks x {run.rank_batch} = "
                         f"{opts.world * run.rank_batch} samples a step; resume with ranks "
                         "and a step whose batches add up to the checkpoint's)")
    check_run_data_state(c, t.seed, run.data_fp)
    return c


def run_rank(opts: DistOptions, rank: int, comm, place: Placement
             ) -> tuple[TrainResult, dict] | None:
    """Train on this rank; rank 0 returns the result and the group's figures. SIGINT or
    SIGTERM on any rank stops every rank after the same step, saved (``TrainResult.
    interrupted`` names the signal); a second SIGINT gives up on the running step."""
    # The ranks on a host load the step one after another: the loader peaks at several
    # times the file's size (GPT-2 124M: 10.8 GB for its 1.5 GB), a rank once set up holds
    # its own arrays only.
    for turn in range(opts.world):
        if turn == rank:
            s = _set_up(opts, rank, comm, place)
            gc.collect()
            trim_heap()
        comm.barrier()
    run, replica, predicted = s.run, s.replica, s.predicted
    steps_done, position, resumed_from = s.steps_done, s.position, s.resumed_from
    del s
    result = TrainResult(start_step=steps_done, steps_done=steps_done,
                         total_steps=run.total_steps, resumed_from=resumed_from,
                         batch_size=run.dataset.batch_size,
                         batches_per_epoch=run.dataset.batches_per_epoch)
    state_bytes = comm.gather_object(replica.optimizer_state_bytes())
    loop = _Loop(opts, run, replica, comm, rank, result, position,
                 steps_done if resumed_from else None,
                 RankMemory(replica.held_bytes(), on_gpu=place.on_gpu,
                            measured=opts.measure_memory))
    with stop_requests() as stop:
        loop.train(stop)
    if loop.diverged:  # on every rank at the same step: no collective is left waiting
        raise RuntimeFailure(diverged_message(result, opts.train))
    # Each process's resident size after training (libraries and all) and its peak
    # (Linux: ru_maxrss in KiB; loading the step file holds all of its state for a while).
    trim_heap()
    rss = comm.gather_object((replica.held_bytes(), rss_bytes(),
                              resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
    # Every rank must end with the same parameters: their digests say whether they do.
    digests = comm.gather_object(ckpt.tensors_digest(replica.parameters())[:16])
    mem = comm.gather_object((predicted, loop.memory.peak, loop.memory.first_step))
    seconds = comm.gather_object({k: round(v, 4) for k, v in replica.seconds.items()})
    if rank != 0:
        return None
    info = {"world_size": opts.world, "zero": opts.zero, "bucket_bytes": opts.bucket_bytes,
            "device": place.kind, "backend": comm.backend,
            "global_batch": run.dataset.batch_size,
            "rank_batch": run.rank_batch, "optimizer_state_bytes_per_rank": state_bytes,
            "held_bytes_per_rank": [r[0] for r in rss],
            "rss_bytes_per_rank": [r[1] for r in rss],
            "peak_rss_bytes_per_rank": [r[2] for r in rss],
            "parameter_digest_per_rank": digests,
            "predicted_peak_bytes_per_rank": [m[0] for m in mem],
            "step_peak_bytes_per_rank": [m[1] for m in mem],
            "first_step_peak_bytes_per_rank": [m[2] for m in mem],
            "memory_method": loop.memory.method,
            "planned": json.loads(run.graph.metadata.get(RANKS_KEY) or "null"),
            "rank0_seconds": seconds[0], "seconds_per_rank": seconds}
    return result, info


@dataclass
class _SetUp:
    """A rank ready to train: its run, replica, predicted peak and where it resumes."""

    run: RankRun
    replica: Replica
    predicted: int
    steps_done: int = 0
    position: int = 0
    resumed_from: str | None = None


def _set_up(opts: DistOptions, rank: int, comm, place: Placement) -> _SetUp:
    """Load the step and data, make the replica, take this rank's shard of the checkpoint
    ``--resume`` continues (the consolidated file is dropped before training)."""
    from memcc.dist.replica import Replica, ReplicaSettings  # imports torch
    from memcc.dist.tensors import RankDevice

    t = opts.train
    run = prepare(opts)
    loaded = checkpoint_to_resume(opts, run)
    predicted = predicted_rank_peak(run.graph, opts.world, opts.zero, rank,
                                    opts.bucket_bytes)
    replica = Replica(_split(run, t), comm, ReplicaSettings(
        rank, opts.world, opts.zero, place.threads, str(t.step),
        bucket_bytes=opts.bucket_bytes, device=RankDevice.of(place).check()))
    out = _SetUp(run, replica, predicted)
    if loaded is not None:
        replica.load(step_tensors(run.graph, run.spec, loaded.tensors), str(loaded.path))
        out.steps_done, out.resumed_from = loaded.step, str(loaded.path)
        out.position = int(loaded.data_state.get("batches_consumed", loaded.step))
    return out


@dataclass
class _Loop:
    """One rank's loop: where in the data it stands (``position``, global batches)."""

    opts: DistOptions
    run: RankRun
    replica: Replica
    comm: object
    rank: int
    result: TrainResult
    position: int
    last_saved: int | None
    memory: RankMemory
    # A step's loss was no number (every rank sees the same: the loss is averaged across
    # them), so the loop stopped there without saving it (``trainer.loop.diverges``).
    diverged: bool = False

    def train(self, stop: StopRequest) -> None:
        t, run, result = self.opts.train, self.run, self.result
        b = run.rank_batch
        rates, stopped = Throughput(run.dataset.batch_size), False
        shown = rates.started - 1.0  # progress on stderr: at most once a second, and the last
        while result.steps_done < run.total_steps and not stopped:
            idx = run.dataset.indices(self.position, t.seed)[self.rank * b:(self.rank + 1) * b]
            for n, a in run.dataset.arrays.items():  # into the rank's batch buffers
                # (the slice is gone before the step)
                self.replica.device.write(self.replica.batch[n], a[idx])
            self.memory.start()
            loss, stopped = self.replica.step(None, stop=bool(stop))
            self.memory.stop()
            self.position += 1
            result.steps_done += 1
            result.losses.append(loss)
            result.samples_per_s, result.steady_samples_per_s = rates.step_done()
            if diverges(loss, run.spec):
                self.diverged = True
                return
            if self.rank == 0 and not self.opts.quiet and (
                    time.perf_counter() - shown >= 1.0 or result.steps_done == run.total_steps):
                shown = time.perf_counter()
                print(f"step {result.steps_done}/{run.total_steps}  loss {loss:.6f}  "
                      f"{result.samples_per_s:,.1f} samples/s", file=sys.stderr, flush=True)
            if t.save_every and t.checkpoint is not None and \
                    result.steps_done % t.save_every == 0:
                self.save()
        if t.checkpoint is not None and self.last_saved != result.steps_done:
            self.save()
        elif t.checkpoint is not None and result.checkpoint is None:
            latest = ckpt.latest(t.checkpoint)
            result.checkpoint = str(latest) if latest is not None else None
        if stopped and result.steps_done < run.total_steps:
            result.interrupted = stop.name or "a signal on another rank"

    def save(self) -> None:
        """A consolidated checkpoint, written by rank 0; every rank waits until it is."""
        t, run = self.opts.train, self.run
        state = self.replica.full_state()
        if state is not None:
            assert t.checkpoint is not None
            state = checkpoint_tensors(run.graph, run.spec, state)
            self.result.checkpoint = str(ckpt.save(t.checkpoint, state, ckpt.CheckpointInfo(
                step=self.result.steps_done, sig=run.sig,
                data_state=run_data_state(t.seed, self.position, run.dataset, run.data_fp),
                step_file=str(Path(t.step).resolve())), keep=t.keep))
        self.comm.barrier()
        self.last_saved = self.result.steps_done


def _split(run: RankRun, t: TrainOptions):
    return split_step(run.graph, run.spec, str(t.step))


def default_threads(local_world: int) -> int:
    """ORT threads per rank: the host's cores shared by the ranks on it."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world))
