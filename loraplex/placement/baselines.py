"""Baseline placements the paper compares against (notes §4): every adapter everywhere
(Toppings-like), one random server per adapter (S-LoRA Random, static across steps), and equal-count
chunks of adapters sorted by rank (S-LoRA Contiguous). Each honours `min_replicas` (replicas.py)."""

from __future__ import annotations

import random

from loraplex.placement.replicas import ensure_min_replicas
from loraplex.placement.snapshot import (
    Placement,
    PlacementAdapter,
    PlacementInput,
    PlacementServer,
    previous_routes,
    split_placeable,
)


class ReplicateAllPolicy:
    """Every adapter on every server that can hold it, with equal φ."""

    name = "replicate-all"

    def place(self, inp: PlacementInput) -> Placement:
        servers = inp.healthy_servers()
        adapters, unplaceable = split_placeable(inp, servers)
        weights = {}
        for a in adapters:
            capable = [s.id for s in servers if s.max_rank >= a.rank]
            weights[a.name] = dict.fromkeys(capable, 1.0 / len(capable))
        return Placement(self.name, weights, inp.required_servers(), unplaceable)  # min_replicas: all capable


class RandomPolicy:
    """Each adapter on one server drawn from `rng`, φ = 1. Static like the paper's baseline: an adapter
    stays where the previous table routed it while that server is healthy and can hold it (with
    `min_replicas` > 1, on its min_replicas heaviest previous servers, φ as before)."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def place(self, inp: PlacementInput) -> Placement:
        servers = inp.healthy_servers()
        by_id = {s.id: s for s in servers}
        adapters, unplaceable = split_placeable(inp, servers)
        weights = {}
        for a in sorted(adapters, key=lambda a: a.name):
            weights[a.name] = (previous_routes(inp, a, by_id)
                               or {self._rng.choice([s.id for s in servers if s.max_rank >= a.rank]): 1.0})
        _add_replicas(inp, weights, adapters, servers)
        return Placement(self.name, weights, inp.required_servers(), unplaceable)


class ContiguousPolicy:
    """Adapters sorted by (rank, name) and cut into len(servers) chunks of (nearly) equal count; chunk
    i goes to the i-th server in (max_rank, id) order, so ranks close to each other share a server.
    An adapter whose chunk's server cannot hold its rank goes to the capable server holding the fewest
    adapters (pools whose servers have different max ranks)."""

    name = "contiguous"

    def place(self, inp: PlacementInput) -> Placement:
        servers = sorted(inp.healthy_servers(), key=lambda s: (s.max_rank, s.id))
        adapters, unplaceable = split_placeable(inp, servers)
        ordered = sorted(adapters, key=lambda a: (a.rank, a.name))
        n, count = len(servers), len(ordered)
        weights = {}
        counts = dict.fromkeys((s.id for s in servers), 0)
        for i, a in enumerate(ordered):
            server = servers[i * n // count]
            if server.max_rank < a.rank:
                server = min((s for s in servers if s.max_rank >= a.rank), key=lambda s: (counts[s.id], s.max_rank, s.id))
            weights[a.name] = {server.id: 1.0}
            counts[server.id] += 1
        _add_replicas(inp, weights, adapters, servers)
        return Placement(self.name, weights, inp.required_servers(), unplaceable)


def _add_replicas(inp: PlacementInput, weights: dict[str, dict[str, float]], adapters: list[PlacementAdapter],
                  servers: list[PlacementServer]) -> None:
    loads = {a.name: inp.load(a) for a in adapters}
    ensure_min_replicas(weights, adapters, servers, loads, sum(loads.values()) / len(servers))
