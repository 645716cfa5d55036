"""Device bytes the way ORT's arena counts them: a replay of a step's allocations through a
model of ``BFCArena`` (onnxruntime/core/framework/bfc_arena.cc), the allocator behind every
CUDA tensor and, when the CPU arena is on, every CPU one.

Liveness says how many bytes are live; a GPU runs out when the arena cannot find room, which
can be sooner. The arena rounds every request up to 256 bytes, serves it from the smallest
free chunk that fits (ties to the lower address), splits a chunk only when the rest is at
least as large as the request (or at least ``max_dead_bytes_per_chunk``), merges a freed chunk
with free neighbours of the same region only, and, with ``arena_extend_strategy =
kSameAsRequested`` (memcc's setting, ``backend/session.py``), grows by a new region of exactly
the request when nothing fits. Regions are never merged, so freed space in one region cannot
serve a request larger than that region: the reserved bytes (what ``gpu_mem_limit`` caps and
NVML sees) can exceed the live bytes. This module says by how much, for one order.

Between steps ORT shrinks the arena (run option ``memory.enable_memory_arena_shrinkage``),
giving back every region with nothing in use; a region that holds a step output at that
moment survives into the next step, and a meter that subtracts a baseline taken between
steps does not see it. ``replay_steps`` replays a warm-up step before the measured ones to
get that steady state.

What is modelled from ORT's sources and checked on CPU (the same arena class, registered
with kSameAsRequested; ``benchmarks/memory_truth.py --arena``): rounding, best fit, splits,
coalescing, regions, shrink. What is not: kernel workspaces that cuDNN or cuBLAS take outside
the arena, and the order in which one kernel allocates its outputs and scratch (modelled as
outputs in output order, then scratch, then the inputs it was the last reader of, in input
order).

On CUDA the arena's regions come from ``cudaMalloc``, and what NVML (and a user's budget)
counts is the device pages behind them. Measured on an H100 (ORT's verbose arena log gives
every region's address, BENCHMARKS.md "CUDA on an H100"): 1,096 of 1,108 regions over 1 MiB
started on a 2 MiB boundary, the next one on the next boundary, so each holds whole 2 MiB
pages; smaller regions were packed side by side into shared pages. Every NVML reading was a
whole number of 2 MiB pages, and the regions ORT's log shows one step adding, counted this
way, came within 0.5% of NVML on all six steps logged (``benchmarks/cuda_repredict.py
--logs``; the logs are kept in ``benchmarks/cuda_h100/``).
``BfcArena(cuda_pages=True)`` counts those pages (``device_bytes``).
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

from memcc.graph import Graph
from memcc.passes.analysis.kernel_scratch import scratch_buffers

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


# ---------------------------------------------------------------------------- a step's events
@dataclass(frozen=True)
class Event:
    """One arena request or release; ``node`` is the index of the node it belongs to (-1:
    the values that exist before the first node)."""

    node: int
    key: str
    nbytes: int        # > 0: allocate; 0: free


def step_events(graph: Graph, liveness, *, feeds_in_arena: bool,
                cpu_threads: int | None = None, outputs_in_arena: bool = True) -> list[Event]:
    """The arena requests of one run of ``graph`` in the order of ``liveness``
    (a ``passes.analysis.liveness.LivenessReport`` of that graph).

    ``feeds_in_arena``: every value that exists before the first node (inputs,
    initializers, constants: the runner feeds them all) is copied into the arena first, as
    on CUDA; on CPU ORT reads the caller's arrays where they are. Host copies
    (``MemcpyToHost``) live in another allocator and are left out. Step outputs are released
    by ``replay_steps`` after the run. ``cpu_threads``: the CPU provider's kernels with that
    many intra-op threads, whose convolution working buffers come from the arena too
    (``kernel_scratch.scratch_buffers``). ``outputs_in_arena=False``: the step's outputs are
    written into buffers the caller bound beforehand (``backend.device_step``), so they ask
    the arena for nothing.
    """
    order = list(liveness.order)
    by_name = {n.name: n for n in graph.nodes}
    # Names index the order; a graph with repeated or empty names is analysed in file order.
    nodes = [by_name[name] for name in order] if len(by_name) == len(graph.nodes) \
        else list(graph.nodes)
    values = liveness.values
    born: dict[int, list[str]] = {}
    died: dict[int, list[str]] = {}
    host = {o for n in graph.nodes if n.op_type == "MemcpyToHost" for o in n.output}
    if not outputs_in_arena:
        host |= set(graph.outputs)
    events: list[Event] = []
    for name, life in values.items():
        if not life.owns_buffer or name in host:
            continue
        if life.birth < 0:
            if feeds_in_arena:
                events.append(Event(-1, name, _raw(graph, name)))
            continue
        born.setdefault(life.birth, []).append(name)
        if life.death is not None:
            died.setdefault(life.death, []).append(name)
    for j, node in enumerate(nodes):
        outs = {o: k for k, o in enumerate(node.output)}
        for name in sorted(born.get(j, ()), key=lambda v: outs.get(v, len(outs))):
            events.append(Event(j, name, _raw(graph, name)))
        scratch = [b for b in scratch_buffers(node, graph.info, graph.opset,
                                              cpu_threads=cpu_threads) if b]
        for k, nbytes in enumerate(scratch):
            events.append(Event(j, f"scratch:{j}:{k}", int(nbytes)))
        for k in range(len(scratch)):
            events.append(Event(j, f"scratch:{j}:{k}", 0))
        ins = {i: k for k, i in reversed(list(enumerate(node.input)))}
        for name in sorted(died.get(j, ()), key=lambda v: ins.get(v, len(ins))):
            events.append(Event(j, name, 0))
    return events


def _raw(graph: Graph, name: str) -> int:
    ti = graph.info.get(name)
    return int(ti.nbytes) if ti is not None else 0


# ---------------------------------------------------------------------------- replay
@dataclass(frozen=True)
class ArenaReport:
    """The arena over the last replayed step (the steady state)."""

    peak_reserved_bytes: int     # regions held at the step's worst moment: the device peak
    start_reserved_bytes: int    # regions still held from the step before (a meter's baseline)
    peak_in_use_bytes: int       # chunks handed out at the worst moment (rounded live bytes)
    extensions: int              # regions the step added
    peak_node: str | None        # the node during which the reserved peak was reached
    fails_at: str | None = None  # under ``limit``: the node whose request found no room
    peaks_per_step: tuple[int, ...] = ()  # each measured run's reserved peak
    # CUDA: the device pages behind the regions at the worst moment and between steps
    # (``BfcArena.device_bytes``); None elsewhere.
    peak_device_bytes: int | None = None
    start_device_bytes: int | None = None
    # The sizes of the regions the last measured run added, in order (set against ORT's
    # arena log by ``benchmarks/cuda_check.py --phases arena_log``; not in ``to_json``).
    last_run_extensions: tuple[int, ...] = ()
    # The warm-up run's own peak (device pages on CUDA, reserved bytes else), counted from
    # an empty arena: a first training step's peak when nothing shrinks between steps.
    first_run_peak_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The step's peak as the device counts it: pages on CUDA, reserved bytes else."""
        return (self.peak_device_bytes if self.peak_device_bytes is not None
                else self.peak_reserved_bytes)

    @property
    def measured_bytes(self) -> int:
        """What a meter that subtracts the memory held between steps sees."""
        if self.peak_device_bytes is not None and self.start_device_bytes is not None:
            return self.peak_device_bytes - self.start_device_bytes
        return self.peak_reserved_bytes - self.start_reserved_bytes

    @property
    def fragmentation_bytes(self) -> int:
        return self.peak_reserved_bytes - self.peak_in_use_bytes

    def to_json(self) -> dict:
        return {"peak_reserved_bytes": self.peak_reserved_bytes,
                "start_reserved_bytes": self.start_reserved_bytes,
                "measured_bytes": self.measured_bytes,
                "peak_in_use_bytes": self.peak_in_use_bytes,
                "fragmentation_bytes": self.fragmentation_bytes,
                "extensions": self.extensions,
                "peak_node": self.peak_node,
                "fails_at": self.fails_at,
                "peaks_per_step": list(self.peaks_per_step),
                "peak_device_bytes": self.peak_device_bytes,
                "start_device_bytes": self.start_device_bytes,
                "first_run_peak_bytes": self.first_run_peak_bytes}


def replay_steps(graph: Graph, liveness, *, steps: int = 2, feeds_in_arena: bool = True,
                 limit: int | None = None, addresses_grow: bool = True,
                 cpu_threads: int | None = None, cuda: bool = False, shrink: bool = True,
                 outputs_in_arena: bool = True) -> ArenaReport:
    """Replay a warm-up run and then ``steps`` runs through a fresh arena, the way
    ``backend.runner`` runs a step, and report the measured runs against the reserved bytes
    after the warm-up (the meter's baseline).

    Each run: the feeds (``feeds_in_arena``: copied in first, released before the shrink),
    the step's requests, then ORT's shrink while the run's outputs are still held, then the
    outputs, which the caller copies out (CUDA; ``memcc run --arena`` on CPU).
    ``cuda``: the CUDA arena and the device beneath it: device pages (``peak_device_bytes``;
    the peak node is where they peak) and stream tags, the step's outputs requested without
    a stream (measured on an H100: ORT gave GPT-2's updated parameters and momenta new
    regions where freed chunks of the right size were there, 243 region extensions per step
    where the replay without tags made 128), and the tags cleared at the end of each run.
    """
    if steps < 1:
        raise ValueError("replay_steps needs at least one step")
    order = list(liveness.order)
    events = step_events(graph, liveness, feeds_in_arena=feeds_in_arena,
                         cpu_threads=cpu_threads, outputs_in_arena=outputs_in_arena)
    feeds = [e.key for e in events if e.node < 0]
    held_outputs = list(graph.outputs) if outputs_in_arena else []
    outputs_held = set(held_outputs)
    arena = BfcArena(limit=limit, addresses_grow=addresses_grow, cuda_pages=cuda,
                     streams=cuda)
    outputs = set(graph.outputs)
    # The step's outputs are requested without a stream (they outlive it), the rest on the
    # compute stream; the same for every run.
    streams = [None if e.key in outputs else STREAM for e in events]
    baseline = peak = peak_in_use = extensions = 0
    device_base = device_peak = 0
    peak_at = device_at = -1
    first_peak = 0
    peaks: list[int] = []

    def report(**kw) -> ArenaReport:
        at = device_at if cuda else peak_at
        node = order[at] if 0 <= at < len(order) else None
        return ArenaReport(
            peak_reserved_bytes=peak, start_reserved_bytes=baseline,
            peak_in_use_bytes=peak_in_use, extensions=arena.extensions - extensions,
            peak_node=kw.pop("peak_node", node), peaks_per_step=tuple(peaks),
            peak_device_bytes=device_peak if cuda else None,
            start_device_bytes=device_base if cuda else None,
            last_run_extensions=tuple(arena.extension_sizes[run_start:]),
            first_run_peak_bytes=first_peak, **kw)

    for run in range(steps + 1):
        tag = f"#{run}"
        run_start = len(arena.extension_sizes)
        if run == 1:
            baseline = peak = arena.reserved
            device_base = device_peak = arena.device_bytes
            peak_in_use, extensions = arena.in_use, arena.extensions
        run_peak = arena.reserved
        try:
            for e, stream in zip(events, streams, strict=True):
                if e.nbytes:
                    arena.alloc(e.key + tag, e.nbytes, stream=stream)
                else:
                    arena.free(e.key + tag)
                if not run:
                    first_peak = max(first_peak,
                                     arena.device_bytes if cuda else arena.reserved)
                else:
                    if arena.reserved > peak:
                        peak, peak_at = arena.reserved, e.node
                    if cuda and (d := arena.device_bytes) > device_peak:
                        device_peak, device_at = d, e.node
                    peak_in_use = max(peak_in_use, arena.in_use)
                    run_peak = max(run_peak, arena.reserved)
        except ArenaExhausted:
            where = order[e.node] if 0 <= e.node < len(order) else "(the feeds)"
            peak = max(peak, arena.reserved)
            device_peak = max(device_peak, arena.device_bytes)
            return report(peak_node=where, fails_at=where)
        if run:
            peaks.append(run_peak)
        for name in feeds:
            arena.free(name + tag)
        # Values nothing reads (and so live to the end of the run) go when the run ends.
        for e in events:
            if e.nbytes and e.node >= 0 and e.key not in outputs_held:
                arena.free(e.key + tag)
        arena.release_streams()
        if shrink:
            arena.shrink()
        for o in held_outputs:
            arena.free(o + tag)
    return report()


def cpu_threads() -> int:
    """ORT's default intra-op threads on this machine: one per core it may run on (the CPU
    provider's convolution working buffers, which come from the arena, depend on it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_arena_peak(graph: Graph, liveness, *, steps: int = 2,
                   meter: bool = False) -> tuple[ArenaReport, int]:
    """The CPU provider with its arena on (``memcc compile --arena``, ``memcc run --arena``,
    ``memcc train`` of such a plan): ORT reads the caller's feeds where they are
    (``liveness.start_bytes``), everything else comes from the arena, and each region keeps
    a host-side index of one chunk handle per 256 bytes.

    Returns the bytes the process holds at the step's worst moment: the feeds, every region
    the arena has reserved then, and their index. That includes the regions that held the
    last step's outputs when ORT shrank the arena and so survive into this step, empty, as
    the CUDA peak does (``simulate``). ``meter=True``: what a meter that takes its baseline
    between steps sees instead (``backend.runner``'s measurement), those regions left out.
    Measured against the meter on the zoo: docs/MEMORY_TRUTH.md."""
    report = replay_steps(graph, liveness, steps=steps, feeds_in_arena=False,
                          addresses_grow=False, cpu_threads=cpu_threads())
    held = report.measured_bytes if meter else report.peak_reserved_bytes
    index = held * REGION_INDEX_BYTES // MIN_ALLOCATION
    return report, liveness.start_bytes + held + index
