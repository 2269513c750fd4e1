"""LoRADeployment: register the adapter in its pool's registry, route it at once, and take it out again.

Kopf-free: the handlers call these with the injected Deps, write the status a `Registered` carries
and turn its `retry_after` into kopf.TemporaryError. Tables are written by the pool's
PoolRoutes only (one writer, coalesced), never here. Registrations come in batches (the handlers'
`RegistrationQueue`, the pool's tick): one batch, one table version."""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from loraplex.pool.records import AdapterFactsError, adapter_record
from loraplex.routing import (
    AdapterRecord,
    RoutingTable,
    ServerRecord,
    StaleVersionError,
    StoreUnavailableError,
)
from loraplex.spec.alora import backend_refusal
from loraplex.spec.crd import AdapterPoolSpec, LoRADeploymentSpec, LoRADeploymentStatus
from loraplex_operator.adapter_status import (
    ALORA_UNSUPPORTED,
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

Outcome = tuple[LoRADeploymentStatus, list[Event]]


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


def alora_unservable(record: AdapterRecord, pool: AdapterPoolSpec) -> str | None:
    """Why the pool cannot serve the adapter because it is an activated LoRA; None when it can."""
    return backend_refusal(pool.engine.backend) if record.is_alora else None


def _record(ref: ObjectRef, spec: LoRADeploymentSpec, pool: AdapterPoolSpec, deps: Deps) -> AdapterRecord:
    facts = deps.inspector.inspect(spec.adapter, _credentials(deps, ref.namespace, spec))
    try:
        return adapter_record(ref.name, facts, spec, pool)
    except AdapterFactsError as exc:
        raise InspectionError(exc.reason, exc.message) from exc


def _known_record(existing: AdapterRecord | None, spec: LoRADeploymentSpec, generation: int | None,
                  previous: LoRADeploymentStatus | None) -> AdapterRecord | None:
    """The registry's record when this generation was inspected before (an operator restart resumes
    every object: no second download of every adapter)."""
    if previous is None or previous.digest is None or previous.observed_generation != generation:
        return None
    if existing is not None and existing.digest == previous.digest:
        return existing
    return None


@dataclass(frozen=True)
class Registration:
    """One generation of a LoRADeployment to register, as its handler (or the pool's tick) read it."""

    ref: ObjectRef
    generation: int | None
    spec: LoRADeploymentSpec
    previous: LoRADeploymentStatus | None
    pool: AdapterPoolSpec | None  # None: the pool does not exist


@dataclass(frozen=True)
class Registered:
    """The status (and events) to write; `retry_after`: not possible yet, try again after this long."""

    outcome: Outcome
    retry_after: float | None = None


def register_adapters(pool: str, batch: Sequence[Registration], deps: Deps) -> list[Registered]:
    """Registers a batch of one pool's LoRADeployments: each in the registry (inspecting its source
    unless this generation was inspected before; nothing written when the registry already says the
    same), then all of them routed by at most one new table version. The work per batch is that of
    its adapters plus one copy of the table, whatever the pool holds."""
    now = deps.clock.now()
    if batch:  # the pool ticks every second for a while (tick_due)
        deps.registered[pool] = now
    prepared = [_prepare(r, deps, now) for r in batch]
    records = [p for p in prepared if isinstance(p, AdapterRecord)]
    table: RoutingTable | None = None
    servers: list[ServerRecord] = []
    if records:
        try:
            table, servers = deps.routes(pool).route(records)
        except (StoreUnavailableError, StaleVersionError) as exc:
            prepared = [_store_down(r, exc, now) if isinstance(p, AdapterRecord) else p
                        for r, p in zip(batch, prepared, strict=True)]
    return [p if isinstance(p, Registered) else
            Registered(adapter_status(adapter_view(r.ref.name, r.spec, r.generation, p, table, servers),
                                      r.previous, now))
            for r, p in zip(batch, prepared, strict=True)]


def _store_down(r: Registration, exc: Exception, now: float) -> Registered:
    return Registered(blocked_status("Pending", "StoreUnavailable", str(exc), r.generation, r.previous, now,
                                     r.spec.adapter.rank), 10)


def _prepare(r: Registration, deps: Deps, now: float) -> Registered | AdapterRecord:
    """The adapter's record, in the registry and waiting to be routed; or its final status."""
    if r.pool is None:
        view = AdapterView(r.ref.name, r.spec.pool, r.generation, False, None, None, ())
        return Registered(adapter_status(view, r.previous, now), 30)
    try:
        store = deps.store(r.spec.pool)
        existing = store.get_adapter(r.ref.name)
        record = _known_record(existing, r.spec, r.generation, r.previous) or _record(r.ref, r.spec, r.pool, deps)
        too_large = rank_too_large(record.rank, r.pool)
        if too_large:
            _unregister(r.ref.name, r.spec.pool, deps)
            return Registered(blocked_status("Failed", RANK_TOO_LARGE, too_large, r.generation, r.previous, now,
                                             record.rank, record.digest))
        no_alora = alora_unservable(record, r.pool)
        if no_alora:
            _unregister(r.ref.name, r.spec.pool, deps)
            return Registered(blocked_status("Failed", ALORA_UNSUPPORTED, no_alora, r.generation, r.previous, now,
                                             record.rank, record.digest))
        deps.routes(r.spec.pool).copies[r.ref.name] = r.spec.replicas.min
        if existing is not None and existing.to_json() == record.to_json():
            return existing  # a resume: nothing to write
        store.put_adapter(record)
        return record
    except InspectionError as exc:
        if exc.retryable:
            return Registered(blocked_status("Pending", exc.reason, exc.message, r.generation, r.previous, now,
                                             r.spec.adapter.rank), 60)
        _unregister(r.ref.name, r.spec.pool, deps)
        return Registered(blocked_status("Failed", exc.reason, exc.message, r.generation, r.previous, now,
                                         r.spec.adapter.rank))
    except (StoreUnavailableError, StaleVersionError) as exc:
        return _store_down(r, exc, now)


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
