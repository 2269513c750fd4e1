"""LoRADeployment `replicas.max`: an adapter on at most that many servers.

The policies know only a minimum (`PlacementAdapter.min_replicas`). The maximum is applied to the
policy's result, before the controller compares and publishes, so one placement is one table version
with both bounds in it (loraplex.pool.policy.PoolPolicy applies it for both drivers)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from loraplex.placement.snapshot import Placement


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

