"""One immutable view of the pool that the router routes against: the routing table, the live
servers and the adapter registry, read together. A request sees exactly one snapshot.

A server's live batch (its open requests by rank, for rank-aware routing) is offered to the policy
only while its heartbeat is at most `batch_max_age_s` old when the snapshot is read; an older one,
or none, leaves `Candidate.batch` empty and the rank-aware profile routes by φ instead. Requests
this router sent to a server beyond those the heartbeat counted are added to its batch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from loraplex.routing.pipeline import Candidate, Residency, RouteRequest
from loraplex.routing.records import AdapterRecord, ServerBatch, ServerRecord
from loraplex.routing.table import RoutingTable

BATCH_MAX_AGE_S = 5.0  # a heartbeat's batch older than this (2.5 agent heartbeats) is not trusted


@dataclass(frozen=True)
class Snapshot:
    table: RoutingTable | None
    servers: Mapping[str, ServerRecord]
    adapters: Mapping[str, AdapterRecord]
    base_model: str | None = None       # the name clients use for the base model
    taken_at: float = field(default_factory=time.time)
    batch_max_age_s: float = BATCH_MAX_AGE_S

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

    def route_request(self, adapter: str | None, prompt_tokens: int | None = None) -> RouteRequest:
        """`prompt_tokens`: the prompt's length when the caller knows it (rank-aware routing uses it)."""
        if adapter is None:
            return RouteRequest(None, prompt_tokens=prompt_tokens)
        record = self.adapters.get(adapter)
        entry = self.table.entries.get(adapter) if self.table else None
        rank = record.rank if record else entry.rank if entry else None
        return RouteRequest(adapter, rank, prompt_tokens)

    def candidates(self, adapter: str | None, down: set[str], in_flight: Mapping[str, int]) -> list[Candidate]:
        """Every registered server as the policy sees it. `down` are servers this router just failed
        to reach; `in_flight` is this router's own count of open requests per server, fresher than
        the load in the last heartbeat."""
        phis = {r.server: r.weight for r in self.table.routes(adapter)} if self.table and adapter else {}
        return [Candidate(server_id=s.id, healthy=s.id not in down, phi=phis.get(s.id, 0.0),
                          residency=_residency(s, adapter), max_rank=s.max_rank,
                          queue_depth=max(in_flight.get(s.id, 0), s.load.running + s.load.waiting),
                          batch=self._batch(s, in_flight.get(s.id, 0)))
                for s in self.servers.values()]

    def _batch(self, server: ServerRecord, open_requests: int) -> ServerBatch | None:
        """The server's reported batch if fresh enough, with this router's newer requests added."""
        if server.batch is None or self.taken_at - server.heartbeat_at > self.batch_max_age_s:
            return None
        return server.batch.with_open_requests(open_requests)


def _residency(server: ServerRecord, adapter: str | None) -> Residency:
    if adapter is None:
        return Residency.NONE
    if adapter in server.gpu_adapters:
        return Residency.GPU
    if adapter in server.host_adapters:
        return Residency.HOST
    return Residency.NONE
