"""Pure edits of a routing table between two placements.

A new LoRADeployment must not wait a whole placement interval: it goes at once to `replicas.min`
servers that can hold it (those already holding a copy, else the healthy servers with enough max
rank and the fewest adapters), with equal φ. A deleted one leaves the table at once. The periodic
placement then spreads the traffic as the demand says."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord, make_entry


class NoServerError(RuntimeError):
    """No healthy server can hold the adapter (none registered, or all with a lower max rank)."""


def _next(table: RoutingTable | None, entries: dict, now: float) -> RoutingTable:
    if table is None:
        return RoutingTable(1, now, entries, policy="operator").validate()
    return replace(table, version=table.version + 1, created_at=now, entries=entries).validate()


def pick_servers(table: RoutingTable | None, record: AdapterRecord, servers: Sequence[ServerRecord],
                 count: int = 1) -> list[str]:
    """Up to `count` servers able to hold the rank: those holding a copy first (no fetch), then the
    ones with the fewest adapters, then by id."""
    able = [s for s in servers if s.max_rank >= record.rank]
    if not able:
        raise NoServerError(f"no healthy server can hold rank {record.rank} "
                            f"({len(servers)} healthy, max rank {max((s.max_rank for s in servers), default=0)})")
    counts = {s.id: len(table.assignments(s.id)) if table else 0 for s in able}
    ranked = sorted(counts, key=lambda server: (server not in record.locations, counts[server], server))
    return ranked[:count]


def ensure_adapter(table: RoutingTable | None, record: AdapterRecord, servers: Sequence[ServerRecord],
                   now: float, copies: int = 1) -> RoutingTable | None:
    """The next table with `record` routable, or None when the current table already routes it with
    the same digest and rank. A new adapter goes to `copies` servers (its `replicas.min`; fewer when
    fewer can hold it) with equal φ. A changed digest keeps the routes (the agents fetch the new
    weights) unless a server on them can no longer hold the rank."""
    current = table.entries.get(record.name) if table else None
    if current is not None and (current.digest, current.rank) == (record.digest, record.rank):
        return None
    by_id = {s.id: s for s in servers}
    if current is not None and all(r.server in by_id and by_id[r.server].max_rank >= record.rank
                                   for r in current.routes):
        weights = [(r.server, r.weight) for r in current.routes]
    else:
        weights = [(server, 1.0) for server in pick_servers(table, record, servers, copies)]
    entries = dict(table.entries) if table else {}
    entries[record.name] = make_entry(record.name, record.digest, record.rank, weights)
    return _next(table, entries, now)


def without_adapter(table: RoutingTable | None, name: str, now: float) -> RoutingTable | None:
    """The next table without `name`, or None when it is not routed."""
    if table is None or name not in table.entries:
        return None
    entries = {k: v for k, v in table.entries.items() if k != name}
    return _next(table, entries, now)
