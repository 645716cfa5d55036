"""Read back the order ORT really executed and compare it with the planned order.

A plan is only real if ORT ran the nodes in the planned order (ORT_NOTES.md §1): a node ORT
added or renumbered, or a session not made under the execution contract, can move a
recompute node back into the forward pass and the saving disappears without any error.
ORT's profiler writes one ``Node`` event named ``<node name>_kernel_time`` per executed
kernel, in execution order; this module turns the first run's profile into the executed
order and reports the first place where it leaves the plan.

Constant nodes never run: ORT turns them into initializers when it loads the graph, so
they are not part of the planned order either.
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from memcc.errors import RuntimeFailure

KERNEL_SUFFIX = "_kernel_time"
NOT_EXECUTED = frozenset({"Constant"})
# PRIORITY_BASED runs these first whenever they are ready (core/graph/graph_viewer.cc).
HIGH_PRIORITY_OPS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class OrderCheck:
    """Planned versus executed node order of one run."""

    matches: bool
    planned_count: int
    executed_count: int
    first_mismatch: dict | None  # {"index", "planned", "executed"} or None
    # Nodes whose kernel ran on another provider than the session's first (a CUDA session's
    # CPU fallbacks and the copies ORT inserted for them), as "name (provider)".
    off_provider: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "order_matches_plan": self.matches,
            "planned_nodes": self.planned_count,
            "executed_nodes": self.executed_count,
            "first_mismatch": self.first_mismatch,
            "off_provider_nodes": list(self.off_provider),
        }


def planned_order(nodes: Iterable[onnx.NodeProto]) -> list[str]:
    """Names of the nodes ORT will execute, in file order (Constant nodes excluded)."""
    return [n.name for n in nodes if n.op_type not in NOT_EXECUTED]


def ort_priority_order(nodes: Sequence[onnx.NodeProto]) -> list[str]:
    """The order ORT's PRIORITY_BASED executes these nodes in: Kahn's algorithm taking, among
    ready nodes, Shape/Size first, then the lowest file index.

    A topologically sorted file runs in file order except where a Shape or Size node becomes
    ready before its place in the file: ORT hoists it. A writer that wants its order kept
    puts such nodes where this function puts them.
    """
    executed = [n for n in nodes if n.op_type not in NOT_EXECUTED]
    producer = {o: i for i, n in enumerate(executed) for o in n.output if o}
    waiting = [0] * len(executed)
    readers: dict[int, list[int]] = {}
    for i, n in enumerate(executed):
        deps = {producer[x] for x in n.input if x in producer and producer[x] != i}
        waiting[i] = len(deps)
        for d in deps:
            readers.setdefault(d, []).append(i)
    heap = [(_priority(executed[i]), i) for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(heap)
    order = []
    while heap:
        _, i = heapq.heappop(heap)
        order.append(executed[i].name)
        for r in readers.get(i, ()):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(heap, (_priority(executed[r]), r))
    return order


def _priority(node: onnx.NodeProto) -> int:
    return 0 if node.op_type in HIGH_PRIORITY_OPS else 1


def executed_order(profile: str | os.PathLike | Sequence[dict]) -> list[str]:
    """Node names in the order their kernels ran, from a profile file or its parsed events.

    Events are ordered by start time (stable, so ties keep file order); only ``Node`` events
    ending in ``_kernel_time`` count, one per kernel launch.
    """
    if isinstance(profile, (str, os.PathLike)):
        events = _load_events(profile)
    else:
        events = list(profile)
    kernels = [
        (float(ev.get("ts", 0)), i, ev["name"][: -len(KERNEL_SUFFIX)])
        for i, ev in enumerate(events)
        if isinstance(ev, dict) and ev.get("cat") == "Node"
        and str(ev.get("name", "")).endswith(KERNEL_SUFFIX)
    ]
    kernels.sort()
    return [name for _, _, name in kernels]


def compare_orders(planned: Sequence[str], executed: Sequence[str]) -> OrderCheck:
    """Where the executed order first differs from the plan (extra or missing nodes too)."""
    for i, (p, e) in enumerate(zip(planned, executed, strict=False)):
        if p != e:
            return OrderCheck(False, len(planned), len(executed),
                              {"index": i, "planned": p, "executed": e})
    if len(planned) != len(executed):
        i = min(len(planned), len(executed))
        return OrderCheck(False, len(planned), len(executed), {
            "index": i,
            "planned": planned[i] if i < len(planned) else None,
            "executed": executed[i] if i < len(executed) else None,
        })
    return OrderCheck(True, len(planned), len(executed), None)


def check_session_order(session, planned: Sequence[str], *, runs_profiled: int = 1) -> OrderCheck:
    """End profiling on ``session`` (made with ``profile=True``), compare, delete the file.

    ``runs_profiled`` runs were made while profiling was on; only the first one's kernels are
    compared, so a session profiled over several runs is still checked correctly.
    """
    path = session.end_profiling()
    if not path:
        raise RuntimeFailure(
            "the order check needs a session made with profiling on "
            "(make_session(..., profile=True)); ORT wrote no profile"
        )
    try:
        events = _load_events(path)
    finally:
        Path(path).unlink(missing_ok=True)
    executed = executed_order(events)
    if runs_profiled > 1 and len(executed) >= len(planned):
        executed = executed[: len(executed) // runs_profiled]
    check = compare_orders(planned, executed)
    main = session.get_providers()[0]
    return replace(check, off_provider=tuple(off_provider_nodes(events, main)))


def off_provider_nodes(events: Sequence[dict], provider: str) -> list[str]:
    """``"name (provider)"`` for every node whose kernel ran on another provider than
    ``provider``, once each, in the order they first ran."""
    seen: dict[str, str] = {}
    for ev in events:
        if not (isinstance(ev, dict) and ev.get("cat") == "Node"
                and str(ev.get("name", "")).endswith(KERNEL_SUFFIX)):
            continue
        where = str((ev.get("args") or {}).get("provider", provider))
        name = ev["name"][: -len(KERNEL_SUFFIX)]
        if where != provider and name not in seen:
            seen[name] = where
    return [f"{n} ({p})" for n, p in seen.items()]


def _load_events(path: str | os.PathLike) -> list[dict]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RuntimeFailure(f"cannot read the ORT profile {path}: {exc}") from exc
    if isinstance(data, dict):  # some ORT builds wrap events in {"traceEvents": [...]}
        data = data.get("traceEvents", [])
    return data
