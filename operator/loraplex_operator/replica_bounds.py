"""LoRADeployment `replicas.min` / `replicas.max` inside the placement the controller publishes.

`replicas.min` goes to the placement core (PlacementAdapter.min_replicas, through the controller's
`min_replicas` callable), which puts each adapter on that many capable servers. The core has no
maximum: `cap_placement` trims every capped adapter to its heaviest `max` routes, inside the pool's
policy (pool_policy.PoolPolicy), before the controller compares and publishes: one table version
per placement, with both bounds in it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from loraplex.placement.snapshot import Placement
from loraplex.spec.crd import ReplicasSpec


@dataclass(frozen=True)
class ReplicaBounds:
    """The bounds of one pool's LoRADeployments; adapters left out need one server and have no cap."""

    minimum: Mapping[str, int] = field(default_factory=dict)
    maximum: Mapping[str, int] = field(default_factory=dict)


def replica_bounds(deployments: Iterable[tuple[str, ReplicasSpec]]) -> ReplicaBounds:
    """From (adapter name, spec.replicas) pairs."""
    pairs = list(deployments)
    return ReplicaBounds({name: r.min for name, r in pairs if r.min > 1},
                         {name: r.max for name, r in pairs if r.max is not None})


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
