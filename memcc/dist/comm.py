"""torch.distributed under memcc: the only module that imports torch, and only when asked.

memcc's single-device tool stays torch-free: torch comes with the optional extra
(``pip install "memcc[dist]"``), and ``torch_distributed`` says so when it is missing.
Arrays cross into torch with ``torch.from_numpy`` (the tensor is the array's memory: the
collectives reduce the buffers ORT wrote, in place, no copy). On GPUs this would be DLPack
on device buffers with NCCL (not built: this machine has no GPU).
"""

from __future__ import annotations

import os
import socket

import numpy as np

from memcc.errors import InputError

EXTRA_HINT = 'pip install "memcc[dist]"'


def torch_distributed():
    """``torch.distributed``, or an ``InputError`` naming the extra that installs it."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        raise InputError(f"--nproc needs PyTorch (torch.distributed), which is not installed "
                         f"({exc}); install memcc's distributed extra: {EXTRA_HINT}") from None
    if not dist.is_available():
        raise InputError(f"this PyTorch ({torch.__version__}) was built without "
                         "torch.distributed; install a build that has it")
    return dist


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT of a local launch)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launched_by_torchrun() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process is one rank of a group started by
    ``torchrun`` (or another launcher setting the same variables), else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env and not {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= set(env):
        return None
    try:
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except (KeyError, ValueError) as exc:
        raise InputError(f"torchrun's environment is incomplete ({exc}): RANK and WORLD_SIZE "
                         "must be set") from None


class _Averaging:
    """An all-reduce in flight; ``wait`` divides the sum by the world size, as
    ``Comm.all_reduce_mean`` does (the same bits)."""

    def __init__(self, work, tensor, world: int) -> None:
        self.work, self.tensor, self.world = work, tensor, world

    def wait(self) -> None:
        self.work.wait()
        self.tensor.div_(self.world)


class Comm:
    """The collectives a ``dist.replica.Replica`` needs, over one gloo process group."""

    def __init__(self, rank: int, world: int) -> None:
        self.dist = torch_distributed()
        if not self.dist.is_initialized():
            self.dist.init_process_group("gloo", rank=rank, world_size=world)
        self.rank, self.world = rank, world

    def all_reduce_mean(self, arr: np.ndarray) -> None:
        """Average ``arr`` over the ranks, in place (SUM, then divided by the world size)."""
        import torch

        t = torch.from_numpy(arr)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        t.div_(self.world)

    def all_reduce_mean_async(self, arr: np.ndarray) -> _Averaging:
        """``all_reduce_mean`` started in gloo's thread: ``wait()`` on the result ends it
        (then ``arr`` holds the mean). ``arr`` must not be read or written until then."""
        import torch

        t = torch.from_numpy(arr)
        return _Averaging(self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, async_op=True),
                          t, self.world)

    def reduce_mean(self, arr: np.ndarray, dst: int) -> None:
        """Average ``arr`` over the ranks into rank ``dst``'s ``arr`` (ZeRO-2: a gradient to
        its owner; SUM, then divided there as ``all_reduce_mean`` divides: the same bits
        on 2 ranks, where a sum of two is the same in any order). gloo reduces in place
        (measured: at most 2.0 MB of scratch); elsewhere ``arr`` is left undefined."""
        import torch

        t = torch.from_numpy(arr)
        self.dist.reduce(t, dst=dst, op=self.dist.ReduceOp.SUM)
        if self.rank == dst:
            t.div_(self.world)

    def broadcast(self, arr: np.ndarray, src: int) -> None:
        import torch

        self.dist.broadcast(torch.from_numpy(arr), src=src)

    def gather_object(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere); pickled: for checkpoints only."""
        out = [None] * self.world if self.rank == 0 else None
        self.dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        self.dist.barrier()

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (so that all stop together on an error)."""
        import torch

        t = torch.tensor([0 if ok else 1], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        return int(t.item()) == 0

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
