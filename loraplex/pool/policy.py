"""The placement policy both drivers run for a pool: the named policy, then `replicas.max`, then the
servers' adapter slots (a vLLM server's max_cpu_loras), then a measure of the busiest server, all
before the controller compares and publishes (one version).

The busiest server's forecast load (in servers: 1.0 is what one server sustains under the SLO) tells
a real capacity shortfall from an imbalance. The policy's `overloaded` servers are those above its
balanced share; with few servers able to hold a high rank they can sit above it at any pool size,
while only a load above 1.0 means requests there will miss the SLO."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from loraplex.placement.max_replicas import cap_placement
from loraplex.placement.policy import PlacementPolicy
from loraplex.placement.slots import cap_slots
from loraplex.placement.snapshot import Placement, PlacementInput

# The stat (also kept in the routing table's meta) with the busiest server's forecast load.
MAX_SERVER_LOAD = "max_server_load"


def server_loads(inp: PlacementInput, weights: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Σ φ · u(adapter) per server, u in servers (demand ÷ the operating point of the rank)."""
    loads = {a.name: inp.load(a) for a in inp.adapters}
    per_server: dict[str, float] = {}
    for name, routes in weights.items():
        for server, phi in routes.items():
            per_server[server] = per_server.get(server, 0.0) + phi * loads[name]
    return per_server


class PoolPolicy:
    """`maximum` is asked at each placement: the LoRADeployments change between placements."""

    def __init__(self, inner: PlacementPolicy, maximum: Callable[[], Mapping[str, int]]) -> None:
        self.inner, self.maximum = inner, maximum
        self.name = inner.name

    def place(self, inp: PlacementInput) -> Placement:
        placement = cap_slots(cap_placement(self.inner.place(inp), self.maximum()), inp)
        busiest = max(server_loads(inp, placement.weights).values(), default=0.0)
        return replace(placement, stats={**placement.stats, MAX_SERVER_LOAD: round(busiest, 6)})
