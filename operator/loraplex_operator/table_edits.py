"""Pure edits of a routing table between two placements.

A new LoRADeployment must not wait a whole placement interval: it goes at once to one server that
can hold it (one already holding a copy, else the healthy server with enough max rank and the fewest
adapters), with φ = 1. A deleted one leaves the table at once. The periodic placement then spreads
the traffic as the demand says."""

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


def pick_server(table: RoutingTable | None, record: AdapterRecord, servers: Sequence[ServerRecord]) -> str:
    able = [s for s in servers if s.max_rank >= record.rank]
    if not able:
        raise NoServerError(f"no healthy server can hold rank {record.rank} "
                            f"({len(servers)} healthy, max rank {max((s.max_rank for s in servers), default=0)})")
    holders = sorted(s.id for s in able if s.id in record.locations)
    if holders:
        return holders[0]
    counts = {s.id: len(table.assignments(s.id)) if table else 0 for s in able}
    return min(counts, key=lambda server: (counts[server], server))


def ensure_adapter(table: RoutingTable | None, record: AdapterRecord, servers: Sequence[ServerRecord],
                   now: float) -> RoutingTable | None:
    """The next table with `record` routable, or None when the current table already routes it with
    the same digest and rank. A changed digest keeps the routes (the agents fetch the new weights)
    unless a server on them can no longer hold the rank."""
    current = table.entries.get(record.name) if table else None
    if current is not None and (current.digest, current.rank) == (record.digest, record.rank):
        return None
    by_id = {s.id: s for s in servers}
    if current is not None and all(r.server in by_id and by_id[r.server].max_rank >= record.rank
                                   for r in current.routes):
        weights = [(r.server, r.weight) for r in current.routes]
    else:
        weights = [(pick_server(table, record, servers), 1.0)]
    entries = dict(table.entries) if table else {}
    entries[record.name] = make_entry(record.name, record.digest, record.rank, weights)
    return _next(table, entries, now)


def without_adapter(table: RoutingTable | None, name: str, now: float) -> RoutingTable | None:
    """The next table without `name`, or None when it is not routed."""
    if table is None or name not in table.entries:
        return None
    entries = {k: v for k, v in table.entries.items() if k != name}
    return _next(table, entries, now)


def apply_replica_bounds(table: RoutingTable, bounds: dict[str, tuple[int, int | None]],
                         servers: Sequence[ServerRecord]) -> RoutingTable:
    """Honours each LoRADeployment's `replicas.min` / `replicas.max` on a placement's table (same
    version). Too few servers: add the capable ones with the fewest adapters, each taking 1/min of the
    traffic; too many: keep the heaviest `max` routes. φ is renormalised to sum to 1."""
    entries = dict(table.entries)
    counts = {s.id: len(table.assignments(s.id)) for s in servers}
    for name, (low, high) in sorted(bounds.items()):
        entry = entries.get(name)
        if entry is None:
            continue
        weights = {r.server: r.weight for r in entry.routes}
        if len(weights) < low:
            spare = sorted((s.id for s in servers if s.max_rank >= entry.rank and s.id not in weights),
                           key=lambda sid: (counts[sid], sid))
            added = spare[:low - len(weights)]
            scale = len(weights) / (len(weights) + len(added))
            weights = {s: w * scale for s, w in weights.items()} | dict.fromkeys(added, 1.0 / (len(weights) + len(added)))
            for sid in added:
                counts[sid] += 1
        if high is not None and len(weights) > high:
            weights = dict(sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))[:high])
        entries[name] = make_entry(name, entry.digest, entry.rank, weights.items())
    return replace(table, entries=entries).validate()
