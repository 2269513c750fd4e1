"""Kopf handlers: read the object, call a kopf-free function with the Deps from `memo`, write the
status and post the events. Nothing else happens here."""

from __future__ import annotations

import asyncio
import logging
from contextlib import suppress
from functools import partial
from typing import Any, TypeVar

import kopf
from pydantic import ValidationError

from loraplex.routing import StaleVersionError, StoreUnavailableError
from loraplex.spec.crd import (
    API_VERSION,
    GROUP,
    VERSION,
    AdapterPoolSpec,
    AdapterPoolStatus,
    CrdModel,
    LoRADeploymentSpec,
    LoRADeploymentStatus,
)
from loraplex_operator.adapter_reconcile import (
    Registered,
    Registration,
    register_adapters,
    unregister_adapter,
)
from loraplex_operator.adapter_status import Event
from loraplex_operator.batching import BatchQueue
from loraplex_operator.deps import Deps
from loraplex_operator.kube import ObjectRef, throttled_session
from loraplex_operator.names import POOL_LABEL, selector_string
from loraplex_operator.pool_reconcile import (
    APPLY_FAILED,
    DeploymentInfo,
    InvalidPool,
    apply_pool,
    forget_pool,
    pool_tick,
    tick_due,
)

POOLS = (GROUP, VERSION, "adapterpools")
ADAPTERS = (GROUP, VERSION, "loradeployments")
# Each pool's timer wakes this often; it ticks when `tick_due` says (every LORAPLEX_TICK_SECONDS, and
# each time while registrations are recent) and places only when `placement.intervalSeconds` has passed.
TIMER_SECONDS = 1.0
M = TypeVar("M", bound=CrdModel)


def _parse(model: type[M], data: Any) -> M | None:
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError:
        return None


def _spec(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(dict(data or {}))
    except ValidationError as exc:  # the CRD schema should have refused it; never retry
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc


def _post(deps: Deps, ref: ObjectRef, events: list[Event]) -> None:
    for event in events:
        deps.events.post(ref, event)


def _pool_ref(meta: kopf.Meta, name: str, namespace: str) -> ObjectRef:
    return ObjectRef(API_VERSION, "AdapterPool", namespace, name, meta.get("uid", ""))


@kopf.index(*POOLS)
def pools_by_name(spec: kopf.Spec, name: str, namespace: str, **_: Any) -> dict[tuple[str, str], AdapterPoolSpec | None]:
    return {(namespace, name): _parse(AdapterPoolSpec, spec)}


@kopf.index("pods", labels={POOL_LABEL: kopf.PRESENT})
def ready_pods_by_pool(labels: kopf.Labels, status: kopf.Status, name: str, namespace: str,
                       **_: Any) -> dict[tuple[str, str], str] | None:
    """The pods whose Ready condition is True, by pool: a server serves only with a Ready pod."""
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    return {(namespace, labels[POOL_LABEL]): name} if ready else None


@kopf.index("statefulsets.apps", labels={POOL_LABEL: kopf.PRESENT})
def statefulsets_by_pool(labels: kopf.Labels, name: str, namespace: str, **_: Any) -> dict[tuple[str, str], str]:
    """The pools' StatefulSets, so that one deleted by hand is made again without polling for it."""
    return {(namespace, labels[POOL_LABEL]): name}


def _ready_pods(index: kopf.Index, namespace: str, pool: str) -> frozenset[str]:
    return frozenset(index.get((namespace, pool), []))


@kopf.on.resume(*POOLS)
@kopf.on.create(*POOLS)
@kopf.on.update(*POOLS, field="spec")
def pool_changed(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
                 patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    deps: Deps = memo.deps
    try:
        replicas, applied = apply_pool(_pool_ref(meta, name, namespace), _spec(AdapterPoolSpec, spec), deps,
                                       status.get("appliedHash", ""))
    except InvalidPool as exc:  # the pool's timer writes the Failed status and its event
        if exc.reason == APPLY_FAILED:
            raise kopf.TemporaryError(exc.message, delay=60) from exc
        return
    wanted = {"replicas": replicas, "selector": selector_string(name), "appliedHash": applied}
    if any(status.get(k) != v for k, v in wanted.items()):
        patch.status.update(wanted)


@kopf.on.delete(*POOLS, retries=6)
def pool_deleted(name: str, namespace: str, memo: kopf.Memo, adapters_by_pool: kopf.Index, **_: Any) -> None:
    """The finalizer: the pool's routing state leaves Redis; its adapters say PoolNotFound."""
    try:
        forget_pool(name, namespace, list(adapters_by_pool.get((namespace, name), [])), memo.deps)
    except StoreUnavailableError as exc:
        raise kopf.TemporaryError(f"cannot clear pool {name!r} from the routing store yet: {exc}", delay=10) from exc


@kopf.index(*ADAPTERS)
def adapters_by_pool(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
                     **_: Any) -> dict[tuple[str, str], DeploymentInfo] | None:
    parsed = _parse(LoRADeploymentSpec, spec)
    if parsed is None:
        return None
    info = DeploymentInfo(name, meta.get("uid", ""), meta.get("generation"), parsed,
                          _parse(LoRADeploymentStatus, status), str(meta.get("resourceVersion", "")))
    return {(namespace, parsed.pool): info}


@kopf.timer(*POOLS, interval=TIMER_SECONDS, initial_delay=1.0)
def pool_timer(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
               patch: kopf.Patch, memo: kopf.Memo, adapters_by_pool: kopf.Index, ready_pods_by_pool: kopf.Index,
               statefulsets_by_pool: kopf.Index, **_: Any) -> None:
    deps: Deps = memo.deps
    now = deps.clock.now()
    if not tick_due(now, deps.ticked.get(name), deps.registered.get(name), deps.config.tick_seconds):
        return
    deps.ticked[name] = now
    ref = _pool_ref(meta, name, namespace)
    parsed = _spec(AdapterPoolSpec, spec)
    if (namespace, name) not in statefulsets_by_pool and status.get("appliedHash"):
        with suppress(InvalidPool):  # its failure is the tick's to report
            apply_pool(ref, parsed, deps)  # someone deleted the StatefulSet: make everything again
    deployments = list(adapters_by_pool.get((namespace, name), []))
    previous = _parse(AdapterPoolStatus, status)
    result = pool_tick(ref, meta.get("generation"), parsed, previous, deployments,
                       _ready_pods(ready_pods_by_pool, namespace, name), deps)
    if previous is None or result.status.to_k8s() != previous.to_k8s():
        # appliedHash is pool_changed's alone: kopf runs this timer beside the handlers, so the status
        # this tick read may predate pool_changed's last write, and writing it back would make a later
        # change back to those objects look applied already.
        patch.status.update({k: v for k, v in result.status.to_patch().items() if k != "appliedHash"})
    if result.replicas is not None:
        patch.spec["servers"] = {"replicas": result.replicas}
    _post(deps, ref, result.events)


def _fetch_pool(namespace: str, pool: str, deps: Deps) -> AdapterPoolSpec | None:
    """The pool's spec from the API, when the index has not seen the pool yet (a pool and its adapters
    applied together)."""
    obj = deps.kube.get(API_VERSION, "AdapterPool", namespace, pool)
    return _parse(AdapterPoolSpec, obj.get("spec")) if obj is not None else None


def _registrations(deps: Deps, pool: str) -> BatchQueue[Registration, Registered]:
    """The pool's queue of registrations (one batch, one table version); made in kopf's event loop."""
    if pool not in deps.registrations:
        deps.registrations[pool] = BatchQueue(partial(register_adapters, pool, deps=deps),
                                              deps.config.registration_batch_seconds)
    queue: BatchQueue[Registration, Registered] = deps.registrations[pool]
    return queue


@kopf.on.resume(*ADAPTERS)
@kopf.on.create(*ADAPTERS)
@kopf.on.update(*ADAPTERS, field="spec")
async def adapter_changed(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
                          patch: kopf.Patch, memo: kopf.Memo, pools_by_name: kopf.Index,
                          ready_pods_by_pool: kopf.Index, **_: Any) -> None:
    """Async, so that every LoRADeployment waiting for its pool's next batch holds no worker thread."""
    deps: Deps = memo.deps
    ref = ObjectRef(API_VERSION, "LoRADeployment", namespace, name, meta.get("uid", ""))
    previous = _parse(LoRADeploymentStatus, status)
    parsed = _spec(LoRADeploymentSpec, spec)
    deps.routes(parsed.pool).ready_pods = _ready_pods(ready_pods_by_pool, namespace, parsed.pool)
    indexed = list(pools_by_name.get((namespace, parsed.pool), []))
    pool = indexed[0] if indexed else await asyncio.to_thread(_fetch_pool, namespace, parsed.pool, deps)
    done = await _registrations(deps, parsed.pool).submit(
        Registration(ref, meta.get("generation"), parsed, previous, pool))
    _write(deps, ref, patch, previous, done.outcome)
    if done.retry_after is not None:
        raise kopf.TemporaryError(done.outcome[0].message, delay=done.retry_after)


def _write(deps: Deps, ref: ObjectRef, patch: kopf.Patch, previous: LoRADeploymentStatus | None,
           outcome: tuple[LoRADeploymentStatus, list[Event]]) -> None:
    """The handler's status goes out with kopf's own patch, only when it changed."""
    status, events = outcome
    new = status.to_k8s()
    if previous is not None and previous.to_k8s() == new:
        return
    patch.status.update(status.to_patch())
    deps.written[ref.uid] = new
    _post(deps, ref, events)


@kopf.on.delete(*ADAPTERS)
def adapter_deleted(spec: kopf.Spec, meta: kopf.Meta, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: the adapter leaves the registry and the routing table before the object goes."""
    deps: Deps = memo.deps
    try:
        unregister_adapter(name, str(spec.get("pool", "")), deps)
    except (StoreUnavailableError, StaleVersionError) as exc:
        raise kopf.TemporaryError(f"cannot remove {name!r} from the routing store yet: {exc}", delay=10) from exc
    deps.written.pop(meta.get("uid", ""), None)
    deps.refreshed.pop(meta.get("uid", ""), None)


class _QuietTimers(logging.Filter):
    """Drops kopf's "Timer 'pool_timer' succeeded." (every tick of every pool); failures still show."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and record.getMessage().startswith("Timer ")
                    and record.getMessage().endswith(" succeeded."))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress lives in annotations, so the statuses stay ours and schema-valid.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # our own events tell the story; kopf adds only problems
    settings.watching.server_timeout = 300
    logging.getLogger("kopf.objects").addFilter(_QuietTimers())


@kopf.on.login()
async def login(memo: kopf.Memo, logger: logging.Logger, settings: kopf.OperatorSettings, **kwargs: Any) -> Any:
    """kopf's own credentials, in a session whose requests share the operator's Throttle (async: the
    session belongs to kopf's event loop)."""
    info = kopf.login_via_client(logger=logger, settings=settings, **kwargs)
    return throttled_session(info, memo.deps.throttle) if info is not None else None


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    """Stops the planner's worker. The Redis connections stay open until the process exits: kopf
    may leave a timer that did not stop in time running, and it must not find them closed."""
    deps: Deps | None = memo.get("deps")
    if deps is not None:
        deps.planner.close()
