"""Zero-demand adapters (cold or new): they carry no load but every adapter needs a server. Keep them
where they were routed (their `min_replicas` heaviest routes) or where a copy already lives; otherwise put them on the server holding the
fewest adapters among those whose max rank they do not raise (empty servers, or servers already at
their rank or above), so the rank mix of busy servers does not get worse."""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from loraplex.placement.snapshot import PlacementAdapter, PlacementInput, PlacementServer, previous_routes


def place_cold(inp: PlacementInput, cold: Sequence[PlacementAdapter], servers: Sequence[PlacementServer],
               weights: dict[str, dict[str, float]], ranks: Mapping[str, int]) -> None:
    """Adds `weights[a.name] = {server: 1.0}` for each cold adapter. `weights` holds the adapters
    placed so far; `ranks` maps every adapter name in it to its rank."""
    by_id = {s.id: s for s in servers}
    state = _ServerState(servers, weights, ranks)
    for a in sorted(cold, key=lambda a: (-a.rank, a.name)):
        routes = previous_routes(inp, a, by_id)
        if not routes:
            routes = {_held_copy(a, by_id) or state.best(a.rank): 1.0}
        weights[a.name] = routes
        for server in routes:
            state.add(server, a.rank)


def _held_copy(a: PlacementAdapter, servers: Mapping[str, PlacementServer]) -> str | None:
    held = sorted(s for s in a.locations if s in servers and servers[s].max_rank >= a.rank)
    return held[0] if held else None


class _ServerState:
    """Per server: adapter count and current max rank; heaps of (count, id) grouped by
    (current max rank, max_rank capability), lazily invalidated."""

    def __init__(self, servers: Sequence[PlacementServer], weights: Mapping[str, Mapping[str, float]],
                 ranks: Mapping[str, int]) -> None:
        self._capability = {s.id: s.max_rank for s in servers}
        self._count = dict.fromkeys(self._capability, 0)
        self._max_rank = dict.fromkeys(self._capability, 0)
        for name, routes in weights.items():
            for server in routes:
                self._count[server] += 1
                self._max_rank[server] = max(self._max_rank[server], ranks[name])
        self._heaps: dict[tuple[int, int], list[tuple[int, str]]] = {}
        for server in self._capability:
            self._push(server)

    def _group(self, server: str) -> tuple[int, int]:
        return self._max_rank[server], self._capability[server]

    def _push(self, server: str) -> None:
        heapq.heappush(self._heaps.setdefault(self._group(server), []), (self._count[server], server))

    def _head(self, group: tuple[int, int]) -> tuple[int, str] | None:
        heap = self._heaps[group]
        while heap:
            count, server = heap[0]
            if self._count[server] == count and self._group(server) == group:
                return heap[0]
            heapq.heappop(heap)
        return None

    def best(self, rank: int) -> str:
        """The server with the fewest adapters among those `rank` does not mix into (else among all
        that can hold it); the id breaks ties."""
        options = []
        for (current, capability), _ in self._heaps.items():
            head = self._head((current, capability)) if capability >= rank else None
            if head is not None:
                raises_mix = 0 < current < rank
                options.append((raises_mix, *head))
        return min(options)[2]

    def add(self, server: str, rank: int) -> None:
        self._count[server] += 1
        self._max_rank[server] = max(self._max_rank[server], rank)
        self._push(server)
