"""Adapter popularity: the share of requests each adapter gets (workloads.md §3, §5).

Every mode returns a probability vector over adapter indices, most popular first; the generator
shuffles which adapter ids get which share (seeded).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Mode = Literal["head_tail", "zipf", "uniform", "slora_power", "punica"]


class Popularity(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Mode = "head_tail"
    head_k: int = Field(5, ge=1)  # head_tail: this many adapters share head_share, Zipf(1) among them
    head_share: float = Field(0.724, gt=0, lt=1)  # LoRAServe: top-5 carry 72.4%
    tail_zipf_s: float = Field(0.6, ge=0)
    zipf_s: float = Field(1.0, ge=0)  # zipf: p_i ~ 1 / i^s
    slora_alpha: float = Field(1.0, gt=0)  # slora_power: np.random.power(alpha); alpha = 1 is uniform
    punica_base: float = Field(1.5, gt=1)  # punica: counts floor(base^i), geometric


def weights(popularity: Popularity, count: int) -> np.ndarray:
    if count < 1:
        raise ValueError("a workload needs at least one adapter")
    p = _MODES[popularity.mode](popularity, count)
    return p / p.sum()


def _zipf(count: int, s: float) -> np.ndarray:
    return 1.0 / np.arange(1, count + 1) ** s


def _head_tail(pop: Popularity, count: int) -> np.ndarray:
    if count <= pop.head_k:
        return _zipf(count, 1.0)
    head = _zipf(pop.head_k, 1.0)
    tail = _zipf(count - pop.head_k, pop.tail_zipf_s)
    return np.concatenate([head / head.sum() * pop.head_share, tail / tail.sum() * (1 - pop.head_share)])


def _slora_power(pop: Popularity, count: int) -> np.ndarray:
    # S-LoRA draws index = floor(count * X), X ~ power(alpha), density alpha*x^(alpha-1): the share
    # of index i is the probability mass of [i/count, (i+1)/count), i.e. a difference of x^alpha.
    edges = (np.arange(count + 1) / count) ** pop.slora_alpha
    return np.diff(edges)[::-1].copy()


def _punica(pop: Popularity, count: int) -> np.ndarray:
    return np.floor(pop.punica_base ** np.arange(count))[::-1].astype(float)


_MODES = {
    "head_tail": _head_tail,
    "zipf": lambda pop, n: _zipf(n, pop.zipf_s),
    "uniform": lambda pop, n: np.ones(n),
    "slora_power": _slora_power,
    "punica": _punica,
}


def punica_batch_counts(batch_size: int, base: float = 1.5) -> list[int]:
    """Punica's skewed batch: counts floor(base^i) (1, 1, 2, 3, 5, 7, 11, ...) until the batch is
    full (the last count is cut to fit), sorted descending."""
    counts, i = [], 0
    while sum(counts) < batch_size:
        counts.append(min(int(base ** i), batch_size - sum(counts)))
        i += 1
    return sorted(counts, reverse=True)
