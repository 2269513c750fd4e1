"""LoRADeployment `replicas.min` / `replicas.max` inside the placement the controller publishes.

`replicas.min` goes to the placement core (PlacementAdapter.min_replicas, through the controller's
`min_replicas` callable), which puts each adapter on that many capable servers. The core has no
maximum: `cap_placement` (loraplex.placement.max_replicas) trims every capped adapter to its heaviest
`max` routes, inside the pool's policy (loraplex.pool.policy.PoolPolicy), before the controller
compares and publishes: one table version per placement, with both bounds in it. Both drivers (the
operator, `loraplex up`) hold the bounds in this one form."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

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
