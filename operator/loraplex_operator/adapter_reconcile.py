"""LoRADeployment: register the adapter in its pool's registry, route it at once, and take it out again.

Kopf-free: the handlers call these with the injected Deps and turn `RetryLater` into
kopf.TemporaryError after writing the status it carries. Tables are written by the pool's
PoolRoutes only (one writer, coalesced), never here."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from loraplex.routing import (
    AdapterRecord,
    RecordError,
    RoutingTable,
    ServerRecord,
    StaleVersionError,
    StoreUnavailableError,
)
from loraplex.spec.crd import AdapterPoolSpec, LoRADeploymentSpec, LoRADeploymentStatus
from loraplex_operator.adapter_status import (
    RANK_TOO_LARGE,
    AdapterView,
    Event,
    adapter_status,
    beyond_every_server,
    blocked_status,
    out_of_slots,
)
from loraplex_operator.deps import Deps
from loraplex_operator.inspect_source import InspectionError
from loraplex_operator.kube import ObjectRef
from loraplex_operator.pool_routes import PoolRoutes

Outcome = tuple[LoRADeploymentStatus, list[Event]]


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


def adapter_view(name: str, spec: LoRADeploymentSpec, generation: int | None, record: AdapterRecord | None,
                 table: RoutingTable | None, servers: Sequence[ServerRecord],
                 demand: tuple[float | None, float] = (None, 0.0)) -> AdapterView:
    """The view of an adapter whose pool exists; unplaceable when no serving server holds its rank."""
    unplaced = record is not None and (table is None or name not in table.entries)
    unplaceable = unplaced and beyond_every_server(record.rank, servers)
    no_slot = unplaced and not unplaceable and out_of_slots(record.rank, servers, table)
    return AdapterView(name=name, pool=spec.pool, generation=generation, pool_exists=True, record=record,
                       table=table, servers=servers, demand_tps=demand[0], demand_window_s=demand[1],
                       unplaceable=unplaceable, no_slot=no_slot)


def rank_too_large(rank: int, pool: AdapterPoolSpec) -> str | None:
    if rank <= pool.engine.max_lora_rank:
        return None
    return f"rank {rank} exceeds the pool's engine.maxLoraRank {pool.engine.max_lora_rank}"


def _record(ref: ObjectRef, spec: LoRADeploymentSpec, pool: AdapterPoolSpec, deps: Deps) -> AdapterRecord:
    facts = deps.inspector.inspect(spec.adapter, _credentials(deps, ref.namespace, spec))
    try:
        return AdapterRecord(ref.name, facts.digest, facts.rank, facts.size_bytes, spec.adapter.source,
                             facts.target_modules, pool.base_model.name,
                             spec.traffic.expected_tokens_per_second).validate()
    except RecordError as exc:
        raise InspectionError("InvalidAdapter", str(exc)) from exc


def _known_record(existing: AdapterRecord | None, spec: LoRADeploymentSpec, generation: int | None,
                  previous: LoRADeploymentStatus | None) -> AdapterRecord | None:
    """The registry's record when this generation was inspected before (an operator restart resumes
    every object: no second download of every adapter)."""
    if previous is None or previous.digest is None or previous.observed_generation != generation:
        return None
    if existing is not None and existing.digest == previous.digest:
        return existing
    return None


def register_adapter(ref: ObjectRef, generation: int | None, spec: LoRADeploymentSpec,
                     previous: LoRADeploymentStatus | None, pool: AdapterPoolSpec | None, deps: Deps) -> Outcome:
    """Registers this generation of the adapter (inspecting its source unless already done) and
    routes it before returning. Writes nothing to Redis when the registry already says the same."""
    now = deps.clock.now()
    if pool is None:
        view = AdapterView(ref.name, spec.pool, generation, False, None, None, ())
        raise RetryLater(adapter_status(view, previous, now), 30)
    try:
        store = deps.store(spec.pool)
        existing = store.get_adapter(ref.name)
        record = _known_record(existing, spec, generation, previous) or _record(ref, spec, pool, deps)
        too_large = rank_too_large(record.rank, pool)
        if too_large:
            _unregister(ref.name, spec.pool, deps)
            return blocked_status("Failed", RANK_TOO_LARGE, too_large, generation, previous, now, record.rank,
                                  record.digest)
        routes = deps.routes(spec.pool)
        routes.copies[ref.name] = spec.replicas.min
        if existing is not None and existing.to_json() == record.to_json():
            table, servers = _routed(routes, record)  # a resume: nothing to write
            record = existing
        else:
            store.put_adapter(record)
            table, servers = routes.sync()
            record = store.get_adapter(ref.name) or record  # with its locations
    except InspectionError as exc:
        if exc.retryable:
            raise RetryLater(blocked_status("Pending", exc.reason, exc.message, generation, previous, now,
                                            spec.adapter.rank), 60) from exc
        _unregister(ref.name, spec.pool, deps)
        return blocked_status("Failed", exc.reason, exc.message, generation, previous, now, spec.adapter.rank)
    except (StoreUnavailableError, StaleVersionError) as exc:
        raise RetryLater(blocked_status("Pending", "StoreUnavailable", str(exc), generation, previous, now,
                                        spec.adapter.rank), 10) from exc
    return adapter_status(adapter_view(ref.name, spec, generation, record, table, servers), previous, now)


def _routed(routes: PoolRoutes, record: AdapterRecord) -> tuple[RoutingTable | None, list[ServerRecord]]:
    """The table and serving servers when the registry already holds `record`: the current table
    if it routes this digest and rank (no sync, so resuming a thousand adapters publishes nothing
    and reads little), else after a sync."""
    table = routes.store.read_table()
    entry = table.entries.get(record.name) if table else None
    if entry is None or (entry.digest, entry.rank) != (record.digest, record.rank):
        return routes.sync()
    return table, routes.serving(routes.store.healthy_servers())


def _unregister(name: str, pool: str, deps: Deps) -> None:
    """A generation that cannot be served leaves the registry and the table (if an earlier one was
    there); the store being down only delays it to the pool's next tick."""
    try:
        if deps.store(pool).get_adapter(name) is not None:
            unregister_adapter(name, pool, deps)
    except (StoreUnavailableError, StaleVersionError):
        pass


def unregister_adapter(name: str, pool: str, deps: Deps) -> None:
    """Removes the adapter from the registry and the routing table (the finalizer's work)."""
    deps.store(pool).remove_adapter(name)
    routes = deps.routes(pool)
    routes.copies.pop(name, None)
    routes.sync()
