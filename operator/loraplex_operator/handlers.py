"""Kopf handlers: read the object, call a kopf-free function with the Deps from `memo`, write the
status and post the events. Nothing else happens here."""

from __future__ import annotations

import logging
import os
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
from loraplex_operator.adapter_reconcile import RetryLater, register_adapter, unregister_adapter
from loraplex_operator.adapter_status import Event
from loraplex_operator.deps import Deps
from loraplex_operator.kube import ObjectRef
from loraplex_operator.names import selector_string
from loraplex_operator.pool_reconcile import DeploymentInfo, apply_pool, pool_tick

POOLS = (GROUP, VERSION, "adapterpools")
ADAPTERS = (GROUP, VERSION, "loradeployments")
# Each pool's timer wakes this often and places only when `placement.intervalSeconds` has passed.
TICK_SECONDS = float(os.environ.get("LORAPLEX_TICK_SECONDS", "5"))
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


@kopf.on.resume(*POOLS)
@kopf.on.create(*POOLS)
@kopf.on.update(*POOLS, field="spec")
def pool_changed(spec: kopf.Spec, meta: kopf.Meta, name: str, namespace: str, patch: kopf.Patch,
                 memo: kopf.Memo, **_: Any) -> None:
    deps: Deps = memo.deps
    ref = ObjectRef(API_VERSION, "AdapterPool", namespace, name, meta.get("uid", ""))
    replicas = apply_pool(ref, _spec(AdapterPoolSpec, spec), deps)
    patch.status["replicas"] = replicas
    patch.status["selector"] = selector_string(name)


@kopf.index(*ADAPTERS)
def adapters_by_pool(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
                     **_: Any) -> dict[tuple[str, str], DeploymentInfo] | None:
    parsed = _parse(LoRADeploymentSpec, spec)
    if parsed is None:
        return None
    info = DeploymentInfo(name, meta.get("uid", ""), meta.get("generation"), parsed,
                          _parse(LoRADeploymentStatus, status))
    return {(namespace, parsed.pool): info}


@kopf.timer(*POOLS, interval=TICK_SECONDS, initial_delay=1.0)
def pool_timer(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
               patch: kopf.Patch, memo: kopf.Memo, adapters_by_pool: kopf.Index, **_: Any) -> None:
    deps: Deps = memo.deps
    ref = ObjectRef(API_VERSION, "AdapterPool", namespace, name, meta.get("uid", ""))
    deployments = list(adapters_by_pool.get((namespace, name), []))
    result = pool_tick(ref, meta.get("generation"), _spec(AdapterPoolSpec, spec),
                       _parse(AdapterPoolStatus, status), deployments, deps)
    patch.status.update(result.status.to_patch())
    if result.replicas is not None:
        patch.spec["servers"] = {"replicas": result.replicas}
    _post(deps, ref, result.events)


@kopf.on.resume(*ADAPTERS)
@kopf.on.create(*ADAPTERS)
@kopf.on.update(*ADAPTERS, field="spec")
def adapter_changed(spec: kopf.Spec, status: kopf.Status, meta: kopf.Meta, name: str, namespace: str,
                    patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    deps: Deps = memo.deps
    ref = ObjectRef(API_VERSION, "LoRADeployment", namespace, name, meta.get("uid", ""))
    previous = _parse(LoRADeploymentStatus, status)
    try:
        outcome = register_adapter(ref, meta.get("generation"), _spec(LoRADeploymentSpec, spec), previous, deps)
    except RetryLater as retry:
        patch.status.update(retry.outcome[0].to_patch())
        _post(deps, ref, retry.outcome[1])
        raise kopf.TemporaryError(retry.outcome[0].message, delay=retry.delay) from retry
    patch.status.update(outcome[0].to_patch())
    _post(deps, ref, outcome[1])


@kopf.on.delete(*ADAPTERS)
def adapter_deleted(spec: kopf.Spec, name: str, memo: kopf.Memo, **_: Any) -> None:
    """The finalizer: the adapter leaves the registry and the routing table before the object goes."""
    try:
        unregister_adapter(name, str(spec.get("pool", "")), memo.deps)
    except (StoreUnavailableError, StaleVersionError) as exc:
        raise kopf.TemporaryError(f"cannot remove {name!r} from the routing store yet: {exc}", delay=10) from exc


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress lives in annotations, so the statuses stay ours and schema-valid.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # our own events tell the story; kopf adds only problems
    settings.watching.server_timeout = 300


@kopf.on.cleanup()
def close(memo: kopf.Memo, **_: Any) -> None:
    deps: Deps | None = memo.get("deps")
    if deps is not None:
        deps.close()
