"""Where a data-parallel rank's time goes on the CPU (issue 33's throughput, docs/DATA_PARALLEL.md,
"Throughput"): three measurements on the zoo GPT-2 that ``benchmarks/data_parallel.py``
writes (width 256, batch 4 per rank, AdamW).

    PYTHONPATH=.:tests python -m benchmarks.data_parallel_costs --part split
    PYTHONPATH=.:tests python -m benchmarks.data_parallel_costs --part collectives
    PYTHONPATH=.:tests python -m benchmarks.data_parallel_costs --part buckets
    PYTHONPATH=.:tests python -m benchmarks.data_parallel_costs --part heap --rounds 3

- ``split``: rank 0 of 2's split step (ZeRO-1, the collectives stood in for:
  ``tests/dist_ranks.OneRank``) against ``memcc.Trainer``'s fused step, one ORT thread,
  alternated in one process: medians of the steps after the first two.
- ``collectives``: gloo between 2 spawned ranks (one torch thread each) on a buffer of the
  model's 42 MB of gradients: ``all_reduce`` and two halves' ``broadcast`` (what ZeRO-1
  does) against ``reduce_scatter_tensor`` and ``all_gather_into_tensor``; ms per call,
  10 calls each.
- ``buckets``: ``memcc train --nproc 2 --zero 1`` with one bucket, buckets of 25 MB and of
  5 MB, alternated for ``--rounds`` rounds of ``--steps`` steps; steady samples/s.
- ``heap``: each in a fresh process (glibc's heap settings are per process), one ORT
  thread, rotated for ``--rounds`` rounds: rank 0 of 2's split step at glibc's defaults and
  with ``backend.memory.keep_heap_between_steps`` (what a CPU rank now does), and the fused
  step of ``memcc.Trainer`` both ways (``memcc train`` keeps glibc's defaults); each
  one's median step time over ``--steps`` steps after two, the kernel's share of its CPU
  time, minor page faults per step and its peak resident size.
  (``split`` above alternates both steps in one process, sharing one heap: there the two
  were alike, where in processes of their own the rank's step is the slower.)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

DATA = Path("/tmp/memcc_data_parallel_small")


def _split(steps: int) -> dict:
    from dist_ranks import OneRank

    from memcc.backend.device_step import step_for_provider
    from memcc.dist import split_step
    from memcc.dist.replica import Replica, ReplicaSettings
    from memcc.frontend.load import load_graph
    from memcc.step import TrainingStep
    from memcc.trainer.trainer import Trainer

    path = DATA / "gpt2_b4.onnx"
    g, _ = step_for_provider(load_graph(path), "cpu")
    rank = Replica(split_step(g.copy(), TrainingStep.of(g)), OneRank(),
                   ReplicaSettings(0, 2, 1, threads=1))
    trainer = Trainer(path, provider="cpu", threads=1)
    arrays = np.load(DATA / "data.npz")
    batch = {n: arrays[n][:4] for n in rank.batch}
    times: dict[str, list[float]] = {"rank_split_step": [], "trainer_fused_step": []}
    for i in range(steps):
        for name in (list(times) if i % 2 else list(times)[::-1]):
            t = time.perf_counter()
            (rank.step(batch) if name == "rank_split_step" else trainer.step(batch))
            times[name].append(time.perf_counter() - t)
    return {name: round(float(np.median(v[2:])), 4) for name, v in times.items()}


def _collective_rank(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    n = 10_600_000  # the model's float32 gradients: 42 MB
    t, half = torch.ones(n), torch.empty(n // 2)
    calls = {"all_reduce": lambda: dist.all_reduce(t),
             "broadcast_two_halves": lambda: (dist.broadcast(t[:n // 2], src=0),
                                              dist.broadcast(t[n // 2:], src=1)),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(half, t),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(t, half)}
    ms = {}
    for name, call in calls.items():
        call()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            call()
        dist.barrier()
        ms[name] = round((time.perf_counter() - t0) / 10 * 1e3, 1)
    if rank == 0:
        Path(out).write_text(json.dumps(ms))
    dist.destroy_process_group()


def _collectives() -> dict:
    import tempfile

    import torch.multiprocessing as mp

    from memcc.dist.comm import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "ms.json")
        mp.spawn(_collective_rank, args=(free_port(), out), nprocs=2)
        return {"ms_per_call": json.loads(Path(out).read_text())}


def _buckets(steps: int, rounds: int) -> dict:
    from memcc.dist.launch import train_distributed
    from memcc.trainer.loop import TrainOptions

    rates: dict[str, list[float]] = {"one bucket": [], "25 MB": [], "5 MB": []}
    for _ in range(rounds):
        for name, mb in (("one bucket", None), ("25 MB", 25.0), ("5 MB", 5.0)):
            r, _ = train_distributed(TrainOptions(step=DATA / "gpt2_b4.onnx",
                                                  data=DATA / "data.npz", steps=steps,
                                                  threads=1), 2, zero=1, quiet=True,
                                     bucket_mb=mb)
            rates[name].append(round(r.steady_samples_per_s, 2))
    return {"steady_samples_per_s": rates}


def _heap_child(kind: str, keep: bool, steps: int) -> dict:
    """In a fresh process (glibc's heap settings are per process): ``kind``'s step
    (``rank``: rank 0 of 2's split step, the collectives stood in for; ``trainer``: the
    fused step), with or without ``keep_heap_between_steps``; after two steps, ``steps``
    steps' median time, the kernel's share of the CPU time, minor page faults per step and
    the peak resident size."""
    import resource

    from memcc.backend.memory import keep_heap_between_steps, peak_rss_bytes

    if keep:
        keep_heap_between_steps()
    if kind == "rank":
        from dist_ranks import OneRank

        from memcc.backend.device_step import step_for_provider
        from memcc.dist import split_step
        from memcc.dist.replica import Replica, ReplicaSettings
        from memcc.frontend.load import load_graph
        from memcc.step import TrainingStep

        g, _ = step_for_provider(load_graph(DATA / "gpt2_b4.onnx"), "cpu")
        runner = Replica(split_step(g.copy(), TrainingStep.of(g)), OneRank(),
                         ReplicaSettings(0, 2, 1, threads=1))
    else:
        from memcc.trainer.trainer import Trainer

        runner = Trainer(DATA / "gpt2_b4.onnx", provider="cpu", threads=1)
    arrays = np.load(DATA / "data.npz")
    batch = {n: arrays[n][:4] for n in ("input_ids", "labels")}
    for _ in range(2):
        runner.step(batch)
    r0, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(steps):
        t = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - t)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    user, system = r1.ru_utime - r0.ru_utime, r1.ru_stime - r0.ru_stime
    return {"median_step_s": round(float(np.median(times)), 4),
            "kernel_share": round(system / (user + system), 3),
            "minor_faults_per_step": round((r1.ru_minflt - r0.ru_minflt) / steps),
            "peak_rss_bytes": peak_rss_bytes()}


def _heap(steps: int, rounds: int) -> dict:
    import multiprocessing as mp

    sides = {"rank_default_heap": ("rank", False), "rank_heap_kept": ("rank", True),
             "trainer_default_heap": ("trainer", False),
             "trainer_heap_kept": ("trainer", True)}
    got: dict[str, list[dict]] = {name: [] for name in sides}
    env = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("MALLOC_")}
    try:
        for r in range(rounds):
            names = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            for name in names:
                with mp.get_context("spawn").Pool(1) as pool:
                    got[name].append(pool.apply(_heap_child, (*sides[name], steps)))
    finally:
        os.environ.update(env)
    return {"runs": got}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["split", "collectives", "buckets", "heap"],
                    required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    if not (DATA / "gpt2_b4.onnx").exists():
        raise SystemExit(f"{DATA}: run benchmarks/data_parallel.py once first (it writes "
                         "the step and the data)")
    parts = {"split": lambda: _split(a.steps), "collectives": _collectives,
             "buckets": lambda: _buckets(a.steps, a.rounds),
             "heap": lambda: _heap(a.steps, a.rounds)}
    out = parts[a.part]()
    print(json.dumps({"part": a.part, **out}))


if __name__ == "__main__":
    main()
