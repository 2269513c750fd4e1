"""Step 5 of Algorithm 1: map logical bins onto physical servers so that the new placement overlaps
the previous one as much as possible (churn = adapters that must move). Score(bin, server) =
Σ_a min(φ_new(a, bin), φ_prev(a, server)); a bin whose max rank exceeds a server's max_rank can
never go there."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from loraplex.placement.assignment import max_weight_assignment
from loraplex.placement.binpack import Bin
from loraplex.placement.snapshot import PlacementError, PlacementServer
from loraplex.routing.table import RoutingTable

_FORBIDDEN = -1e9


def map_bins_to_servers(bins: Sequence[Bin], servers: Sequence[PlacementServer], loads: Mapping[str, float],
                        previous: RoutingTable | None) -> list[str]:
    """Returns the server id of each bin (len(bins) == len(servers))."""
    if len(bins) != len(servers):
        raise ValueError(f"{len(bins)} bins for {len(servers)} servers")
    score = np.zeros((len(bins), len(servers)))
    _forbid_incapable(score, bins, servers)
    if previous is not None:
        _add_overlap(score, bins, servers, loads, previous)
    columns = max_weight_assignment(score)
    if (score[np.arange(len(bins)), columns] <= _FORBIDDEN / 2).any():
        # Bins are tied to server capabilities before packing, so a valid mapping always exists.
        raise PlacementError("internal error: packed bins do not match the servers' max ranks")
    return [servers[j].id for j in columns]


def _forbid_incapable(score: np.ndarray, bins: Sequence[Bin], servers: Sequence[PlacementServer]) -> None:
    capacity = np.array([s.max_rank for s in servers])
    needed = np.array([b.max_rank for b in bins])
    score[needed[:, None] > capacity[None, :]] = _FORBIDDEN


def _add_overlap(score: np.ndarray, bins: Sequence[Bin], servers: Sequence[PlacementServer],
                 loads: Mapping[str, float], previous: RoutingTable) -> None:
    column = {s.id: j for j, s in enumerate(servers)}
    for i, b in enumerate(bins):
        for name, share in b.shares.items():
            phi_new = share / loads[name]
            for route in previous.routes(name):
                j = column.get(route.server)
                if j is not None and score[i, j] > _FORBIDDEN / 2:
                    score[i, j] += min(phi_new, route.weight)
