"""What a placement policy sees (a snapshot of the pool) and what it returns."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.placement.operating_points import OperatingPoints
from loraplex.routing.table import RoutingTable, TableEntry, make_entry

EPS = 1e-9


class PlacementError(RuntimeError):
    """The snapshot cannot be placed (e.g. no healthy server, capabilities that cannot hold the bins)."""


@dataclass(frozen=True)
class PlacementServer:
    id: str
    max_rank: int          # the largest adapter rank the server's engine accepts
    healthy: bool = True   # unhealthy servers are never placed on


@dataclass(frozen=True)
class PlacementAdapter:
    name: str
    digest: str
    rank: int
    demand_tps: float = 0.0                    # forecast tokens/s for the next step
    locations: frozenset[str] = frozenset()    # servers holding it in host memory now


@dataclass(frozen=True)
class PlacementInput:
    servers: Sequence[PlacementServer]
    adapters: Sequence[PlacementAdapter]
    operating_points: OperatingPoints
    previous: RoutingTable | None = None

    def healthy_servers(self) -> list[PlacementServer]:
        servers = sorted((s for s in self.servers if s.healthy), key=lambda s: s.id)
        if not servers:
            raise PlacementError("no healthy server to place adapters on")
        return servers

    def load(self, adapter: PlacementAdapter) -> float:
        """u(a): the adapter's forecast load in server-equivalents."""
        return adapter.demand_tps / self.operating_points.tps(adapter.rank)

    def required_servers(self) -> int:
        """ceil(Σ u): the fewest servers that serve the forecast under the SLO (the autoscaling signal);
        at least 1 while the pool has adapters."""
        total = sum(self.load(a) for a in self.adapters)
        return max(1 if self.adapters else 0, math.ceil(total - 1e-6))


@dataclass(frozen=True)
class Placement:
    """`weights[adapter][server] = φ`. Adapters that no healthy server can hold (rank above every
    server's max_rank) are listed in `unplaceable` and left out of `weights`."""

    policy: str
    weights: Mapping[str, Mapping[str, float]]
    required_servers: int
    unplaceable: tuple[str, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)  # policy diagnostics, e.g. target_util

    def entries(self, adapters: Sequence[PlacementAdapter]) -> dict[str, TableEntry]:
        placed = [a for a in adapters if a.name in self.weights]
        return {a.name: make_entry(a.name, a.digest, a.rank, self.weights[a.name].items()) for a in placed}

    def to_table(self, version: int, created_at: float, adapters: Sequence[PlacementAdapter]) -> RoutingTable:
        return RoutingTable(version, created_at, self.entries(adapters), self.policy, self.required_servers,
                            dict(self.stats)).validate()


def split_placeable(inp: PlacementInput, servers: Sequence[PlacementServer]
                    ) -> tuple[list[PlacementAdapter], tuple[str, ...]]:
    """Adapters some healthy server can hold, and the names of those none can."""
    top = max(s.max_rank for s in servers)
    placeable = [a for a in inp.adapters if a.rank <= top]
    return placeable, tuple(sorted(a.name for a in inp.adapters if a.rank > top))


def previous_server(inp: PlacementInput, adapter: PlacementAdapter, servers: Mapping[str, PlacementServer]
                    ) -> str | None:
    """Where the adapter was routed most recently (its largest-φ server), if that server can still take it."""
    if inp.previous is None:
        return None
    for route in sorted(inp.previous.routes(adapter.name), key=lambda r: (-r.weight, r.server)):
        server = servers.get(route.server)
        if server is not None and server.max_rank >= adapter.rank:
            return route.server
    return None
