"""The predicted peak of a rank that reduces its gradients by buckets (``--bucket-mb``).

``passes.analysis.rank_step`` writes the step a rank runs with one bucket: every gradient
bound to a buffer held all step, every update after the backward. By buckets
(``dist.overlap``) the run differs in three ways, which this writes into that graph so
that the same simulator judges it:

- no gradient is held: each is made by its producer and freed once its bucket's updates
  (this rank's) have read it, or, for gradients only other ranks' updates read (ZeRO-1),
  once its reduction is waited on;
- the update nodes due after a segment (``buckets.update_points``) run there, between the
  segments' nodes;
- a value a segment takes from an earlier one lives to the end of that segment (it is that
  session's input), not to its last reading node; so does a gradient an update part reads.

The two waits stand as ``Shape`` nodes reading the values they keep, as
``rank_step``'s ZeRO-2 sends do; the graph is the planner's, never a file.
"""

from __future__ import annotations

import json

import onnx

from memcc.dist.buckets import cut_at_buckets, update_points
from memcc.dist.split import split_step, update_part
from memcc.graph import Graph, TensorInfo
from memcc.passes.analysis.rank_step import Ranks, rank_step
from memcc.step import BOUND_KEY, PLACED_KEY, STATE_KEY, TrainingStep

HOLD_SUFFIX = ".held_to"


def bucketed_rank_graph(graph: Graph, ranks: Ranks, rank: int, bucket_bytes: int) -> Graph:
    """Rank ``rank``'s step as it runs by buckets of ``bucket_bytes`` (module docstring)."""
    view = rank_step(graph, ranks, rank).graph
    split = split_step(graph, TrainingStep.of(graph))
    cut = cut_at_buckets(split, bucket_bytes)
    grads = set(split.gradients.values())
    bound = json.loads(view.metadata[BOUND_KEY])
    state = json.loads(view.metadata[STATE_KEY])
    for g in grads & set(bound):
        view.inputs.remove(bound.pop(g))
    view.outputs = [o for o in view.outputs if o not in grads]
    view.metadata[BOUND_KEY] = json.dumps(bound)
    view.metadata[PLACED_KEY] = "1"   # the updates below run where they stand
    in_view = {id(n) for n in view.nodes}
    mine = [o for o in split.update_state if o in state or o in bound]
    due = {at: [n for n in update_part(split, outs).nodes if id(n) in in_view]
           for at, outs in update_points(split, cut, mine).items()}
    read_by_mine = {i for ns in due.values() for n in ns for i in n.input}
    nodes: list[onnx.NodeProto] = []
    placed: set[int] = set()
    for k, seg in enumerate(cut.segments):
        start = cut.ends[k - 1] if k else 0
        nodes += [n for n in split.gradient.nodes[start:cut.ends[k]] if id(n) in in_view]
        nodes += _holds(view, seg.takes, f"segment{k}")
        nodes += _point(view, cut, due, k, placed, read_by_mine)
    nodes += _point(view, cut, due, len(cut.segments), placed, read_by_mine)
    ordered = {id(n) for n in nodes}
    view.nodes = nodes + [n for n in view.nodes if id(n) not in ordered]
    return view


def _point(view: Graph, cut, due: dict, at: int, placed: set[int], read_by_mine: set[str]
           ) -> list[onnx.NodeProto]:
    """What runs after segment ``at``: the gradients waited on there that none of this
    rank's updates reads (held to the wait), then the updates due there (a node two
    parts share, placed with the first)."""
    waited = [g for k, seg in enumerate(cut.segments) if cut.waited_after(k) == at
              for g in seg.bucket if g not in read_by_mine]
    out = _holds(view, waited, f"wait{at}")
    for n in due.get(at, []):
        if id(n) not in placed:
            placed.add(id(n))
            out.append(n)
    # The gradients an update part reads are its session's inputs: alive to its end.
    grads = {g for seg in cut.segments for g in seg.bucket}
    read = dict.fromkeys(i for n in due.get(at, []) for i in n.input if i in grads)
    return out + _holds(view, read, f"update{at}")


def _holds(view: Graph, values, where: str) -> list[onnx.NodeProto]:
    """A ``Shape`` node per value, keeping it alive to this point."""
    out = []
    for v in values:
        if v not in view.info:
            continue
        name = f"{v}{HOLD_SUFFIX}.{where}"
        view.info[name] = TensorInfo(onnx.TensorProto.INT64, (len(view.info[v].shape),))
        out.append(onnx.helper.make_node("Shape", [v], [name],
                                         name=f"memcc.dist.hold/{where}/{v}"))
    return out
