"""The memory a training step holds, measured while it trains (``StepMemory``), next to
what its plan predicts, and which allocator the numbers belong to.

A ``Trainer`` enters; numbers with the name of how they were measured leave. Apart from
the loop so that a benchmark can meter a ``Trainer`` it drives itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from memcc.backend.memory import trim_heap
from memcc.errors import RuntimeFailure
from memcc.step import PLAN_KEY

if TYPE_CHECKING:
    from memcc.trainer.trainer import Trainer


def allocator_of(trainer: Trainer) -> str:
    """Where the step's buffers come from, as ``TrainResult.allocator`` names it."""
    if trainer.provider != "cpu":
        return "cuda-arena"
    return "arena" if trainer.arena else "malloc"


def arena_peak_bytes(trainer: Trainer) -> int:
    """The step's peak through ORT's CPU arena as ``StepMemory`` measures it (the meter's
    view of ``passes.analysis.arena.cpu_arena_peak``)."""
    from memcc.passes.analysis.arena import cpu_arena_peak

    a = trainer.arrangement
    return cpu_arena_peak(a.graph, a.prediction, meter=True)[1]


def allocator_notes(trainer: Trainer) -> list[str]:
    """A compiled plan trained from an allocator it was not planned for: from malloc the
    plan holds and glibc's heap need not; through the arena (``train --arena`` on a plan
    compiled without it) the arena's 256-byte rounding and regions can hold far more than
    the budget, which nothing checked (``memcc tune``'s batch 111 of a ResNet under 30 MB:
    planned at 27.7 MB, 42.9 MB measured through the arena), so the figure is said."""
    if trainer.provider != "cpu" or PLAN_KEY not in trainer.graph.metadata:
        return []
    if trainer.arena:
        if trainer.spec.allocator == "arena":
            return []
        return [f"{trainer.path}: this plan was compiled for malloc and trains through the "
                f"arena here (--arena), whose peak its budget did not check: predicted "
                f"{arena_peak_bytes(trainer):,} bytes through the arena against the "
                f"{trainer.predicted_peak_bytes:,} it was planned at; to train within the "
                "budget through the arena, compile with --arena"]
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
      trainer holds (parameters, optimizer state, constants, its bound copy of the batch),
      as the measuring child counts its feeds (the caller's batch arrays are not added:
      the plan counts the batch once). Predicted by ``passes.analysis.arena.cpu_arena_peak`` (the
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
        self.allocator = allocator_of(trainer)
        self.held = trainer.held_bytes() if self.allocator != "cuda-arena" else 0
        self.predicted = trainer.predicted_peak_bytes
        self.prediction = "live bytes (passes.analysis.liveness)"
        self.first_step_predicted: int | None = None
        if self.allocator == "arena":
            self.predicted = arena_peak_bytes(trainer)
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

    @property
    def method(self) -> str:
        if self.allocator == "arena":
            return ("cpu-vmhwm: growth of VmHWM over the step (heap trimmed before it) plus "
                    "the arrays the trainer holds")
        if self.allocator == "cuda-arena":
            return self._nvml.method if self._nvml is not None else "none"
        return "none: malloc (the resident size is shown instead)"

    def start(self, batch: Mapping[str, np.ndarray]) -> None:
        """Before a step on ``batch``, whose bound copy ``held`` already counts."""
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
        # growth of the heap is added to what the trainer holds, the bound batch included.
        # The caller's own batch arrays are not added: the trainer copies them into its
        # bound buffers, which the plan counts once as the step's inputs (adding them too
        # counted the batch twice: 3.1 MB on the zoo's ResNet-18 at 16 x 128 px).
        step = grew if self.allocator == "cuda-arena" else grew + self.held
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
                "rss_bytes": process_memory_bytes("cuda" if self.allocator == "cuda-arena"
                                           else "cpu")}


def process_memory_bytes(provider: str) -> int | None:
    """Resident memory of this process (CPU); None on CUDA (device memory is not read)."""
    if provider != "cpu":
        return None
    from memcc.backend.memory import rss_bytes

    try:
        return rss_bytes()
    except Exception:  # no /proc: show nothing rather than fail a training run
        return None

