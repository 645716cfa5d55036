"""What kind of training step ``memcc build`` makes: loss, optimizer, chunking, fusions.

In: the ``memcc build`` flags (the CLI, ``memcc compile`` and Python callers fill
``BuildOptions``). Out: a checked, frozen ``BuildOptions``; a bad value is an
``InputError`` naming the flag, raised before any graph is touched. Apart from the builder
(``frontend.build``) so that the pieces it calls (``frontend.update``) can read the
options without importing the builder back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memcc.errors import InputError
from memcc.frontend.fuse import RULES as FUSION_RULES

LOSSES = ("cross-entropy", "mse", "none")
OPTIMIZERS = ("none", "sgd", "adamw")
# fp32: the step computes as exported. bf16 / fp16: autocast (frontend/autocast.py), with
# fp32 parameters and optimizer state.
PRECISIONS = ("fp32", "bf16", "fp16")
# dynamic: the step scales its loss and skips overflowing updates (frontend/loss_scaling.py)
LOSS_SCALES = ("dynamic", "none")
DEFAULT_LR = {"none": 0.0, "sgd": 0.01, "adamw": 1e-3}


@dataclass(frozen=True)
class BuildOptions:
    """What kind of step to build; the CLI fills this from ``memcc build`` flags."""

    loss: str = "cross-entropy"
    optimizer: str = "sgd"
    lr: float | None = None
    momentum: float = 0.9
    weight_decay: float | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    # fnmatch patterns over initializer names: parameters kept fixed (no gradient built)
    freeze: tuple[str, ...] = ()
    # > 1: cross-entropy and the vocabulary projection over that many row chunks, each
    # chunk's gradient taken right away (frontend/chunked_loss.py)
    loss_chunks: int | None = None
    # cross-entropy's class axis in the first output; None: the last (frontend/loss.py)
    class_axis: int | None = None
    # cross-entropy: labels equal to it count for nothing (torch's ignore_index); None: no
    # value is ignored (frontend/loss.py)
    ignore_index: int | None = None
    # > 1: every attention's scores and probabilities, every MLP's hidden activations, over
    # that many row chunks (frontend/row_chunks.py)
    attention_chunks: int | None = None
    mlp_chunks: int | None = None
    # > 1: the stem (Conv of the image -> training BatchNorm -> activation [-> MaxPool])
    # over that many batch chunks (frontend/batch_chunks.py)
    batch_chunks: int | None = None
    # None (any of the four): not given. The step is built without those chunks (as 1);
    # ``memcc compile`` chooses them itself where they lower the plan's cost at the budget
    # (compiler/chunk_choice.py). A number given is kept as it is (1: never split).
    # memcc's fusions applied to the built step (frontend/fuse.py); () builds it unfused
    fusions: tuple[str, ...] = FUSION_RULES
    # fp32, or bf16 / fp16 autocast: matrix products and convolutions in 16-bit, the
    # numerically delicate ops in fp32, parameters and optimizer state fp32
    # (frontend/autocast.py)
    precision: str = "fp32"
    # dynamic loss scaling as torch.amp.GradScaler (frontend/loss_scaling.py): "dynamic",
    # "none", or None = dynamic with fp16, none otherwise; the rest are GradScaler's
    # arguments, with its defaults
    loss_scale: str | None = None
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    # the vector parameters' updates as one update of their concatenation, a few kernels
    # instead of a few per parameter, the same bits (frontend/update_groups.py)
    grouped_updates: bool = True

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise InputError(f"--loss '{self.loss}': choose one of {', '.join(LOSSES)}")
        if self.loss_chunks is not None and self.loss_chunks < 1:
            raise InputError(f"--loss-chunks {self.loss_chunks}: give 1 (the plain loss) or "
                             "more")
        for flag, k in (("--attention-chunks", self.attention_chunks),
                        ("--mlp-chunks", self.mlp_chunks),
                        ("--batch-chunks", self.batch_chunks)):
            if k is not None and k < 1:
                raise InputError(f"{flag} {k}: give 1 (whole regions) or more")
        if (self.loss_chunks or 1) > 1 and self.loss != "cross-entropy":
            raise InputError(f"--loss-chunks applies to --loss cross-entropy, not "
                             f"'{self.loss}'")
        if self.class_axis is not None and self.loss != "cross-entropy":
            raise InputError(f"--class-axis applies to --loss cross-entropy, not "
                             f"'{self.loss}'")
        self._check_ignore_index()
        if self.precision not in PRECISIONS:
            raise InputError(f"--precision '{self.precision}': choose one of "
                             f"{', '.join(PRECISIONS)}")
        if (self.loss_chunks or 1) > 1 and self.precision != "fp32":
            raise InputError(f"--loss-chunks {self.loss_chunks} with --precision "
                             f"{self.precision}: the chunked loss is built for float32 steps "
                             "only; give --loss-chunks 1 (attention and MLP chunks work in "
                             "16-bit)")
        self._check_loss_scale()
        if self.optimizer not in OPTIMIZERS:
            raise InputError(
                f"--optimizer '{self.optimizer}': choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.lr is not None and self.lr < 0:
            raise InputError(f"--lr {self.lr:g}: the learning rate must not be negative")
        if self.momentum < 0:
            raise InputError(f"--momentum {self.momentum:g}: momentum must not be negative "
                             "(0 disables it; torch.optim.SGD's rule)")
        if self.weight_decay is not None and self.weight_decay < 0:
            raise InputError(f"--weight-decay {self.weight_decay:g}: weight decay must not "
                             "be negative")

    def _check_ignore_index(self) -> None:
        if self.ignore_index is None:
            return
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int) \
                or not -2**63 <= self.ignore_index < 2**63:
            raise InputError(f"--ignore-index {self.ignore_index!r}: give a whole number "
                             "(an int64 label value)")
        if self.loss != "cross-entropy":
            raise InputError(f"--ignore-index applies to --loss cross-entropy, not "
                             f"'{self.loss}'")
        if (self.loss_chunks or 1) > 1:
            raise InputError(f"--ignore-index {self.ignore_index} with --loss-chunks "
                             f"{self.loss_chunks}: the chunked loss averages over every "
                             "position; give one or the other")

    def _check_loss_scale(self) -> None:
        """GradScaler's own conditions on its arguments, named as BuildOptions fields."""
        if self.loss_scale is not None and self.loss_scale not in LOSS_SCALES:
            raise InputError(f"--loss-scale '{self.loss_scale}': choose one of "
                             f"{', '.join(LOSS_SCALES)}")
        if not (math.isfinite(self.init_scale) and self.init_scale > 0):
            raise InputError(f"loss scaling's init_scale {self.init_scale:g}: give a finite "
                             "number above 0 (GradScaler's default is 65536)")
        if not (math.isfinite(self.growth_factor) and self.growth_factor > 1):
            raise InputError(f"loss scaling's growth_factor {self.growth_factor:g}: give a "
                             "finite number above 1 (GradScaler's default is 2)")
        if not 0 < self.backoff_factor < 1:
            raise InputError(f"loss scaling's backoff_factor {self.backoff_factor:g}: give a "
                             "number between 0 and 1 (GradScaler's default is 0.5)")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or not 0 < self.growth_interval <= 2**24:
            raise InputError(f"loss scaling's growth_interval {self.growth_interval!r}: give a "
                             "whole number of steps from 1 to 2^24 (GradScaler's default is "
                             "2000)")

    @property
    def dynamic_loss_scale(self) -> bool:
        """Whether the step scales its loss: --loss-scale dynamic, or not given with fp16."""
        if self.loss_scale is None:
            return self.precision == "fp16"
        return self.loss_scale == "dynamic"

    @property
    def learning_rate(self) -> float:
        return DEFAULT_LR[self.optimizer] if self.lr is None else self.lr

    @property
    def decay(self) -> float:
        if self.weight_decay is not None:
            return self.weight_decay
        return 0.01 if self.optimizer == "adamw" else 0.0
