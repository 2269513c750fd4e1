"""AdapterPool: apply its objects, and the periodic tick (placement when due, autoscaling, statuses).

Kopf-free; the handlers pass in the spec, the previous status, the pool's LoRADeployments (from a
kopf index) and the Deps."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.placement.snapshot import PlacementError
from loraplex.routing import (
    DEFAULT_WINDOWS,
    RoutingStore,
    RoutingTable,
    StaleVersionError,
    StoreUnavailableError,
)
from loraplex.spec.crd import (
    API_VERSION,
    AdapterPoolSpec,
    AdapterPoolStatus,
    LoRADeploymentSpec,
    LoRADeploymentStatus,
)
from loraplex_operator import names
from loraplex_operator.adapter_status import AdapterView, Event, adapter_status
from loraplex_operator.deps import Deps
from loraplex_operator.kube import ObjectRef
from loraplex_operator.pool_objects import PoolRef, build_statefulset, pool_objects
from loraplex_operator.pool_status import PoolView, parse_time, placement_due, pool_status
from loraplex_operator.scaling import ScaleDecision, decide_replicas
from loraplex_operator.table_edits import apply_replica_bounds

log = logging.getLogger(__name__)


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


def _place(pool: str, spec: AdapterPoolSpec, deployments: Sequence[DeploymentInfo], deps: Deps) -> int | None:
    """Runs the placement controller, then enforces per-adapter replica bounds; returns the
    required-server estimate (None when nothing could be placed)."""
    report = deps.controller(pool, spec).run_once()
    if report.outcome not in ("published", "unchanged"):
        return None
    store = deps.store(pool)
    table = store.read_table()
    bounds = {d.name: (d.spec.replicas.min, d.spec.replicas.max) for d in deployments
              if d.spec.replicas.min > 1 or d.spec.replicas.max is not None}
    if table is not None and bounds:
        _publish_bounded(store, table, bounds, deps.clock.now())
    return report.required_servers


def _publish_bounded(store: RoutingStore, table: RoutingTable, bounds: dict[str, tuple[int, int | None]],
                     now: float) -> None:
    bounded = apply_replica_bounds(table, bounds, store.healthy_servers())
    if bounded.same_routes(table):
        return
    try:
        store.publish_table(RoutingTable(table.version + 1, now, bounded.entries, table.policy,
                                         table.required_servers, table.meta))
    except StaleVersionError:
        log.info("pool %s: a newer table was published meanwhile; bounds apply at the next tick", store.pool)


def _scale(spec: AdapterPoolSpec, required: int | None, previous: AdapterPoolStatus | None, now: float) -> ScaleDecision:
    current = spec.servers.desired_replicas
    below = parse_time(previous.below_since) if previous else None
    if not spec.placement.autoscale:
        return ScaleDecision(current, None)
    return decide_replicas(current, required, spec.servers.min_replicas, spec.servers.max_replicas, below, now,
                           spec.placement.scale_down_delay_seconds)


def _refresh_deployments(ref: ObjectRef, deployments: Sequence[DeploymentInfo], store: RoutingStore,
                         table: RoutingTable | None, placed: bool, deps: Deps) -> None:
    """Rewrites the status of the pool's LoRADeployments that may have changed: all of them after a
    placement, otherwise those not Ready yet or behind the current routing version. A Failed status
    of the current generation stays until the spec changes."""
    now = deps.clock.now()
    servers = store.healthy_servers()
    demand = store.demand_windows(now, DEFAULT_WINDOWS)
    records = {r.name: r for r in store.adapters()}
    version = table.version if table else None
    for d in deployments:
        prev = d.status
        if prev is not None and prev.phase == "Failed" and prev.observed_generation == d.generation:
            continue
        if not placed and prev is not None and prev.phase == "Ready" and prev.routing_version == version:
            continue
        view = AdapterView(d.name, ref.name, d.generation, True, records.get(d.name), table, servers,
                           demand.mean_tps(d.name), demand.window_s * DEFAULT_WINDOWS)
        status, events = adapter_status(view, prev, now)
        target = ObjectRef(API_VERSION, "LoRADeployment", ref.namespace, d.name, d.uid)
        if prev is None or status.to_k8s() != prev.to_k8s():
            deps.kube.patch_status(target, status.to_patch())
        for event in events:
            deps.events.post(target, event)


def pool_tick(ref: ObjectRef, generation: int | None, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
              deployments: Sequence[DeploymentInfo], deps: Deps) -> TickResult:
    now = deps.clock.now()
    last = parse_time(previous.last_placement_time) if previous else None
    required = previous.required_servers if previous else None
    table, servers, store_error, events = None, [], "", []
    try:
        store = deps.store(ref.name)
        due = placement_due(previous.last_placement_time if previous else None,
                            spec.placement.interval_seconds, now)
        if due:
            last, required = now, _place(ref.name, spec, deployments, deps)
        table, servers = store.read_table(), store.healthy_servers()
        _refresh_deployments(ref, deployments, store, table, due, deps)
    except StoreUnavailableError as exc:
        store_error = str(exc)
    except PlacementError as exc:
        events.append(Event("Warning", "PlacementFailed", str(exc)))
    decision = _scale(spec, required, previous, now) if not store_error else ScaleDecision(
        spec.servers.desired_replicas, None)
    new_replicas = None
    if decision.replicas != spec.servers.desired_replicas:
        new_replicas = decision.replicas
        deps.kube.apply(build_statefulset(_pool_ref(ref), spec, deps.config, decision.replicas))
        events.append(Event("Normal", decision.reason or "Scaled", f"servers {spec.servers.desired_replicas} -> "
                            f"{decision.replicas} (required {required})"))
    if table is not None and previous is not None and previous.routing_version != table.version:
        events.append(Event("Normal", "RoutingUpdated", f"routing version {table.version}: "
                            f"{len(table.entries)} adapters on {len(table.servers())} servers"))
    view = PoolView(ref.name, generation, decision.replicas, _ready_replicas(ref, deps), table, servers,
                    required, store_error)
    status = pool_status(view, previous, last, decision.below_since, now)
    return TickResult(status, new_replicas, events)
