"""Demand counters in fixed time windows. The router adds tokens per adapter (`demand_tokens`: prompt +
output, less what a prefix-aware profile predicts cached) to the bucket of the current window;
placement reads the last complete windows as tokens/s."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 10.0
DEFAULT_WINDOWS = 6  # one minute of history, the paper's time-step scale


def demand_tokens(prompt_tokens: int, output_tokens: int, cached_blocks: int = 0, block_tokens: int = 0,
                  reported_cached: int | None = None) -> int:
    """The work one request adds to its adapter's demand: its output and the prompt tokens not cached
    on the server that took it. `reported_cached`: the cached prompt tokens the server reported
    (`usage.prompt_tokens_details.cached_tokens`); without it, the prediction of `cached_blocks`, the
    prefix blocks a prefix-aware profile's index matched there (0 for other profiles), of
    `block_tokens` tokens each, which undercounts near saturation. Either is capped by the prompt. A
    prefill served from the prefix cache costs the server (almost) nothing, so counting it would size
    the pool for a re-sent chat history as if it were recomputed every turn."""
    predicted = max(0, cached_blocks) * max(0, block_tokens)
    cached = min(prompt_tokens, predicted if reported_cached is None else max(0, reported_cached))
    return max(0, prompt_tokens - cached) + max(0, output_tokens)


def bucket_of(now: float, window_s: float) -> int:
    """Index of the window containing `now` (seconds since the epoch)."""
    if window_s <= 0:
        raise ValueError(f"window must be positive, got {window_s}")
    return math.floor(now / window_s)


def complete_buckets(now: float, window_s: float, count: int) -> list[int]:
    """The last `count` windows that have ended, oldest first; the current one is still filling."""
    if count <= 0:
        raise ValueError(f"window count must be positive, got {count}")
    current = bucket_of(now, window_s)
    return list(range(current - count, current))


def bucket_ttl_s(window_s: float, count: int) -> int:
    """How long a bucket key must live: long enough to be read as the oldest of `count` windows."""
    return math.ceil(window_s * (count + 2))


@dataclass(frozen=True)
class DemandWindows:
    """Observed tokens/s per adapter in consecutive complete windows, oldest first.
    Adapters with no tokens in any window are absent."""

    window_s: float
    rates: Mapping[str, tuple[float, ...]] = field(default_factory=dict)

    def mean_tps(self, adapter: str) -> float:
        series = self.rates.get(adapter)
        return sum(series) / len(series) if series else 0.0

    @classmethod
    def from_counts(cls, window_s: float, counts: list[Mapping[str, int]]) -> DemandWindows:
        """Builds the rates from per-window token counts (oldest first), as read from the store."""
        names = {name for window in counts for name in window}
        rates = {name: tuple(window.get(name, 0) / window_s for window in counts) for name in names}
        return cls(window_s, rates)
