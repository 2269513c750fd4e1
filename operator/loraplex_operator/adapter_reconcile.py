"""LoRADeployment: register the adapter in its pool's registry, route it at once, and take it out again.

Kopf-free: the handlers call these with the injected Deps and turn `RetryLater` into
kopf.TemporaryError after writing the status it carries."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from loraplex.routing import (
    AdapterRecord,
    RecordError,
    RoutingStore,
    RoutingTable,
    ServerRecord,
    StaleVersionError,
    StoreUnavailableError,
)
from loraplex.spec.crd import API_VERSION, AdapterPoolSpec, LoRADeploymentSpec, LoRADeploymentStatus
from loraplex_operator.adapter_status import (
    AdapterView,
    Event,
    adapter_status,
    beyond_every_server,
    blocked_status,
)
from loraplex_operator.deps import Deps
from loraplex_operator.inspect_source import InspectionError
from loraplex_operator.kube import ObjectRef
from loraplex_operator.table_edits import NoServerError, ensure_adapter, without_adapter

Outcome = tuple[LoRADeploymentStatus, list[Event]]
_PUBLISH_ATTEMPTS = 5


class RetryLater(Exception):
    """Not possible yet (no pool, store down, source unreachable): write `outcome`, retry after `delay`."""

    def __init__(self, outcome: Outcome, delay: float) -> None:
        super().__init__(outcome[0].message)
        self.outcome, self.delay = outcome, delay


def _credentials(deps: Deps, namespace: str, spec: LoRADeploymentSpec) -> Mapping[str, str]:
    ref = spec.adapter.credentials_secret_ref
    if ref is None:
        return {}
    secret = deps.kube.get("v1", "Secret", namespace, ref.name)
    if secret is None:
        raise InspectionError("SecretNotFound", f"Secret {ref.name!r} does not exist", retryable=True)
    return {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}


def _view(ref: ObjectRef, spec: LoRADeploymentSpec, generation: int | None, pool_exists: bool,
          record: AdapterRecord | None = None, table: RoutingTable | None = None,
          servers: Sequence[ServerRecord] = ()) -> AdapterView:
    unplaceable = record is not None and beyond_every_server(record.rank, servers) and \
        (table is None or ref.name not in table.entries)
    return AdapterView(name=ref.name, pool=spec.pool, generation=generation, pool_exists=pool_exists,
                       record=record, table=table, servers=servers, unplaceable=unplaceable)


def _record(ref: ObjectRef, spec: LoRADeploymentSpec, pool: AdapterPoolSpec, deps: Deps) -> AdapterRecord:
    facts = deps.inspector.inspect(spec.adapter, _credentials(deps, ref.namespace, spec))
    if facts.rank > pool.engine.max_lora_rank:
        raise InspectionError("RankTooLarge", f"rank {facts.rank} exceeds the pool's engine.maxLoraRank "
                              f"{pool.engine.max_lora_rank}")
    try:
        return AdapterRecord(ref.name, facts.digest, facts.rank, facts.size_bytes, spec.adapter.source,
                             facts.target_modules, pool.base_model.name,
                             spec.traffic.expected_tokens_per_second).validate()
    except RecordError as exc:
        raise InspectionError("InvalidAdapter", str(exc)) from exc


def _known_record(name: str, spec: LoRADeploymentSpec, generation: int | None,
                  previous: LoRADeploymentStatus | None, deps: Deps) -> AdapterRecord | None:
    """The registry's record when this generation was registered before (an operator restart
    resumes every object: no second download of every adapter)."""
    if previous is None or previous.digest is None or previous.observed_generation != generation:
        return None
    try:
        existing = deps.store(spec.pool).get_adapter(name)
    except StoreUnavailableError:
        return None
    return existing if existing is not None and existing.digest == previous.digest else None


def register_adapter(ref: ObjectRef, generation: int | None, spec: LoRADeploymentSpec,
                     previous: LoRADeploymentStatus | None, deps: Deps) -> Outcome:
    now = deps.clock.now()
    pool_obj = deps.kube.get(API_VERSION, "AdapterPool", ref.namespace, spec.pool)
    if pool_obj is None:
        raise RetryLater(adapter_status(_view(ref, spec, generation, False), previous, now), 30)
    pool = AdapterPoolSpec.model_validate(pool_obj.get("spec", {}))
    try:
        record = _known_record(ref.name, spec, generation, previous, deps) or _record(ref, spec, pool, deps)
    except InspectionError as exc:
        if exc.retryable:
            raise RetryLater(blocked_status("Pending", exc.reason, exc.message, generation, previous, now), 60) from exc
        return blocked_status("Failed", exc.reason, exc.message, generation, previous, now)
    try:
        store = deps.store(spec.pool)
        store.put_adapter(record)
        table, servers = _route_now(store, ref.name, spec, now)
    except (StoreUnavailableError, StaleVersionError) as exc:
        raise RetryLater(blocked_status("Pending", "StoreUnavailable", str(exc), generation, previous, now), 10) \
            from exc
    view = _view(ref, spec, generation, True, record=record, table=table, servers=servers)
    return adapter_status(view, previous, now)


def _route_now(store: RoutingStore, name: str, spec: LoRADeploymentSpec, now: float
               ) -> tuple[RoutingTable | None, list[ServerRecord]]:
    """Adds the adapter to the current table on `replicas.min` servers that can hold it; returns
    (table, servers). With no capable server it stays unrouted until the pool's next placement."""
    for _ in range(_PUBLISH_ATTEMPTS):
        record = store.get_adapter(name)  # with its locations
        table, servers = store.read_table(), store.healthy_servers()
        if record is None:
            return table, servers
        try:
            new = ensure_adapter(table, record, servers, now, copies=spec.replicas.min)
        except NoServerError:
            return table, servers
        if new is None:
            return table, servers
        try:
            store.publish_table(new)
            return new, servers
        except StaleVersionError:
            continue  # the placement published meanwhile: edit its table instead
    raise StaleVersionError(f"could not publish a table with {name!r} after {_PUBLISH_ATTEMPTS} attempts")


def unregister_adapter(name: str, pool: str, deps: Deps) -> None:
    """Removes the adapter from the registry and the routing table (the finalizer's work)."""
    store = deps.store(pool)
    store.remove_adapter(name)
    for _ in range(_PUBLISH_ATTEMPTS):
        new = without_adapter(store.read_table(), name, deps.clock.now())
        if new is None:
            return
        try:
            store.publish_table(new)
            return
        except StaleVersionError:
            continue
    raise StaleVersionError(f"could not publish a table without {name!r} after {_PUBLISH_ATTEMPTS} attempts")
