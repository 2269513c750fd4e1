"""Hysteresis for LoRAServe (notes §3.5.8, not in the paper): under small demand drift a fresh
packing reshuffles the sorted order and moves a quarter of the adapters. Instead, every route of the
previous table keeps its share φ_prev · u_new on its server while that server is healthy, can hold the
adapter's rank and stays within `limit` = targetUtil · (1 + tolerance); only what does not fit (and
new adapters) is placed again, as leftovers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from loraplex.placement.binpack import Bin
from loraplex.placement.snapshot import EPS, PlacementAdapter
from loraplex.routing.table import RoutingTable


def keep_previous(bins: Mapping[str, Bin], adapters: Sequence[PlacementAdapter], loads: Mapping[str, float],
                  previous: RoutingTable, limit: float) -> dict[str, float]:
    """Fills `bins` (server id -> its bin) with the previous routes that still fit and returns what
    is left of each adapter's load. On a server that would go over `limit`, the smallest shares stay
    first, so the fewest adapters leave it; a route stays whole or not at all (a partly kept route
    would split the adapter onto one more server)."""
    claims: dict[str, list[tuple[float, str, PlacementAdapter]]] = {}
    for a in adapters:
        for route in previous.routes(a.name):
            b = bins.get(route.server)
            if b is not None and b.capability >= a.rank:
                claims.setdefault(route.server, []).append((route.weight * loads[a.name], a.name, a))
    remainder = {a.name: loads[a.name] for a in adapters}
    fits = limit * (1 + 1e-9) + EPS
    for server, wanted in claims.items():
        b = bins[server]
        for share, name, a in sorted(wanted, key=lambda c: (c[0], c[1])):
            if b.load + share > fits:
                break  # the rest are larger: they go back to packing
            b.add(name, a.rank, share)
            remainder[name] -= share
    return remainder
