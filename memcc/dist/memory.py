"""A data-parallel rank's step memory: measured around each step, next to the prediction
``memcc compile --nproc`` plans with.

Measured the way ``memcc train --arena`` measures a step (``trainer.memory.StepMemory``):
before the step the free heap is given back (``malloc_trim``) and the high-water mark is
reset; after it, the growth of the high-water mark (ORT's buffers of both halves, gloo's
scratch) plus the arrays the rank holds (``Replica.held_bytes``: parameters, the gradient
bucket, its optimizer state, carried statistics, the batch, update outputs not written in
place). Only where asked (``memcc train --nproc N --measure-memory``): its ranks then run
with ``MEMORY_ENV`` (every allocation of 4 KiB or more its own ``mmap``, one malloc arena:
``backend.memory``), the allocation rules the plan's peak follows
(``passes.analysis.liveness``), so freed buffers leave the resident size at once. That costs
speed: every large temporary is a fresh mapping whose pages the kernel zeroes on first
touch, and the heap is trimmed before each step. On this project's 2-core machine two ranks
of the zoo's GPT-2 (width 256, batch 4 each) trained at 8.06 samples/s so (median of 5
runs), against 14.78 without it, while one process alone on one core trains at 10.09
(``benchmarks/data_parallel.py --mode scaling``; docs/DATA_PARALLEL.md, "Throughput").
Without it a rank allocates as ``memcc train`` does and its
step peak is not measured (glibc's heap keeps freed buffers: a growth of the high-water
mark would say nothing of the step); the ranks' resident sizes are reported. A process
started with ``MEMORY_ENV`` already (``exact_cpu_measurement``) measures as asked. Under
``torchrun`` the launcher's environment decides; the method then says whether the figure
is exact. The first step (thread pools, kernel caches) is shown apart; the run's peak is
that of the later steps.

Predicted: the rank's step as ``passes.analysis.rank_step`` writes it, judged by
``passes.analysis.arrange`` (the compile's simulator, without a plan: the step file
carries its plan's rewrites).
"""

from __future__ import annotations

from memcc.backend.memory import (
    CPU_METHOD,
    MMAP_ENV,
    exact_cpu_measurement,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    trim_heap,
)
from memcc.dist.bucket_memory import bucketed_rank_graph
from memcc.errors import RuntimeFailure
from memcc.graph import Graph
from memcc.passes.analysis.arrange import arrange_step
from memcc.passes.analysis.rank_step import Ranks, rank_step
from memcc.step import TrainingStep

MEMORY_ENV = dict(MMAP_ENV)


def predicted_rank_peak(graph: Graph, world: int, zero: int, rank: int,
                        bucket_bytes: int | None = None) -> int:
    """The predicted peak of ``rank``'s step (before its replica drops the initial values:
    the rank's graph counts the stored state); by buckets of ``bucket_bytes``, in the
    order they run (``dist.bucket_memory``)."""
    if bucket_bytes:
        view = bucketed_rank_graph(graph, Ranks(world, zero), rank, bucket_bytes)
        return int(arrange_step(view, TrainingStep.of(view)).prediction.peak_bytes)
    view = rank_step(graph, Ranks(world, zero), rank).graph
    return int(arrange_step(view, TrainingStep.of(view)).prediction.peak_bytes)


class RankMemory:
    """The step peak of one rank, measured around each step (module docstring)."""

    def __init__(self, held_bytes: int, on_gpu: bool = False, measured: bool = True
                 ) -> None:
        self.held = held_bytes
        self.peak: int | None = None
        self.first_step: int | None = None
        self.steps = 0
        self._before = 0
        # A GPU rank's step memory is on the device, where ranks may share one GPU: not
        # measured per rank (the prediction and the held bytes are still reported).
        self.on_gpu = on_gpu
        self.asked = measured or exact_cpu_measurement()
        self.ok = not on_gpu and self.asked

    @property
    def method(self) -> str:
        if self.on_gpu:
            return "none: a GPU rank's device memory is not measured per rank yet"
        if not self.asked:
            return ("none: the ranks allocate from glibc's heap, as memcc train does, for "
                    "speed; memcc train --nproc N --measure-memory measures each rank's "
                    "step peak (slower)")
        how = CPU_METHOD if exact_cpu_measurement() else \
            "cpu-vmhwm-approximate: glibc's default thresholds (not started by memcc)"
        return (f"growth of VmHWM over the step (heap trimmed before it) plus the arrays the "
                f"rank holds; {how}")

    def start(self) -> None:
        if not self.ok:
            return
        try:
            trim_heap()
            reset_peak_rss()
            self._before = rss_bytes()
        except (OSError, RuntimeFailure):  # no /proc (not Linux): nothing measured
            self.ok = False

    def stop(self) -> None:
        if not self.ok:
            return
        step = peak_rss_bytes() - self._before + self.held
        self.steps += 1
        if self.steps == 1:
            self.first_step = step
        self.peak = step if self.steps <= 2 else max(self.peak or 0, step)
