"""Per-queue quotas from an M/M/1 bound (Chameleon).

Each queue is an M/M/1 system whose server is `Tok / S` concurrent requests of at most S tokens,
each lasting D seconds, with arrivals at rate lambda. Its time in system 1 / (mu - lambda) stays
under the SLO when

    Tok_min >= S * D * (1/SLO + lambda)

Every queue gets its floor; what the pool has left is split by weight (the floors themselves, or
equally). When the floors alone exceed the pool, they are scaled down to fit and the plan says
`overloaded` (a signal for autoscaling). Every queue keeps at least one unit so no class is shut out.
The same function sizes seats (running requests) with S = 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class QueueLoad:
    size: float  # S: the largest request of the queue (tokens; 1 when sizing seats)
    service_s: float  # D: seconds from admission to finish
    arrival_rate: float  # lambda: requests per second


@dataclass(frozen=True)
class QuotaPlan:
    quotas: list[int]
    minimums: list[int]
    overloaded: bool


def min_quota(load: QueueLoad, slo_s: float) -> int:
    return math.ceil(load.size * load.service_s * (1.0 / slo_s + load.arrival_rate))


def plan_quotas(loads: Sequence[QueueLoad], total: int, slo_s: float, split: str = "min") -> QuotaPlan:
    """Quotas summing to `total` (each at least 1); `split` is "min" (the rest in proportion to the
    floors) or "equal"."""
    if not loads:
        raise ValueError("quotas need at least one queue")
    if total < len(loads):
        raise ValueError(f"a pool of {total} cannot give {len(loads)} queues one unit each")
    if split not in ("min", "equal"):
        raise ValueError(f"quota split {split!r} is not 'min' or 'equal'")
    minimums = [min_quota(load, slo_s) for load in loads]
    floors = [max(1, m) for m in minimums]
    overloaded = sum(minimums) > total
    if sum(floors) > total:  # the floors, scaled down to fit
        return QuotaPlan(_apportion(total, [float(f) for f in floors]), minimums, overloaded)
    weights = [float(f) for f in floors] if split == "min" else [1.0] * len(loads)
    extra = _apportion(total - sum(floors), weights, floor=0)
    return QuotaPlan([f + e for f, e in zip(floors, extra, strict=True)], minimums, overloaded)


def _apportion(total: int, weights: list[float], floor: int = 1) -> list[int]:
    """`total` split in proportion to `weights` (largest remainders), every share at least `floor`."""
    n = len(weights)
    base = [floor] * n
    left = total - floor * n
    weight_sum = sum(weights)
    if weight_sum <= 0:
        weights, weight_sum = [1.0] * n, float(n)
    exact = [left * w / weight_sum for w in weights]
    shares = [int(x) for x in exact]
    rest = left - sum(shares)
    for i in sorted(range(n), key=lambda i: shares[i] - exact[i])[:rest]:
        shares[i] += 1
    return [b + s for b, s in zip(base, shares, strict=True)]
