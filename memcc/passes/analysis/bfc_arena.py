"""A model of ORT's ``BFCArena`` (onnxruntime/core/framework/bfc_arena.cc), the allocator
behind every CUDA tensor and, when the CPU arena is on, every CPU one.

The arena rounds every request up to 256 bytes, serves it from the smallest
free chunk that fits (ties to the lower address), splits a chunk only when the rest is at
least as large as the request (or at least ``max_dead_bytes_per_chunk``), merges a freed chunk
with free neighbours of the same region only, and, with ``arena_extend_strategy =
kSameAsRequested`` (memcc's setting, ``backend/session.py``), grows by a new region of exactly
the request when nothing fits. Regions are never merged, so freed space in one region cannot
serve a request larger than that region: the reserved bytes (what ``gpu_mem_limit`` caps and
NVML sees) can exceed the live bytes.

On CUDA the arena's regions come from ``cudaMalloc``, and what NVML (and a user's budget)
counts is the device pages behind them. Measured on an H100 (ORT's verbose arena log gives
every region's address, BENCHMARKS.md "CUDA on an H100"): 1,096 of 1,108 regions over 1 MiB
started on a 2 MiB boundary, the next one on the next boundary, so each holds whole 2 MiB
pages; smaller regions were packed side by side into shared pages. Every NVML reading was a
whole number of 2 MiB pages, and the regions ORT's log shows one step adding, counted this
way, came within 0.5% of NVML on all six steps logged (``benchmarks/cuda_repredict.py
--logs``; the logs are kept in ``benchmarks/cuda_h100/``).
``BfcArena(cuda_pages=True)`` counts those pages (``device_bytes``).

Enters: requests and releases, one at a time (``BfcArena.alloc`` / ``free``), and ORT's
end-of-run calls (``release_streams``, ``shrink``). Leaves: the arena's reserved, in-use and
device bytes after each, and the regions it added. Nothing here knows about graphs: the
replay of a step's requests through it is ``arena``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_ALLOCATION = 256                       # BFCArena::kMinAllocationSize
MAX_DEAD_BYTES_PER_CHUNK = 128 * 1024 * 1024  # BFCArena default
# Each region keeps a host-side index, one chunk handle (size_t) per 256 bytes: 1/32 of the
# region again, in host memory (so it shows in a CPU measurement, never on a device).
REGION_INDEX_BYTES = 8
# cudaMalloc beneath the arena (module docstring): regions over 1 MiB hold whole pages,
# the others share pages, each at this alignment.
CUDA_PAGE_BYTES = 2 << 20
CUDA_LARGE_REGION_BYTES = 1 << 20
CUDA_SMALL_ALIGNMENT = 512


def _round_up(n: int, unit: int) -> int:
    return -(-int(n) // unit) * unit


def cuda_pages_for(region_sizes: list[int] | tuple[int, ...]) -> int:
    """The device pages behind regions of these sizes, all held at once (the rule of
    ``BfcArena(cuda_pages=True)``, for sizes read from ORT's arena log)."""
    large = sum(_round_up(s, CUDA_PAGE_BYTES) for s in region_sizes
                if s > CUDA_LARGE_REGION_BYTES)
    small = sum(_round_up(s, CUDA_SMALL_ALIGNMENT) for s in region_sizes
                if s <= CUDA_LARGE_REGION_BYTES)
    return large + _round_up(small, CUDA_PAGE_BYTES)


def rounded_bytes(nbytes: int) -> int:
    """A request of ``nbytes`` as the arena serves it: whole 256-byte units (0 stays 0: the
    arena returns no memory for an empty tensor)."""
    return -(-int(nbytes) // MIN_ALLOCATION) * MIN_ALLOCATION


# The stream tags of ORT's stream-aware arena (CUDA): a chunk first handed out to a node
# keeps that node's stream after it is freed; a request without a stream (the step's
# outputs) may only take chunks with none, and only chunks with the same tag merge.
STREAM = 1


@dataclass
class _Chunk:
    region: int
    address: int
    size: int
    in_use: bool = False
    stream: int | None = None
    prev: _Chunk | None = None
    next: _Chunk | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.size, self.address)


class ArenaExhausted(Exception):
    """A request the arena could not serve under its limit (ORT fails the run)."""


@dataclass
class BfcArena:
    """The arena's state: regions, chunks, free chunks by (size, address), statistics.

    ``limit`` is ``gpu_mem_limit`` (None: unlimited). ``addresses_grow`` says whether each
    new region lies above the previous ones (cudaMalloc) or below (glibc's mmap, the CPU
    case); it only matters for which of two equal free chunks the arena picks.
    ``cuda_pages``: also count the device pages the regions occupy (``device_bytes``).
    ``streams``: keep the stream tags of ORT's stream-aware CUDA arena (``STREAM``):
    ``alloc(stream=None)`` then takes only chunks no node has used since the last
    ``release_streams``, and freed chunks merge only with neighbours of the same tag.
    """

    limit: int | None = None
    max_dead_bytes: int = MAX_DEAD_BYTES_PER_CHUNK
    addresses_grow: bool = True
    cuda_pages: bool = False
    streams: bool = False
    reserved: int = 0
    in_use: int = 0
    extension_sizes: list[int] = field(default_factory=list)  # every region added, in order
    _free: list[tuple[int, int]] = field(default_factory=list)
    _free_chunks: dict[tuple[int, int], _Chunk] = field(default_factory=dict)
    _regions: dict[int, _Chunk] = field(default_factory=dict)   # region -> first chunk
    _held: dict[object, _Chunk] = field(default_factory=dict)
    _next_region: int = 0
    _low: int = 0
    _high: int = 0
    _region_bytes: dict[int, int] = field(default_factory=dict)
    _large_pages_bytes: int = 0
    _small_bytes: int = 0

    @property
    def extensions(self) -> int:
        """Regions added so far."""
        return len(self.extension_sizes)

    @property
    def device_bytes(self) -> int:
        """The device memory behind the regions: whole pages for large regions, small ones
        packed into shared pages (``cuda_pages``); the reserved bytes otherwise."""
        if not self.cuda_pages:
            return self.reserved
        return self._large_pages_bytes + _round_up(self._small_bytes, CUDA_PAGE_BYTES)

    def _count_region(self, size: int, sign: int) -> None:
        if size > CUDA_LARGE_REGION_BYTES:
            self._large_pages_bytes += sign * _round_up(size, CUDA_PAGE_BYTES)
        else:
            self._small_bytes += sign * _round_up(size, CUDA_SMALL_ALIGNMENT)

    def alloc(self, key: object, nbytes: int, stream: int | None = STREAM) -> None:
        """Serve ``nbytes`` for ``key`` (an empty request takes nothing); ``stream``: the
        requester's stream (``streams`` only; None: a request without one)."""
        size = rounded_bytes(nbytes)
        if size == 0:
            return
        stream = stream if self.streams else None
        chunk = self._best_fit(size, stream)
        if chunk is None:
            self._extend(size)
            chunk = self._best_fit(size, stream)
        assert chunk is not None
        self._unfree(chunk)
        if chunk.size >= 2 * size or chunk.size - size >= self.max_dead_bytes:
            rest = _Chunk(chunk.region, chunk.address + size, chunk.size - size,
                          prev=chunk, next=chunk.next, stream=chunk.stream)
            if chunk.next is not None:
                chunk.next.prev = rest
            chunk.next, chunk.size = rest, size
            self._add_free(rest)
        if chunk.stream is None:
            chunk.stream = stream
        chunk.in_use = True
        self._held[key] = chunk
        self.in_use += chunk.size

    def free(self, key: object) -> None:
        """Give ``key``'s chunk back, merged with free neighbours (unknown keys: nothing)."""
        chunk = self._held.pop(key, None)
        if chunk is None:
            return
        chunk.in_use = False
        self.in_use -= chunk.size
        self._add_free(self._coalesce(chunk))

    def _coalesce(self, chunk: _Chunk) -> _Chunk:
        """Merge a free chunk (out of the free set) with its free neighbours of the same
        stream tag; the merged chunk, still out of the free set."""
        nxt = chunk.next
        if nxt is not None and not nxt.in_use and nxt.stream == chunk.stream:
            self._unfree(nxt)
            self._absorb_next(chunk)
        prev = chunk.prev
        if prev is not None and not prev.in_use and prev.stream == chunk.stream:
            self._unfree(prev)
            self._absorb_next(prev)
            chunk = prev
        return chunk

    def release_streams(self) -> None:
        """The end of a run (ORT's ``ReleaseStreamBuffers``): every chunk's stream tag is
        cleared and free neighbours merge."""
        if not self.streams:
            return
        for first in list(self._regions.values()):
            c: _Chunk | None = first
            while c is not None:
                c.stream = None
                c = c.next
        for first in list(self._regions.values()):
            c = first
            while c is not None:
                if not c.in_use and c.next is not None and not c.next.in_use:
                    self._unfree(c)
                    self._unfree(c.next)
                    self._absorb_next(c)
                    self._add_free(c)
                    continue  # c may absorb the next one too
                c = c.next

    @staticmethod
    def _absorb_next(chunk: _Chunk) -> None:
        """Merge the chunk after ``chunk`` (same region, free, out of the free set) into it."""
        nxt = chunk.next
        assert nxt is not None
        chunk.size += nxt.size
        chunk.next = nxt.next
        if nxt.next is not None:
            nxt.next.prev = chunk

    def shrink(self) -> int:
        """Give back every region with nothing in use (ORT's end-of-run shrink); bytes freed."""
        freed = 0
        for region, first in list(self._regions.items()):
            if first.next is None and not first.in_use:
                self._unfree(first)
                del self._regions[region]
                self.reserved -= first.size
                freed += first.size
                if self.cuda_pages:
                    self._count_region(self._region_bytes.pop(region), -1)
        return freed

    def holds(self, key: object) -> bool:
        return key in self._held

    # ---------------------------------------------------------------- internals
    def _best_fit(self, size: int, stream: int | None = None) -> _Chunk | None:
        """The smallest free chunk of at least ``size`` (lower address first) that a
        request on ``stream`` may take: one with its stream's tag or with none."""
        i = bisect.bisect_left(self._free, (size, -(1 << 62)))
        while i < len(self._free):
            chunk = self._free_chunks[self._free[i]]
            if chunk.stream is None or chunk.stream == stream:
                return chunk
            i += 1
        return None

    def _extend(self, size: int) -> None:
        if self.limit is not None and size > (self.limit - self.reserved) // MIN_ALLOCATION \
                * MIN_ALLOCATION:
            raise ArenaExhausted(f"the arena holds {self.reserved} bytes and cannot add "
                                 f"{size} under its limit of {self.limit}")
        if self.addresses_grow:
            address, self._high = self._high, self._high + size + MIN_ALLOCATION
        else:
            self._low -= size + MIN_ALLOCATION
            address = self._low
        region = self._next_region
        self._next_region += 1
        chunk = _Chunk(region, address, size)
        self._regions[region] = chunk
        self.reserved += size
        if self.cuda_pages:
            self._region_bytes[region] = size
            self._count_region(size, +1)
        self.extension_sizes.append(size)
        self._add_free(chunk)

    def _add_free(self, chunk: _Chunk) -> None:
        bisect.insort(self._free, chunk.key)
        self._free_chunks[chunk.key] = chunk

    def _unfree(self, chunk: _Chunk) -> None:
        i = bisect.bisect_left(self._free, chunk.key)
        del self._free[i]
        del self._free_chunks[chunk.key]
