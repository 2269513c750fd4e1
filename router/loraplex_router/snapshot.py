"""One immutable view of the pool that the router routes against: the routing table, the live
servers and the adapter registry, read together. A request sees exactly one snapshot."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from loraplex.routing.pipeline import Candidate, Residency, RouteRequest
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.table import RoutingTable


@dataclass(frozen=True)
class Snapshot:
    table: RoutingTable | None
    servers: Mapping[str, ServerRecord]
    adapters: Mapping[str, AdapterRecord]
    base_model: str | None = None       # the name clients use for the base model
    taken_at: float = field(default_factory=time.time)

    @property
    def version(self) -> int:
        return self.table.version if self.table else 0

    def adapter_names(self) -> list[str]:
        names = set(self.adapters)
        if self.table:
            names.update(self.table.entries)
        return sorted(names)

    def knows(self, model: str) -> bool:
        return model in self.adapters or bool(self.table and model in self.table.entries)

    def route_request(self, adapter: str | None) -> RouteRequest:
        if adapter is None:
            return RouteRequest(None)
        record = self.adapters.get(adapter)
        entry = self.table.entries.get(adapter) if self.table else None
        rank = record.rank if record else entry.rank if entry else None
        return RouteRequest(adapter, rank)

    def candidates(self, adapter: str | None, down: set[str], in_flight: Mapping[str, int]) -> list[Candidate]:
        """Every registered server as the policy sees it. `down` are servers this router just failed
        to reach; `in_flight` is this router's own count of open requests per server, fresher than
        the load in the last heartbeat."""
        phis = {r.server: r.weight for r in self.table.routes(adapter)} if self.table and adapter else {}
        return [Candidate(server_id=s.id, healthy=s.id not in down, phi=phis.get(s.id, 0.0),
                          residency=_residency(s, adapter), max_rank=s.max_rank,
                          queue_depth=max(in_flight.get(s.id, 0), s.load.running + s.load.waiting))
                for s in self.servers.values()]


def _residency(server: ServerRecord, adapter: str | None) -> Residency:
    if adapter is None:
        return Residency.NONE
    if adapter in server.gpu_adapters:
        return Residency.GPU
    if adapter in server.host_adapters:
        return Residency.HOST
    return Residency.NONE
