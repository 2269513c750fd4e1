"""The RoutingStore protocol: everything the router, the agents, the operator and the placement
controller read and write about one pool. Two implementations: `RedisRoutingStore` (redis_store.py,
the only module here that imports redis) and `InMemoryRoutingStore` (memory_store.py, for the
simulator, tests and `loraplex up` without redis-server)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from loraplex.routing.demand import DemandWindows
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.table import RoutingTable


class StoreUnavailableError(RuntimeError):
    """The backing store could not be reached (Redis down or restarting). Callers keep their last
    snapshot and retry; they never need to import redis to catch this."""


class StaleVersionError(RuntimeError):
    """publish_table was given a version that is not newer than the current one (another writer won)."""


class Subscription(Protocol):
    def close(self) -> None: ...


class RoutingStore(Protocol):
    """One pool's shared state. All methods are synchronous and safe to call from several threads;
    any of them may raise StoreUnavailableError."""

    pool: str
    window_s: float  # width of a demand window in seconds

    # routing table
    def publish_table(self, table: RoutingTable) -> None:
        """Validates the table, stores it (in Redis: as a delta over the version before, or as a new
        snapshot), then makes it current and announces it, atomically for readers. Raises
        StaleVersionError if table.version <= the current version, or another writer won a race."""

    def current_version(self) -> int | None:
        """The current version, or None before the first publish. Cheap: poll it."""

    def read_table(self, version: int | None = None) -> RoutingTable | None:
        """The current table (or a given version while the store can still rebuild it); None if there
        is none. Readers that want the newest table call it without a version."""

    def watch_versions(self, callback: Callable[[int], None]) -> Subscription:
        """Calls `callback(version)` (from another thread) for each announced version until closed.
        Announcements can be lost (e.g. Redis restarts): readers must also poll current_version."""

    # server registry
    def register_server(self, record: ServerRecord, ttl_s: float) -> None:
        """Registration and heartbeat are the same call: writes the record and renews its TTL."""

    def deregister_server(self, server_id: str) -> None: ...

    def healthy_servers(self) -> list[ServerRecord]:
        """Servers whose last heartbeat has not expired, sorted by id."""

    # adapter registry
    def put_adapter(self, record: AdapterRecord) -> None:
        """Creates or replaces an adapter record (its locations are kept)."""

    def remove_adapter(self, name: str) -> None:
        """Removes the record and its locations."""

    def get_adapter(self, name: str) -> AdapterRecord | None: ...

    def adapters(self, names: Collection[str] | None = None) -> list[AdapterRecord]:
        """All adapter records with their locations, sorted by name; with `names`, only the records of
        those of them that exist (one round trip, whatever the size of the registry)."""

    def add_location(self, adapter: str, server_id: str) -> None:
        """Records that `server_id` now holds `adapter` in host memory."""

    def remove_location(self, adapter: str, server_id: str) -> bool:
        """Forgets that `server_id` holds `adapter`, unless it is the adapter's last known location:
        returns False (and changes nothing) in that case, so the last copy is never deleted."""

    def clear(self) -> None:
        """Removes everything of the pool (its AdapterPool was deleted)."""

    # demand
    def add_demand(self, tokens: Mapping[str, int], now: float) -> None:
        """Adds token counts per adapter to the window containing `now` (wall-clock seconds)."""

    def demand_windows(self, now: float, count: int) -> DemandWindows:
        """Tokens/s per adapter in the last `count` complete windows before `now`, oldest first."""
