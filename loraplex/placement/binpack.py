"""Steps 2-3 of LoRAServe's Algorithm 1 over logical bins: per-rank server budgets, bins tied to
servers able to hold the rank, and fractional next-fit packing of each rank's adapters."""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.placement.snapshot import EPS, PlacementAdapter


@dataclass
class Bin:
    """One logical server: adapter -> share of its load (server-equivalents). `capability` is the
    max_rank of the server the bin will land on, so no adapter above it may enter."""

    capability: int
    shares: dict[str, float] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    load: float = 0.0
    max_rank: int = 0  # the largest rank held; 0 while empty

    def add(self, name: str, rank: int, share: float) -> None:
        self.shares[name] = self.shares.get(name, 0.0) + share
        self.ranks[name] = rank
        self.load += share
        self.max_rank = max(self.max_rank, rank)

    def remove(self, name: str, share: float) -> float:
        """Takes `share` of adapter `name` out (all of it when what stays would be dust); returns
        what was taken."""
        if self.shares[name] - share <= EPS:
            share = self.shares.pop(name)
            del self.ranks[name]
            self.max_rank = max(self.ranks.values(), default=0)
        else:
            self.shares[name] -= share
        self.load -= share
        return share


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


def budget_capabilities(budgets: Mapping[int, int], capabilities: Sequence[int]) -> tuple[dict[int, list[int]], list[int]]:
    """Ties each rank's bins to servers that can hold it. Ranks are served from the highest down, each
    bin taking the smallest server max_rank that suffices, so the largest servers stay free for the
    leftovers of high ranks. A rank with fewer capable servers left than its budget gets fewer bins
    (its excess load becomes leftovers). Returns {rank: bin capabilities} and the unused capabilities
    (the surplus bins)."""
    free = sorted(capabilities)
    per_rank: dict[int, list[int]] = {}
    for rank in sorted(budgets, reverse=True):
        start = bisect.bisect_left(free, rank)
        end = min(start + budgets[rank], len(free))
        per_rank[rank] = free[start:end]
        del free[start:end]
    return per_rank, free


def pack_ranks(adapters: Sequence[PlacementAdapter], loads: Mapping[str, float],
               capabilities: Mapping[int, Sequence[int]], target: float) -> tuple[list[Bin], dict[str, float]]:
    """Fractional next-fit packing, ranks ascending so bins come out rank-contiguous. Each rank fills
    its bins (one per entry of `capabilities[rank]`) up to `target`, splitting an adapter across
    consecutive bins when it does not fit. Returns the bins and what is left of each adapter's load."""
    remainder = {a.name: loads[a.name] for a in adapters}
    bins: list[Bin] = []
    by_rank: dict[int, list[PlacementAdapter]] = {}
    for a in adapters:
        by_rank.setdefault(a.rank, []).append(a)
    for rank in sorted(by_rank):
        if capabilities.get(rank):
            _pack_rank(by_rank[rank], capabilities[rank], target, bins, remainder)
    return bins, remainder


def _pack_rank(adapters: list[PlacementAdapter], capabilities: Sequence[int], target: float, bins: list[Bin],
               remainder: dict[str, float]) -> None:
    k = len(bins)
    bins.extend(Bin(c) for c in capabilities)
    for a in sorted(adapters, key=lambda a: (-remainder[a.name], a.name)):
        while remainder[a.name] > EPS and k < len(bins):
            free = target - bins[k].load
            if free <= EPS:
                k += 1
                continue
            take = min(free, remainder[a.name])
            bins[k].add(a.name, a.rank, take)
            remainder[a.name] -= take
        if k == len(bins):
            return  # this rank's bins are full; the rest of its adapters are leftovers
