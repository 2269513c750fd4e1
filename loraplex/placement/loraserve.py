"""LoRAServe's placement (Algorithm 1, paper notes §3.4-3.6): per-rank server budgets from
operating-point-normalised demand, fractional bin packing per rank on servers able to hold the rank,
leftovers on high-max-rank servers with a capacity check, a churn-minimising bin -> server
permutation, φ = share / load. With `hysteresis` > 0 and a previous table, routes that still fit stay
put and only the rest is placed again (sticky.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex.placement.binpack import Bin, budget_capabilities, pack_ranks, rank_budgets
from loraplex.placement.cold import place_cold
from loraplex.placement.leftovers import place_leftovers
from loraplex.placement.permute import map_bins_to_servers
from loraplex.placement.replicas import ensure_min_replicas
from loraplex.placement.snapshot import (
    EPS,
    Placement,
    PlacementAdapter,
    PlacementInput,
    PlacementServer,
    check_hysteresis,
    demand_of,
    server_loads,
)
from loraplex.placement.sticky import keep_previous
from loraplex.routing.table import RoutingTable

# Default tolerance: a server keeps its previous adapters while its load stays within 10 % above
# targetUtil. 0 reproduces the paper (a fresh packing every step, churn limited by the permutation).
DEFAULT_HYSTERESIS = 0.1


class LoRAServePolicy:
    name = "loraserve"

    def __init__(self, hysteresis: float = DEFAULT_HYSTERESIS) -> None:
        self.hysteresis = check_hysteresis("loraserve", hysteresis)

    def place(self, inp: PlacementInput) -> Placement:
        d = demand_of(inp)
        servers, adapters, loads, hot, total, target = d.servers, d.adapters, d.loads, d.hot, d.total, d.target
        limit = target * (1 + self.hysteresis)
        stats = {"total_util": total, "target_util": target}
        weights: dict[str, dict[str, float]] = {}
        overloaded: set[str] = set()
        if hot:
            packed = None
            if inp.previous is not None and self.hysteresis > 0:
                packed = _sticky(inp.previous, hot, servers, loads, target, limit, stats)
            if packed is None:
                packed = _fresh(inp.previous, hot, servers, loads, target, limit, stats)
            weights, overloaded = _weights(packed, loads)
        cold = [a for a in adapters if loads[a.name] <= EPS]
        place_cold(inp, cold, servers, weights, {a.name: a.rank for a in adapters})
        ensure_min_replicas(weights, adapters, servers, loads, target)
        per_server = server_loads(weights, loads)
        stats["max_load_ratio"] = max(per_server.values(), default=0.0) / target if target > 0 else 0.0
        return Placement(self.name, weights, inp.required_servers(), d.unplaceable, stats, tuple(sorted(overloaded)))


@dataclass
class _Packed:
    bins: list[Bin]
    servers: list[str]     # the server each bin landed on
    overflowed: set[int]   # bins that took load beyond the limit


def _fresh(previous: RoutingTable | None, hot: Sequence[PlacementAdapter], servers: Sequence[PlacementServer],
           loads: Mapping[str, float], target: float, limit: float, stats: dict[str, float]) -> _Packed:
    """Algorithm 1 steps 2-5 on logical bins, then mapped onto servers."""
    rank_util: dict[int, float] = {}
    for a in hot:
        rank_util[a.rank] = rank_util.get(a.rank, 0.0) + loads[a.name]
    budgets = rank_budgets(rank_util, target, len(servers))
    per_rank, surplus = budget_capabilities(budgets, [s.max_rank for s in servers])
    bins, remainder = pack_ranks(hot, loads, per_rank, target)
    bins.extend(Bin(c) for c in surplus)
    overflowed = place_leftovers(bins, [a for a in hot if remainder[a.name] > EPS], remainder, target, limit)
    stats.update({f"budget_r{r}": float(len(per_rank[r])) for r in budgets})
    return _Packed(bins, map_bins_to_servers(bins, servers, loads, previous), overflowed)


def _sticky(previous: RoutingTable, hot: Sequence[PlacementAdapter], servers: Sequence[PlacementServer],
            loads: Mapping[str, float], target: float, limit: float, stats: dict[str, float]) -> _Packed | None:
    """Hysteresis: previous routes that still fit stay, the rest is placed as leftovers. None when
    that overloads a server: under overload a full repacking spreads the load better."""
    by_server = {s.id: Bin(s.max_rank) for s in servers}
    remainder = keep_previous(by_server, hot, loads, previous, limit)
    moved = [a for a in hot if remainder[a.name] > EPS]
    bins = list(by_server.values())
    if place_leftovers(bins, moved, remainder, target, limit):
        return None
    stats["kept_fraction"] = 1.0 - math.fsum(remainder[a.name] for a in moved) / math.fsum(loads.values())
    return _Packed(bins, list(by_server), set())


def _weights(packed: _Packed, loads: Mapping[str, float]) -> tuple[dict[str, dict[str, float]], set[str]]:
    """φ(a, s) = share of u(a) on s / u(a); and the overloaded servers."""
    weights: dict[str, dict[str, float]] = {}
    for b, server in zip(packed.bins, packed.servers, strict=True):
        for name, share in b.shares.items():
            weights.setdefault(name, {})[server] = share / loads[name]
    return weights, {packed.servers[i] for i in packed.overflowed}

