"""Pure: the status of one AdapterPool and the moment its next placement is due."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from loraplex.routing import RoutingTable, ServerRecord
from loraplex.spec.crd import AdapterPoolStatus, ServerStatus
from loraplex_operator import names
from loraplex_operator.conditions import rfc3339, set_condition
from loraplex_operator.scaling import short_of_capacity

PLANNED = "Planned"  # the condition of pools sized by the planner


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def placement_due(last_placement_time: str | None, interval_seconds: float, now: float) -> bool:
    last = parse_time(last_placement_time)
    return last is None or now - last >= interval_seconds


@dataclass(frozen=True)
class PoolView:
    name: str
    generation: int | None
    replicas: int                 # asked of the StatefulSet
    ready_replicas: int           # the StatefulSet's ready pods
    table: RoutingTable | None
    servers: Sequence[ServerRecord]  # healthy (heartbeating) servers
    required_servers: int | None
    store_error: str = ""         # non-empty when the routing store could not be reached
    overloaded: Sequence[str] = ()  # servers the last placement loaded beyond its balanced share
    max_server_load: float | None = None  # the busiest server's forecast load (1.0: one server's capacity)
    max_replicas: int | None = None  # the autoscaler's ceiling (None: autoscaling off)
    planned_slots: Sequence[int] = ()  # sizing by the planner: A_max per planned server
    planned: tuple[bool, str, str] | None = None  # the Planned condition; None: sized by the placement
    failure: tuple[str, str] = ("", "")  # (reason, message) when the spec cannot be served as written


def shortfall_condition(view: PoolView) -> tuple[bool, str, str]:
    """CapacityShortfall: (status, reason, message)."""
    if not view.overloaded:
        return False, "EnoughCapacity", ""
    servers = ", ".join(view.overloaded)
    load = view.max_server_load or 0.0
    if not short_of_capacity(view.overloaded, view.max_server_load):
        return False, "Unbalanced", (f"servers {servers} carry more than the balanced share (few servers can "
                                     f"hold their ranks) but within capacity: busiest at {load:.2f}")
    message = f"servers {servers} are overloaded (busiest at {load:.2f} of its capacity): too few servers " \
              "can hold the ranks they serve"
    if view.planned is not None:
        return True, "ServersOverloaded", f"{message}; the planner sizes this pool (sizing.estimator), so the " \
                                          "placement adds no server"
    if view.max_replicas is not None and (view.required_servers or 0) > view.max_replicas:
        return True, "AtMaxReplicas", f"{message}; {view.required_servers} servers wanted, maxReplicas is " \
                                      f"{view.max_replicas}"
    return True, "ServersOverloaded", f"{message}; asking for more servers"


def _servers(view: PoolView) -> list[ServerStatus]:
    healthy = {s.id for s in view.servers}
    out = []
    for i in range(view.replicas):
        name = names.server_name(view.name, i)
        assigned = view.table.assignments(name) if view.table else {}
        out.append(ServerStatus(name=name, ready=name in healthy, adapters=len(assigned),
                                weight=round(sum(assigned.values()), 4)))
    return out


def pool_status(view: PoolView, previous: AdapterPoolStatus | None, last_placement: float | None,
                below_since: float | None, now: float) -> AdapterPoolStatus:
    if view.failure[0]:
        phase, (reason, message) = "Failed", view.failure
    elif view.store_error:
        phase, reason, message = "Degraded", "StoreUnavailable", view.store_error
    elif view.ready_replicas == 0:
        phase, reason, message = "Pending", "NoReadyServers", "no server is ready yet"
    elif view.ready_replicas < view.replicas:
        phase, reason, message = "Progressing", "ServersStarting", f"{view.ready_replicas}/{view.replicas} ready"
    else:
        phase, reason, message = "Ready", "AllServersReady", f"{view.ready_replicas}/{view.replicas} ready"
    old = previous.conditions if previous else []
    gen = view.generation
    conditions = [
        set_condition(old, "Ready", phase == "Ready", reason, message, now, gen),
        set_condition(old, "StoreAvailable", not view.store_error, "StoreUnavailable" if view.store_error
                      else "Reachable", view.store_error, now, gen),
        set_condition(old, "CapacityShortfall", *shortfall_condition(view), now, gen),
    ]
    if view.planned is not None:
        conditions.append(set_condition(old, PLANNED, *view.planned, now, gen))
    return AdapterPoolStatus(
        phase=phase, replicas=view.replicas, ready_replicas=view.ready_replicas,
        selector=names.selector_string(view.name), applied_hash=previous.applied_hash if previous else "",
        routing_version=view.table.version if view.table else None,
        required_servers=view.required_servers, adapters=len(view.table.entries) if view.table else 0,
        servers=_servers(view), last_placement_time=rfc3339(last_placement) if last_placement else None,
        below_since=rfc3339(below_since) if below_since is not None else None,
        overloaded_servers=list(view.overloaded), max_server_load=view.max_server_load,
        planned_adapter_slots=list(view.planned_slots),
        observed_generation=gen, conditions=conditions)
