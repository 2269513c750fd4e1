"""AdapterPool: apply its objects, and the periodic tick (placement when due, autoscaling, statuses).

Kopf-free; the handlers pass in the spec, the previous status, the pool's LoRADeployments (from a
kopf index) and the Deps."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.placement.snapshot import PlacementError
from loraplex.routing import DEFAULT_WINDOWS, RoutingStore, RoutingTable, StoreUnavailableError
from loraplex.spec.crd import (
    API_VERSION,
    AdapterPoolSpec,
    AdapterPoolStatus,
    Condition,
    LoRADeploymentSpec,
    LoRADeploymentStatus,
)
from loraplex_operator import names
from loraplex_operator.adapter_status import UNPLACEABLE, AdapterView, Event, adapter_status
from loraplex_operator.deps import Deps
from loraplex_operator.kube import ObjectRef
from loraplex_operator.pool_objects import PoolRef, build_statefulset, pool_objects
from loraplex_operator.pool_policy import MAX_SERVER_LOAD
from loraplex_operator.pool_sizing import planner_sizing, size_with_planner
from loraplex_operator.pool_status import PoolView, parse_time, placement_due, pool_status
from loraplex_operator.replica_bounds import replica_bounds
from loraplex_operator.scaling import ScaleDecision, decide_replicas, short_of_capacity, with_shortfall


@dataclass(frozen=True)
class DeploymentInfo:
    """One LoRADeployment as the pool's tick sees it (the value of the kopf index)."""

    name: str
    uid: str
    generation: int | None
    spec: LoRADeploymentSpec
    status: LoRADeploymentStatus | None


@dataclass(frozen=True)
class TickResult:
    status: AdapterPoolStatus
    replicas: int | None  # the new spec.servers.replicas when the autoscaler moved it, else None
    events: list[Event]


def _pool_ref(ref: ObjectRef) -> PoolRef:
    return PoolRef(ref.name, ref.namespace, ref.uid)


def apply_pool(ref: ObjectRef, spec: AdapterPoolSpec, deps: Deps) -> int:
    """Creates or updates everything the pool owns; returns the replicas asked of the StatefulSet."""
    replicas = spec.servers.desired_replicas
    for obj in pool_objects(_pool_ref(ref), spec, deps.config, replicas):
        deps.kube.apply(obj)
    return replicas


def _ready_replicas(ref: ObjectRef, deps: Deps) -> int:
    sts = deps.kube.get("apps/v1", "StatefulSet", ref.namespace, names.statefulset_name(ref.name))
    return int(((sts or {}).get("status") or {}).get("readyReplicas") or 0)


@dataclass(frozen=True)
class Findings:
    """What the pool's placement says; kept in the pool status between placements."""

    required: int | None                 # servers needed (None: no estimate yet)
    overloaded: tuple[str, ...] = ()     # servers loaded beyond the policy's balanced share
    max_server_load: float | None = None  # the busiest server's forecast load, in servers
    unplaceable: frozenset[str] | None = None  # adapters no server holds; None: no placement this tick

    @property
    def placed(self) -> bool:
        return self.unplaceable is not None

    def required_with_shortfall(self, healthy_servers: int) -> int | None:
        """The estimate; a placement of this tick that found the pool short of capacity asks for one
        server more than the healthy ones (counted once: the status keeps the raised number)."""
        if not self.placed:
            return self.required
        return with_shortfall(self.required, short_of_capacity(self.overloaded, self.max_server_load),
                              healthy_servers)


def _place(pool: str, spec: AdapterPoolSpec, deployments: Sequence[DeploymentInfo], deps: Deps) -> Findings:
    """Runs the placement with the LoRADeployments' replica bounds: at most one new table version."""
    bounds = replica_bounds((d.name, d.spec.replicas) for d in deployments)
    report = deps.place(pool, spec, bounds)
    if report.outcome not in ("published", "unchanged"):  # no servers or no adapters: nothing to say
        return Findings(None, (), None, frozenset())
    busiest = report.placement.stats.get(MAX_SERVER_LOAD) if report.placement else None
    return Findings(report.required_servers, report.overloaded, busiest, frozenset(report.unplaceable))


def _previous_findings(previous: AdapterPoolStatus | None) -> Findings:
    if previous is None:
        return Findings(None)
    return Findings(previous.required_servers, tuple(previous.overloaded_servers), previous.max_server_load)


def _scale(spec: AdapterPoolSpec, required: int | None, previous: AdapterPoolStatus | None, now: float) -> ScaleDecision:
    current = spec.servers.desired_replicas
    below = parse_time(previous.below_since) if previous else None
    if not spec.placement.autoscale:
        return ScaleDecision(current, None)
    return decide_replicas(current, required, spec.servers.min_replicas, spec.servers.max_replicas, below, now,
                           spec.placement.scale_down_delay_seconds)


def _unplaceable(d: DeploymentInfo, unplaceable: frozenset[str] | None) -> bool:
    """As the placement of this tick says; between placements, as the last one said."""
    if unplaceable is not None:
        return d.name in unplaceable
    return d.status is not None and d.status.reason == UNPLACEABLE


def _refresh_deployments(ref: ObjectRef, deployments: Sequence[DeploymentInfo], store: RoutingStore,
                         table: RoutingTable | None, unplaceable: frozenset[str] | None, deps: Deps) -> None:
    """Rewrites the status of the pool's LoRADeployments that may have changed: all of them after a
    placement, otherwise those not Ready yet or behind the current routing version. A Failed status
    of the current generation stays until the spec changes, except the placement's own (no server
    holds the rank), which clears once a placement places the adapter."""
    placed = unplaceable is not None  # a placement ran this tick
    now = deps.clock.now()
    servers = store.healthy_servers()
    demand = store.demand_windows(now, DEFAULT_WINDOWS)
    records = {r.name: r for r in store.adapters()}
    version = table.version if table else None
    for d in deployments:
        prev = d.status
        if prev is not None and prev.phase == "Failed" and prev.reason != UNPLACEABLE \
                and prev.observed_generation == d.generation:
            continue
        if not placed and prev is not None and prev.phase == "Ready" and prev.routing_version == version:
            continue
        view = AdapterView(d.name, ref.name, d.generation, True, records.get(d.name), table, servers,
                           demand.mean_tps(d.name), demand.window_s * DEFAULT_WINDOWS,
                           _unplaceable(d, unplaceable))
        status, events = adapter_status(view, prev, now)
        target = ObjectRef(API_VERSION, "LoRADeployment", ref.namespace, d.name, d.uid)
        if prev is None or status.to_k8s() != prev.to_k8s():
            deps.kube.patch_status(target, status.to_patch())
        for event in events:
            deps.events.post(target, event)


def _tick_events(previous: AdapterPoolStatus | None, status: AdapterPoolStatus, table: RoutingTable | None
                 ) -> list[Event]:
    """RoutingUpdated on a new version; CapacityShortfall when the pool becomes short of capacity."""
    events = []
    if table is not None and previous is not None and previous.routing_version != table.version:
        events.append(Event("Normal", "RoutingUpdated", f"routing version {table.version}: "
                            f"{len(table.entries)} adapters on {len(table.servers())} servers"))
    shortfall = _condition(status, "CapacityShortfall")
    before = _condition(previous, "CapacityShortfall") if previous else None
    if shortfall is not None and shortfall.status == "True" and (before is None or before.status != "True"):
        events.append(Event("Warning", "CapacityShortfall", shortfall.message))
    return events


def _condition(status: AdapterPoolStatus, type_: str) -> Condition | None:
    return next((c for c in status.conditions if c.type == type_), None)


def _planner_floor(deployments: Sequence[DeploymentInfo]) -> int:
    """An adapter with replicas.min N needs N servers, whatever the plan says."""
    return max((d.spec.replicas.min for d in deployments), default=1)


def pool_tick(ref: ObjectRef, generation: int | None, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
              deployments: Sequence[DeploymentInfo], deps: Deps) -> TickResult:
    now = deps.clock.now()
    last = parse_time(previous.last_placement_time) if previous else None
    findings = _previous_findings(previous)
    by_planner = spec.sizing.estimator == "planner"
    table, servers, store_error, events, sizing = None, [], "", [], None
    try:
        store = deps.store(ref.name)
        due = placement_due(previous.last_placement_time if previous else None,
                            spec.placement.interval_seconds, now)
        if by_planner:  # before placing: a failed placement must not hold the plan back
            sizing = size_with_planner(ref.name, spec, previous, _planner_floor(deployments), due, deps)
        if due:
            last, findings = now, _place(ref.name, spec, deployments, deps)
        table, servers = store.read_table(), store.healthy_servers()
        _refresh_deployments(ref, deployments, store, table, findings.unplaceable, deps)
    except StoreUnavailableError as exc:
        store_error = str(exc)
    except PlacementError as exc:
        events.append(Event("Warning", "PlacementFailed", str(exc)))
    if by_planner and sizing is None:  # the store failed first: the last plan stands
        sizing = planner_sizing(None, previous, _planner_floor(deployments))
    if not by_planner:
        deps.planner.forget(ref.name)
    required = sizing.required if sizing else findings.required_with_shortfall(len(servers))
    events += sizing.events if sizing else ()
    decision = _scale(spec, required, previous, now) if not store_error else ScaleDecision(
        spec.servers.desired_replicas, None)
    new_replicas = None
    if decision.replicas != spec.servers.desired_replicas:
        new_replicas = decision.replicas
        deps.kube.apply(build_statefulset(_pool_ref(ref), spec, deps.config, decision.replicas))
        events.append(Event("Normal", decision.reason or "Scaled", f"servers {spec.servers.desired_replicas} -> "
                            f"{decision.replicas} (required {required})"))
    view = PoolView(ref.name, generation, decision.replicas, _ready_replicas(ref, deps), table, servers,
                    required, store_error, findings.overloaded, findings.max_server_load,
                    spec.servers.max_replicas if spec.placement.autoscale else None,
                    sizing.slots if sizing else (), sizing.condition if sizing else None,
                    sizing.invalid if sizing else "")
    status = pool_status(view, previous, last, decision.below_since, now)
    return TickResult(status, new_replicas, events + _tick_events(previous, status, table))
