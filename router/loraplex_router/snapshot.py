"""One immutable view of the pool that the router routes against: the routing table, the live
servers and the adapter registry, read together. A request sees exactly one snapshot.

A server's live batch (its open requests by rank, for rank-aware routing) is offered to the policy
only while its heartbeat is at most `batch_max_age_s` old when the snapshot is read; an older one,
or none, leaves `Candidate.batch` empty and the rank-aware profile routes by φ instead. Requests
this router sent to a server beyond those the heartbeat counted are added to its batch.

Heartbeats are also watched for lateness (`heartbeat_late`): a server whose process stopped
(SIGSTOP, a long pause, a frozen node) stops heartbeating long before its registry entry expires.
Lateness is measured on the router's clock from when a heartbeat was first *seen*, against the
server's own interval (learned from its heartbeats' timestamps), so the agents' clocks never need
to agree with the router's.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from loraplex.routing.pipeline import Candidate, Residency, RouteRequest
from loraplex.routing.prefix import PrefixConfig, cached_match
from loraplex.routing.records import AdapterRecord, ServerBatch, ServerRecord
from loraplex.routing.table import RoutingTable

BATCH_MAX_AGE_S = 5.0  # a heartbeat's batch older than this (2.5 agent heartbeats) is not trusted
LATE_INTERVALS = 2.0  # a heartbeat is late after this many of the server's intervals (plus one poll)


@dataclass(frozen=True)
class Heartbeat:
    """What the router saw of one server's heartbeats. `sent_at` is the agent's clock (compared only
    with its own earlier values); `seen_at` the router's clock when this heartbeat was first read."""

    sent_at: float
    seen_at: float
    interval_s: float | None = None  # the shortest gap seen between two heartbeats; None: one seen so far

    def next(self, sent_at: float, now: float) -> Heartbeat:
        """This server's heartbeat as read again at `now`."""
        if sent_at == self.sent_at:
            return self
        gap = sent_at - self.sent_at
        interval = self.interval_s if gap <= 0 else gap if self.interval_s is None else min(self.interval_s, gap)
        return Heartbeat(sent_at, now, interval)


def track_heartbeats(old: Mapping[str, Heartbeat], servers: Mapping[str, ServerRecord],
                     now: float) -> dict[str, Heartbeat]:
    """The heartbeats of `servers` (just read at `now`), continuing what was seen before."""
    beats = {}
    for sid, record in servers.items():
        before = old.get(sid)
        beats[sid] = before.next(record.heartbeat_at, now) if before else Heartbeat(record.heartbeat_at, now)
    return beats


@dataclass(frozen=True)
class Snapshot:
    table: RoutingTable | None
    servers: Mapping[str, ServerRecord]
    adapters: Mapping[str, AdapterRecord]
    base_model: str | None = None       # the name clients use for the base model
    taken_at: float = field(default_factory=time.time)
    batch_max_age_s: float = BATCH_MAX_AGE_S
    heartbeats: Mapping[str, Heartbeat] = field(default_factory=dict)
    servers_read_at: float = 0.0  # when `servers` was read from the store (a kept snapshot keeps it)
    poll_interval_s: float = 1.0  # how often the router reads the registry

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

    def route_request(self, adapter: str | None, prompt_tokens: int | None = None,
                      prefix_blocks: int = 0) -> RouteRequest:
        """`prompt_tokens`: the prompt's length when the caller knows it (rank-aware routing uses it);
        `prefix_blocks`: how many prefix keys the router computed for it (prefix-aware routing)."""
        if adapter is None:
            return RouteRequest(None, prompt_tokens=prompt_tokens, prefix_blocks=prefix_blocks)
        record = self.adapters.get(adapter)
        entry = self.table.entries.get(adapter) if self.table else None
        rank = record.rank if record else entry.rank if entry else None
        return RouteRequest(adapter, rank, prompt_tokens, prefix_blocks, alora=bool(record and record.is_alora))

    def candidates(self, adapter: str | None, down: set[str], in_flight: Mapping[str, int],
                   prefix_matches: Mapping[str, int] | None = None,
                   chunk_chars: int = PrefixConfig.chunk_chars) -> list[Candidate]:
        """Every registered server as the policy sees it. `down` are servers this router just failed
        to reach; `in_flight` is this router's own count of open requests per server, fresher than
        the load in the last heartbeat; `prefix_matches` the prefix chunks (of `chunk_chars`) of the
        request each server holds, as far as the router's prefix index knows: a match counts only
        when it covers one of the server's KV blocks (`loraplex.routing.prefix.cached_match`)."""
        phis = {r.server: r.weight for r in self.table.routes(adapter)} if self.table and adapter else {}
        matches = prefix_matches or {}
        return [Candidate(server_id=s.id, healthy=s.id not in down, phi=phis.get(s.id, 0.0),
                          residency=_residency(s, adapter), max_rank=s.max_rank,
                          queue_depth=max(in_flight.get(s.id, 0), s.load.running + s.load.waiting),
                          batch=self._batch(s, in_flight.get(s.id, 0)),
                          prefix_blocks=cached_match(matches.get(s.id, 0), chunk_chars, s.block_size))
                for s in self.servers.values()]

    def late_after_s(self, server_id: str) -> float | None:
        """How long without a new heartbeat the server's heartbeat is late: two of its intervals and one
        poll (a healthy server's is at most one interval and one poll old). None while its interval is
        not known yet (fewer than two heartbeats seen)."""
        beat = self.heartbeats.get(server_id)
        if beat is None or beat.interval_s is None:
            return None
        return LATE_INTERVALS * beat.interval_s + self.poll_interval_s

    def heartbeat_late(self, server_id: str, now: float) -> bool:
        """Whether no new heartbeat of the server was seen for longer than `late_after_s`. Judged only
        while the registry is being read: when the store fails, every heartbeat stops in this view."""
        late_after = self.late_after_s(server_id)
        if late_after is None or now - self.servers_read_at > 2 * self.poll_interval_s + 1.0:
            return False
        return now - self.heartbeats[server_id].seen_at > late_after

    def late_heartbeats(self, now: float) -> int:
        """How many servers' heartbeats are late now."""
        return sum(self.heartbeat_late(server_id, now) for server_id in self.servers)

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
