"""Data-parallel training on ``torch.distributed`` (``memcc train --nproc N``, ``torchrun``).

A driver over the trainer's pieces: the step is cut at its updates (``split``: gradient step
and update step, no torch), each rank binds both halves to buffers it owns (``bound``,
``replica``: gradients written into flat buckets, averaged with one all-reduce per dtype,
ZeRO-1 optimizer state sharding, ZeRO-2 gradients reduced to their owners), ranks train and
checkpoint in ``train`` and are started by ``launch``. torch is imported in ``comm`` only,
when a run asks for it: memcc's single-device tool stays torch-free (``pip install
".[dist]"`` in memcc's checkout adds it). Semantics, costs and measured figures:
DATA_PARALLEL.md.
"""

from memcc.dist.split import SplitStep, owners_of_state, peaks, split_step, update_part

__all__ = ["SplitStep", "owners_of_state", "peaks", "split_step", "train_distributed",
           "update_part"]


def train_distributed(*args, **kwargs):
    """``memcc.dist.launch.train_distributed`` (imported on use)."""
    from memcc.dist.launch import train_distributed as run

    return run(*args, **kwargs)
