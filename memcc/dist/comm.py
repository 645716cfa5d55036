"""torch.distributed under memcc: the only module that imports torch, and only when asked.

memcc's single-device tool stays torch-free: torch comes with the optional extra
(``pip install ".[dist]"`` in memcc's checkout), and ``torch_distributed`` says so when it
is missing.
The buffers are torch tensors on the rank's device that ORT reads and writes through DLPack
(``dist.tensors``): the collectives reduce the buffers ORT wrote, in place, no copy. gloo on
the CPU; NCCL where every rank has a GPU of its own (``backend_for``); on a GPU shared by
ranks, gloo over CUDA tensors (torch stages them through host memory).
"""

from __future__ import annotations

import os
import socket

from memcc.errors import InputError

EXTRA_HINT = 'pip install ".[dist]" in memcc\'s checkout'


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


def backend_for(device_kind: str, ranks_per_gpu: int) -> str:
    """The process group's backend: NCCL where each rank has a GPU of its own (NCCL refuses
    two ranks on one device), else gloo (on the CPU; over CUDA tensors on a shared GPU)."""
    return "nccl" if device_kind == "cuda" and ranks_per_gpu == 1 else "gloo"


class _Averaging:
    """An all-reduce in flight; ``wait`` divides the sum by the world size, as
    ``Comm.all_reduce_mean`` does (the same bits)."""

    def __init__(self, work, tensor, comm: Comm) -> None:
        self.work, self.tensor, self.comm = work, tensor, comm

    def wait(self) -> None:
        self.work.wait()
        self.tensor.div_(self.comm.world)
        self.comm.settle(self.tensor)


class Comm:
    """The collectives a ``dist.replica.Replica`` needs, over one process group (gloo, or
    NCCL: ``backend_for``), on tensors where they lie."""

    def __init__(self, rank: int, world: int, backend: str = "gloo", gpu: int = 0) -> None:
        self.dist = torch_distributed()
        # NCCL's own small tensors (flags, pickled objects) live on the rank's GPU.
        self._small = "cpu"
        if backend == "nccl":
            import torch

            torch.cuda.set_device(gpu)
            self._small = f"cuda:{gpu}"
        if not self.dist.is_initialized():
            self.dist.init_process_group(backend, rank=rank, world_size=world)
        self.rank, self.world, self.backend = rank, world, backend

    @staticmethod
    def settle(t) -> None:
        """On a GPU, wait until torch's current stream is done with ``t``: the collective
        was waited on (``work.wait`` orders it before that stream's later work) and the
        division ran there; ORT reads ``t`` on a stream of its own next. Other collectives
        in flight are not waited for."""
        if t.is_cuda:
            import torch

            torch.cuda.current_stream(t.device).synchronize()

    def all_reduce_mean(self, t) -> None:
        """Average ``t`` over the ranks, in place (SUM, then divided by the world size)."""
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        t.div_(self.world)
        self.settle(t)

    def all_reduce_mean_async(self, t) -> _Averaging:
        """``all_reduce_mean`` started in the backend's thread or stream: ``wait()`` on the
        result ends it (then ``t`` holds the mean). ``t`` must not be read or written until
        then."""
        return _Averaging(self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM, async_op=True),
                          t, self)

    def reduce_mean(self, t, dst: int) -> None:
        """Average ``t`` over the ranks into rank ``dst``'s ``t`` (ZeRO-2: a gradient to
        its owner; SUM, then divided there as ``all_reduce_mean`` divides: the same bits
        on 2 ranks, where a sum of two is the same in any order). gloo reduces in place
        (measured: at most 2.0 MB of scratch); elsewhere ``t`` is left undefined."""
        self.dist.reduce(t, dst=dst, op=self.dist.ReduceOp.SUM)
        if self.rank == dst:
            t.div_(self.world)
        self.settle(t)

    def broadcast(self, t, src: int) -> None:
        self.dist.broadcast(t, src=src)
        self.settle(t)

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

        t = torch.tensor([0 if ok else 1], dtype=torch.int64, device=self._small)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.SUM)
        return int(t.item()) == 0

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()
