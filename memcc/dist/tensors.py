"""A rank's buffers: torch tensors on its device, handed to ORT through DLPack.

Every array a data-parallel rank keeps (parameters, optimizer state, gradient buckets, the
batch) is a torch tensor on the rank's device, and ORT reads and writes it where it lies:
``OrtValue.from_dlpack`` wraps the tensor's memory (no copy), the collectives reduce the
same memory, and an output ORT allocates comes back as a tensor by ``torch.from_dlpack``.
On the CPU that is what ``torch.from_numpy`` did; on a GPU it is the only way to keep
gradients on the device between ORT's backward and NCCL's all-reduce (issue 33: no host
copies on GPUs). One code path for both devices: the CPU tests run it.

Streams (CUDA): ORT runs on a stream of its own and synchronizes it before ``run``
returns (``RunOptions`` default); torch's copies and collectives run on torch's streams.
``synchronize`` (torch's current stream, not the whole device) is called before ORT reads
what torch wrote and after a collective is waited on, so neither side reads a buffer the
other is still writing, while a bucket's reduction in flight goes on beside the next
segment. Not yet run on a GPU (none was lent
to the session that wrote it): docs/DATA_PARALLEL.md says what a GPU session checks.

Imported only by the modules that run ranks (torch is memcc's optional ``dist`` extra).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import torch

from memcc.dist.placement import Placement
from memcc.errors import InputError


def from_numpy(arr: np.ndarray) -> torch.Tensor:
    """``arr``'s memory as a CPU tensor (a C-ordered copy where it is not C-ordered; 0-d
    kept 0-d). Read-only arrays (an ONNX file's constants) are wrapped without torch's
    warning: memcc only copies from them or hands them to ORT as inputs."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.asarray(arr, order="C"))


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy dtype (what ``torch.from_numpy`` would give)."""
    return torch.from_numpy(np.zeros(0, dtype)).dtype


@dataclass(frozen=True)
class RankDevice:
    """Where a rank's buffers and sessions live: ``kind`` ``cpu`` or ``cuda``, ``index``
    the GPU's (``cuda:index``; ORT's ``device_id``)."""

    kind: str = "cpu"
    index: int = 0

    @classmethod
    def of(cls, place: Placement) -> RankDevice:
        return cls(place.kind, place.gpu)

    @property
    def torch(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device("cuda", self.index)

    @property
    def on_gpu(self) -> bool:
        return self.kind == "cuda"

    def check(self) -> RankDevice:
        """``self``, or an ``InputError`` where this torch cannot reach the device."""
        if self.on_gpu and not (torch.cuda.is_available()
                                and self.index < torch.cuda.device_count()):
            raise InputError(f"--provider cuda: this rank needs GPU {self.index}, and PyTorch "
                             f"{torch.__version__} sees {torch.cuda.device_count()} GPU(s) "
                             f"(CUDA available: {torch.cuda.is_available()}); install a "
                             "CUDA build of torch, or run fewer ranks per host")
        return self

    # --------------------------------------------------------------- making
    def zeros(self, shape, dtype: np.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=torch_dtype(np.dtype(dtype)), device=self.torch)

    def unwritten(self, shape, dtype: np.dtype) -> torch.Tensor:
        """A tensor whose every element is written before it is read (a gradient bucket ORT
        fills): not zeroed, so on the CPU its pages become resident only as they are
        written, as the backward produces the gradients (zeroed, a 21 MB bucket measured
        21 MB more at the step's peak: all of it resident from the segment's start)."""
        return torch.empty(tuple(shape), dtype=torch_dtype(np.dtype(dtype)), device=self.torch)

    def copy_of(self, arr) -> torch.Tensor:
        """A contiguous tensor of its own on this device holding ``arr`` (numpy or torch)."""
        src = from_numpy(arr) if isinstance(arr, np.ndarray) else arr
        return src.to(self.torch, copy=True).contiguous()

    def place(self, arr: np.ndarray) -> torch.Tensor:
        """``arr`` (a value ORT only reads: a constant) on this device: the same memory on
        the CPU, where a copy would hold every constant twice; a copy on a GPU."""
        return self.copy_of(arr) if self.on_gpu else from_numpy(arr)

    def write(self, dst: torch.Tensor, src) -> None:
        """Copy ``src`` (numpy or torch) into ``dst`` where it lies."""
        dst.copy_(from_numpy(src) if isinstance(src, np.ndarray) else src)

    # --------------------------------------------------------------- crossing
    def ortvalue(self, t: torch.Tensor):
        """``t``'s memory as an ORT value (no copy). onnxruntime 1.31's DLPack reader knows
        bool only as bytes flagged bool (torch's kDLBool: "Unsupported code 6"), and 1.32
        dropped that flag: a bool tensor goes through the public reader first, else as its
        uint8 view flagged bool."""
        import onnxruntime as ort

        if not t.is_contiguous():
            raise InputError("a buffer bound to ONNX Runtime is not contiguous")
        if t.dtype != torch.bool:
            return ort.OrtValue.from_dlpack(t)
        try:
            return ort.OrtValue.from_dlpack(t)
        except RuntimeError:
            from onnxruntime.capi import _pybind_state as C

            return ort.OrtValue(C.OrtValue.from_dlpack(t.view(torch.uint8).__dlpack__(), True))

    def tensor(self, value, dtype: np.dtype | None = None) -> torch.Tensor:
        """An ORT value as a tensor over the same memory; ``dtype`` bool restores what
        DLPack carries as bytes."""
        t = torch.from_dlpack(value)
        return t.view(torch.bool) if dtype is not None and np.dtype(dtype) == np.bool_ else t

    def host(self, t: torch.Tensor) -> np.ndarray:
        """``t`` as a numpy array: a view of the same memory on the CPU, a copy from a GPU
        (checkpoints, digests)."""
        return t.numpy() if not t.is_cuda else t.detach().cpu().numpy()

    def synchronize(self) -> None:
        """Wait for the work torch queued on its current stream here (copies, a reduction's
        division after its wait); a no-op on the CPU. Not the whole device: a collective
        still in flight on NCCL's stream (a bucket the backward does not read) goes on."""
        if self.on_gpu:
            torch.cuda.current_stream(self.torch).synchronize()

    def ort_output(self) -> tuple[str, int]:
        """(device type, device id) for ``IOBinding.bind_output``."""
        return (self.kind, self.index)
