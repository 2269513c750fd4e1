"""LoRADeployment `replicas.min`, for every policy: an adapter placed on fewer distinct servers than
its `min_replicas` gets copies on the least-loaded servers able to hold its rank (as many as exist).
Its φ is then split in proportion to the room each of its servers has for it below `capacity`, so
the copies add availability without pushing a server over; a zero-demand adapter is split evenly."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from loraplex.placement.snapshot import EPS, PlacementAdapter, PlacementServer

# Each copy gets at least this share of the traffic before renormalising, so it stays warm and the
# router can fail over to it: a replica with φ = 0 would not be a route at all.
MIN_COPY_SHARE = 0.01


def ensure_min_replicas(weights: dict[str, dict[str, float]], adapters: Sequence[PlacementAdapter],
                        servers: Sequence[PlacementServer], loads: Mapping[str, float], capacity: float) -> None:
    """Adds copies to `weights` in place. `loads[a]` is u(a) in server-equivalents; `capacity` the
    load a server should stay under (the policy's target). Adapters go hottest first, so the hot ones
    get the emptiest servers."""
    short = [a for a in adapters if a.name in weights and len(weights[a.name]) < a.min_replicas]
    if not short:
        return
    board = _LoadBoard(servers, weights, loads)
    for a in sorted(short, key=lambda a: (-loads[a.name], a.name)):
        current = weights[a.name]
        added = board.least_loaded(a.rank, exclude=current, count=a.min_replicas - len(current))
        if added:
            split = _split(current, added, loads[a.name], board, capacity)
            board.move(current, split, loads[a.name])
            weights[a.name] = split


def _split(current: Mapping[str, float], added: Sequence[str], load: float, board: _LoadBoard,
           capacity: float) -> dict[str, float]:
    servers = [*current, *added]
    if load <= EPS:
        return dict.fromkeys(servers, 1.0 / len(servers))
    room = {s: max(0.0, capacity - board.load(s) + current.get(s, 0.0) * load) for s in servers}
    total = sum(room.values())
    phi = {s: (room[s] / total if total > EPS else 1.0 / len(servers)) for s in servers}
    floored = {s: max(p, MIN_COPY_SHARE) for s, p in phi.items()}
    norm = sum(floored.values())
    return {s: p / norm for s, p in floored.items()}


class _LoadBoard:
    """Per healthy server: load (Σ φ·u), adapter count and max_rank, as arrays for fast selection."""

    def __init__(self, servers: Sequence[PlacementServer], weights: Mapping[str, Mapping[str, float]],
                 loads: Mapping[str, float]) -> None:
        ordered = sorted(servers, key=lambda s: s.id)
        self._ids = [s.id for s in ordered]
        self._index = {sid: i for i, sid in enumerate(self._ids)}
        self._capability = np.array([s.max_rank for s in ordered])
        self._load = np.zeros(len(ordered))
        self._count = np.zeros(len(ordered), dtype=np.int64)
        for name, routes in weights.items():
            for server, phi in routes.items():
                self._load[self._index[server]] += phi * loads.get(name, 0.0)
                self._count[self._index[server]] += 1

    def load(self, server: str) -> float:
        return float(self._load[self._index[server]])

    def least_loaded(self, rank: int, exclude: Mapping[str, float], count: int) -> list[str]:
        """Up to `count` servers able to hold `rank`, not in `exclude`: least load, then fewest
        adapters, then id."""
        allowed = self._capability >= rank
        allowed[[self._index[s] for s in exclude]] = False
        order = np.lexsort((np.arange(len(self._ids)), self._count, self._load))
        return [self._ids[i] for i in order[allowed[order]][:count]]

    def move(self, before: Mapping[str, float], after: Mapping[str, float], load: float) -> None:
        for server, phi in before.items():
            self._load[self._index[server]] -= phi * load
        for server, phi in after.items():
            self._load[self._index[server]] += phi * load
        for server in after.keys() - before.keys():
            self._count[self._index[server]] += 1
