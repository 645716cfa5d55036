"""The gradient step cut into segments at gradient buckets (no torch here).

ORT hands back a session's outputs only when its run ends: a gradient step run as one
session can send no gradient before the whole backward is done, and holds every gradient
until then. Cut into segments, each ending where a bucket's last gradient is made (DDP's
buckets, in the order the backward makes them), a bucket can be all-reduced while the
next segments run, and once its reduction is waited on, the updates of its parameters run
and its gradients are freed: memcc's early updates kept per bucket
(docs/DATA_PARALLEL.md, "Overlapping the reduction with the backward";
``dist.overlap`` runs the segments).

What crosses a cut (saved activations, partial sums) is an output of one segment, handed
to the later ones as ORT values (no copy) and dropped after the last segment that reads
it. Constant nodes are repeated in each segment that reads them instead of crossing.
A parameter's update waits until no later segment reads the parameter (a tied weight),
and a bucket's reduction until no later segment reads one of its gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from memcc.dist.split import SplitStep, subgraph
from memcc.errors import InputError
from memcc.graph import Graph, ancestors


@dataclass(frozen=True)
class Segment:
    """A run of the gradient step's nodes: its own graph (a session), the gradients it
    completes (``bucket``; empty for a tail that completes none), the values it makes
    that later segments read (``hands_on``) and those it reads from earlier ones
    (``takes``)."""

    graph: Graph
    bucket: tuple[str, ...]
    hands_on: tuple[str, ...]
    takes: tuple[str, ...]


@dataclass(frozen=True)
class SegmentedStep:
    """The segments in order and when things may happen between them: ``reduce_after``,
    per segment, the segment after which its bucket's reduction starts; ``read_until``,
    every value a segment reads -> the last segment reading it (a handed-on value is
    dropped there; an update overwriting a parameter or state waits for it)."""

    segments: tuple[Segment, ...]
    reduce_after: tuple[int, ...]
    read_until: dict[str, int]
    ends: tuple[int, ...]    # where each segment ends among the gradient step's nodes

    def waited_after(self, bucket: int) -> int:
        """The point after which bucket ``bucket``'s reduction is done: it is waited on
        after the segment following the one that started it (one segment of overlap), or
        after the last segment (``len(segments)``)."""
        return min(self.reduce_after[bucket] + 1, len(self.segments))


def bucket_bytes(bucket_mb: float | None, zero: int) -> int | None:
    """``--bucket-mb`` in bytes (MB = 10^6 bytes, as torch's DDP ``bucket_cap_mb``), or
    an ``InputError`` saying what to give."""
    if bucket_mb is None:
        return None
    if not bucket_mb > 0:
        raise InputError(f"--bucket-mb {bucket_mb}: give a size in MB above 0 (DDP's default "
                         "is 25)")
    refuse_zero2(zero)
    return max(1, int(bucket_mb * 1_000_000))


def refuse_zero2(zero: int) -> None:
    """Buckets are all-reduced: ZeRO-2's reductions of each gradient to its owner are not
    bucketed (and by buckets ZeRO-1 already holds no gradient between steps)."""
    if zero == 2:
        raise InputError("--bucket-mb with --zero 2: not built (ZeRO-2 reduces each "
                         "gradient to its owner); use --zero 1 or leave out --bucket-mb")


def cut_at_buckets(split: SplitStep, bucket_bytes: int) -> SegmentedStep:
    """Cut ``split``'s gradient step after the node completing each bucket of at least
    ``bucket_bytes`` of gradients (the last bucket takes what is left)."""
    if bucket_bytes <= 0:
        raise InputError(f"a gradient bucket of {bucket_bytes} bytes: give a positive size")
    g = split.gradient
    grads = set(split.gradients.values())
    unmade = sorted(grads - {o for n in g.nodes for o in n.output if o})
    if unmade:
        raise InputError(f"the gradient '{unmade[0]}' is not computed by a node of the step; "
                         "its buckets cannot be cut (train without --bucket-mb)")
    ends, buckets, current, size = [], [], [], 0
    for i, node in enumerate(g.nodes):
        made = [o for o in node.output if o in grads]
        current += made
        size += sum(g.info[o].nbytes for o in made)
        if size >= bucket_bytes:
            ends.append(i + 1)
            buckets.append(current)
            current, size = [], 0
    if not ends or ends[-1] < len(g.nodes):
        ends.append(len(g.nodes))
        buckets.append(current)
    return _segments(split, ends, buckets)


def _segments(split: SplitStep, ends: list[int], buckets: list[list[str]]) -> SegmentedStep:
    g = split.gradient
    starts = [0, *ends[:-1]]
    runs = [g.nodes[a:b] for a, b in zip(starts, ends, strict=True)]
    made_in = {o: k for k, nodes in enumerate(runs) for n in nodes for o in n.output if o}
    constants = {n.output[0]: n for n in g.nodes
                 if n.op_type == "Constant" and len(n.output) == 1}
    read_until = {i: k for k, nodes in enumerate(runs) for n in nodes for i in n.input if i}
    takes = [list(dict.fromkeys(i for n in nodes for i in n.input
                                if i and made_in.get(i, k) < k and i not in constants))
             for k, nodes in enumerate(runs)]
    wanted = set(g.outputs)
    segments = []
    for k, nodes in enumerate(runs):
        made = [o for n in nodes for o in n.output if o]
        hands_on = [o for o in made if read_until.get(o, k) > k and o not in constants]
        repeated = [constants[i] for i in dict.fromkeys(
            i for n in nodes for i in n.input if i in constants and made_in[i] != k)]
        outputs = [*hands_on, *(o for o in made if o in wanted)]
        graph = subgraph(g, [*repeated, *nodes], outputs)
        segments.append(Segment(graph, tuple(buckets[k]), tuple(hands_on), tuple(takes[k])))
    reduce_after = tuple(max([k, *(read_until.get(gr, k) for gr in b)])
                         for k, b in enumerate(buckets))
    return SegmentedStep(tuple(segments), reduce_after, read_until, tuple(ends))


def update_points(split: SplitStep, cut: SegmentedStep, outputs: Iterable[str]
                  ) -> dict[int, list[str]]:
    """Point (after that segment; ``len(segments)``: after the last) -> the update outputs
    due there: after every gradient its update reads is reduced (a finiteness check may
    read them all) and after the last segment reading the value it overwrites; state no
    gradient feeds (step counters) at the end."""
    last = len(cut.segments)
    grads = set(split.gradients.values())
    bucket_of = {g: k for k, seg in enumerate(cut.segments) for g in seg.bucket}
    producer = split.update.def_use().producer
    due: dict[int, list[str]] = {}
    for out in outputs:
        reads = grads & ancestors([out], producer)[1]
        at = max([cut.read_until.get(split.update_state[out], 0),
                  *(cut.waited_after(bucket_of[g]) for g in reads)]) if reads else last
        due.setdefault(at, []).append(out)
    return due
