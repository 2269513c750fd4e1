"""AdapterPool: apply its objects, and the periodic tick (placement when due, autoscaling, statuses).

Kopf-free; the handlers pass in the spec, the previous status, the pool's LoRADeployments (from a
kopf index) and the Deps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from loraplex.placement.snapshot import PlacementError
from loraplex.pool import MAX_SERVER_LOAD, replica_bounds, routing_pending, spec_failure
from loraplex.pool.records import reported_invocations, with_reported_invocation
from loraplex.routing import (
    DEFAULT_WINDOWS,
    AdapterRecord,
    DemandWindows,
    RoutingStore,
    RoutingTable,
    ServerRecord,
    StaleVersionError,
    StoreUnavailableError,
)
from loraplex.routing.choice import pool_routing
from loraplex.spec.crd import (
    API_VERSION,
    AdapterPoolSpec,
    AdapterPoolStatus,
    Condition,
    LoRADeploymentSpec,
    LoRADeploymentStatus,
)
from loraplex_operator.adapter_reconcile import Registration, adapter_view, rank_too_large, register_adapters
from loraplex_operator.adapter_status import (
    HEALING_REASONS,
    RANK_TOO_LARGE,
    TICK_REASONS,
    AdapterView,
    Event,
    adapter_status,
    blocked_status,
)
from loraplex_operator.deps import Deps
from loraplex_operator.kube import KubeError, ObjectRef
from loraplex_operator.pool_objects import (
    PoolRef,
    build_statefulset,
    config_hash,
    pool_objects,
)
from loraplex_operator.pool_sizing import INVALID_SIZING, Sizing, planner_sizing, size_with_planner
from loraplex_operator.pool_status import PoolView, parse_time, placement_due, pool_status
from loraplex_operator.scaling import ScaleDecision, decide_replicas, short_of_capacity, with_shortfall
from loraplex_operator.status_writes import StatusWrite, write_statuses


@dataclass(frozen=True)
class DeploymentInfo:
    """One LoRADeployment as the pool's tick sees it (the value of the kopf index)."""

    name: str
    uid: str
    generation: int | None
    spec: LoRADeploymentSpec
    status: LoRADeploymentStatus | None
    resource_version: str = ""  # changes with every write of the object


@dataclass(frozen=True)
class TickResult:
    status: AdapterPoolStatus
    replicas: int | None  # the new spec.servers.replicas when the autoscaler moved it, else None
    events: list[Event]


# Adapters re-registered by one tick at most (each may read its source): a pool whose registry was
# lost (Redis restarted empty) or whose maxLoraRank was raised recovers over a few ticks, and a tick
# stays short.
MAX_REREGISTER_PER_TICK = 32
APPLY_FAILED = "ApplyFailed"  # the API server refused one of the pool's objects
# Status reasons after which the tick registers the adapter again (the handler does not run again).
_REREGISTER = frozenset({"PoolNotFound", RANK_TOO_LARGE})  # besides a TICK_REASONS status that lost its record


def _pool_ref(ref: ObjectRef) -> PoolRef:
    return PoolRef(ref.name, ref.namespace, ref.uid)


class InvalidPool(Exception):
    """The pool's objects cannot be made as the spec is written (or the API server refused them)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def apply_pool(ref: ObjectRef, spec: AdapterPoolSpec, deps: Deps, applied_hash: str = "") -> tuple[int, str]:
    """Creates or updates everything the pool owns, unless `applied_hash` says exactly these objects
    were applied already (an operator restart resumes every pool); returns the replicas asked of the
    StatefulSet and the objects' digest. Raises InvalidPool, before applying anything, when the spec
    cannot be served, or with the API server's answer when it refuses an object."""
    reason, message = spec_failure(spec)
    if reason:
        raise InvalidPool(reason, message)
    replicas = spec.servers.desired_replicas
    objects = pool_objects(_pool_ref(ref), spec, deps.config, replicas)
    digest = config_hash(objects)
    if digest == applied_hash and ref.name not in deps.apply_failures:
        return replicas, digest
    for obj in objects:
        try:
            deps.kube.apply(obj)
        except KubeError as exc:
            failure = (APPLY_FAILED, f"{obj['kind']} {obj['metadata']['name']}: {exc.message}")
            deps.apply_failures[ref.name] = failure
            raise InvalidPool(*failure) from exc
    deps.apply_failures.pop(ref.name, None)
    return replicas, digest


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
    if report.outcome == "no-adapters":
        return Findings(0, (), None, frozenset())
    if report.outcome == "no-servers":  # the estimate alone: nothing was placed
        return Findings(report.required_servers, (), None, frozenset())
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


def _handled(d: DeploymentInfo) -> bool:
    """Its handler registered (or refused) this generation: the tick may take over its status."""
    return d.status is not None and d.status.observed_generation == d.generation


def _prune_registry(spec: AdapterPoolSpec, deployments: Sequence[DeploymentInfo], records: Mapping[str, AdapterRecord],
                    deps: Deps, store: RoutingStore) -> list[str]:
    """Takes out of the registry what must not be placed: adapters whose LoRADeployment is gone (deleted
    while no operator ran), whose generation Failed, or whose rank the pool no longer accepts (their
    status turns Failed/RankTooLarge in `_refresh_deployments`). Returns the removed names."""
    by_name = {d.name: d for d in deployments}
    removed = []
    for name, record in records.items():
        d = by_name.get(name)
        failed = d is not None and _handled(d) and d.status is not None and d.status.phase == "Failed" \
            and d.status.reason not in HEALING_REASONS
        if d is None or failed or rank_too_large(record.rank, spec):
            store.remove_adapter(name)
            removed.append(name)
    return removed


def _reregister(ref: ObjectRef, pool: AdapterPoolSpec, deployments: Sequence[DeploymentInfo],
                records: Mapping[str, AdapterRecord], deps: Deps) -> int:
    """Registers again the adapters that wait for the pool rather than for their own spec: their
    pool came back, its max rank now holds them, or the registry lost them. Returns how many."""
    due = [d for d in deployments if _handled(d) and d.name not in records and d.status is not None
           and (d.status.reason in _REREGISTER or d.status.reason in TICK_REASONS)
           and not (d.status.reason == RANK_TOO_LARGE and rank_too_large(d.status.rank or 0, pool))]
    batch = [Registration(ObjectRef(API_VERSION, "LoRADeployment", ref.namespace, d.name, d.uid), d.generation,
                          d.spec, d.status, pool) for d in due[:MAX_REREGISTER_PER_TICK]]
    writes = [StatusWrite(r.ref, r.previous, *done.outcome)
              for r, done in zip(batch, register_adapters(ref.name, batch, deps), strict=True)]
    write_statuses(deps, writes)
    return len(writes)


def _learn_invocations(records: Mapping[str, AdapterRecord], servers: Sequence[ServerRecord],
                       store: RoutingStore) -> Mapping[str, AdapterRecord]:
    """The records, with the invocation the servers read from an activated LoRA whose source the operator
    cannot read (file://, s3://, gs://: registered from the declared sha256 and rank) written in."""
    reported = reported_invocations(servers)
    if not reported:
        return records
    learned = {name: with_reported_invocation(record, reported) for name, record in records.items()}
    for name, record in learned.items():
        if record is not records[name]:
            store.put_adapter(record)
    return learned


def _refused(servers: Sequence[ServerRecord]) -> dict[str, tuple[tuple[str, str, str], ...]]:
    """adapter -> (server, digest, why) of each refusal to load it the servers report."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for s in servers:
        for name, digest, why in s.refused:
            found.setdefault(name, []).append((s.id, digest, why))
    return {name: tuple(rows) for name, rows in found.items()}


def _holders(servers: Sequence[ServerRecord]) -> dict[str, frozenset[str]]:
    """adapter -> the serving servers that hold it (in GPU or host memory)."""
    held: dict[str, set[str]] = {}
    for s in servers:
        for name in (*s.host_adapters, *s.gpu_adapters):
            held.setdefault(name, set()).add(s.id)
    return {name: frozenset(ids) for name, ids in held.items()}


def _observed(d: DeploymentInfo, demand: DemandWindows | None) -> tuple[float | None, float]:
    """(tokens/s, window) for the status, or (None, 0) for no news: the demand counts for an adapter
    the routers counted in the windows just read, and drops to 0 once they stop counting it; one
    never counted keeps no observedDemand (no write of a zero for every adapter of the pool)."""
    if demand is None:
        return None, 0.0
    window = demand.window_s * DEFAULT_WINDOWS
    if d.name in demand.rates:
        return demand.mean_tps(d.name), window
    seen = d.status.observed_demand if d.status else None
    return (0.0, window) if seen is not None and seen.tokens_per_second > 0 else (None, 0.0)


def _refresh_deployments(ref: ObjectRef, spec: AdapterPoolSpec, deployments: Sequence[DeploymentInfo],
                         records: Mapping[str, AdapterRecord], table: RoutingTable | None,
                         servers: Sequence[ServerRecord], demand: DemandWindows | None, deps: Deps) -> None:
    """Rewrites the statuses the tick owns (TICK_REASONS, once the handler registered the generation)
    that changed: placement, serving servers, the demand after a placement, and RankTooLarge when
    the pool's max rank dropped below the adapter's. Every other status is its handler's. An adapter
    whose object and inputs are those of the last tick is skipped without building its status, so
    a tick at rest costs a few dict lookups per adapter."""
    now = deps.clock.now()
    holders, top_rank = _holders(servers), max((s.max_rank for s in servers), default=0)
    refused = _refused(servers)
    writes = []
    for d in deployments:
        prev = d.status
        if prev is None or not _handled(d) or prev.reason not in TICK_REASONS:
            continue
        record = records.get(d.name)
        tps = _observed(d, demand)
        inputs = (d.resource_version, spec.engine.max_lora_rank, record and (record.digest, record.rank),
                  table.entries.get(d.name) if table else None, holders.get(d.name), top_rank, tps,
                  refused.get(d.name))
        if deps.refreshed.get(d.uid) == inputs:
            continue
        deps.refreshed[d.uid] = inputs
        target = ObjectRef(API_VERSION, "LoRADeployment", ref.namespace, d.name, d.uid)
        too_large = rank_too_large(prev.rank or 0, spec)
        if too_large:
            outcome = blocked_status("Failed", RANK_TOO_LARGE, too_large, d.generation, prev, now, prev.rank,
                                     prev.digest)
        else:
            outcome = adapter_status(adapter_view(d.name, d.spec, d.generation, record, table, servers, tps),
                                     prev, now)
        writes.append(StatusWrite(target, prev, *outcome))
    write_statuses(deps, writes)


def _tick_events(previous: AdapterPoolStatus | None, status: AdapterPoolStatus, table: RoutingTable | None
                 ) -> list[Event]:
    """RoutingUpdated on a new version; CapacityShortfall when the pool becomes short of capacity; a
    Warning with the reason when the pool turns Failed (or fails for another reason)."""
    events = []
    ready, before_ready = _condition(status, "Ready"), _condition(previous, "Ready") if previous else None
    if status.phase == "Failed" and ready is not None and (
            previous is None or previous.phase != "Failed" or before_ready is None or before_ready.reason != ready.reason):
        events.append(Event("Warning", ready.reason, ready.message))
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


@dataclass
class _Observed:
    """What one tick found: the pool's table and servers after syncing its registry (and placing, when
    a placement was due), what that placement said, and the plan; a failure of the store or the
    placement leaves the rest as it was when the failure came."""

    findings: Findings
    last_placement: float | None
    table: RoutingTable | None = None
    servers: Sequence[ServerRecord] = ()
    sizing: Sizing | None = None
    records: Mapping[str, AdapterRecord] = field(default_factory=dict)
    demand: DemandWindows | None = None
    store_error: str = ""
    synced: bool = False  # the whole sync ran: the adapters' statuses may be refreshed from it
    events: list[Event] = field(default_factory=list)


@dataclass(frozen=True)
class _Decision:
    required: int | None     # servers the pool needs (None: no estimate yet)
    sizing: Sizing | None    # the planner's, with sizing.estimator planner
    failure: tuple[str, str]  # (reason, message) that makes the pool Failed; ("", "") when none
    scale: ScaleDecision


def tick_due(now: float, last_tick: float | None, last_batch: float | None, tick_s: float) -> bool:
    """Whether the pool's timer (it wakes every second) runs a tick now: every `tick_s`, and every
    wake-up while registrations are recent (within `tick_s`), so that an adapter turns Ready about a
    second after its servers report it, not up to a whole tick later."""
    if last_tick is None or now - last_tick >= tick_s:
        return True
    return last_batch is not None and now - last_batch <= tick_s


def pool_tick(ref: ObjectRef, generation: int | None, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
              deployments: Sequence[DeploymentInfo], ready_pods: frozenset[str], deps: Deps) -> TickResult:
    """Observe (sync the registry and the table, place when due), decide (servers required, failure,
    scale), apply (adapter statuses, the StatefulSet's replicas), then the pool's status and events."""
    now = deps.clock.now()
    seen = _observe(ref, spec, previous, deployments, ready_pods, deps, now)
    decision = _decide(ref.name, spec, previous, deployments, seen, deps, now)
    scale, new_replicas, applied = _apply(ref, spec, deployments, seen, decision, deps)
    view = PoolView(ref.name, generation, scale.replicas, len(ready_pods), seen.table, seen.servers,
                    decision.required, seen.store_error, seen.findings.overloaded, seen.findings.max_server_load,
                    spec.servers.max_replicas if spec.placement.autoscale else None,
                    decision.sizing.slots if decision.sizing else (),
                    decision.sizing.condition if decision.sizing else None, decision.failure)
    status = pool_status(view, previous, seen.last_placement, scale.below_since, now)
    events = [*seen.events, *(decision.sizing.events if decision.sizing else ()), *applied]
    return TickResult(status, new_replicas, events + _tick_events(previous, status, seen.table))


def _observe(ref: ObjectRef, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
             deployments: Sequence[DeploymentInfo], ready_pods: frozenset[str], deps: Deps, now: float) -> _Observed:
    seen = _Observed(_previous_findings(previous), parse_time(previous.last_placement_time) if previous else None)
    try:
        _sync(ref, spec, previous, deployments, ready_pods, deps, now, seen)
    except (StoreUnavailableError, StaleVersionError) as exc:
        seen.store_error = str(exc)
    except PlacementError as exc:
        seen.events.append(Event("Warning", "PlacementFailed", str(exc)))
    return seen


def _sync(ref: ObjectRef, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
          deployments: Sequence[DeploymentInfo], ready_pods: frozenset[str], deps: Deps, now: float,
          seen: _Observed) -> None:
    """Fills `seen` step by step, so that what came before a failure stays."""
    store = deps.store(ref.name)
    routes = deps.routes(ref.name)
    routes.ready_pods = ready_pods
    routes.bounds = replica_bounds((d.name, d.spec.replicas) for d in deployments)
    routes.routing = pool_routing(spec)
    seen.records = {r.name: r for r in store.adapters()}
    if _prune_registry(spec, deployments, seen.records, deps, store) or _reregister(ref, spec, deployments,
                                                                                   seen.records, deps):
        seen.records = {r.name: r for r in store.adapters()}
    seen.table, seen.servers = routes.sync()
    seen.records = _learn_invocations(seen.records, seen.servers, store)
    due = placement_due(previous.last_placement_time if previous else None, spec.placement.interval_seconds, now)
    if spec.sizing.estimator == "planner":  # before placing: a failed placement must not hold the plan back
        seen.sizing = size_with_planner(ref.name, spec, previous, _planner_floor(deployments), due, deps)
    if due or (seen.servers and routing_pending(seen.table, routes.routing)):  # a new choice: place now
        seen.last_placement, seen.findings = now, _place(ref.name, spec, deployments, deps)
        seen.table, seen.servers = routes.sync()
        seen.demand = store.demand_windows(now, DEFAULT_WINDOWS)
    seen.synced = True


def _decide(pool: str, spec: AdapterPoolSpec, previous: AdapterPoolStatus | None,
            deployments: Sequence[DeploymentInfo], seen: _Observed, deps: Deps, now: float) -> _Decision:
    sizing = seen.sizing
    if spec.sizing.estimator == "planner" and sizing is None:  # the store failed first: the last plan stands
        sizing = planner_sizing(None, previous, _planner_floor(deployments))
    required = sizing.required if sizing else seen.findings.required_with_shortfall(len(seen.servers))
    failure = spec_failure(spec)
    if not failure[0]:
        failure = deps.apply_failures.get(pool) or ((INVALID_SIZING, sizing.invalid) if sizing and sizing.invalid
                                                    else ("", ""))
    if seen.store_error or failure[0]:
        scale = ScaleDecision(spec.servers.desired_replicas, None)
    else:
        scale = _scale(spec, required, previous, now)
    return _Decision(required, sizing, failure, scale)


def _apply(ref: ObjectRef, spec: AdapterPoolSpec, deployments: Sequence[DeploymentInfo], seen: _Observed,
           decision: _Decision, deps: Deps) -> tuple[ScaleDecision, int | None, list[Event]]:
    """The adapters' statuses, then the StatefulSet's replicas. Returns the scale that holds, the new
    spec.servers.replicas (None: unchanged) and the events."""
    if seen.synced:
        _refresh_deployments(ref, spec, deployments, seen.records, seen.table, seen.servers, seen.demand, deps)
    if spec.sizing.estimator != "planner":
        deps.planner.forget(ref.name)
    scale, current = decision.scale, spec.servers.desired_replicas
    if scale.replicas == current:
        return scale, None, []
    try:
        deps.kube.apply(build_statefulset(_pool_ref(ref), spec, deps.config, scale.replicas))
    except KubeError as exc:
        return ScaleDecision(current, scale.below_since), None, [
            Event("Warning", "ScaleFailed", f"servers {current} -> {scale.replicas}: {exc.message}")]
    return scale, scale.replicas, [Event("Normal", scale.reason or "Scaled",
                                         f"servers {current} -> {scale.replicas} (required {decision.required})")]


def forget_pool(pool: str, namespace: str, deployments: Sequence[DeploymentInfo], deps: Deps) -> None:
    """The pool's finalizer: its routing state leaves Redis, and its adapters say PoolNotFound (their
    own handlers do not run again; a pool created again under the name re-registers them)."""
    deps.store(pool).clear()
    deps.forget(pool)
    deps.apply_failures.pop(pool, None)
    now = deps.clock.now()
    writes = []
    for d in deployments:
        target = ObjectRef(API_VERSION, "LoRADeployment", namespace, d.name, d.uid)
        view = AdapterView(d.name, pool, d.generation, False, None, None, ())
        writes.append(StatusWrite(target, d.status, *adapter_status(view, d.status, now)))
    write_statuses(deps, writes)
