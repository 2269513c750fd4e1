"""Synthetic workloads: arrivals x lengths x adapter popularity x ranks x drift, seeded.

A `WorkloadSpec` is the exact parameter set; it is written into every trace header, so a result
file always says which workload produced it. Each part draws from its own random stream, so
changing one part (say, the popularity) leaves the others (arrival times, lengths) unchanged.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from loraplex.sim.arrivals import Arrivals, arrival_times, replay
from loraplex.sim.drift import Drift, demand
from loraplex.sim.lengths import Lengths, sample_lengths
from loraplex.sim.popularity import Popularity, weights
from loraplex.sim.trace import Trace, requests_from


class Adapters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    count: int = Field(100, ge=1)
    ranks: list[int] = Field(default_factory=lambda: [8, 16, 32, 64])
    rank_weights: list[float] | None = None  # share of adapters per rank; None: equal counts
    popularity: Popularity = Field(default_factory=Popularity)
    name_prefix: str = "lora-"

    @model_validator(mode="after")
    def _check(self) -> Adapters:
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError("ranks must be a non-empty list of positive integers")
        if self.rank_weights is not None and (len(self.rank_weights) != len(self.ranks)
                                              or min(self.rank_weights) < 0 or sum(self.rank_weights) <= 0):
            raise ValueError("rank_weights needs one non-negative weight per rank, not all zero")
        return self

    def names(self) -> list[str]:
        width = len(str(self.count - 1))
        return [f"{self.name_prefix}{i:0{width}d}" for i in range(self.count)]


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seed: int = 0
    duration_s: float = Field(600.0, gt=0)
    rps: float = Field(1.0, gt=0)  # mean request rate over the run
    arrivals: Arrivals = Field(default_factory=Arrivals)
    lengths: Lengths = Field(default_factory=Lengths)
    adapters: Adapters = Field(default_factory=Adapters)
    drift: Drift | None = None

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.lengths.profile == "replay" and self.arrivals.process != "replay":
            raise ValueError("lengths profile 'replay' needs arrivals.process 'replay'")
        return self


def _rng(seed: int, part: int) -> np.random.Generator:
    return np.random.default_rng([seed, part])


def adapter_ranks(spec: Adapters, seed: int) -> np.ndarray:
    """Rank of each adapter index: equal counts per rank (or rank_weights), randomly permuted."""
    if spec.rank_weights is None:
        ranks = np.resize(np.asarray(spec.ranks), spec.count)
    else:
        shares = np.asarray(spec.rank_weights) / sum(spec.rank_weights)
        counts = np.floor(shares * spec.count).astype(int)
        counts[np.argmax(shares)] += spec.count - counts.sum()
        ranks = np.repeat(spec.ranks, counts)
    return _rng(seed, 3).permutation(ranks)


def adapter_shares(spec: Adapters, seed: int) -> np.ndarray:
    """Stationary request share of each adapter index (which ids are popular is shuffled)."""
    return _rng(seed, 4).permutation(weights(spec.popularity, spec.count))


def generate(spec: WorkloadSpec, traces_dir: str | None = None) -> Trace:
    rows = None
    if spec.arrivals.process == "replay":
        times, rows = replay(spec.arrivals.replay_service, spec.rps, spec.duration_s, traces_dir)
    else:
        times = arrival_times(spec.arrivals, spec.rps, spec.duration_s, _rng(spec.seed, 1), traces_dir)
    prompt, output = sample_lengths(spec.lengths, len(times), _rng(spec.seed, 2), traces_dir, rows,
                                    spec.arrivals.replay_service)
    ranks = adapter_ranks(spec.adapters, spec.seed)
    chosen = _choose_adapters(spec, times)
    names = spec.adapters.names()
    requests = requests_from(
        (float(t), names[a], int(ranks[a]), int(p), int(o))
        for t, a, p, o in zip(times, chosen, prompt, output, strict=True))
    return Trace(requests, spec.model_dump(mode="json"))


def _choose_adapters(spec: WorkloadSpec, times: np.ndarray) -> np.ndarray:
    """Each arrival's adapter, drawn from the shares in force in its drift bucket."""
    base = adapter_shares(spec.adapters, spec.seed)
    bucket_starts, multipliers = demand(spec.drift, spec.adapters.count, spec.duration_s, _rng(spec.seed, 5))
    bucket = np.searchsorted(bucket_starts, times, side="right") - 1
    rng = _rng(spec.seed, 6)
    chosen = np.empty(len(times), dtype=np.int64)
    for b in np.unique(bucket):
        members = np.flatnonzero(bucket == b)
        shares = base * multipliers[b]
        chosen[members] = rng.choice(spec.adapters.count, size=len(members), p=shares / shares.sum())
    return chosen
