"""The placement controller: every interval (and at once when servers or adapters change) read
demand, healthy servers, the adapter registry and the last table from a RoutingStore, place, and
publish a new table version if the routes changed. Used by the operator and by `loraplex up`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from loraplex.placement.forecast import Forecaster, ewma
from loraplex.placement.operating_points import OperatingPoints
from loraplex.placement.policy import PlacementPolicy
from loraplex.placement.snapshot import (
    Placement,
    PlacementAdapter,
    PlacementError,
    PlacementInput,
    PlacementServer,
)
from loraplex.routing.choice import RoutingChoice, routing_error
from loraplex.routing.demand import DEFAULT_WINDOWS, DemandWindows
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.store import RoutingStore, StoreUnavailableError
from loraplex.routing.table import RoutingTable
from loraplex.util.clock import Clock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControllerReport:
    """What one run did. `outcome`: "published", "unchanged", "no-servers" or "no-adapters"."""

    outcome: str
    version: int | None                    # the current version after the run
    required_servers: int = 0              # the autoscaling signal (ceil of Σ load)
    unplaceable: tuple[str, ...] = ()
    placement: Placement | None = None
    overloaded: tuple[str, ...] = ()       # servers over the policy's limit: the pool lacks capacity


@dataclass(frozen=True)
class _Observed:
    servers: list[ServerRecord]
    adapters: list[AdapterRecord]
    version: int | None
    routing: RoutingChoice | None = None  # the owner's routing choice (when it names one)

    def fingerprint(self) -> tuple[frozenset[tuple[str, int, int]], frozenset[tuple[str, str, int]],
                                   RoutingChoice | None]:
        return (frozenset((s.id, s.max_rank, s.max_adapters) for s in self.servers),
                frozenset((a.name, a.digest, a.rank) for a in self.adapters), self.routing)


def build_input(servers: Sequence[ServerRecord], adapters: Sequence[AdapterRecord], demand: DemandWindows,
                operating_points: OperatingPoints, previous: RoutingTable | None,
                forecaster: Forecaster = ewma, min_replicas: Mapping[str, int] | None = None) -> PlacementInput:
    """The policy's snapshot: forecast tokens/s from the observed windows; an adapter never observed
    in them uses its declared `expected_tps`. `min_replicas` maps adapter names to their
    LoRADeployment `replicas.min` (default 1)."""
    floors = min_replicas or {}
    placement_adapters = [
        PlacementAdapter(a.name, a.digest, a.rank,
                         forecaster(demand.rates[a.name]) if a.name in demand.rates else a.expected_tps,
                         a.locations, floors.get(a.name, 1))
        for a in adapters]
    placement_servers = [PlacementServer(s.id, s.max_rank, max_adapters=s.max_adapters) for s in servers]
    return PlacementInput(placement_servers, placement_adapters, operating_points, previous)


class PlacementController:
    """`min_replicas`, when given, is called at each placement for {adapter: replicas.min} (the
    operator's view of its LoRADeployments); adapters it leaves out need one server.
    `server_filter`, when given, keeps the heartbeating servers that may serve (the operator keeps
    those whose pod is Ready). `routing`, when given, is called at each placement for the pool's
    routing choice (its AdapterPool's spec.routing), which the table carries to the routers (none
    without it); a choice the routers would refuse is never published: the last table's stays."""

    def __init__(self, store: RoutingStore, policy: PlacementPolicy, clock: Clock, interval_s: float,
                 operating_points: OperatingPoints, windows: int = DEFAULT_WINDOWS,
                 forecaster: Forecaster = ewma, phi_tolerance: float = 1e-3,
                 min_replicas: Callable[[], Mapping[str, int]] | None = None,
                 server_filter: Callable[[list[ServerRecord]], list[ServerRecord]] | None = None,
                 routing: Callable[[], RoutingChoice | None] | None = None) -> None:
        if interval_s <= 0:
            raise ValueError(f"placement interval must be positive, got {interval_s}")
        self.store, self.policy, self.clock = store, policy, clock
        self.interval_s = interval_s
        self.operating_points = operating_points
        self.windows = windows
        self.forecaster = forecaster
        self.phi_tolerance = phi_tolerance
        self.min_replicas = min_replicas
        self.server_filter = server_filter
        self.routing = routing
        self._last_version = 0        # numbering stays monotonic even if the store lost its tables
        self._last_run: float | None = None
        self._last_fingerprint: object = None

    def run_once(self) -> ControllerReport:
        """Place now and publish if the routes changed."""
        return self._place(self._observe())

    def step(self) -> ControllerReport | None:
        """Places when the interval has passed, the set of servers or adapters or the routing choice
        changed, or the store no longer holds the table this controller published (e.g. Redis
        restarted); else None."""
        observed = self._observe()
        now = self.clock.now()
        due = self._last_run is None or now - self._last_run >= self.interval_s
        changed = observed.fingerprint() != self._last_fingerprint
        lost = self._last_version > 0 and observed.version != self._last_version
        return self._place(observed) if due or changed or lost else None

    def run_forever(self, stop: threading.Event, poll_s: float = 1.0) -> None:
        """Calls step() every `poll_s` until `stop` is set; store outages and placement errors are
        logged and retried at the next poll."""
        while not stop.is_set():
            try:
                self.step()
            except StoreUnavailableError as exc:
                log.warning("placement skipped: %s", exc)
            except PlacementError as exc:
                log.error("placement failed: %s", exc)
            stop.wait(poll_s)

    def _observe(self) -> _Observed:
        servers = self.store.healthy_servers()
        if self.server_filter is not None:
            servers = self.server_filter(servers)
        routing = self.routing() if self.routing is not None else None
        return _Observed(servers, self.store.adapters(), self.store.current_version(), routing)

    def _place(self, observed: _Observed) -> ControllerReport:
        now = self.clock.now()
        self._last_run = now
        self._last_fingerprint = observed.fingerprint()
        if not observed.adapters:
            return ControllerReport("no-adapters", observed.version)
        previous = self.store.read_table()
        demand = self.store.demand_windows(now, self.windows)
        inp = build_input(observed.servers, observed.adapters, demand, self.operating_points, previous,
                          self.forecaster, self.min_replicas() if self.min_replicas else None)
        if not observed.servers:  # keep routing to the last table; the estimate still sizes the pool
            return ControllerReport("no-servers", observed.version, required_servers=inp.required_servers())
        placement = self.policy.place(inp)
        if placement.unplaceable:
            log.warning("no healthy server can hold adapters %s", ", ".join(placement.unplaceable))
        if placement.overloaded:
            log.warning("servers %s are overloaded: too few servers can hold the ranks they serve",
                        ", ".join(placement.overloaded))
        version = max(previous.version if previous else 0, self._last_version) + 1
        table = replace(placement.to_table(version, now, inp.adapters), routing=self._routing(observed, previous))
        report = dict(required_servers=placement.required_servers, unplaceable=placement.unplaceable,
                      placement=placement, overloaded=placement.overloaded)
        if previous is not None and table.same_routes(previous, self.phi_tolerance) \
                and table.routing == previous.routing:
            self._last_version = previous.version
            return ControllerReport("unchanged", previous.version, **report)
        self.store.publish_table(table)
        self._last_version = version
        log.info("published routing table v%d for pool %s (%d adapters, %d servers)", version,
                 self.store.pool, len(table.entries), len(table.servers()))
        return ControllerReport("published", version, **report)

    def _routing(self, observed: _Observed, previous: RoutingTable | None) -> RoutingChoice | None:
        if routing_error(observed.routing):
            return previous.routing if previous is not None else None
        return observed.routing
