"""Stand-ins for ``memcc.dist.comm.Comm`` in one process: a group of one, and ranks as
threads whose collectives run over the ranks' tensors (``tests/test_dist.py``,
``tests/test_dist_buckets.py``)."""

from __future__ import annotations

import threading


class _Done:
    """A collective already finished."""

    def wait(self) -> None:
        pass


class OneRank:
    """The collectives of a group of one: nothing to exchange."""

    def all_reduce_mean(self, arr): pass
    def all_reduce_mean_async(self, arr): return _Done()
    def broadcast(self, arr, src): pass
    def gather_object(self, obj): return [obj]
    def barrier(self): pass


class Threads:
    """``world`` ranks as threads of this process: ``dist.comm.Comm``'s collectives over
    the ranks' tensors (sums in rank order). ``reduce_mean`` leaves NaN on the ranks it does not
    reduce to: a gradient a ZeRO-2 rank sent and then read would poison its parameters."""

    def __init__(self, world: int) -> None:
        self.world, self.slots = world, [None] * world
        self.wait = threading.Barrier(world, timeout=60)  # a rank that failed stops the rest

    def rank(self, r: int) -> ThreadRank:
        return ThreadRank(self, r)


class ThreadRank:
    def __init__(self, group: Threads, rank: int) -> None:
        self.g, self.r = group, rank

    def _all(self, value) -> list:
        self.g.slots[self.r] = value
        self.g.wait.wait()
        values = list(self.g.slots)
        self.g.wait.wait()
        return values

    def all_reduce_mean(self, arr): arr[...] = sum(self._all(arr.clone())) / self.g.world

    def all_reduce_mean_async(self, arr):
        """Done at once (the ranks call in the same order): the bits of ``all_reduce_mean``."""
        self.all_reduce_mean(arr)
        return _Done()

    def reduce_mean(self, arr, dst):
        total = sum(self._all(arr.clone())) / self.g.world
        arr[...] = total if self.r == dst else float("nan")

    def broadcast(self, arr, src): arr[...] = self._all(arr.clone())[src]
    def gather_object(self, obj):
        objs = self._all(obj)
        return objs if self.r == 0 else None

    def barrier(self): self.g.wait.wait()


def run_ranks(group: Threads, body) -> None:
    """``body(rank)`` for every rank of ``group``, each in a thread; the first failure is
    raised here once all have stopped (a failing rank aborts the group's barrier, so the
    others stop too)."""
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            body(r)
        except BaseException as exc:
            errors.append(exc)
            group.wait.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(group.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
