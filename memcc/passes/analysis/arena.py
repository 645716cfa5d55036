"""A step's device bytes the way ORT's arena counts them: the step's allocations, in the
order liveness gives, replayed through ``bfc_arena.BfcArena`` (a model of ORT's
``BFCArena``, the allocator behind every CUDA tensor and, when the CPU arena is on, every CPU
one).

Liveness says how many bytes are live; a GPU runs out when the arena cannot find room, which
can be sooner, because freed space in one region cannot serve a request larger than that
region. This module says by how much, for one order.

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

Enters: a graph and its ``LivenessReport`` (and an ``ArenaSetup``: how the step meets the
arena). Leaves: the step's requests (``step_events``) and an ``ArenaReport`` of the
steady-state step (``replay_steps``, ``cpu_arena_peak``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from memcc.graph import Graph
from memcc.passes.analysis.bfc_arena import (  # noqa: F401 (the allocator's names, re-exported)
    CUDA_LARGE_REGION_BYTES,
    CUDA_PAGE_BYTES,
    CUDA_SMALL_ALIGNMENT,
    MAX_DEAD_BYTES_PER_CHUNK,
    MIN_ALLOCATION,
    REGION_INDEX_BYTES,
    STREAM,
    ArenaExhausted,
    BfcArena,
    cuda_pages_for,
    rounded_bytes,
)
from memcc.passes.analysis.kernel_scratch import scratch_buffers, scratch_on_heap


# ---------------------------------------------------------------------------- a step's events
@dataclass(frozen=True)
class Event:
    """One arena request or release; ``node`` is the index of the node it belongs to (-1:
    the values that exist before the first node). ``heap``: kernel scratch that the CPU
    kernel takes from glibc's heap, not from the arena (``kernel_scratch.scratch_on_heap``);
    CPU replays (``ArenaSetup.cpu_threads`` set) count it beside the arena."""

    node: int
    key: str
    nbytes: int        # > 0: allocate; 0: free
    heap: bool = False


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
        heap = scratch_on_heap(node)
        for k, nbytes in enumerate(scratch):
            events.append(Event(j, f"scratch:{j}:{k}", int(nbytes), heap))
        for k in range(len(scratch)):
            events.append(Event(j, f"scratch:{j}:{k}", 0, heap))
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
    # CPU: the kernel scratch on glibc's heap (``Event.heap``) live at the worst moment,
    # beside ``peak_reserved_bytes`` (the regions at that moment); 0 elsewhere.
    peak_heap_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """The step's peak as the device counts it: pages on CUDA, reserved bytes else."""
        return (self.peak_device_bytes if self.peak_device_bytes is not None
                else self.peak_reserved_bytes + self.peak_heap_bytes)

    @property
    def measured_bytes(self) -> int:
        """What a meter that subtracts the memory held between steps sees."""
        if self.peak_device_bytes is not None and self.start_device_bytes is not None:
            return self.peak_device_bytes - self.start_device_bytes
        return self.peak_reserved_bytes + self.peak_heap_bytes - self.start_reserved_bytes

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
                "first_run_peak_bytes": self.first_run_peak_bytes,
                "peak_heap_bytes": self.peak_heap_bytes}


@dataclass(frozen=True)
class ArenaSetup:
    """How one step meets the arena (``replay_steps``), the same for every run.

    ``feeds_in_arena``: every value that exists before the first node is copied into the
    arena first (CUDA), rather than read where the caller holds it (CPU). ``limit``:
    ``gpu_mem_limit`` (None: unlimited). ``addresses_grow``: new regions lie above the old
    ones (cudaMalloc) or below (glibc's mmap, the CPU case). ``cpu_threads``: the CPU
    provider's intra-op threads, whose convolution working buffers come from the arena.
    ``cuda``: the CUDA arena and the device beneath it (device pages, stream tags).
    ``shrink``: ORT shrinks the arena at the end of each run. ``outputs_in_arena=False``: the
    step's outputs are written into buffers bound beforehand (``backend.device_step``).
    """

    feeds_in_arena: bool = True
    limit: int | None = None
    addresses_grow: bool = True
    cpu_threads: int | None = None
    cuda: bool = False
    shrink: bool = True
    outputs_in_arena: bool = True


@dataclass(frozen=True)
class _RunRequests:
    """One run's requests as every run makes them: the events, the stream each is made on
    (None: the step's outputs, which outlive it), the feeds released before the shrink and
    the outputs held through it."""

    events: list[Event]
    streams: list[int | None]
    feeds: list[str]
    held_outputs: list[str]


@dataclass
class _ReplayMeter:
    """What the replay reads off the arena across runs: the baseline after the warm-up, the
    reserved, in-use and device peaks and where they were reached, each run's peak."""

    baseline: int = 0
    peak: int = 0
    peak_in_use: int = 0
    extensions: int = 0
    device_base: int = 0
    device_peak: int = 0
    peak_at: int = -1
    device_at: int = -1
    first_peak: int = 0
    run_start: int = 0
    peak_heap: int = 0
    peaks: list[int] = field(default_factory=list)

    def settle(self, arena: BfcArena) -> None:
        """The warm-up is over: the arena as it stands is the meter's baseline."""
        self.baseline = self.peak = arena.reserved
        self.device_base = self.device_peak = arena.device_bytes
        self.peak_in_use, self.extensions = arena.in_use, arena.extensions

    def observe(self, arena: BfcArena, node: int, run: int, cuda: bool,
                heap: int = 0) -> None:
        """The arena after one request of ``node`` in run ``run`` (0: the warm-up), with
        ``heap`` bytes of kernel scratch live beside it (CPU)."""
        if not run:
            self.first_peak = max(self.first_peak,
                                  arena.device_bytes if cuda else arena.reserved + heap)
            return
        if arena.reserved + heap > self.peak:
            self.peak, self.peak_at, self.peak_heap = arena.reserved + heap, node, heap
        if cuda and (d := arena.device_bytes) > self.device_peak:
            self.device_peak, self.device_at = d, node
        self.peak_in_use = max(self.peak_in_use, arena.in_use)

    def report(self, arena: BfcArena, order: list[str], cuda: bool,
               **kw) -> ArenaReport:
        at = self.device_at if cuda else self.peak_at
        node = order[at] if 0 <= at < len(order) else None
        return ArenaReport(
            peak_reserved_bytes=self.peak - self.peak_heap, peak_heap_bytes=self.peak_heap,
            start_reserved_bytes=self.baseline,
            peak_in_use_bytes=self.peak_in_use,
            extensions=arena.extensions - self.extensions,
            peak_node=kw.pop("peak_node", node), peaks_per_step=tuple(self.peaks),
            peak_device_bytes=self.device_peak if cuda else None,
            start_device_bytes=self.device_base if cuda else None,
            last_run_extensions=tuple(arena.extension_sizes[self.run_start:]),
            first_run_peak_bytes=self.first_peak, **kw)


def replay_steps(graph: Graph, liveness, setup: ArenaSetup = ArenaSetup(), *,
                 steps: int = 2) -> ArenaReport:
    """Replay a warm-up run and then ``steps`` runs through a fresh arena, the way
    ``backend.runner`` runs a step, and report the measured runs against the reserved bytes
    after the warm-up (the meter's baseline).

    Each run: the feeds (``setup.feeds_in_arena``: copied in first, released before the
    shrink), the step's requests, then ORT's shrink while the run's outputs are still held,
    then the outputs, which the caller copies out (CUDA; ``memcc run --arena`` on CPU).
    ``setup.cuda``: the CUDA arena and the device beneath it: device pages
    (``peak_device_bytes``; the peak node is where they peak) and stream tags, the step's
    outputs requested without a stream (measured on an H100: ORT gave GPT-2's updated
    parameters and momenta new regions where freed chunks of the right size were there, 243
    region extensions per step where the replay without tags made 128), and the tags
    cleared at the end of each run.
    """
    if steps < 1:
        raise ValueError("replay_steps needs at least one step")
    order = list(liveness.order)
    requests = _run_requests(graph, liveness, setup)
    arena = BfcArena(limit=setup.limit, addresses_grow=setup.addresses_grow,
                     cuda_pages=setup.cuda, streams=setup.cuda)
    meter = _ReplayMeter()
    for run in range(steps + 1):
        meter.run_start = len(arena.extension_sizes)
        if run == 1:
            meter.settle(arena)
        failed = _replay_run(requests, arena, meter, run, setup)
        if failed is not None:
            where = order[failed] if 0 <= failed < len(order) else "(the feeds)"
            if arena.reserved > meter.peak:
                meter.peak, meter.peak_heap = arena.reserved, 0
            meter.device_peak = max(meter.device_peak, arena.device_bytes)
            return meter.report(arena, order, setup.cuda, peak_node=where, fails_at=where)
    return meter.report(arena, order, setup.cuda)


def _run_requests(graph: Graph, liveness, setup: ArenaSetup) -> _RunRequests:
    """The requests every run makes, with their streams: the step's outputs are requested
    without a stream (they outlive it), the rest on the compute stream."""
    events = step_events(graph, liveness, feeds_in_arena=setup.feeds_in_arena,
                         cpu_threads=setup.cpu_threads,
                         outputs_in_arena=setup.outputs_in_arena)
    outputs = set(graph.outputs)
    return _RunRequests(
        events=events,
        streams=[None if e.key in outputs else STREAM for e in events],
        feeds=[e.key for e in events if e.node < 0],
        held_outputs=list(graph.outputs) if setup.outputs_in_arena else [])


def _replay_run(requests: _RunRequests, arena: BfcArena, meter: _ReplayMeter, run: int,
                setup: ArenaSetup) -> int | None:
    """Run ``run`` (0: the warm-up) through the arena, then its end: feeds and unread values
    released, streams cleared, the shrink, the outputs copied out. Returns the node whose
    request found no room (None: the run fitted)."""
    tag = f"#{run}"
    run_peak = arena.reserved
    heap: dict[str, int] = {}  # CPU: kernel scratch live on glibc's heap, not in the arena
    for e, stream in zip(requests.events, requests.streams, strict=True):
        try:
            if e.heap and setup.cpu_threads is not None:
                heap[e.key] = e.nbytes
            elif e.nbytes:
                arena.alloc(e.key + tag, e.nbytes, stream=stream)
            else:
                arena.free(e.key + tag)
        except ArenaExhausted:
            return e.node
        beside = sum(heap.values())  # a freed scratch buffer's entry is 0
        meter.observe(arena, e.node, run, setup.cuda, beside)
        run_peak = max(run_peak, arena.reserved + beside)
    if run:
        meter.peaks.append(run_peak)
    for name in requests.feeds:
        arena.free(name + tag)
    # Values nothing reads (and so live to the end of the run) go when the run ends.
    outputs_held = set(requests.held_outputs)
    for e in requests.events:
        if e.nbytes and e.node >= 0 and e.key not in outputs_held:
            arena.free(e.key + tag)
    arena.release_streams()
    if setup.shrink:
        arena.shrink()
    for o in requests.held_outputs:
        arena.free(o + tag)
    return None


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
    the arena has reserved then, their index, and the kernel scratch on glibc's heap then
    (ScatterElements' copy of its indices: ``kernel_scratch.scratch_on_heap``). That
    includes the regions that held the last step's outputs when ORT shrank the arena and so
    survive into this step, empty, as the CUDA peak does (``simulate``). ``meter=True``: what
    a meter that takes its baseline between steps sees instead (``backend.runner``'s
    measurement), those regions left out.
    Measured against the meter on the zoo: docs/MEMORY_TRUTH.md."""
    report = replay_steps(graph, liveness, ArenaSetup(feeds_in_arena=False, addresses_grow=False,
                                                      cpu_threads=cpu_threads()), steps=steps)
    held = report.peak_reserved_bytes - (report.start_reserved_bytes if meter else 0)
    index = held * REGION_INDEX_BYTES // MIN_ALLOCATION
    return report, liveness.start_bytes + held + index + report.peak_heap_bytes
