"""Random placement inputs for property tests (seeded loops; hypothesis is not installed)."""

from __future__ import annotations

import math
import random

import pytest

from loraplex.placement import OperatingPoints, PlacementAdapter, PlacementInput, PlacementServer

RANKS = (8, 16, 32, 64, 128)
OP = OperatingPoints({8: 4000.0, 16: 3600.0, 32: 3200.0, 64: 2600.0, 128: 2000.0})


def random_input(rng: random.Random, previous=None, max_servers: int = 12, max_adapters: int = 60,
                 capabilities: tuple[int, ...] = (128,), max_min_replicas: int = 1) -> PlacementInput:
    """Servers get a max rank drawn from `capabilities` (15 % unhealthy, at least one healthy);
    adapters a rank from RANKS and, when `max_min_replicas` > 1, a min_replicas in 1..max_min_replicas."""
    servers = [PlacementServer(f"s{i:02d}", rng.choice(capabilities), healthy=rng.random() > 0.15)
               for i in range(rng.randint(1, max_servers))]
    if not any(s.healthy for s in servers):
        servers[0] = PlacementServer(servers[0].id, max(capabilities))
    adapters = []
    for i in range(rng.randint(0, max_adapters)):
        # Zipf-like popularity with many cold adapters
        demand = 0.0 if rng.random() < 0.3 else 3000.0 / (i + 1) ** rng.uniform(0.5, 1.5) * rng.uniform(0.1, 4)
        copies = rng.randint(1, max_min_replicas) if max_min_replicas > 1 else 1
        adapters.append(PlacementAdapter(f"a{i:03d}", f"sha256:{i}", rng.choice(RANKS), demand, min_replicas=copies))
    return PlacementInput(servers, adapters, OP, previous)


def server_loads(inp: PlacementInput, weights) -> dict[str, float]:
    loads: dict[str, float] = {}
    by_name = {a.name: a for a in inp.adapters}
    for name, routes in weights.items():
        for server, phi in routes.items():
            loads[server] = loads.get(server, 0.0) + phi * inp.load(by_name[name])
    return loads


def total_load(inp: PlacementInput) -> float:
    return math.fsum(inp.load(a) for a in inp.adapters)


def flat(weights) -> dict[tuple[str, str], float]:
    """{(adapter, server): φ}, comparable with pytest.approx."""
    return {(name, server): phi for name, routes in weights.items() for server, phi in routes.items()}


def check_invariants(inp: PlacementInput, placement) -> None:
    """Every adapter placed or unplaceable (exactly those above every healthy max rank), on healthy
    servers able to hold its rank, φ > 0, Σφ = 1."""
    healthy = {s.id: s for s in inp.servers if s.healthy}
    top = max(s.max_rank for s in healthy.values())
    by_name = {a.name: a for a in inp.adapters}
    assert set(placement.weights) | set(placement.unplaceable) == set(by_name)
    assert set(placement.unplaceable) == {a.name for a in inp.adapters if a.rank > top}
    for name, routes in placement.weights.items():
        assert routes and math.fsum(routes.values()) == pytest.approx(1.0)
        for server, phi in routes.items():
            assert server in healthy and phi > 0
            assert healthy[server].max_rank >= by_name[name].rank
    placement.to_table(1, 0.0, inp.adapters)  # validates Σφ = 1 and ≥ 1 route per adapter
