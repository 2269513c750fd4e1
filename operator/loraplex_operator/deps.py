"""What the handlers need from the outside world, built once at startup and kept in kopf's `memo`.
Tests build the same object with an in-memory routing store, a manual clock and a recorder of
Kubernetes API calls (the only part that needs a cluster)."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from loraplex.engine.clock import Clock
from loraplex.placement.controller import ControllerReport, PlacementController
from loraplex.placement.operating_points import default_operating_points
from loraplex.placement.policy import make_policy
from loraplex.routing import RoutingStore
from loraplex.spec.crd import AdapterPoolSpec, AdapterSource
from loraplex_operator.config import OperatorConfig
from loraplex_operator.inspect_source import AdapterFacts
from loraplex_operator.kube import EventSink, KubeApi
from loraplex_operator.planner_runner import PlannerRunner
from loraplex_operator.pool_policy import PoolPolicy
from loraplex_operator.replica_bounds import ReplicaBounds


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
    _stores: dict[str, RoutingStore] = field(default_factory=dict)
    _controllers: dict[str, tuple[tuple[str, bool, float], PlacementController]] = field(default_factory=dict)
    _bounds: dict[str, ReplicaBounds] = field(default_factory=dict)  # per pool, as its last tick saw them
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def store(self, pool: str) -> RoutingStore:
        with self._lock:
            if pool not in self._stores:
                self._stores[pool] = self.store_factory(pool)
            return self._stores[pool]

    def place(self, pool: str, spec: AdapterPoolSpec, bounds: ReplicaBounds) -> ControllerReport:
        """Runs the pool's placement once with its LoRADeployments' replica bounds: one publish."""
        with self._lock:
            self._bounds[pool] = bounds
        return self.controller(pool, spec).run_once()

    def _pool_bounds(self, pool: str) -> ReplicaBounds:
        with self._lock:
            return self._bounds.get(pool, ReplicaBounds())

    def controller(self, pool: str, spec: AdapterPoolSpec) -> PlacementController:
        """One controller per pool (it remembers the versions it published); rebuilt when the
        policy, its hysteresis or the kind of server changes."""
        key = (spec.placement.policy, spec.servers.gpus_per_server > 0, spec.placement.hysteresis)
        with self._lock:
            cached = self._controllers.get(pool)
            if cached is not None and cached[0] == key:
                return cached[1]
        policy = make_policy(spec.placement.policy, self.make_random(pool), hysteresis=spec.placement.hysteresis)
        pool_policy = PoolPolicy(policy, lambda: self._pool_bounds(pool).maximum)
        points = default_operating_points("gpu" if key[1] else "cpu")
        controller = PlacementController(self.store(pool), pool_policy, self.clock, spec.placement.interval_seconds,
                                         points, min_replicas=lambda: self._pool_bounds(pool).minimum)
        with self._lock:
            self._controllers[pool] = (key, controller)
        return controller

    def close(self) -> None:
        self.planner.close()
        with self._lock:
            for store in self._stores.values():
                close = getattr(store, "close", None)
                if close is not None:
                    close()
            self._stores.clear()
            self._controllers.clear()
            self._bounds.clear()
