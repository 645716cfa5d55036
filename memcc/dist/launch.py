"""Starting the ranks: ``memcc train --nproc N`` spawns N local processes; under
``torchrun`` this process is one rank of the launcher's group.

Local launch: ``torch.multiprocessing`` (spawn start method), ``MASTER_ADDR`` 127.0.0.1 and a
free ``MASTER_PORT``; gloo on the CPU, NCCL with ``--provider cuda`` where each rank has a GPU
of its own (``dist.placement.place_rank``, ``dist.comm.backend_for``). Everything a rank
would refuse (the step, the data, the checkpoint directory) is checked here first, so bad
input fails once, with exit status 2, before a process is started. A rank that fails later
writes its error where the parent reads it; torch stops the other ranks.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from memcc.backend.memory import keep_heap_between_steps, trim_heap
from memcc.backend.session import resolve_provider
from memcc.dist.buckets import bucket_bytes
from memcc.dist.comm import Comm, backend_for, free_port, launched_by_torchrun, torch_distributed
from memcc.dist.memory import MEMORY_ENV
from memcc.dist.placement import place_rank
from memcc.dist.train import DistOptions, checkpoint_to_resume, default_threads, prepare, run_rank
from memcc.errors import InputError, MemccError, RuntimeFailure
from memcc.step import PROVIDER_KEY, RANKS_KEY
from memcc.trainer.loop import TrainOptions, TrainResult

MAX_LOCAL_RANKS = 64


def check_nproc(nproc: int | None) -> None:
    if nproc is not None and not 1 <= nproc <= MAX_LOCAL_RANKS:
        raise InputError(f"--nproc {nproc}: give a number of ranks from 1 to "
                         f"{MAX_LOCAL_RANKS}")


def train_distributed(opts: TrainOptions, nproc: int | None, *, zero: int = 0,
                      quiet: bool = False, bucket_mb: float | None = None,
                      measure_memory: bool = False) -> tuple[TrainResult, dict] | None:
    """Train data-parallel; the result and the group's figures (None on ranks but 0 under
    torchrun, which print nothing). ``bucket_mb``: gradients reduced in buckets of that
    many MB while the backward goes on (``dist.overlap``). ``measure_memory``: each rank's
    step peak measured, its ranks started with the allocation rules plans count
    (``dist/memory.py``), at a cost in speed; else they allocate as ``memcc train`` does."""
    check_nproc(nproc)
    buckets = bucket_bytes(bucket_mb, zero)
    if zero not in (0, 1, 2):
        raise InputError(f"--zero {zero}: give 0 (every rank keeps all optimizer state), 1 "
                         "(each rank keeps its parameters' optimizer state) or 2 (and only "
                         "its parameters' averaged gradients)")
    torch_distributed()
    env = launched_by_torchrun()
    # Notes and warnings go to stderr even with --json (``quiet``), whose object is stdout's.
    opts = _on_planned_provider(opts, say=env is None or env[0] == 0)
    if env is not None:
        rank, world, local_rank = env
        if nproc is not None and nproc != world:
            raise InputError(f"--nproc {nproc}: torchrun started {world} ranks (WORLD_SIZE); "
                             "give the same number or leave --nproc out")
        dopts = DistOptions(opts, world, zero, quiet or rank != 0, buckets, measure_memory)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        comm, place = _join(dopts, rank, local_rank, local)
        try:
            out = run_rank(dopts, rank, comm, place)
        finally:
            comm.close()
        return _raise_if_interrupted(out)
    assert nproc is not None
    dopts = DistOptions(opts, nproc, zero, quiet, buckets, measure_memory)
    run = prepare(dopts)
    checkpoint_to_resume(dopts, run)  # refuse bad input before any rank starts
    mismatch = planned_for_other_ranks(run.graph.metadata, nproc, zero, buckets)
    del run
    if mismatch:
        print(f"warning: {opts.step}: {mismatch}", file=sys.stderr, flush=True)
    _check_placement(dopts, nproc)
    gc.collect()
    trim_heap()  # what checking the step file took is not held while the ranks load it
    return _raise_if_interrupted(_spawn(dopts))


def _on_planned_provider(opts: TrainOptions, *, say: bool) -> TrainOptions:
    """``opts`` with the provider resolved as ``memcc train`` resolves it for one process
    (``backend.session.provider_as_planned``: none given, the one the step was compiled for;
    a CUDA plan without CUDA on the CPU, with a note), so that the ranks and the checks
    before them run where the step was planned: ``--nproc`` ran a CUDA plan on the CPU."""
    import onnx

    from memcc.backend.session import provider_as_planned

    try:  # the step's own metadata; a file that cannot be read is refused by ``prepare``
        model = onnx.load(str(opts.step), load_external_data=False)
        planned = {p.key: p.value for p in model.metadata_props}.get(PROVIDER_KEY) or None
    except Exception:
        planned = None
    try:
        provider, note = provider_as_planned(opts.provider, planned)
    except RuntimeFailure as exc:  # --provider cuda without CUDA: nothing a rank could run
        raise InputError(f"--nproc: {exc}") from None
    if note and say:
        print(f"note: {opts.step}: {note}", file=sys.stderr, flush=True)
    return replace(opts, provider=provider)


def planned_for_other_ranks(metadata: dict, world: int, zero: int,
                            bucket_bytes: int | None = None) -> str | None:
    """Why a step compiled with ``--nproc`` was planned for other ranks than this run's
    (its per-rank budget then does not hold), or None. A plan for one bucket holds for a
    run by buckets (which holds less), not the other way round."""
    text = metadata.get(RANKS_KEY)
    if not text:
        return None
    p = json.loads(text)
    planned_buckets = p.get("bucket_bytes")
    same_ranks = (p.get("world_size"), p.get("zero")) == (world, zero)
    if same_ranks and planned_buckets in (None, bucket_bytes):
        return None
    this = f"{world} ranks, ZeRO-{zero}, " + (f"buckets of {bucket_bytes:,} bytes"
                                               if bucket_bytes else "one bucket")
    planned = _rank_flags(p.get("world_size"), p.get("zero"), planned_buckets)
    return (f"planned by memcc compile {planned} for a per-rank budget of "
            f"{p.get('budget_bytes'):,} bytes; this run has {this}, whose peaks that plan "
            f"did not check (compile again with {_rank_flags(world, zero, bucket_bytes)})")


def _rank_flags(world, zero, bucket_bytes: int | None) -> str:
    return f"--nproc {world} --zero {zero}" + \
        (f" --bucket-mb {bucket_bytes / 1e6:g}" if bucket_bytes else "")


def _raise_if_interrupted(out: tuple[TrainResult, dict] | None
                          ) -> tuple[TrainResult, dict] | None:
    """``TrainingInterrupted`` (as ``memcc train`` raises it) where a signal stopped the run."""
    if out is not None and out[0].interrupted:
        from memcc.trainer.loop import TrainingInterrupted

        signum = getattr(signal, str(out[0].interrupted), signal.SIGTERM)
        raise TrainingInterrupted(out[0], signum)
    return out


def _spawn(opts: DistOptions) -> tuple[TrainResult, dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="memcc-dist-") as tmp:
        port = free_port()
        try:
            # The ranks' allocation rules where their step peaks are measured (dist/memory.py).
            with _environment(MEMORY_ENV if opts.measure_memory else {}):
                context = mp.start_processes(_rank_main, args=(opts, port, tmp),
                                             nprocs=opts.world, join=False,
                                             start_method="spawn")
            with _passing_signals_on([p.pid for p in context.processes]):
                while not context.join():
                    pass
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
            for r in range(opts.world):
                err = Path(tmp) / f"error-{r}.json"
                if err.exists():
                    e = json.loads(err.read_text())
                    kind = InputError if e["kind"] == "input" else RuntimeFailure
                    raise kind(f"rank {r}: {e['message']}") from None
            raise RuntimeFailure(f"a rank of the data-parallel run failed ({exc}); the other "
                                 f"ranks were stopped. {_what_stands(opts)}") from None
        data = json.loads((Path(tmp) / "result.json").read_text())
    info = data.pop("distributed")
    fields = {k: data[k] for k in ("start_step", "total_steps", "losses", "checkpoint",
                                   "resumed_from", "samples_per_s", "steady_samples_per_s",
                                   "batch_size",
                                   "batches_per_epoch", "interrupted")}
    return TrainResult(steps_done=data["steps"], **fields), info


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while the ranks are spawned (glibc reads them at a
    process's start: they reach the ranks, not this process); a variable the user set
    is left as it is."""
    values = {k: v for k, v in values.items() if k not in os.environ}
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _passing_signals_on(pids: list[int]) -> Iterator[None]:
    """While the ranks run: a SIGTERM sent to this process is passed on to every rank (each
    stops after the running step, saved); SIGINT from a terminal reaches the ranks
    themselves (same process group), so here it is only kept from stopping the wait."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame) -> None:
        if signum == signal.SIGTERM:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _what_stands(opts: DistOptions) -> str:
    """Where a failed run can continue from: its newest checkpoint, if any."""
    from memcc.backend import checkpoint as ckpt

    d = opts.train.checkpoint
    newest = ckpt.latest(d) if d is not None and Path(d).is_dir() else None
    if newest is None:
        return "No checkpoint was written."
    return f"Newest checkpoint: {newest} (continue with --resume)."


def _rank_main(rank: int, opts: DistOptions, port: int, tmp: str) -> None:
    """One spawned rank: join the group, train, rank 0 writes the result for the parent."""
    import sys

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    comm = None
    try:
        comm, place = _join(opts, rank, rank, opts.world)
        out = run_rank(opts, rank, comm, place)
        if out is not None:
            result, info = out
            Path(tmp, "result.json").write_text(json.dumps({**result.to_json(),
                                                            "distributed": info}))
    except MemccError as exc:
        kind = "input" if isinstance(exc, InputError) else "runtime"
        Path(tmp, f"error-{rank}.json").write_text(json.dumps({"kind": kind,
                                                               "message": str(exc)}))
        sys.exit(2)
    finally:
        if comm is not None:
            comm.close()


def _join(opts: DistOptions, rank: int, local_rank: int, local_world: int):
    """This rank's place (its GPU with ``--provider cuda``, its share of the host's cores)
    and its process group: NCCL where every rank has a GPU of its own, else gloo."""
    place, sharing = _placement(opts, local_rank, local_world)
    if not place.on_gpu and place.threads:
        import torch

        # torch's own work in the rank (the averaging's division, copies) on the rank's
        # share of the cores: at torch's default (every core) its OpenMP threads may take
        # cores the other ranks compute on. (On 2 cores the gain was within the scaling
        # benchmark's noise: docs/DATA_PARALLEL.md, "Throughput".)
        torch.set_num_threads(place.threads)
    if not place.on_gpu:
        keep_heap_between_steps()
    return Comm(rank, opts.world, backend_for(place.kind, sharing), place.gpu), place


def _gpus(provider: str) -> int:
    """The GPUs torch sees on this host (0 on the CPU)."""
    if provider != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def _check_placement(opts: DistOptions, local_world: int) -> None:
    """Refuse before any rank starts what a rank's placement would refuse."""
    _placement(opts, 0, local_world)


def _placement(opts: DistOptions, local_rank: int, local_world: int):
    """``place_rank`` for this run, with what it refuses: ``--provider cuda`` without a GPU
    torch sees, and ZeRO-2 on a GPU shared by ranks (gloo has no ``reduce`` over CUDA
    tensors)."""
    provider = resolve_provider(opts.train.provider)
    gpus = _gpus(provider)
    place, sharing = place_rank(provider, local_rank, local_world, gpus,
                                opts.train.threads or default_threads(local_world))
    if place.on_gpu and sharing > 1 and opts.zero == 2:
        raise InputError(f"--zero 2 with --provider cuda and {local_world} ranks on "
                         f"{gpus} GPU(s): ranks sharing a GPU talk over gloo, which cannot "
                         "reduce CUDA tensors to one rank; use --zero 1, or one rank per "
                         "GPU (NCCL)")
    return place, sharing
