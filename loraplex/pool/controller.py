"""A pool's placement controller, built one way for both drivers: the spec's policy and hysteresis
inside PoolPolicy (replicas.max, adapter slots, the busiest server's load), the operating points of
the servers' device, the LoRADeployments' replicas.min as the floor, the driver's filter of the
servers that may serve (Ready pods; live agent processes), and the pool's routing choice, which
reaches the routers only in the tables this controller publishes (a changed choice: place now)."""

from __future__ import annotations

import random
from collections.abc import Callable

from loraplex.placement.controller import PlacementController
from loraplex.placement.operating_points import default_operating_points
from loraplex.placement.policy import make_policy
from loraplex.pool.bounds import ReplicaBounds
from loraplex.pool.policy import PoolPolicy
from loraplex.routing.choice import RoutingChoice, routing_error
from loraplex.routing.records import ServerRecord
from loraplex.routing.store import RoutingStore
from loraplex.routing.table import RoutingTable
from loraplex.spec.crd import PlacementSpec
from loraplex.util.clock import Clock

ServerFilter = Callable[[list[ServerRecord]], list[ServerRecord]]


def build_controller(store: RoutingStore, spec: PlacementSpec, clock: Clock, rng: random.Random,
                     bounds: Callable[[], ReplicaBounds], routing: Callable[[], RoutingChoice | None], *,
                     gpu: bool, server_filter: ServerFilter | None = None,
                     policy: str | None = None, interval_s: float | None = None) -> PlacementController:
    """The controller of a pool placed as `spec` (its spec.placement) says. `bounds` and `routing`
    (the pool's spec.routing, `pool_routing`) are asked at each placement: LoRADeployments and the
    AdapterPool change between placements. `gpu`: the servers run on GPUs (GPU operating points) or
    CPUs. `policy` / `interval_s` override the spec's (`loraplex up --placement`). ValueError for an
    unknown policy."""
    chosen = make_policy(policy or spec.policy, rng, hysteresis=spec.hysteresis)
    return PlacementController(store, PoolPolicy(chosen, lambda: bounds().maximum), clock,
                               interval_s or spec.interval_seconds,
                               default_operating_points("gpu" if gpu else "cpu"),
                               min_replicas=lambda: bounds().minimum, server_filter=server_filter, routing=routing)


def routing_pending(table: RoutingTable | None, routing: RoutingChoice | None) -> bool:
    """The pool's routing choice is not the one its table carries, and the routers could build it: a
    placement is due now rather than at the interval (a refused choice is never published)."""
    return table is not None and table.routing != routing and not routing_error(routing)
