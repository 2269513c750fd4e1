"""An in-process RoutingStore with the same semantics as the Redis one: table versions made current
atomically, heartbeat records that expire on the injected clock, demand windows. It serves the
simulator, unit tests and `loraplex up` when no redis-server is installed."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

from loraplex.routing.demand import DEFAULT_WINDOW_S, DemandWindows, bucket_of, complete_buckets
from loraplex.routing.keys import validate_pool_name
from loraplex.routing.records import AdapterRecord, ServerRecord, validate_server_id
from loraplex.routing.store import StaleVersionError
from loraplex.routing.table import RoutingTable
from loraplex.util.clock import Clock

MAX_DEMAND_BUCKETS = 1000


class _Callbacks:
    def __init__(self, owner: set[Callable[[int], None]], callback: Callable[[int], None]) -> None:
        self._owner, self._callback = owner, callback

    def close(self) -> None:
        self._owner.discard(self._callback)


class InMemoryRoutingStore:
    """`clock` decides heartbeat expiry (seconds, same scale as the TTLs). Tables are kept for
    `retain_versions` versions. Callbacks of watch_versions run synchronously in publish_table."""

    def __init__(self, pool: str, clock: Clock, window_s: float = DEFAULT_WINDOW_S, retain_versions: int = 16) -> None:
        self.pool = validate_pool_name(pool)
        self.window_s = window_s
        self._clock = clock
        self._retain = retain_versions
        self._lock = threading.Lock()
        self._tables: dict[int, RoutingTable] = {}
        self._current: int | None = None
        self._watchers: set[Callable[[int], None]] = set()
        self._servers: dict[str, tuple[ServerRecord, float]] = {}  # id -> (record, expires_at)
        self._adapters: dict[str, AdapterRecord] = {}
        self._locations: dict[str, set[str]] = {}
        self._demand: dict[int, dict[str, int]] = {}

    # routing table
    def publish_table(self, table: RoutingTable) -> None:
        table.validate()
        with self._lock:
            if self._current is not None and table.version <= self._current:
                raise StaleVersionError(f"version {table.version} is not newer than current {self._current}")
            self._tables[table.version] = table
            self._current = table.version
            for old in [v for v in self._tables if v <= table.version - self._retain]:
                del self._tables[old]
            watchers = list(self._watchers)
        for callback in watchers:
            callback(table.version)

    def current_version(self) -> int | None:
        return self._current

    def read_table(self, version: int | None = None) -> RoutingTable | None:
        with self._lock:
            return self._tables.get(self._current if version is None else version)

    def watch_versions(self, callback: Callable[[int], None]) -> _Callbacks:
        with self._lock:
            self._watchers.add(callback)
        return _Callbacks(self._watchers, callback)

    # server registry
    def register_server(self, record: ServerRecord, ttl_s: float) -> None:
        record.validate()
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl must be positive, got {ttl_s}")
        with self._lock:
            self._servers[record.id] = (record, self._clock.now() + ttl_s)

    def deregister_server(self, server_id: str) -> None:
        with self._lock:
            self._servers.pop(server_id, None)

    def healthy_servers(self) -> list[ServerRecord]:
        now = self._clock.now()
        with self._lock:
            for sid in [sid for sid, (_, expires) in self._servers.items() if expires <= now]:
                del self._servers[sid]
            return [rec for _, (rec, _) in sorted(self._servers.items())]

    # adapter registry
    def put_adapter(self, record: AdapterRecord) -> None:
        record.validate()
        with self._lock:
            self._adapters[record.name] = replace(record, locations=frozenset())

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self._adapters.pop(name, None)
            self._locations.pop(name, None)

    def get_adapter(self, name: str) -> AdapterRecord | None:
        with self._lock:
            record = self._adapters.get(name)
            return replace(record, locations=frozenset(self._locations.get(name, ()))) if record else None

    def adapters(self, names: Collection[str] | None = None) -> list[AdapterRecord]:
        with self._lock:
            wanted = sorted(self._adapters if names is None else set(names) & self._adapters.keys())
            return [replace(self._adapters[name], locations=frozenset(self._locations.get(name, ())))
                    for name in wanted]

    def add_location(self, adapter: str, server_id: str) -> None:
        validate_server_id(server_id)
        with self._lock:
            self._locations.setdefault(adapter, set()).add(server_id)

    def remove_location(self, adapter: str, server_id: str) -> bool:
        with self._lock:
            holders = self._locations.get(adapter, set())
            if server_id not in holders:
                return True
            if len(holders) == 1:
                return False
            holders.discard(server_id)
            return True

    def clear(self) -> None:
        with self._lock:
            self._tables.clear()
            self._current = None
            self._servers.clear()
            self._adapters.clear()
            self._locations.clear()
            self._demand.clear()

    # demand
    def add_demand(self, tokens: Mapping[str, int], now: float) -> None:
        bucket = bucket_of(now, self.window_s)
        with self._lock:
            counts = self._demand.setdefault(bucket, {})
            for name, n in tokens.items():
                counts[name] = counts.get(name, 0) + int(n)
            for old in [b for b in self._demand if b < bucket - MAX_DEMAND_BUCKETS]:
                del self._demand[old]

    def demand_windows(self, now: float, count: int) -> DemandWindows:
        buckets = complete_buckets(now, self.window_s, count)
        with self._lock:
            counts = [dict(self._demand.get(b, {})) for b in buckets]
        return DemandWindows.from_counts(self.window_s, counts)
