"""A rank's gradient step run segment by segment, each bucket all-reduced while the next
segments run, its parameters updated and its gradients freed once the reduction is done
(``dist.buckets`` cuts the step; ``memcc train --nproc N --bucket-mb B``).

Per step and bucket, one flat array per dtype is made when its segment starts and dropped
after the bucket's updates: between steps a rank holds no gradient, and within a step
about the buckets in flight, where the unsegmented step holds every gradient all step.
ZeRO-1: each rank runs the updates of the parameters it owns and all-reduces every
bucket; the parameters are then broadcast by their owners as without buckets.

``comm`` is ``dist.comm.Comm`` (or a stand-in with ``all_reduce_mean_async``); the
buffers are tensors on the rank's device (``dist.tensors``), made through it: nothing here
imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from memcc.dist.bound import BoundGraph, Unbound, flat_arrays
from memcc.dist.buckets import SegmentedStep, update_points
from memcc.dist.placement import Placement
from memcc.dist.split import SplitStep, update_part
from memcc.dist.tensors import RankDevice
from memcc.errors import InputError
from memcc.frontend.update_groups import update_units


@dataclass(frozen=True)
class RankBuffers:
    """The tensors a rank keeps across steps (``dist.replica.Replica``'s): parameters, its
    optimizer state, the carried statistics' inputs, the batch, and the loss's slot; and
    the updates it runs (ZeRO-1: its own parameters')."""

    params: Mapping[str, object]
    opt_state: Mapping[str, object]
    carried: Mapping[str, object]
    batch: Mapping[str, object]
    loss: object
    updates: Mapping[str, str]   # the update outputs this rank runs -> what each replaces


class OverlappedStep:
    """The gradient step's segments and the update parts run between them (module
    docstring). ``run()`` leaves the loss in ``buffers.loss`` and the carried statistics'
    new values in ``carried_outputs`` (not yet averaged); the parameters it owns updated."""

    def __init__(self, split: SplitStep, cut: SegmentedStep, buffers: RankBuffers, comm,
                 place: Placement, source: str) -> None:
        self.split, self.cut, self.buffers, self.comm = split, cut, buffers, comm
        self.device = RankDevice.of(place)
        fixed = {**buffers.params, **buffers.opt_state, **buffers.carried, **buffers.batch,
                 split.spec.loss: buffers.loss}
        wanted = set(split.gradient.outputs)
        self.sessions = [
            BoundGraph(seg.graph, fixed, place=place,
                       unbound=Unbound(per_run={*seg.takes, *seg.bucket,
                                                *(o for o in seg.hands_on if o not in wanted)}),
                       source=f"{source} (gradient step, segment {k + 1} of "
                              f"{len(cut.segments)})")
            for k, seg in enumerate(cut.segments)]
        self.carried_outputs = {o: s.outputs[o] for s in self.sessions for o in s.outputs
                                if o in split.grad_carried}
        # Outputs of the gradient step that later segments read (the loss, statistics):
        # bound once, read from where they lie.
        self._kept = {split.spec.loss: buffers.loss, **self.carried_outputs}
        self.updates = self._update_parts(buffers.updates, place, source)
        # A grouped update's gradients (``frontend/update_groups.py``): copied out of their
        # bucket when it is freed, so that the group, updated at the end, holds no bucket.
        self._grouped = {split.gradients[p] for unit in update_units(
            split.full, split.spec.state, split.parameters) if len(unit) > 1
            for p in unit if p in split.gradients}
        self._done_after = self._bucket_ends()
        # Per bucket, the grouped gradients an update part after its end still reads.
        self._copied = [[g for g in seg.bucket if g in self._grouped and any(
            p is not None and g in p[1] for p in self.updates[end + 1:])]
            for seg, end in zip(self.cut.segments, self._done_after, strict=True)]

    def _update_parts(self, update_state: Mapping[str, str], place: Placement,
                      source: str) -> list[tuple[BoundGraph, tuple[str, ...]] | None]:
        """Per point between segments (and one after the last), the update of the
        parameters due there as one session, with the gradients it reads (bound per run);
        None where none is due. State outputs no parameter owns (step counters) go last."""
        cut, last = self.cut, len(self.cut.segments)
        grads = set(self.split.gradients.values())
        due = update_points(self.split, cut, update_state)
        fixed = {**self.buffers.params, **self.buffers.opt_state}
        parts: list[tuple[BoundGraph, tuple[str, ...]] | None] = []
        overwritten: set[str] = set()
        for at in range(last + 1):
            if at not in due:
                parts.append(None)
                continue
            graph = update_part(self.split, due[at])
            stale = sorted(overwritten & set(graph.inputs))
            if stale:
                raise InputError(f"{source}: an update reads '{stale[0]}' after another "
                                 "update has overwritten it; the updates cannot be split "
                                 "by bucket (train without --bucket-mb)")
            overwritten.update(update_state[o] for o in due[at])
            reads = tuple(i for i in graph.inputs if i in grads)
            part = BoundGraph(graph, fixed, updates={o: update_state[o] for o in due[at]},
                              place=place, unbound=Unbound(per_run=reads),
                              source=f"{source} (update step, after segment {at})")
            parts.append((part, reads))
        return parts

    def bound(self) -> list[BoundGraph]:
        """Every session: the segments, then the update parts."""
        return [*self.sessions, *(p[0] for p in self.updates if p is not None)]

    def _bucket_ends(self) -> list[int]:
        """Per bucket, the point (a segment's index, or ``len(segments)``: the end) after
        whose updates it is no longer read: its reduction waited on, every update part
        reading its gradients run. It is freed there."""
        ends = []
        for k, seg in enumerate(self.cut.segments):
            waited = self.cut.waited_after(k)
            readers = [at for at, p in enumerate(self.updates)
                       if p is not None and set(p[1]) & (set(seg.bucket) - self._grouped)]
            ends.append(max([waited, *readers]))
        return ends

    def run(self) -> None:
        """One step's gradients, reductions and this rank's updates (class docstring)."""
        cut, n = self.cut, len(self.cut.segments)
        views: dict[str, object] = {}
        flats: dict[int, dict] = {}
        handed: dict[str, object] = {}
        pending: list[tuple[int, list]] = []  # (bucket, its reductions in flight)
        for k in range(n):
            flats[k] = self._run_segment(k, views, handed)
            self._wait(pending, upto=k)
            for b, after in enumerate(cut.reduce_after):
                if after == k and flats.get(b):
                    pending.append((b, [self.comm.all_reduce_mean_async(f)
                                        for f in flats[b].values()]))
            self._update(k, views, flats)
        self._wait(pending, upto=n)
        self._update(n, views, flats)

    def _run_segment(self, k: int, views: dict, handed: dict) -> dict:
        """Segment ``k`` with its bucket made for this step (returned: dtype -> flat
        array; its gradients' views added to ``views``), the values it takes from
        ``handed`` and those it hands on added there; what no later segment reads is
        dropped. Nothing it bound stays referenced here once it returns (a value held by
        a local until the updates after the last segment measured 310 MB over the
        prediction on GPT-2 124M)."""
        seg = self.cut.segments[k]
        made_views, flats = flat_arrays(list(seg.bucket), self.split.full.info,
                                        device=self.device)
        views.update(made_views)
        inputs = {v: handed[v] if v in handed else views.get(v, self._kept.get(v))
                  for v in seg.takes}
        handed.update(self.sessions[k].run_with(
            inputs, made_views,
            [o for o in seg.hands_on if o not in views and o not in self._kept]))
        for v in seg.takes:
            if self.cut.read_until[v] == k:
                handed.pop(v, None)
        return flats

    def _wait(self, pending: list, *, upto: int) -> None:
        """Wait on the reductions started before segment ``upto`` ran (all of them at the
        end), so that the updates due after it can read their buckets."""
        for entry in list(pending):
            b, works = entry
            if self.cut.reduce_after[b] < upto:
                for w in works:
                    w.wait()
                pending.remove(entry)

    def _update(self, at: int, views: dict, flats: dict) -> None:
        """Run the update part due after segment ``at``; then free the buckets no later
        step of this run reads (their views and flat arrays)."""
        part = self.updates[at]
        if part is not None:
            session, reads = part
            session.run_with({g: views[g] for g in reads}, {})
        for b, end in enumerate(self._done_after):
            if end == at and b in flats:
                copies = {g: self.device.copy_of(views[g]) for g in self._copied[b]}
                for g in self.cut.segments[b].bucket:
                    views.pop(g, None)
                views.update(copies)  # vectors a later update part reads
                del flats[b]
