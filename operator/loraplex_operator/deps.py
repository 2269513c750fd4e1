"""What the handlers need from the outside world, built once at startup and kept in kopf's `memo`.
Tests build the same object with an in-memory routing store, a manual clock and a recorder of
Kubernetes API calls (the only part that needs a cluster)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from loraplex.placement.controller import ControllerReport, PlacementController
from loraplex.pool import AdapterFacts, build_controller
from loraplex.pool.bounds import ReplicaBounds
from loraplex.routing import RoutingStore
from loraplex.spec.crd import AdapterPoolSpec, AdapterSource
from loraplex.util.clock import Clock
from loraplex_operator.config import OperatorConfig
from loraplex_operator.kube import EventSink, KubeApi
from loraplex_operator.planner_runner import PlannerRunner
from loraplex_operator.pool_routes import ControllerKey, PoolRoutes
from loraplex_operator.throttle import Throttle


class Inspector(Protocol):
    """Learns an adapter's digest and rank (inspect_source.SourceInspector in production)."""

    def inspect(self, adapter: AdapterSource, credentials: Mapping[str, str]) -> AdapterFacts: ...


@dataclass
class Deps:
    config: OperatorConfig
    kube: KubeApi
    events: EventSink
    clock: Clock                                  # wall-clock seconds (demand windows are wall time)
    store_factory: Callable[[str], RoutingStore]  # pool name -> its routing store
    inspector: Inspector
    # The `random` policy's source, seeded per pool so a restarted operator places the same way.
    make_random: Callable[[str], random.Random] = field(default=lambda pool: random.Random(pool))
    planner: PlannerRunner = field(default_factory=PlannerRunner)  # pools sized by the planner
    # The rate of the operator's API requests, shared by `kube` and kopf's own session.
    throttle: Throttle = field(default_factory=lambda: Throttle(0, 1))
    # The last status this operator wrote per object uid: an unchanged status is not written again.
    written: dict[str, dict[str, Any]] = field(default_factory=dict)
    # What the pool tick last refreshed each adapter's status from (object version and inputs).
    refreshed: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    # Pools whose objects the API server refused at the last apply: (reason, message) for their status.
    apply_failures: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Per pool, the queue of registrations its LoRADeployments' handlers await (made by handlers.py;
    # here because kopf gives each object a copy of `memo`, and one queue must serve them all).
    registrations: dict[str, Any] = field(default_factory=dict)
    # Per pool, when its last tick ran and when its last batch of registrations did (clock time).
    ticked: dict[str, float] = field(default_factory=dict)
    registered: dict[str, float] = field(default_factory=dict)
    _stores: dict[str, RoutingStore] = field(default_factory=dict)
    _routes: dict[str, PoolRoutes] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self, pool: str) -> RoutingStore:
        with self._lock:
            if pool not in self._stores:
                self._stores[pool] = self.store_factory(pool)
            return self._stores[pool]

    def routes(self, pool: str) -> PoolRoutes:
        store = self.store(pool)
        with self._lock:
            if pool not in self._routes:
                self._routes[pool] = PoolRoutes(store, self.clock)
            return self._routes[pool]

    def place(self, pool: str, spec: AdapterPoolSpec, bounds: ReplicaBounds) -> ControllerReport:
        """Runs the pool's placement once with its LoRADeployments' replica bounds: one publish."""
        routes = self.routes(pool)
        routes.bounds = bounds
        return routes.place(_controller_key(spec), lambda: self._build_controller(routes, spec))

    def controller(self, pool: str, spec: AdapterPoolSpec) -> PlacementController:
        routes = self.routes(pool)
        return routes.controller(_controller_key(spec), lambda: self._build_controller(routes, spec))

    def _build_controller(self, routes: PoolRoutes, spec: AdapterPoolSpec) -> PlacementController:
        return build_controller(routes.store, spec.placement, self.clock, self.make_random(routes.store.pool),
                                lambda: routes.bounds, lambda: routes.routing,
                                gpu=spec.servers.gpus_per_server > 0, server_filter=routes.serving)

    def forget(self, pool: str) -> None:
        """Drops what this operator keeps for a deleted pool. Its store is not closed here: handlers of
        the pool's adapters may still be using it (closing it under them broke their Redis reads), and
        its connections close when the last of them lets it go."""
        self.planner.forget(pool)
        with self._lock:
            self._routes.pop(pool, None)
            self._stores.pop(pool, None)

    def close(self) -> None:
        self.planner.close()
        with self._lock:
            for store in self._stores.values():
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            self._stores.clear()
            self._routes.clear()


def _controller_key(spec: AdapterPoolSpec) -> ControllerKey:
    return spec.placement.policy, spec.servers.gpus_per_server > 0, spec.placement.hysteresis
