"""LoRADeployment `replicas.max`: an adapter on at most that many servers.

The policies know only a minimum (`PlacementAdapter.min_replicas`). The maximum is applied to the
policy's result, before the controller compares and publishes, so one placement is one table version
with both bounds in it. Used by the operator and by `loraplex up`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from loraplex.placement.policy import PlacementPolicy
from loraplex.placement.slots import cap_slots
from loraplex.placement.snapshot import Placement, PlacementInput


def cap_routes(weights: Mapping[str, float], limit: int) -> dict[str, float]:
    """The `limit` heaviest routes (ties by server id), φ renormalised to sum to 1."""
    if limit < 1:
        raise ValueError(f"an adapter needs at least one route, got a limit of {limit}")
    kept = sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    total = sum(w for _, w in kept)
    return {server: w / total for server, w in kept}


def cap_placement(placement: Placement, maximum: Mapping[str, int]) -> Placement:
    """The placement with every adapter on at most `maximum[adapter]` servers."""
    over = {a for a, routes in placement.weights.items() if a in maximum and len(routes) > maximum[a]}
    if not over:
        return placement
    weights = {a: cap_routes(routes, maximum[a]) if a in over else routes for a, routes in placement.weights.items()}
    return replace(placement, weights=weights)


class MaxReplicasPolicy:
    """`inner`, then `cap_placement`, then the servers' adapter slots (`cap_slots`). `maximum` is asked
    at each placement for {adapter: replicas.max} because deployments change between placements;
    adapters it leaves out have no cap."""

    def __init__(self, inner: PlacementPolicy, maximum: Callable[[], Mapping[str, int]]) -> None:
        self.inner, self.maximum = inner, maximum
        self.name = inner.name

    def place(self, inp: PlacementInput) -> Placement:
        return cap_slots(cap_placement(self.inner.place(inp), self.maximum()), inp)
