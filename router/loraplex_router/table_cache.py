"""Keeps the router's snapshot of the pool fresh, in a background thread.

The routing table is re-read when a new version is announced on pub/sub or seen by polling (a lost
announcement only delays the swap by one poll); the store applies the deltas since the last read, so
a change of one adapter costs a read of one small delta, and the registry records of the adapters it
added, dropped or re-versioned are read with it (the whole registry is re-read every `adapters_every_s`). Live servers are re-read every poll, because
heartbeats expire silently; each read also notes when every server's heartbeat was first seen, so
the proxy can tell a server whose heartbeat is late (`Snapshot.heartbeat_late`). A server the proxy
found silent (late heartbeat, requests unanswered) is dropped from the server registry at once
(`drop_server`) instead of when its TTL runs out, so that placement and the agents' peer fetches stop
counting on it too; its next heartbeat registers it again. Every store error is swallowed after
counting it: the router goes on routing with its last snapshot until the store is back. The store is
synchronous, so all of this runs off the event loop and a hanging Redis never stalls a request.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from loraplex.routing.records import AdapterRecord
from loraplex.routing.store import RoutingStore, StoreUnavailableError, Subscription
from loraplex.routing.table import RoutingTable
from loraplex_router.demand import DemandCounter
from loraplex_router.metrics import RouterMetrics
from loraplex_router.snapshot import BATCH_MAX_AGE_S, Snapshot, track_heartbeats

log = logging.getLogger("loraplex.router")
CHANGED_AT_ONCE = 64  # a table re-versioning up to this many adapters (or a quarter) reads only their records


class TableCache:
    def __init__(self, store: RoutingStore, metrics: RouterMetrics, demand: DemandCounter,
                 base_model: str | None = None, poll_interval_s: float = 1.0,
                 adapters_every_s: float = 5.0, clock: Callable[[], float] = time.time,
                 batch_max_age_s: float = BATCH_MAX_AGE_S,
                 on_table: Callable[[RoutingTable | None], None] | None = None) -> None:
        """`batch_max_age_s`: servers' live batches from heartbeats older than this are not used.
        `on_table` is given the snapshot's table after every read (the router's profile follows it)."""
        self.store = store
        self.metrics = metrics
        self.demand = demand
        self.base_model = base_model
        self.poll_interval_s = poll_interval_s
        self.adapters_every_s = adapters_every_s
        self.clock = clock
        self.batch_max_age_s = batch_max_age_s
        self.on_table = on_table
        self.snapshot = Snapshot(None, {}, {}, base_model, taken_at=0.0, batch_max_age_s=batch_max_age_s,
                                 poll_interval_s=poll_interval_s)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._subscription: Subscription | None = None
        self._adapters_read_at = 0.0
        self._thread = threading.Thread(target=self._run, name="loraplex-table-cache", daemon=True)

    def start(self) -> None:
        self.refresh()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._close_subscription()
        self._flush_demand()

    def refresh(self) -> bool:
        """Reads the store once; True when the snapshot is now current."""
        try:
            self._ensure_subscription()
            self.snapshot = self._read(self.snapshot)
        except StoreUnavailableError as exc:
            self._store_failed(exc)
            return False
        self.metrics.table_version.set(self.snapshot.version)
        self.metrics.servers.set(len(self.snapshot.servers))
        if self.on_table is not None:
            self.on_table(self.snapshot.table)
        return True

    def drop_server(self, server_id: str, heartbeat_at: float, tries: int = 3) -> bool:
        """Removes the server from the registry unless it has heartbeat since `heartbeat_at`: what its
        TTL would do a few seconds later. True if it did. Blocking (call it off the event loop); a store
        error is tried again (`tries` in all), then left to the TTL. The routing table is the
        placement's, so it is left alone; placement re-places without the server, and the server's next
        heartbeat registers it again."""
        for attempt in range(tries):
            try:
                return self._drop(server_id, heartbeat_at)
            except StoreUnavailableError as exc:
                self.metrics.store_errors.inc()
                log.debug("dropping server %s failed (%d of %d): %s", server_id, attempt + 1, tries, exc)
                time.sleep(0.1)
        return False

    def _drop(self, server_id: str, heartbeat_at: float) -> bool:
        record = next((s for s in self.store.healthy_servers() if s.id == server_id), None)
        if record is None or record.heartbeat_at != heartbeat_at:  # gone already, or it heartbeat since
            return False
        self.store.deregister_server(server_id)
        self.metrics.servers_dropped.labels(server_id).inc()
        log.warning("dropped server %s from the registry: its heartbeat is late and it left requests "
                    "unanswered", server_id)
        self._wake.set()  # read the registry again now
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.poll_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.refresh()
            self._flush_demand()
            self.metrics.snapshot_age.set(max(0.0, self.clock() - self.snapshot.taken_at))

    def _read(self, old: Snapshot) -> Snapshot:
        now = self.clock()
        version = self.store.current_version()
        if version is None and old.table is not None:
            # The store lost its state (Redis restarted): its registries are refilling. Keep routing
            # on the whole last snapshot until a table is published again.
            return replace(old, taken_at=now)
        table = old.table
        if version is not None:  # one round trip: the store's table (the same object while unchanged),
            table = self.store.read_table() or old.table  # with the deltas since its last read applied
        adapters = self._read_adapters(old, table, now)
        servers = {s.id: s for s in self.store.healthy_servers()}
        base = self.base_model or _base_model_of(servers.values()) or old.base_model
        return Snapshot(table, servers, adapters, base, taken_at=now, batch_max_age_s=self.batch_max_age_s,
                        heartbeats=track_heartbeats(old.heartbeats, servers, now), servers_read_at=now,
                        poll_interval_s=self.poll_interval_s)

    def _read_adapters(self, old: Snapshot, table: RoutingTable | None, now: float) -> Mapping[str, AdapterRecord]:
        """The whole registry every `adapters_every_s`; in between, on a new table, the records of the
        adapters it added, dropped or re-versioned (one small read, none for a re-placement)."""
        changed = _changed_adapters(old.table, table)
        if changed is None or now - self._adapters_read_at >= self.adapters_every_s:
            self._adapters_read_at = now
            return {a.name: a for a in self.store.adapters()}
        if not changed:
            return old.adapters
        adapters = {name: a for name, a in old.adapters.items() if name not in changed}
        adapters.update((a.name, a) for a in self.store.adapters(changed))
        return adapters

    def _ensure_subscription(self) -> None:
        if self._subscription is None:
            self._subscription = self.store.watch_versions(lambda version: self._wake.set())

    def _close_subscription(self) -> None:
        if self._subscription is not None:
            try:
                self._subscription.close()
            except Exception:  # closing a broken connection must not stop the router
                log.debug("closing the version subscription failed", exc_info=True)
            self._subscription = None

    def _store_failed(self, exc: Exception) -> None:
        self.metrics.store_errors.inc()
        log.warning("routing store unavailable, serving from the last snapshot (version %s): %s",
                    self.snapshot.version, exc)
        # The subscription may be dead (e.g. Redis restarted); subscribe again once the store is back.
        self._close_subscription()

    def _flush_demand(self) -> None:
        try:
            self.demand.flush(lambda tokens: self.store.add_demand(tokens, self.clock()))
        except StoreUnavailableError as exc:
            self.metrics.store_errors.inc()
            log.debug("demand flush failed, keeping the counts: %s", exc)


def _changed_adapters(old: RoutingTable | None, new: RoutingTable | None) -> set[str] | None:
    """The adapters added, dropped or re-versioned (digest or rank) between two tables: those whose
    registry records may have changed (a re-placement only moves routes). None when there is no old
    table to compare with, or when so many changed that reading the whole registry is as cheap."""
    if old is new:
        return set()
    if old is None or new is None:
        return None
    # a table built from the last one by a delta shares its unchanged entries: `is` decides most
    changed = {name for name, entry in new.entries.items()
               if (was := old.entries.get(name)) is not entry
               and (was is None or (was.digest, was.rank) != (entry.digest, entry.rank))}
    changed.update(name for name in old.entries if name not in new.entries)
    return changed if len(changed) <= max(CHANGED_AT_ONCE, len(new.entries) // 4) else None


def _base_model_of(servers) -> str | None:
    names = sorted({s.base_model for s in servers if s.base_model})
    return names[0] if names else None
