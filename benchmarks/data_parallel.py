"""Data-parallel throughput and per-rank memory (issue 33): one process at batch 2B against
2 gloo ranks at batch B (``--zero 0``, ``1`` and ``2``), on a zoo GPT-2 with AdamW.

    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode single --steps 12
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero0 --steps 12
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero1 --steps 12
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero2 --steps 12
    # gradients reduced in buckets of 25 MB during the backward (memcc train --bucket-mb)
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode zero1 --bucket-mb 25
    # rank 0 of 2 (ZeRO-1) in one process, collectives stood in for, with and without
    # buckets, steps alternated: the segmented step's own time and step peak, without the
    # other rank (the peaks exact under the ranks' allocation rules: prefix
    # MALLOC_MMAP_THRESHOLD_=4096 MALLOC_ARENA_MAX=1)
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --size 124m --mode one-process
    # GPT-2 124M (real size: width 768, depth 12, vocab 50257, 1024 positions), 128 tokens,
    # batch 1 per rank: the per-rank memory target of issue 33
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --size 124m --mode zero1 --steps 4
    # throughput: 1 rank at batch B on one core against 2 ranks at batch B, one core each
    # (issue 33's "2 ranks at least 1.6x one rank where the cores allow"), and one process
    # at the global batch 2B on both cores, and two independent one-rank processes at once
    # (what the cores allow); interleaved rounds, ratios with 95% intervals
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode scaling --steps 20 --rounds 5
    # the code path on GPUs: 2 ranks with --provider cuda (ZeRO-0, ZeRO-1, ZeRO-1 by
    # buckets) against one process at the global batch; losses and parameter digests
    PYTHONPATH=.:tests python -m benchmarks.data_parallel --mode check --provider cuda --steps 3

Prints one JSON line: samples/s over the run (first step included), and for the ranks the
figures ``memcc train --nproc 2 --json`` reports (optimizer state and held bytes per rank,
each rank's measured step peak and its prediction, resident size, where rank 0's time
went), plus the predicted peak of the fused step one process would run at the rank's batch
(``passes.analysis.arrange``). Steps and data are written to ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from memcc.trainer.loop import TrainResult

SIZES = {"small": (dict(width=256, depth=4, heads=4, vocab_size=8192, seq_len=128), 4),
         "124m": (dict(width=768, depth=12, heads=12, vocab_size=50257, n_positions=1024,
                       seq_len=128), 1)}


def _files(d: Path, size: str) -> int:
    """Write the steps (batch B and 2B) and the data; B, the rank's batch."""
    from memcc.backend.onnx_file import save_graph
    from memcc.frontend.build import BuildOptions, build_training_step
    from memcc.frontend.load import load_graph
    from models import build_model

    shape, rank_batch = SIZES[size]
    d.mkdir(parents=True, exist_ok=True)
    for b in (rank_batch, 2 * rank_batch):
        if not (d / f"gpt2_b{b}.onnx").exists():
            step = build_training_step(load_graph(build_model("gpt2", batch=b, **shape)),
                                       BuildOptions(optimizer="adamw"))
            save_graph(step, d / f"gpt2_b{b}.onnx")
    if not (d / "data.npz").exists():
        ids = np.random.default_rng(0).integers(0, shape["vocab_size"],
                                                (64 * rank_batch, shape["seq_len"]))
        np.savez(d / "data.npz", input_ids=ids, labels=ids)
    return rank_batch


def _one_process(path: Path, data: Path, steps: int, bucket_bytes: int) -> dict:
    """Seconds per step of rank 0 of 2 (ZeRO-1), one bucket against ``bucket_bytes``
    buckets, both replicas in this process with the collectives stood in for
    (``tests/dist_ranks.OneRank``), one ORT thread, steps alternated."""
    import time

    from dist_ranks import OneRank

    from memcc.backend.device_step import step_for_provider
    from memcc.dist import split_step
    from memcc.dist.memory import RankMemory
    from memcc.dist.replica import Replica, ReplicaSettings
    from memcc.frontend.load import load_graph
    from memcc.step import TrainingStep

    g, _ = step_for_provider(load_graph(path), "cpu")
    reps = {name: Replica(split_step(g.copy(), TrainingStep.of(g)), OneRank(),
                          ReplicaSettings(0, 2, 1, threads=1, bucket_bytes=bb))
            for name, bb in (("one_bucket", None), ("buckets", bucket_bytes))}
    arrays = np.load(data)
    times: dict[str, list[float]] = {name: [] for name in reps}
    memory = {name: RankMemory(rep.held_bytes()) for name, rep in reps.items()}
    for _ in range(steps):
        for name, rep in reps.items():
            batch = {n: arrays[n][:rep.batch[n].shape[0]] for n in rep.batch}
            t = time.perf_counter()
            memory[name].start()
            rep.step(batch)
            memory[name].stop()
            times[name].append(round(time.perf_counter() - t, 3))
    return {"mode": f"rank 0 of 2, ZeRO-1, one process, buckets of {bucket_bytes} bytes",
            "seconds_per_step": times,
            "step_peak_bytes": {n: m.peak for n, m in memory.items()},
            "memory_method": memory["buckets"].method}


def _scaling(d: Path, b: int, a: argparse.Namespace) -> dict:
    """Samples/s of one rank (``memcc train``'s one process, batch ``b``, one ORT thread)
    against 2 gloo ranks (ZeRO-1, batch ``b`` each, one thread each: one core per rank, as
    one GPU per rank; as ``memcc train --nproc 2`` runs them, and with ``--measure-memory``),
    against one process at the global batch with every core, and against two independent
    one-rank processes at once (the ceiling the cores allow, ``_independent``); each
    side ``a.steps`` steps, its rate over every step (what ``memcc train`` prints) and over
    the steps after the first (``steady_samples_per_s``), the
    five in rotated order for ``a.rounds`` rounds; ratios per round with a bootstrap
    interval (``benchmarks/stats.py``)."""
    import os

    from benchmarks.stats import ratio_interval
    from memcc.dist.launch import train_distributed
    from memcc.trainer.loop import TrainOptions, train

    data = d / "data.npz"
    cores = os.cpu_count() or 1

    def one() -> TrainResult:
        return train(TrainOptions(step=d / f"gpt2_b{b}.onnx", data=data, steps=a.steps,
                                  provider=a.provider, threads=1))

    def two(measure_memory: bool = False) -> TrainResult:
        r, _ = train_distributed(TrainOptions(step=d / f"gpt2_b{b}.onnx", data=data,
                                              steps=a.steps, provider=a.provider, threads=1),
                                 2, zero=1, quiet=True, bucket_mb=a.bucket_mb,
                                 measure_memory=measure_memory)
        return r

    def whole() -> TrainResult:
        return train(TrainOptions(step=d / f"gpt2_b{2 * b}.onnx", data=data, steps=a.steps,
                                  provider=a.provider, threads=cores))

    sides = {"one_rank_1_thread": one, "two_ranks_1_thread_each": two,
             f"one_process_batch_{2 * b}_{cores}_threads": whole,
             "two_ranks_measure_memory": lambda: two(measure_memory=True),
             "two_independent_processes": lambda: _independent(d, b, a)}
    names = list(sides)
    runs: dict[str, list[TrainResult]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            runs[n].append(sides[n]())
    out = {"mode": f"scaling, provider {a.provider}, {cores} cores, batch {b} per rank, "
                   f"{a.steps} steps per run, {a.rounds} rounds"}
    for rate in ("samples_per_s", "steady_samples_per_s"):
        got = {n: [getattr(x, rate) for x in v] for n, v in runs.items()}
        # Seconds per sample, so that the ratio of times is the ratio of throughputs.
        per = {n: [1.0 / x for x in v] for n, v in got.items()}
        out[rate] = {
            "per_run": got,
            "two_ranks_over_one_rank": _cell(ratio_interval(per[names[1]], per[names[0]])),
            "two_ranks_over_one_process_all_cores": _cell(
                ratio_interval(per[names[1]], per[names[2]])),
            "two_ranks_measure_memory_over_one_rank": _cell(
                ratio_interval(per[names[3]], per[names[0]])),
            # The machine's own ceiling: two copies that never talk, against one alone.
            "two_independent_over_one_rank": _cell(
                ratio_interval(per[names[4]], per[names[0]])),
            "two_ranks_over_two_independent": _cell(
                ratio_interval(per[names[1]], per[names[4]]))}
    return out


def _independent(d: Path, b: int, a: argparse.Namespace) -> TrainResult:
    """Two ``memcc train`` processes at batch ``b``, one thread each, started together and
    never talking: what the cores give two copies of the rank's step with no collective,
    the ceiling that data-parallel ranks can reach on this machine. Their rates summed (each
    measured while the other ran), as one result."""
    import subprocess
    import sys

    from memcc.trainer.loop import TrainResult

    cmd = [sys.executable, "-m", "memcc.cli", "train", str(d / f"gpt2_b{b}.onnx"),
           "--data", str(d / "data.npz"), "--steps", str(a.steps), "--provider", a.provider,
           "--threads", "1", "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    got = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"an independent run failed: {cmd}")
    return TrainResult(start_step=0, steps_done=a.steps, total_steps=a.steps,
                       losses=got[0]["losses"],
                       samples_per_s=sum(x["samples_per_s"] for x in got),
                       steady_samples_per_s=sum(x["steady_samples_per_s"] for x in got))


def _cell(r) -> dict:
    return {"median": round(r.ratio, 3), "ci95": [round(r.low, 3), round(r.high, 3)]}


def _fused_peak(path: Path) -> int:
    """The predicted peak of the fused step as one process trains it (updates early)."""
    from memcc.frontend.load import load_graph
    from memcc.passes.analysis.arrange import arrange_step
    from memcc.step import TrainingStep

    g = load_graph(path)
    return int(arrange_step(g, TrainingStep.of(g)).prediction.peak_bytes)


def _check(d: Path, b: int, a: argparse.Namespace) -> dict:
    """2 ranks at batch ``b`` on ``a.provider`` (ZeRO-0, ZeRO-1, ZeRO-1 by 25 MB buckets)
    against one process at batch 2b: every rank's parameter digest, and each run's losses
    against the one process's (equal to float32 rounding: the batch sums run in another
    order)."""
    from memcc.dist.launch import train_distributed
    from memcc.trainer.loop import TrainOptions, train

    step, data = d / f"gpt2_b{b}.onnx", d / "data.npz"
    one = train(TrainOptions(step=d / f"gpt2_b{2 * b}.onnx", data=data, steps=a.steps,
                             provider=a.provider))
    runs = {}
    for zero, bucket_mb in ((0, None), (1, None), (1, 25.0)):
        r, info = train_distributed(TrainOptions(step=step, data=data, steps=a.steps,
                                                 provider=a.provider),
                                    2, zero=zero, quiet=True, bucket_mb=bucket_mb)
        runs[f"zero{zero}" + ("-buckets" if bucket_mb else "")] = {
            "losses": r.losses, "samples_per_s": r.samples_per_s,
            "device": info["device"], "backend": info["backend"],
            "digests_agree": len(set(info["parameter_digest_per_rank"])) == 1,
            "max_loss_difference_to_one_process": max(
                abs(x - y) for x, y in zip(r.losses, one.losses, strict=True)),
            "held_bytes_per_rank": info["held_bytes_per_rank"]}
    return {"mode": f"check, provider {a.provider}, 2 ranks x batch {b}",
            "one_process": {"losses": one.losses, "samples_per_s": one.samples_per_s},
            "runs": runs}


def main() -> None:
    from memcc.dist.launch import train_distributed
    from memcc.trainer.loop import TrainOptions, train

    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["single", "zero0", "zero1", "zero2", "one-process",
                                       "check", "scaling"], required=True)
    ap.add_argument("--provider", default="cpu")
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--bucket-mb", type=float, default=None)
    ap.add_argument("--rounds", type=int, default=5, help="--mode scaling: rounds")
    a = ap.parse_args()
    d = a.dir or Path(f"/tmp/memcc_data_parallel_{a.size}")
    b = _files(d, a.size)
    if a.mode == "check":
        out = _check(d, b, a)
    elif a.mode == "scaling":
        out = _scaling(d, b, a)
    elif a.mode == "one-process":
        out = _one_process(d / f"gpt2_b{b}.onnx", d / "data.npz", a.steps,
                           int((a.bucket_mb or 25) * 1_000_000))
    elif a.mode == "single":
        r = train(TrainOptions(step=d / f"gpt2_b{2 * b}.onnx", data=d / "data.npz",
                               steps=a.steps, provider=a.provider))
        out = {"mode": f"1 process, batch {2 * b}", "samples_per_s": r.samples_per_s,
               "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    else:
        zero = int(a.mode[-1])
        r, info = train_distributed(TrainOptions(step=d / f"gpt2_b{b}.onnx",
                                                 data=d / "data.npz", steps=a.steps,
                                                 provider=a.provider),
                                    2, zero=zero, quiet=True, bucket_mb=a.bucket_mb,
                                    measure_memory=True)
        buckets = f", buckets of {a.bucket_mb:g} MB" if a.bucket_mb else ""
        out = {"mode": f"2 ranks x batch {b}, ZeRO-{zero}{buckets}",
               "samples_per_s": r.samples_per_s,
               "fused_step_predicted_peak_bytes_batch_b": _fused_peak(d / f"gpt2_b{b}.onnx"),
               **info}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
