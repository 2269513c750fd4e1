"""Pure: the routing table brought in line with the adapter registry between two placements.

A new LoRADeployment must not wait a whole placement interval: it goes at once to `replicas.min`
servers that can hold it (those already holding a copy, else the healthy servers with enough max
rank and the fewest adapters), with equal φ. A deleted one leaves the table at once. Every change
the registry saw since the last table goes into one new version. The periodic placement then
spreads the traffic as the demand says."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace

from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord, TableEntry, make_entry


class NoServerError(RuntimeError):
    """No healthy server can hold the adapter (none registered, or all with a lower max rank)."""


def pick_servers(record: AdapterRecord, servers: Sequence[ServerRecord], assigned: Mapping[str, int],
                 count: int = 1) -> list[str]:
    """Up to `count` servers able to hold the rank and with a free adapter slot (a vLLM server's
    max_cpu_loras): those holding a copy first (no fetch), then the ones with the fewest adapters
    (`assigned`: adapters per server), then by id."""
    able = [s.id for s in servers if s.max_rank >= record.rank
            and (not s.max_adapters or assigned.get(s.id, 0) < s.max_adapters)]
    if not able:
        raise NoServerError(f"no healthy server can hold rank {record.rank} in a free adapter slot "
                            f"({len(servers)} healthy, max rank {max((s.max_rank for s in servers), default=0)})")
    ranked = sorted(able, key=lambda server: (server not in record.locations, assigned.get(server, 0), server))
    return ranked[:count]


def _entry(record: AdapterRecord, current: TableEntry | None, servers: Sequence[ServerRecord],
           assigned: Counter[str], copies: int) -> TableEntry:
    """A changed digest keeps the routes (the agents fetch the new weights) unless a server on them
    can no longer hold the rank; a new adapter goes to `copies` servers with equal φ."""
    by_id = {s.id: s for s in servers}
    if current is not None and all(r.server in by_id and by_id[r.server].max_rank >= record.rank
                                   for r in current.routes):
        weights = [(r.server, r.weight) for r in current.routes]
    else:
        weights = [(server, 1.0) for server in pick_servers(record, servers, assigned, copies)]
    return make_entry(record.name, record.digest, record.rank, weights)


def sync_with_registry(table: RoutingTable | None, records: Sequence[AdapterRecord],
                       servers: Sequence[ServerRecord], now: float,
                       copies: Mapping[str, int] | None = None) -> RoutingTable | None:
    """The next table, routing exactly the registry's adapters, or None when the current one does.
    Entries whose digest and rank match their record stay as they are; an adapter no healthy server
    can hold stays out until a placement finds one. `copies`: replicas.min by adapter (default 1)."""
    entries = dict(table.entries) if table else {}
    registered = {r.name for r in records}
    removed = [name for name in entries if name not in registered]
    for name in removed:
        del entries[name]
    return _routed(table, entries, records, servers, now, copies or {}, removed)


def route_records(table: RoutingTable | None, records: Sequence[AdapterRecord], servers: Sequence[ServerRecord],
                  now: float, copies: Mapping[str, int] | None = None) -> RoutingTable | None:
    """The next table with these (new or changed) records routed as `sync_with_registry` routes them,
    every other entry as it is; None when the current one routes them already. The cost is the
    records' and one copy of the entries, whatever the registry holds: a batch of registrations."""
    return _routed(table, dict(table.entries) if table else {}, records, servers, now, copies or {}, [])


def _routed(table: RoutingTable | None, entries: dict[str, TableEntry], records: Sequence[AdapterRecord],
            servers: Sequence[ServerRecord], now: float, copies: Mapping[str, int],
            changed: list[str]) -> RoutingTable | None:
    todo = [r for r in records if (e := entries.get(r.name)) is None or (e.digest, e.rank) != (r.digest, r.rank)]
    if not todo and not changed:
        return None
    assigned = Counter(r.server for e in entries.values() for r in e.routes)
    for record in todo:
        current = entries.get(record.name)
        try:
            entry = _entry(record, current, servers, assigned, copies.get(record.name, 1))
        except NoServerError:
            if current is None:
                continue
            del entries[record.name]  # its servers cannot hold the new rank
        else:
            entries[record.name] = entry
            assigned.update(r.server for r in entry.routes if current is None or r.server not in current.servers)
        changed.append(record.name)
    if not changed:
        return None
    if table is None:
        return RoutingTable(1, now, entries, policy="operator").validate()
    return replace(table, version=table.version + 1, created_at=now, entries=entries).validate()
