"""Training a memcc step for real: ``memcc.Trainer``, the ``memcc train`` loop, and getting
the trained weights out.

A training step file (and, for ``memcc train``, data) enters; trained values, checkpoints
and exported models leave. The package keeps each job in its own module:

- ``trainer``: ``Trainer`` (one ORT session of the step, updates in place; ``step(batch)
  -> loss``, ``save``/``resume``, ``export``) and ``TrainerOptions``;
- ``loop``: ``train`` (``memcc train``: data checked, batches in a seeded order, periodic
  checkpoints, SIGINT/SIGTERM after a complete step), ``TrainOptions``/``TrainResult``/
  ``TrainPlan``/``TrainProgress``, ``TrainingInterrupted``;
- ``memory``: ``StepMemory``, the step's memory measured while it trains;
- ``checkpoints``: what a checkpoint shares with its step and its data;
- ``export``: the forward model or its weights out of a step (``memcc export``).
"""

from memcc.trainer.checkpoints import step_signature
from memcc.trainer.export import (
    EXPORT_FORMATS,
    ExportRequest,
    export_checkpoint,
    export_weights,
    exported_weight_names,
    forward_graph,
    made_up_names,
    weight_export_notes,
)
from memcc.trainer.loop import (
    TrainingInterrupted,
    TrainOptions,
    TrainPlan,
    TrainProgress,
    TrainResult,
    plan_training,
    train,
)
from memcc.trainer.memory import StepMemory
from memcc.trainer.trainer import Trainer, TrainerOptions, describe_in_place

__all__ = ["EXPORT_FORMATS", "ExportRequest", "StepMemory", "TrainOptions", "TrainPlan",
           "TrainProgress", "TrainResult", "Trainer", "TrainerOptions", "TrainingInterrupted",
           "describe_in_place", "export_checkpoint", "export_weights", "exported_weight_names",
           "forward_graph", "made_up_names", "plan_training", "step_signature", "train",
           "weight_export_notes"]
