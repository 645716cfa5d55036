"""One rank's data-parallel step: gradient step, averaged gradients, update step.

The buffers (tensors on the rank's device, ``dist.tensors``, bound to both halves of the
split step, ``dist.bound``):

- parameters: one flat array per dtype, laid out owner by owner (ZeRO-1: rank 0's
  parameters first), each parameter a view into it, so the parameters a rank updated are
  handed to the others with one broadcast per owner;
- gradients: one flat bucket per dtype, each gradient a view into it that the gradient
  step writes, and at the end of the float32 bucket the loss and a stop flag: one
  ``all_reduce`` per dtype averages the gradients and the loss together (SUM, then divided
  by the world size), and tells every rank whether any was asked to stop (a signal), so
  that all stop after the same step;
- optimizer state: the rank's own (ZeRO-1: only for the parameters it owns; the AdamW and
  Dropout step counters on every rank).

ZeRO-2: the bucket holds only the gradients of the rank's own parameters; the gradient
step writes every other gradient into a buffer ORT allocates when the backward produces
it (``BoundGraph``'s transient outputs), each gradient is reduced to its owner (one gloo
``reduce`` per gradient, in the same order on every rank: SUM, divided by the world size
on the owner) and the sent ones are freed before the update step; loss and stop flag are
all-reduced apart (8 bytes). Between steps a rank holds 1/N of the gradients.

``comm`` is ``dist.comm.Comm`` (torch.distributed); the buffers are made and copied
through ``settings.device`` (``dist.tensors.RankDevice``): nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from memcc.dist.bound import BoundGraph, Unbound, flat_arrays
from memcc.dist.buckets import cut_at_buckets, refuse_zero2
from memcc.dist.overlap import OverlappedStep, RankBuffers
from memcc.dist.placement import Placement
from memcc.dist.split import SplitStep, owners_of_state, update_part
from memcc.dist.tensors import RankDevice
from memcc.errors import InputError
from memcc.passes.analysis.rank_step import assign_owners as deal
from memcc.passes.analysis.rank_step import gradient_owners


def assign_owners(split: SplitStep, world: int) -> dict[str, int]:
    """Parameter -> the rank that updates it (ZeRO-1): ``passes.analysis.rank_step``'s
    deal (by bytes, largest first), the one ``memcc compile --nproc`` planned."""
    return deal(split.parameters, split.full, world)


@dataclass(frozen=True)
class ReplicaSettings:
    rank: int
    world: int
    zero: int = 0
    threads: int | None = None
    source: str = "<step>"
    # Gradient buckets of this many bytes, each reduced while the backward goes on and
    # freed after its updates (``dist.overlap``); None: one bucket held all step.
    bucket_bytes: int | None = None
    # Where the buffers and sessions live (``--provider cuda``: the rank's GPU).
    device: RankDevice = field(default_factory=RankDevice)

    @property
    def place(self) -> Placement:
        return Placement(self.device.kind, self.device.index, self.threads)


class Replica:
    """The step on one rank (module docstring). ``step(batch) -> loss`` averaged over the
    ranks; every rank ends the step with the same parameters."""

    def __init__(self, split: SplitStep, comm, settings: ReplicaSettings) -> None:
        s = settings
        if s.zero not in (0, 1, 2):
            raise InputError(f"--zero {s.zero}: memcc shards optimizer state at stage 0 "
                             "(none), 1 (optimizer state) or 2 (and gradients)")
        if s.bucket_bytes:
            refuse_zero2(s.zero)
        self.split, self.comm, self.settings = split, comm, s
        self.device = dev = s.device
        info = split.full.info
        params = split.parameters
        self.owner = assign_owners(split, s.world) if s.zero else dict.fromkeys(params, s.rank)
        order = sorted(params, key=lambda p: (self.owner[p], params.index(p)))
        self.param_views, self.param_flats = flat_arrays(order, info, device=dev)
        self._owned_ranges = self._ranges(order)
        self.grad_order = list(dict.fromkeys(split.gradients.values()))
        # ZeRO-2: gradient -> the rank it is reduced to (None: all-reduced, kept by all).
        self.grad_to = gradient_owners(split.spec, self.owner) if s.zero == 2 else {}
        kept = [] if s.bucket_bytes else \
            [g for g in self.grad_order if self.grad_to.get(g, s.rank) in (None, s.rank)]
        apart = s.zero == 2 or bool(s.bucket_bytes)
        self.grad_views, self.grad_flats = flat_arrays(kept, info, 0 if apart else 2, dev)
        # Loss and stop flag: the float32 bucket's tail, or their own 2 floats (ZeRO-2,
        # buckets).
        self.flags = dev.zeros((2,), np.float32) if apart else None
        tail = self.flags if self.flags is not None else \
            self.grad_flats[np.dtype(np.float32)][-2:]
        self.loss_view, self.stop_view = tail[0:1].reshape(()), tail[1:2].reshape(())
        owners = owners_of_state(split)
        mine = [o for o, ps in owners.items()
                if not ps or any(self.owner[p] == s.rank for p in ps)]
        self.update_state = {o: split.update_state[o] for o in mine}
        self.opt_state = {i: dev.copy_of(split.full.initializers[i])
                          for i in self.update_state.values() if i not in self.param_views}
        self.carried = {i: dev.copy_of(split.full.initializers[i])
                        for i in split.grad_carried.values()}
        self.batch = {d: dev.zeros(info[d].shape, info[d].np_dtype)
                      for d in split.spec.data_inputs}
        for p, v in self.param_views.items():
            dev.write(v, split.full.initializers[p])
        self._open_sessions()
        self._drop_initial_values()
        # Where this rank's steps spent their time (seconds, summed over steps).
        self.seconds = dict.fromkeys(("gradient_step", "communication", "update_step"), 0.0)

    def _drop_initial_values(self) -> None:
        """The step file's initial values of the carried state are not needed once copied
        into this rank's buffers: kept, they would hold every rank's optimizer state on
        every rank (ZeRO-1's saving gone)."""
        from memcc.backend.memory import trim_heap

        carried = set(self.split.spec.state.values())
        for g in (self.split.full, self.split.gradient, self.split.update):
            for name in carried:
                g.initializers.pop(name, None)
        trim_heap()

    def _ranges(self, order: list[str]) -> dict[np.dtype, list[tuple[int, int]]]:
        """dtype -> [start, end) in its flat parameter array of each rank's parameters."""
        info = self.split.full.info
        out: dict[np.dtype, list[tuple[int, int]]] = {}
        at: dict[np.dtype, int] = {}
        for r in range(self.settings.world):
            for dt in self.param_flats:
                start = at.get(dt, 0)
                n = sum(info[p].numel for p in order
                        if self.owner[p] == r and info[p].np_dtype == dt)
                out.setdefault(dt, []).append((start, start + n))
                at[dt] = start + n
        return out

    def _open_sessions(self) -> None:
        split, s = self.split, self.settings
        loss = split.spec.loss
        self.overlapped = None
        if s.bucket_bytes:
            buffers = RankBuffers(self.param_views, self.opt_state, self.carried, self.batch,
                                  self.loss_view, self.update_state)
            self.overlapped = OverlappedStep(split, cut_at_buckets(split, s.bucket_bytes),
                                             buffers, self.comm, s.place, s.source)
            return
        # The gradient step reads the Dropout counter, which the update step advances.
        grad_bufs = {**self.param_views, **self.opt_state, **self.carried, **self.batch,
                     **self.grad_views, loss: self.loss_view}
        self.grad_step = BoundGraph(split.gradient, grad_bufs, place=s.place,
                                    source=f"{s.source} (gradient step)",
                                    unbound=Unbound(transient=set(self.grad_order)
                                                    - set(self.grad_views)))
        part = update_part(split, self.update_state)
        upd_bufs = {**self.param_views, **self.opt_state, **self.grad_views}
        self.update_step = BoundGraph(part, upd_bufs, updates=self.update_state,
                                      place=s.place, source=f"{s.source} (update step)")

    # ------------------------------------------------------------------ running
    def step(self, batch: Mapping[str, object] | None, *, stop: bool = False
             ) -> tuple[float, bool]:
        """One data-parallel step on this rank's ``batch`` (None: already written into
        ``self.batch``, as the training loop does, holding no second copy); returns the
        loss averaged over the ranks and whether any rank asked to stop after this step
        (``stop``)."""
        t0 = time.perf_counter()
        for name, buf in self.batch.items() if batch is not None else ():
            self.device.write(buf, batch[name])
        if self.overlapped is not None:
            return self._overlapped_step(stop, t0)
        self.grad_step.run()
        t1 = time.perf_counter()
        self.stop_view[...] = 1.0 if stop else 0.0
        if self.flags is not None:
            self._reduce_to_owners()
        for flat in self.grad_flats.values() if self.flags is None else ():
            self.comm.all_reduce_mean(flat)
        self._average_carried(self.grad_step.outputs)
        t2 = time.perf_counter()
        self.update_step.run()
        t3 = time.perf_counter()
        self._broadcast_owned()
        t4 = time.perf_counter()
        for key, dt in (("gradient_step", t1 - t0), ("communication", t2 - t1 + t4 - t3),
                        ("update_step", t3 - t2)):
            self.seconds[key] += dt
        return float(self.loss_view), bool(self.stop_view > 0)

    def _overlapped_step(self, stop: bool, t0: float) -> tuple[float, bool]:
        """The step by buckets (``dist.overlap``): the reductions and this rank's updates
        happen inside the segmented run; then the loss, the stop flag and the statistics
        are averaged and the owners' parameters broadcast, as without buckets."""
        self.overlapped.run()
        t1 = time.perf_counter()
        self.stop_view[...] = 1.0 if stop else 0.0
        self.comm.all_reduce_mean(self.flags)
        self._average_carried(self.overlapped.carried_outputs)
        self._broadcast_owned()
        self.seconds["gradient_step"] += t1 - t0   # its reductions and updates included
        self.seconds["communication"] += time.perf_counter() - t1
        return float(self.loss_view), bool(self.stop_view > 0)

    def _average_carried(self, outputs: Mapping[str, object]) -> None:
        """The carried statistics (BatchNorm's running ones) averaged and taken."""
        for out, inp in self.split.grad_carried.items():
            new = outputs[out]
            if new.is_floating_point():
                self.comm.all_reduce_mean(new)
            self.carried[inp].copy_(new)

    def _broadcast_owned(self) -> None:
        """ZeRO-1/2: each rank's updated parameters to the others."""
        if self.settings.zero:
            for dt, flat in self.param_flats.items():
                for r, (a, b) in enumerate(self._owned_ranges[dt]):
                    if b > a:
                        self.comm.broadcast(flat[a:b], src=r)

    def _reduce_to_owners(self) -> None:
        """ZeRO-2: each gradient averaged on its owner (all ranks in the same order), the
        loss and stop flag on every rank; then the gradients sent are freed."""
        sent = self.grad_step.transient_outputs
        for g in self.grad_order:
            arr = sent[g] if g in sent else self.grad_views[g]
            if self.grad_to[g] is None:
                self.comm.all_reduce_mean(arr)
            else:
                self.comm.reduce_mean(arr, self.grad_to[g])
        del sent
        self.comm.all_reduce_mean(self.flags)
        self.grad_step.release()

    # ------------------------------------------------------------------ state
    def local_state(self) -> dict[str, np.ndarray]:
        """The carried values this rank holds, as numpy arrays (views of the live buffers
        on the CPU, copies from a GPU)."""
        return self._host({**self.param_views, **self.opt_state, **self.carried})

    def parameters(self) -> dict[str, np.ndarray]:
        """The parameters as numpy arrays (as ``local_state``)."""
        return self._host(self.param_views)

    def _host(self, tensors: Mapping[str, object]) -> dict[str, np.ndarray]:
        return {n: self.device.host(t) for n, t in tensors.items()}

    def optimizer_state_bytes(self) -> int:
        return sum(a.nbytes for a in self.opt_state.values())

    def held_bytes(self) -> int:
        """Bytes of the arrays this rank holds between steps: parameters, its optimizer
        state, the gradient buckets, carried statistics, the batch and the outputs the
        sessions write to arrays of their own (ORT's transient memory not included)."""
        sessions = [self.grad_step, self.update_step] if self.overlapped is None \
            else self.overlapped.bound()
        groups = (self.param_flats, self.grad_flats, self.opt_state, self.carried, self.batch,
                  *(b.outputs for b in sessions))
        flags = self.flags.nbytes if self.flags is not None else 0
        return flags + sum(a.nbytes for g in groups for a in g.values())

    def load(self, tensors: Mapping[str, np.ndarray], source: str) -> None:
        """Take this rank's values from a consolidated state (a checkpoint): re-sharding is
        just taking the optimizer state of the parameters this rank owns now."""
        info = self.split.full.info
        for name, buf in {**self.param_views, **self.opt_state, **self.carried}.items():
            if name not in tensors:
                raise InputError(f"{source}: holds no '{name}'")
            a = np.asarray(tensors[name])
            want = (info[name].np_dtype, tuple(info[name].shape))
            if (a.dtype, a.shape) != want:
                raise InputError(f"{source}: '{name}' is {a.dtype} {list(a.shape)}; the step "
                                 f"carries {want[0]} {list(want[1])}")
            self.device.write(buf, a)

    def full_state(self) -> dict[str, np.ndarray] | None:
        """Every carried value, consolidated on rank 0 (None elsewhere): with ZeRO-1 and 2
        each rank's optimizer state is gathered there."""
        if not self.settings.zero:
            return self.local_state() if self.settings.rank == 0 else None
        parts = self.comm.gather_object(self._host(self.opt_state))
        if parts is None:
            return None
        merged: dict[str, np.ndarray] = {}
        for part in parts:
            merged.update(part)
        return {**self._host(self.param_views), **merged, **self._host(self.carried)}
