"""Step 4 of LoRAServe's Algorithm 1 (ALLOCATEHIGHESTMAXRANK) with a capacity check (notes §3.5),
for servers of different max ranks: a leftover only enters bins whose server can hold its rank, and
when those run out of room it overflows onto the least-loaded of them instead of failing."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from loraplex.placement.binpack import Bin
from loraplex.placement.snapshot import EPS, PlacementAdapter

# Largest piece of overflow (as a fraction of targetUtil) handed to one server at a time.
OVERFLOW_PIECE = 0.1


def place_leftovers(bins: list[Bin], leftovers: Sequence[PlacementAdapter], remainder: Mapping[str, float],
                    target: float, limit: float) -> set[int]:
    """In descending rank (then larger remainder), each adapter's whole remainder goes to
    1. a bin that already holds part of it and has room within `target` (no new copy), else
    2. the bin with the highest max rank >= the adapter's rank that has room within `target`, least
       loaded first (servers stay as rank-homogeneous as the paper's leftovers allow), else
    3. it is poured into the least-loaded bins able to hold its rank, each filled to `target`, then
       to `limit` (>= target). When all of those are full, lower-rank load moves from them to bins
       with room that cannot hold this rank; only when that is impossible does the rest overflow
       onto the least-loaded capable bins, piece by piece.
    Returns the indices of the bins that took overflow (overloaded). Heaps per (max rank,
    capability) keep this O(L · groups · log N) for thousands of leftovers."""
    groups = _BinGroups(bins)
    pour = _Pour(bins, groups, (target, limit))
    fits = target * (1 + 1e-9) + EPS
    hosts = _hosts(bins, {a.name for a in leftovers})
    for a in sorted(leftovers, key=lambda a: (-a.rank, -remainder[a.name], a.name)):
        rem = remainder[a.name]
        index = min((i for i in hosts.get(a.name, ()) if bins[i].load + rem <= fits),
                    key=lambda i: (bins[i].load, i), default=None)
        if index is None:
            index = groups.fitting(a.rank, rem, fits)
        if index is not None:
            bins[index].add(a.name, a.rank, rem)
            groups.update(index)
        else:
            pour(a, rem)
    return pour.overflowed


def _hosts(bins: Sequence[Bin], names: set[str]) -> dict[str, list[int]]:
    hosts: dict[str, list[int]] = {}
    for i, b in enumerate(bins):
        for name in names.intersection(b.shares):
            hosts.setdefault(name, []).append(i)
    return hosts


class _Pour:
    """Step 3 of place_leftovers. Rooms only shrink while leftovers are placed, so a rank for which
    no room could be made once is not searched again."""

    def __init__(self, bins: list[Bin], groups: _BinGroups, limits: tuple[float, float]) -> None:
        self.bins, self.groups, self.limits = bins, groups, limits
        self.overflowed: set[int] = set()
        self._stuck: set[int] = set()

    def room(self, index: int) -> float:
        load = self.bins[index].load
        return next((cap - load for cap in self.limits if cap - load > EPS), 0.0)

    def __call__(self, a: PlacementAdapter, rem: float) -> None:
        while rem > EPS:
            index = self.groups.least_loaded(a.rank)
            room = self.room(index)
            if room <= EPS and a.rank not in self._stuck:
                if self._make_room(a.rank, rem):
                    continue
                self._stuck.add(a.rank)
            if room <= EPS:  # overflow, in pieces so a hot adapter's excess spreads out
                take = min(rem, max(OVERFLOW_PIECE * self.limits[0], EPS))
                self.overflowed.add(index)
            else:
                take = rem if rem <= room + EPS else room
            self.bins[index].add(a.name, a.rank, take)
            self.groups.update(index)
            rem -= take

    def _make_room(self, rank: int, need: float) -> bool:
        """Every bin able to hold `rank` is full: move load of lower ranks out of them to bins with
        room (those are bins that cannot hold `rank`). True if anything moved."""
        freed = 0.0
        for i, b in enumerate(self.bins):
            if b.capability < rank:
                continue
            for name in sorted((n for n in b.shares if b.ranks[n] < rank), key=lambda n: (b.ranks[n], n)):
                other = self.groups.least_loaded(b.ranks[name])
                room = self.room(other)
                if room <= EPS:
                    continue
                adapter_rank = b.ranks[name]
                moved = b.remove(name, min(room, b.shares[name], need - freed))
                self.bins[other].add(name, adapter_rank, moved)
                self.groups.update(i)
                self.groups.update(other)
                freed += moved
                if freed >= need - EPS:
                    return True
        return freed > EPS


class _BinGroups:
    """Bins grouped by (current max rank, capability), each group a min-heap of (load, index) with
    lazy deletion of entries that no longer describe their bin."""

    def __init__(self, bins: list[Bin]) -> None:
        self._bins = bins
        self._heaps: dict[tuple[int, int], list[tuple[float, int]]] = {}
        for i in range(len(bins)):
            self.update(i)

    def update(self, index: int) -> None:
        b = self._bins[index]
        heapq.heappush(self._heaps.setdefault((b.max_rank, b.capability), []), (b.load, index))

    def _head(self, key: tuple[int, int]) -> tuple[float, int] | None:
        heap = self._heaps[key]
        while heap:
            load, i = heap[0]
            b = self._bins[i]
            if (b.max_rank, b.capability) == key and b.load == load:
                return heap[0]
            heapq.heappop(heap)
        return None

    def fitting(self, rank: int, amount: float, limit: float) -> int | None:
        """The least-loaded bin of the highest max rank >= `rank` that takes `amount` within `limit`
        (a bin already holding rank >= `rank` sits on a server able to hold it)."""
        levels: dict[int, list[tuple[float, int]]] = {}
        for key in self._heaps:
            if key[0] >= rank and (head := self._head(key)) is not None:
                levels.setdefault(key[0], []).append(head)
        for max_rank in sorted(levels, reverse=True):
            load, index = min(levels[max_rank])
            if load + amount <= limit:
                return index
        return None

    def least_loaded(self, rank: int) -> int:
        """The least-loaded bin on a server able to hold `rank` (ties: higher max rank, then index)."""
        heads = [(h[0], -key[0], h[1]) for key in self._heaps
                 if key[1] >= rank and (h := self._head(key)) is not None]
        return min(heads)[2]
