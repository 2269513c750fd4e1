"""Pure: the status of one LoRADeployment from what the registry, the routing table and the servers
say, and the events that the change from the previous status deserves.

Phases: Pending (not registered, no pool, no server, or not placed yet), Loading (placed, but no
assigned server holds the weights yet), Ready (at least one assigned server holds them), Failed
(the spec cannot be served: bad source, rank above the pool's limit, weights that fail checks; or
the placement found no healthy server able to hold the rank, which heals once one is placed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.routing import AdapterRecord, RoutingTable, ServerRecord
from loraplex.spec.crd import LoRADeploymentStatus, ObservedDemand, PlacementEntry
from loraplex_operator.conditions import set_condition


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" or "Warning"
    reason: str
    message: str


@dataclass(frozen=True)
class AdapterView:
    """Everything the status depends on, read once per tick."""

    name: str
    pool: str
    generation: int | None
    pool_exists: bool
    record: AdapterRecord | None
    table: RoutingTable | None
    servers: Sequence[ServerRecord]
    demand_tps: float | None = None
    demand_window_s: float = 0.0
    unplaceable: bool = False  # the placement found no healthy server whose max rank holds it
    no_slot: bool = False  # every server able to hold its rank has all its adapter slots taken


# The Failed reasons the pool's placement sets and clears.
UNPLACEABLE = "RankExceedsServers"
NO_SLOTS = "NoAdapterSlots"
PLACEMENT_REASONS = frozenset({UNPLACEABLE, NO_SLOTS})
# The Failed reason that follows the pool's engine.maxLoraRank: cleared when the pool is raised again.
RANK_TOO_LARGE = "RankTooLarge"
# The Failed reason of an activated LoRA deployed to a pool on the vllm backend.
ALORA_UNSUPPORTED = "ActivatedLoRAUnsupported"
# The Failed reason of a version the servers fetched and verified and their engine refused to load
# (what the operator could not read itself: an activated LoRA from s3:// on the vllm backend, a PEFT
# feature the engine lacks); it follows their heartbeats. The version stays registered (and routed: a
# request gets the refusal as its error) so that a server that can load it heals it.
ADAPTER_REFUSED = "AdapterRefused"
# Reasons the pool's tick keeps up to date once the adapter's handler registered its generation. Every
# other reason is the handler's (it retries, or the spec must change), and the tick leaves it alone,
# so a status never alternates between the two writers.
TICK_REASONS = frozenset({"NotRegistered", "NoServers", "AwaitingPlacement", "Fetching", "Serving",
                          ADAPTER_REFUSED, *PLACEMENT_REASONS})
# Failed reasons that keep the adapter in the registry: they heal by themselves (the servers' side changes).
HEALING_REASONS = frozenset({ADAPTER_REFUSED, *PLACEMENT_REASONS})


def beyond_every_server(rank: int, servers: Sequence[ServerRecord]) -> bool:
    """The placement's test for an unplaceable adapter: healthy servers exist, none holds the rank."""
    return bool(servers) and all(s.max_rank < rank for s in servers)


def out_of_slots(rank: int, servers: Sequence[ServerRecord], table: RoutingTable | None) -> bool:
    """Healthy servers can hold the rank, and every one of them has all its adapter slots (a vLLM
    server's max_cpu_loras) taken in the table: the placement leaves the adapter out."""
    able = [s for s in servers if s.max_rank >= rank]
    if table is None or not able:
        return False
    return all(s.max_adapters and len(table.assignments(s.id)) >= s.max_adapters for s in able)


def refusals(record: AdapterRecord, servers: Sequence[ServerRecord]) -> tuple[str, ...]:
    """`server: why` of each server that refused to load this version of the adapter."""
    return tuple(f"{s.id}: {why}" for s in servers for name, digest, why in s.refused
                 if name == record.name and digest == record.digest)


def weights_text(placement: Sequence[PlacementEntry]) -> str:
    return ",".join(f"{p.server}={p.weight:.2f}" for p in placement)


def _phase(view: AdapterView, holders: set[str], assigned: list[str]) -> tuple[str, str, str]:
    if not view.pool_exists:
        return "Pending", "PoolNotFound", f"AdapterPool {view.pool!r} does not exist in this namespace"
    if view.record is None:
        return "Pending", "NotRegistered", "the adapter is not in the pool's registry yet"
    refused = refusals(view.record, view.servers)
    if refused:
        return "Failed", ADAPTER_REFUSED, f"the servers fetched it and refused to load it: {'; '.join(refused)}"
    if not assigned:
        if view.unplaceable and view.servers:
            top = max(s.max_rank for s in view.servers)
            return "Failed", UNPLACEABLE, f"rank {view.record.rank} exceeds every server's maxLoraRank " \
                                          f"(at most {top}); it is placed once a server can hold it"
        if view.no_slot and view.servers:
            return "Failed", NO_SLOTS, f"every server able to hold rank {view.record.rank} has all its adapter " \
                                       "slots (engine.maxCpuLoras) taken; it is placed once one is free (more " \
                                       "servers or a larger maxCpuLoras)"
        if not view.servers:
            return "Pending", "NoServers", f"pool {view.pool!r} has no ready server"
        return "Pending", "AwaitingPlacement", "waiting for the next placement"
    ready = [s for s in assigned if s in holders]
    if ready:
        return "Ready", "Serving", f"served by {len(ready)} of {len(assigned)} assigned servers"
    return "Loading", "Fetching", f"assigned to {', '.join(assigned)}; no server holds the weights yet"


def adapter_status(view: AdapterView, previous: LoRADeploymentStatus | None, now: float
                   ) -> tuple[LoRADeploymentStatus, list[Event]]:
    entry = view.table.entries.get(view.name) if view.table else None
    placement = [PlacementEntry(server=r.server, weight=round(r.weight, 4)) for r in entry.routes] if entry else []
    assigned = [p.server for p in placement]
    holders = {s.id for s in view.servers if view.name in s.host_adapters or view.name in s.gpu_adapters}
    phase, reason, message = _phase(view, holders, assigned)
    old = previous.conditions if previous else []
    gen = view.generation
    conditions = [
        set_condition(old, "Registered", view.record is not None, "InRegistry" if view.record else reason,
                      "" if view.record else message, now, gen),
        set_condition(old, "Placed", bool(assigned), "InRoutingTable" if assigned else reason,
                      weights_text(placement), now, gen),
        set_condition(old, "Ready", phase == "Ready", reason, message, now, gen),
    ]
    demand = previous.observed_demand if previous else None
    if view.demand_tps is not None:
        demand = ObservedDemand(tokens_per_second=_significant(view.demand_tps), window_seconds=view.demand_window_s)
    status = LoRADeploymentStatus(
        phase=phase, reason=reason, message=message,
        rank=view.record.rank if view.record else None, digest=view.record.digest if view.record else None,
        placement=placement, weights=weights_text(placement),
        ready_servers=len([s for s in assigned if s in holders]), observed_demand=demand,
        observed_generation=gen, conditions=conditions)
    return status, transition_events(previous, status)


def _significant(tps: float) -> float:
    """Three significant digits: the demand moves every window, its status need not."""
    return float(f"{tps:.3g}")


def transition_events(previous: LoRADeploymentStatus | None, status: LoRADeploymentStatus) -> list[Event]:
    """One event per change of phase or reason (with the weights when it is placed), else one per
    change of the placement."""
    if previous is None or (previous.phase, previous.reason) != (status.phase, status.reason):
        kind = "Warning" if status.phase == "Failed" else "Normal"
        placed = f" ({status.weights})" if status.weights and status.phase != "Loading" else ""
        return [Event(kind, status.reason or status.phase, f"{status.phase}: {status.message}{placed}")]
    if status.placement and previous.weights != status.weights:
        return [Event("Normal", "Placed", f"traffic: {status.weights}")]
    return []


def blocked_status(phase: str, reason: str, message: str, generation: int | None,
                   previous: LoRADeploymentStatus | None, now: float, rank: int | None = None,
                   digest: str | None = None) -> tuple[LoRADeploymentStatus, list[Event]]:
    """The status when registration cannot go on: Failed (the spec cannot be served; it stays so
    until the spec changes, or the pool's max rank for RankTooLarge) or Pending (a retry may
    succeed: store down, source unreachable). `rank`/`digest`: what is known of the adapter."""
    old = previous.conditions if previous else []
    conditions = [set_condition(old, "Registered", False, reason, message, now, generation),
                  set_condition(old, "Placed", False, reason, "", now, generation),
                  set_condition(old, "Ready", False, reason, message, now, generation)]
    status = LoRADeploymentStatus(phase=phase, reason=reason, message=message, rank=rank, digest=digest,
                                  observed_demand=previous.observed_demand if previous else None,
                                  observed_generation=generation, conditions=conditions)
    return status, transition_events(previous, status)
