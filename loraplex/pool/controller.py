"""A pool's placement controller, built one way for both drivers: the spec's policy and hysteresis
inside PoolPolicy (replicas.max, adapter slots, the busiest server's load), the operating points of
the servers' device, the LoRADeployments' replicas.min as the floor, and the driver's filter of the
servers that may serve (Ready pods; live agent processes)."""

from __future__ import annotations

import random
from collections.abc import Callable

from loraplex.placement.controller import PlacementController
from loraplex.placement.operating_points import default_operating_points
from loraplex.placement.policy import make_policy
from loraplex.pool.bounds import ReplicaBounds
from loraplex.pool.policy import PoolPolicy
from loraplex.routing.choice import RoutingChoice
from loraplex.routing.records import ServerRecord
from loraplex.routing.store import RoutingStore
from loraplex.spec.crd import PlacementSpec
from loraplex.util.clock import Clock

ServerFilter = Callable[[list[ServerRecord]], list[ServerRecord]]


def build_controller(store: RoutingStore, spec: PlacementSpec, clock: Clock, rng: random.Random,
                     bounds: Callable[[], ReplicaBounds], *, gpu: bool,
                     server_filter: ServerFilter | None = None,
                     routing: Callable[[], RoutingChoice | None] | None = None,
                     policy: str | None = None, interval_s: float | None = None) -> PlacementController:
    """The controller of a pool placed as `spec` (its spec.placement) says. `bounds` is asked at each placement (LoRADeployments change between placements); `gpu`: the
    servers run on GPUs (GPU operating points) or CPUs. `routing`: the choice each new table carries
    (None: a new table keeps the last one's). `policy` / `interval_s` override the spec's
    (`loraplex up --placement`). ValueError for an unknown policy."""
    chosen = make_policy(policy or spec.policy, rng, hysteresis=spec.hysteresis)
    return PlacementController(store, PoolPolicy(chosen, lambda: bounds().maximum), clock,
                               interval_s or spec.interval_seconds,
                               default_operating_points("gpu" if gpu else "cpu"),
                               min_replicas=lambda: bounds().minimum, server_filter=server_filter, routing=routing)
