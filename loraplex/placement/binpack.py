"""Steps 2-4 of LoRAServe's Algorithm 1 over logical bins: per-rank server budgets, fractional
next-fit packing of each rank's adapters, and leftovers on the highest-max-rank bin that still has
room (the capacity check of the notes §3.5, without which every leftover piles onto one server)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.placement.snapshot import EPS, PlacementAdapter


@dataclass
class Bin:
    """One logical server: adapter -> share of its load (server-equivalents)."""

    shares: dict[str, float] = field(default_factory=dict)
    load: float = 0.0
    max_rank: int = 0  # 0 while empty

    def add(self, adapter: PlacementAdapter, share: float) -> None:
        self.shares[adapter.name] = self.shares.get(adapter.name, 0.0) + share
        self.load += share
        self.max_rank = max(self.max_rank, adapter.rank)


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def rank_budgets(rank_util: Mapping[int, float], target: float, servers: int) -> dict[int, int]:
    """Servers dedicated to each rank: round-half-up(rankUtil[r] / targetUtil). When the rounding asks
    for more than `servers`, take servers back from the ranks that were rounded up the most."""
    budgets = {r: round_half_up(u / target) for r, u in rank_util.items()}
    while sum(budgets.values()) > servers:
        r = min((r for r in budgets if budgets[r] > 0), key=lambda r: (rank_util[r] / target - (budgets[r] - 1), r))
        budgets[r] -= 1
    return budgets


def pack_ranks(adapters: Sequence[PlacementAdapter], loads: Mapping[str, float], budgets: Mapping[int, int],
               target: float) -> tuple[list[Bin], dict[str, float]]:
    """Fractional next-fit packing, ranks ascending so bins come out rank-contiguous. Each rank fills
    its `budgets[r]` bins up to `target`, splitting an adapter across consecutive bins when it does not
    fit. Returns the bins and what is left of each adapter's load."""
    remainder = {a.name: loads[a.name] for a in adapters}
    bins: list[Bin] = []
    by_rank: dict[int, list[PlacementAdapter]] = {}
    for a in adapters:
        by_rank.setdefault(a.rank, []).append(a)
    for rank in sorted(by_rank):
        if budgets.get(rank, 0) > 0:
            _pack_rank(by_rank[rank], budgets[rank], target, bins, remainder)
    return bins, remainder


def _pack_rank(adapters: list[PlacementAdapter], budget: int, target: float, bins: list[Bin],
               remainder: dict[str, float]) -> None:
    k = len(bins)
    bins.extend(Bin() for _ in range(budget))
    for a in sorted(adapters, key=lambda a: (-remainder[a.name], a.name)):
        while remainder[a.name] > EPS and k < len(bins):
            free = target - bins[k].load
            if free <= EPS:
                k += 1
                continue
            take = min(free, remainder[a.name])
            bins[k].add(a, take)
            remainder[a.name] -= take
        if k == len(bins):
            return  # this rank's bins are full; the rest of its adapters are leftovers


def place_leftovers(bins: list[Bin], leftovers: Sequence[PlacementAdapter], remainder: Mapping[str, float],
                    target: float) -> None:
    """ALLOCATEHIGHESTMAXRANK with a capacity check. In descending rank (then larger remainder):
    the bin with the highest max rank >= the adapter's rank that can take the whole remainder within
    `target`, least loaded first; if none can, the least loaded bin overall. Heaps per max rank keep
    this O(L · ranks · log N) for thousands of leftovers."""
    groups = _BinGroups(bins)
    limit = target + max(EPS, target * 1e-9)
    for a in sorted(leftovers, key=lambda a: (-a.rank, -remainder[a.name], a.name)):
        rem = remainder[a.name]
        index = groups.fitting(a.rank, rem, limit)
        if index is None:
            index = groups.least_loaded()
        bins[index].add(a, rem)
        groups.update(index)


class _BinGroups:
    """Bins grouped by their current max rank, each group a min-heap of (load, index) with lazy deletion."""

    def __init__(self, bins: list[Bin]) -> None:
        self._bins = bins
        self._heaps: dict[int, list[tuple[float, int]]] = {}
        for i in range(len(bins)):
            self.update(i)

    def update(self, index: int) -> None:
        b = self._bins[index]
        heapq.heappush(self._heaps.setdefault(b.max_rank, []), (b.load, index))

    def _head(self, max_rank: int) -> tuple[float, int] | None:
        heap = self._heaps[max_rank]
        while heap:
            load, i = heap[0]
            if self._bins[i].max_rank == max_rank and self._bins[i].load == load:
                return heap[0]
            heapq.heappop(heap)  # stale: the bin has changed since this entry was pushed
        return None

    def fitting(self, rank: int, amount: float, limit: float) -> int | None:
        for max_rank in sorted((r for r in self._heaps if r >= rank), reverse=True):
            head = self._head(max_rank)
            if head is not None and head[0] + amount <= limit:
                return head[1]
        return None

    def least_loaded(self) -> int:
        heads = [(h[0], -r, h[1]) for r in self._heaps if (h := self._head(r)) is not None]
        return min(heads)[2]
