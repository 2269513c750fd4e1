"""The one place that writes a pool's routing table in this operator: the registry sync between
placements (a LoRADeployment added, changed or deleted) and the placement (which also carries the
pool's routing choice, `spec.routing`) take the same lock, so table versions never race each other,
and concurrent syncs are coalesced into one version.

Only servers that may serve count: a fresh heartbeat, and (on Kubernetes) a Ready pod."""

from __future__ import annotations

import threading
from collections.abc import Callable

from loraplex.placement.controller import ControllerReport, PlacementController
from loraplex.pool.bounds import ReplicaBounds
from loraplex.routing import AdapterRecord, RoutingStore, RoutingTable, ServerRecord, StaleVersionError
from loraplex.routing.choice import RoutingChoice
from loraplex.util.clock import Clock
from loraplex_operator.coalesce import Coalescer
from loraplex_operator.table_edits import route_records, sync_with_registry

ControllerKey = tuple[str, bool, float]  # policy, GPU servers, hysteresis
Synced = tuple[RoutingTable | None, list[ServerRecord]]
Edit = Callable[[RoutingTable | None, list[ServerRecord]], RoutingTable | None]  # the next table, or None


class PoolRoutes:
    def __init__(self, store: RoutingStore, clock: Clock) -> None:
        self.store, self.clock = store, clock
        self.ready_pods: frozenset[str] | None = None  # None: not on Kubernetes, heartbeats alone decide
        self.bounds = ReplicaBounds()                 # the pool's LoRADeployments, as the last tick saw them
        self.routing: RoutingChoice | None = None     # the AdapterPool's spec.routing, as the last tick saw it
        self.copies: dict[str, int] = {}              # replicas.min of adapters registered since then
        self._lock = threading.Lock()
        self._sync = Coalescer(self._sync_once)
        self._controller: tuple[ControllerKey, PlacementController] | None = None
        self._known: RoutingTable | None = None  # the last table read or published here

    def current_table(self) -> RoutingTable | None:
        """The pool's table: the one this operator last read or published while it is still the current
        version (a version number costs one small read; decoding the table, all of it)."""
        known = self._known
        if known is not None and self.store.current_version() == known.version:
            return known
        self._known = self.store.read_table()
        return self._known

    def serving(self, servers: list[ServerRecord]) -> list[ServerRecord]:
        if self.ready_pods is None:
            return servers
        return [s for s in servers if s.id in self.ready_pods]

    def sync(self) -> Synced:
        """Brings the table in line with the registry; returns (table, serving servers) as of a sync
        that started after this call."""
        return self._sync()

    def route(self, records: list[AdapterRecord]) -> Synced:
        """Routes these just registered records (a batch of registrations) without reading the rest of
        the registry; returns (table, serving servers). The tick's `sync` catches up on anything else."""
        def edit(table: RoutingTable | None, servers: list[ServerRecord]) -> RoutingTable | None:
            return route_records(table, records, servers, self.clock.now(), {**self.bounds.minimum, **self.copies})
        return self._edit(edit)

    def _sync_once(self) -> Synced:
        def edit(table: RoutingTable | None, servers: list[ServerRecord]) -> RoutingTable | None:
            copies = {**self.bounds.minimum, **self.copies}
            return sync_with_registry(table, self.store.adapters(), servers, self.clock.now(), copies)
        return self._edit(edit)

    def _edit(self, edit: Edit) -> Synced:
        with self._lock:
            for _ in range(2):
                servers = self.serving(self.store.healthy_servers())
                table = self.current_table()
                new = edit(table, servers)
                if new is None:
                    return table, servers
                try:
                    self.store.publish_table(new)
                    self._known = new
                    return new, servers
                except StaleVersionError:
                    continue  # another writer (a peer taking over) published: edit its table
            raise StaleVersionError("another writer kept publishing the pool's table")

    def place(self, key: ControllerKey, build: Callable[[], PlacementController]) -> ControllerReport:
        with self._lock:
            return self.controller(key, build).run_once()

    def controller(self, key: ControllerKey, build: Callable[[], PlacementController]) -> PlacementController:
        """The pool's placement controller (it remembers the versions it published); rebuilt when
        the policy, its hysteresis or the kind of server changes."""
        if self._controller is None or self._controller[0] != key:
            self._controller = (key, build())
        return self._controller[1]

