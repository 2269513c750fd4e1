"""Baseline placements the paper compares against (notes §4): every adapter everywhere
(Toppings-like), one random server per adapter (S-LoRA Random, static across steps), and equal-count
chunks of adapters sorted by rank (S-LoRA Contiguous)."""

from __future__ import annotations

import random

from loraplex.placement.snapshot import (
    Placement,
    PlacementError,
    PlacementInput,
    previous_server,
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
        return Placement(self.name, weights, inp.required_servers(), unplaceable)


class RandomPolicy:
    """Each adapter on one server drawn from `rng`, φ = 1. Static like the paper's baseline: an adapter
    stays where the previous table routed it while that server is healthy and can hold it."""

    name = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def place(self, inp: PlacementInput) -> Placement:
        servers = inp.healthy_servers()
        by_id = {s.id: s for s in servers}
        adapters, unplaceable = split_placeable(inp, servers)
        weights = {}
        for a in sorted(adapters, key=lambda a: a.name):
            server = previous_server(inp, a, by_id)
            if server is None:
                server = self._rng.choice([s.id for s in servers if s.max_rank >= a.rank])
            weights[a.name] = {server: 1.0}
        return Placement(self.name, weights, inp.required_servers(), unplaceable)


class ContiguousPolicy:
    """Adapters sorted by (rank, name) and cut into len(servers) chunks of (nearly) equal count; chunk
    i goes to the i-th server in (max_rank, id) order, so ranks close to each other share a server."""

    name = "contiguous"

    def place(self, inp: PlacementInput) -> Placement:
        servers = sorted(inp.healthy_servers(), key=lambda s: (s.max_rank, s.id))
        adapters, unplaceable = split_placeable(inp, servers)
        ordered = sorted(adapters, key=lambda a: (a.rank, a.name))
        n, count = len(servers), len(ordered)
        weights = {}
        for i, a in enumerate(ordered):
            server = servers[i * n // count]
            if server.max_rank < a.rank:
                raise PlacementError(f"contiguous chunk for server {server.id} (max rank {server.max_rank}) "
                                     f"includes {a.name} of rank {a.rank}")
            weights[a.name] = {server.id: 1.0}
        return Placement(self.name, weights, inp.required_servers(), unplaceable)
