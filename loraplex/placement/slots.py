"""Adapter slots: a server that can hold only so many adapters at once is never assigned more.

A vLLM server keeps at most `max_cpu_loras` adapters in its LoRA cache (`max_loras` of them in a
batch); beyond that it reloads from disk on every switch. Its agent reports the limit
(`ServerRecord.max_adapters`, 0 for no limit) and the placement honours it after the policy ran,
before the controller compares and publishes, so one placement is still one table version:

- on a server over its limit, adapters that have other routes leave first (their φ moves to those
  routes), smallest share of load first;
- an adapter whose only route is there moves whole to the capable server (rank, free slot) with the
  fewest adapters, then the least load, then by id;
- an adapter no capable server has a free slot for is `unplaceable` (the pool needs more servers or
  larger slots), never squeezed in.
"""

from __future__ import annotations

import math
from dataclasses import replace

from loraplex.placement.snapshot import Placement, PlacementInput, PlacementServer

Weights = dict[str, dict[str, float]]


def cap_slots(placement: Placement, inp: PlacementInput) -> Placement:
    """The placement with no server holding more adapters than its `max_adapters`."""
    servers = {s.id: s for s in inp.servers if s.healthy}
    if not any(s.max_adapters for s in servers.values()):
        return placement
    board = _SlotBoard(servers, {a: dict(r) for a, r in placement.weights.items()},
                       {a.name: inp.load(a) for a in inp.adapters}, {a.name: a.rank for a in inp.adapters})
    moved, dropped = board.relieve()
    if not moved and not dropped:
        return placement
    stats = {**placement.stats, "slot_moves": float(moved)}
    return replace(placement, weights=board.weights, stats=stats,
                   unplaceable=tuple(sorted({*placement.unplaceable, *dropped})))


class _SlotBoard:
    def __init__(self, servers: dict[str, PlacementServer], weights: Weights, loads: dict[str, float],
                 ranks: dict[str, int]) -> None:
        self.servers, self.weights, self.loads, self.ranks = servers, weights, loads, ranks
        self.held: dict[str, set[str]] = {s: set() for s in servers}
        for adapter, routes in weights.items():
            for server in routes:
                self.held.setdefault(server, set()).add(adapter)

    def limit(self, server: str) -> float:
        spec = self.servers.get(server)
        return spec.max_adapters if spec is not None and spec.max_adapters else math.inf

    def relieve(self) -> tuple[int, list[str]]:
        """Take adapters off every server over its limit; (routes changed, adapters left unplaced)."""
        moved, dropped = 0, []
        for server in sorted(self.held):
            limit = self.limit(server)
            if len(self.held[server]) <= limit:
                continue
            for adapter in self._leaving(server)[:len(self.held[server]) - int(limit)]:
                moved += 1
                if not self._take_off(adapter, server):
                    dropped.append(adapter)
        return moved, dropped

    def _leaving(self, server: str) -> list[str]:
        """Adapters in the order they leave `server`: those with other routes, then by load share."""
        return sorted(self.held[server], key=lambda a: (len(self.weights[a]) == 1,
                                                        self.weights[a][server] * self.loads.get(a, 0.0), a))

    def _take_off(self, adapter: str, server: str) -> bool:
        routes = self.weights[adapter]
        self.held[server].discard(adapter)
        share = routes.pop(server)
        if routes:
            total = 1.0 - share
            self.weights[adapter] = {s: (w / total if total > 0 else 1.0 / len(routes)) for s, w in routes.items()}
            return True
        target = self._free_server(adapter)
        if target is None:
            del self.weights[adapter]
            return False
        self.weights[adapter] = {target: 1.0}
        self.held[target].add(adapter)
        return True

    def _free_server(self, adapter: str) -> str | None:
        rank = self.ranks.get(adapter, 1)
        free = [s for s in self.servers if self.servers[s].max_rank >= rank and len(self.held[s]) < self.limit(s)]
        return min(free, key=lambda s: (len(self.held[s]), self._load(s), s), default=None)

    def _load(self, server: str) -> float:
        return sum(self.weights[a].get(server, 0.0) * self.loads.get(a, 0.0) for a in self.held[server])
