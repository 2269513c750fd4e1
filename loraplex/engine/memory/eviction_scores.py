"""How much keeping a cached node on the device is worth: FastLibra's cost model and Chameleon's
adapter score. Pure functions of a node's statistics; a higher score means evict later.

FastLibra (Eq. 3-6): `Eval = LoRA_Eval x cost x prob x (1 - sigmoid(t))`, where `cost` is the
host->device copy time (proportional to the node's pages), `prob` its share of visits, `t` the seconds
since its last use (over a time scale tau) and `LoRA_Eval = max(1, Low_lora / Now_lora)` for adapter
nodes only (1 for KV), `Low_lora` being the expected number of distinct adapters in a batch. Scores are
compared in the log domain: `1 - sigmoid(t)` underflows to 0 after ~40 s in floating point.

Chameleon (Sec. 3.1.3): `0.45 frequency + 0.10 recency + 0.45 size`, each min-max normalised over the
candidates, so small, rarely and long-ago used adapters leave first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeUse:
    """What a score needs to know about one cached node."""

    pages: int  # its size; the copy back costs time in proportion
    visits: float  # requests that used it
    idle_s: float  # seconds since its last use
    is_adapter: bool


def expected_batch_adapters(adapter_visits: Iterable[float], batch_size: float) -> float:
    """FastLibra's Low_lora: the expected number of distinct adapters in a batch of `batch_size`
    requests drawn by popularity, sum_i 1 - (1 - p_i)^BS."""
    visits = [v for v in adapter_visits if v > 0]
    total = sum(visits)
    if total <= 0 or batch_size <= 0:
        return 0.0
    return sum(1.0 - (1.0 - v / total) ** batch_size for v in visits)


def adapter_reward(low_lora: float, device_adapters: int) -> float:
    """LoRA_Eval = max(1, Low_lora / Now_lora); with no adapter on the device the reward is Low_lora."""
    return max(1.0, low_lora / max(device_adapters, 1))


def fastlibra_log_score(use: NodeUse, total_visits: float, reward: float, tau_s: float) -> float:
    """log Eval; -inf for a node nobody ever visited."""
    if use.visits <= 0 or total_visits <= 0 or use.pages <= 0:
        return -math.inf
    decay = -_softplus(use.idle_s / tau_s)  # log(1 - sigmoid(t)) = -softplus(t)
    log_reward = math.log(reward) if use.is_adapter else 0.0
    return log_reward + math.log(use.pages) + math.log(use.visits / total_visits) + decay


def chameleon_scores(uses: Sequence[NodeUse], weights: tuple[float, float, float] = (0.45, 0.10, 0.45)) -> list[float]:
    """Frequency, recency and size terms, min-max normalised over `uses` (the eviction candidates)."""
    if not uses:
        return []
    top_visits = max(max(u.visits for u in uses), 1.0)
    top_idle = max(max(u.idle_s for u in uses), 1e-9)
    top_pages = max(max(u.pages for u in uses), 1)
    f, r, s = weights
    return [f * u.visits / top_visits + r * (1.0 - u.idle_s / top_idle) + s * u.pages / top_pages for u in uses]


def _softplus(x: float) -> float:
    return x + math.log1p(math.exp(-x)) if x > 0 else math.log1p(math.exp(x))
