"""The dynamic loss scale as ``memcc train`` goes: its value and the steps it skipped.

A 16-bit step with dynamic loss scaling (``frontend/loss_scaling.py``) skips the update of a
step whose gradients overflowed and halves its scale, as ``torch.amp.GradScaler`` does; a
first-use run saw an fp16 ResNet's loss stay flat for its first steps with nothing saying
why (the scale and the skips were only in the checkpoint). The scale falls only on such a
step (it grows otherwise), so a step after which it is lower was skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memcc.frontend.loss_scaling import SCALE

if TYPE_CHECKING:
    from memcc.trainer.trainer import Trainer


class LossScaleWatch:
    """Read the scale after every step of ``trainer`` (a scalar; nothing where the step has
    no dynamic loss scale) and count the steps it skipped."""

    def __init__(self, trainer: Trainer) -> None:
        self.active = SCALE in trainer.spec.state.values()
        self.scale = float(trainer.state_value(SCALE)) if self.active else None
        self.skipped = 0

    def after_step(self, trainer: Trainer) -> None:
        if not self.active:
            return
        now = float(trainer.state_value(SCALE))
        if self.scale is not None and now < self.scale:
            self.skipped += 1
        self.scale = now

    def to_json(self) -> dict | None:
        return {"scale": self.scale, "skipped_steps": self.skipped} if self.active else None
