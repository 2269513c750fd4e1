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
    max_adapters: int = 0  # adapters it can hold at once (a vLLM server's max_cpu_loras); 0: no limit


@dataclass(frozen=True)
class PlacementAdapter:
    name: str
    digest: str
    rank: int
    demand_tps: float = 0.0                    # forecast tokens/s for the next step
    locations: frozenset[str] = frozenset()    # servers holding it in host memory now
    min_replicas: int = 1                      # LoRADeployment replicas.min: distinct servers to hold it

    def __post_init__(self) -> None:
        if self.rank <= 0 or not math.isfinite(self.demand_tps) or self.demand_tps < 0:
            raise ValueError(f"adapter {self.name!r}: rank must be positive and demand_tps finite and >= 0, "
                             f"got rank {self.rank}, demand_tps {self.demand_tps}")
        if self.min_replicas < 1:
            raise ValueError(f"adapter {self.name!r}: min_replicas must be >= 1, got {self.min_replicas}")


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
    server's max_rank) are listed in `unplaceable` and left out of `weights`. `overloaded` lists the
    servers whose forecast load exceeds the policy's limit because the servers able to hold some
    rank ran out of room (e.g. too few high-max-rank servers): the placement still routes everything,
    and the pool needs more (or larger-rank) servers."""

    policy: str
    weights: Mapping[str, Mapping[str, float]]
    required_servers: int
    unplaceable: tuple[str, ...] = ()
    stats: Mapping[str, float] = field(default_factory=dict)  # policy diagnostics, e.g. target_util
    overloaded: tuple[str, ...] = ()

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


def check_hysteresis(policy: str, hysteresis: float) -> float:
    if not (math.isfinite(hysteresis) and hysteresis >= 0):
        raise ValueError(f"{policy} hysteresis must be a finite fraction >= 0, got {hysteresis}")
    return hysteresis


@dataclass(frozen=True)
class Demand:
    """A snapshot's healthy servers and placeable adapters with their loads u(a); `hot` are those
    with u > 0, `target` is targetUtil = Σ u / servers."""

    servers: list[PlacementServer]
    adapters: list[PlacementAdapter]
    unplaceable: tuple[str, ...]
    loads: dict[str, float]
    hot: list[PlacementAdapter]
    total: float
    target: float


def demand_of(inp: PlacementInput) -> Demand:
    servers = inp.healthy_servers()
    adapters, unplaceable = split_placeable(inp, servers)
    loads = {a.name: inp.load(a) for a in adapters}
    hot = [a for a in adapters if loads[a.name] > EPS]
    total = math.fsum(loads[a.name] for a in hot)
    return Demand(servers, adapters, unplaceable, loads, hot, total, total / len(servers))


def previous_routes(inp: PlacementInput, adapter: PlacementAdapter, servers: Mapping[str, PlacementServer]
                    ) -> dict[str, float]:
    """The adapter's `min_replicas` heaviest routes of the previous table on servers that can still
    hold it, φ renormalised; with min_replicas = 1 the server it was mostly routed to, φ = 1."""
    if inp.previous is None:
        return {}
    routes = [r for r in inp.previous.routes(adapter.name)
              if r.server in servers and servers[r.server].max_rank >= adapter.rank]
    kept = sorted(routes, key=lambda r: (-r.weight, r.server))[:adapter.min_replicas]
    total = sum(r.weight for r in kept)
    return {r.server: r.weight / total for r in kept}


def server_loads(weights: Mapping[str, Mapping[str, float]], loads: Mapping[str, float]) -> dict[str, float]:
    """Σ φ · u per server."""
    per_server: dict[str, float] = {}
    for name, routes in weights.items():
        for server, phi in routes.items():
            per_server[server] = per_server.get(server, 0.0) + phi * loads[name]
    return per_server
