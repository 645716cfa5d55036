"""Where a data-parallel rank runs: its device and its ORT threads (no torch here: the
launcher decides placements before any rank imports torch)."""

from __future__ import annotations

from dataclasses import dataclass

from memcc.backend.session import SessionSettings


@dataclass(frozen=True)
class Placement:
    """``kind`` ``cpu`` or ``cuda``; ``gpu``: the rank's GPU (``cuda:gpu``, ORT's
    ``device_id``); ``threads``: ORT's intra-op threads (None: ORT's default)."""

    kind: str = "cpu"
    gpu: int = 0
    threads: int | None = None

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    def session_settings(self) -> SessionSettings:
        return SessionSettings(intra_op_threads=self.threads,
                               cuda_options={"device_id": str(self.gpu)} if self.on_gpu
                               else None)


def place_rank(provider: str, local_rank: int, local_world: int, gpus: int,
               threads: int | None) -> tuple[Placement, int]:
    """The rank's placement and how many ranks share its GPU (1 on the CPU): ranks are
    dealt to the host's ``gpus`` GPUs round-robin by local rank."""
    if provider != "cuda":
        return Placement("cpu", 0, threads), 1
    if gpus < 1:
        from memcc.errors import InputError

        raise InputError("--nproc with --provider cuda: PyTorch sees no GPU on this host "
                         "(install a CUDA build of torch, or train with --provider cpu)")
    sharing = -(-local_world // gpus)
    return Placement("cuda", local_rank % gpus, threads), sharing
