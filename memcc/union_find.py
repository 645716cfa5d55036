"""A union-find (disjoint sets) over hashable items, shared by the passes that group things.

In: the items, then pairs to join. Out: each item's representative (``find``). Used where
values or nodes that share something (equal weights, one buffer) must be treated as one
group: ``frontend.exported.parameter_sources`` (tied weights) and
``passes.planning.model.recompute_terms`` (nodes whose outputs share a buffer). It sits at
the bottom of the package and imports nothing from memcc, so every layer may use it.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class UnionFind(Generic[T]):
    """Disjoint sets with path halving. ``union(a, b)`` makes ``b``'s root the root of both,
    so callers that order groups by their root get the same roots every time."""

    def __init__(self, items: Iterable[T]) -> None:
        self._parent: dict[T, T] = {x: x for x in items}

    def __contains__(self, item: object) -> bool:
        return item in self._parent

    def __iter__(self) -> Iterator[T]:
        """The items, in the order they were given."""
        return iter(self._parent)

    def find(self, item: T) -> T:
        """The representative of ``item``'s set."""
        parent = self._parent
        while parent[item] != item:
            parent[item] = parent[parent[item]]
            item = parent[item]
        return item

    def union(self, a: T, b: T) -> None:
        """Join the sets of ``a`` and ``b``; ``b``'s representative stays."""
        root_b = self.find(b)
        self._parent[self.find(a)] = root_b
