"""Rank-skewed workloads (the LoRAServe evaluation's traces): a request's *rank* follows a rank
popularity (uniform, power y = x^-α, exponential, or the paper's Shifting Skew), and within that rank
its adapter follows the pool's popularity (head + tail by default).

Traces at different rates share their random numbers (common random numbers): request k has the
same unit-rate gap, lengths and adapter draws at every rate, so a faster trace is the slower one
compressed in time and a rate search compares like with like instead of different draws.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from loraplex.sim.lengths import Lengths, sample_lengths
from loraplex.sim.popularity import Popularity
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.sim.workload import Adapters, adapter_ranks, adapter_shares

RANK_MODES = ("uniform", "power", "exponential", "shifting_skew")
PAPER_RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class RankSkew:
    """Share of requests per rank, ranks ascending. `power`: ∝ i^-alpha for i = 1..R (LoRAServe's
    rank-skew traces); `exponential`: ∝ exp(-lam·i) for i = 0..R-1 (the paper leaves λ unstated);
    `shifting_skew`: the top rank has 1/2 and the others share 1/2 at the start, moving linearly to
    the bottom rank having 1/2 at the end."""

    mode: str = "uniform"
    alpha: float = 1.0
    lam: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in RANK_MODES:
            raise ValueError(f"unknown rank popularity {self.mode!r}; choose one of {', '.join(RANK_MODES)}")
        if self.alpha <= 0 or self.lam <= 0:
            raise ValueError("rank popularity alpha and lam must be positive")

    @property
    def label(self) -> str:
        return {"power": f"power(a={self.alpha:g})", "exponential": f"exponential(l={self.lam:g})"}.get(
            self.mode, self.mode)

    def shares(self, num_ranks: int, progress: np.ndarray) -> np.ndarray:
        """[len(progress), num_ranks] rank shares at each request's position in the run (0..1)."""
        if self.mode == "shifting_skew":
            if num_ranks < 2:
                raise ValueError("shifting_skew needs at least two ranks")
            start = np.full(num_ranks, 0.5 / (num_ranks - 1))
            end = start.copy()
            start[-1], end[0] = 0.5, 0.5
            return (1 - progress)[:, None] * start + progress[:, None] * end
        i = np.arange(num_ranks, dtype=float)
        static = {"uniform": np.ones(num_ranks), "power": (i + 1) ** -self.alpha,
                  "exponential": np.exp(-self.lam * i)}[self.mode]
        return np.broadcast_to(static / static.sum(), (len(progress), num_ranks))


@dataclass(frozen=True)
class SkewedWorkload:
    """Poisson arrivals over `duration_s`, `adapters` adapters in equal numbers per rank."""

    rank_skew: RankSkew = field(default_factory=RankSkew)
    adapters: int = 200
    ranks: tuple[int, ...] = PAPER_RANKS
    duration_s: float = 120.0
    lengths: Lengths = field(default_factory=lambda: Lengths(scale=0.125, max_model_len=2048))
    popularity: Popularity = field(default_factory=Popularity)
    seed: int = 0
    traces_dir: str | None = None

    def __post_init__(self) -> None:
        if self.adapters < len(self.ranks):
            raise ValueError(f"{self.adapters} adapters cannot cover {len(self.ranks)} ranks")
        if self.duration_s <= 0:
            raise ValueError("duration_s must be positive")

    def at(self, rps: float) -> Trace:
        if rps <= 0:
            raise ValueError(f"rate must be positive, got {rps}")
        times = self._arrivals(rps)
        n = len(times)
        prompt, output = sample_lengths(self.lengths, n, self._rng(2), self.traces_dir)
        ranks, chosen = self._adapter_ranks(), self._choose(times)
        width = len(str(self.adapters - 1))
        requests = [TraceRequest(f"r{k}", float(times[k]), f"lora-{chosen[k]:0{width}d}", int(ranks[chosen[k]]),
                                 int(prompt[k]), int(output[k])) for k in range(n)]
        return Trace(requests, self.header(rps))

    def header(self, rps: float | None) -> dict:
        return {"seed": self.seed, "duration_s": self.duration_s, "rps": rps, "arrivals": {"process": "poisson"},
                "lengths": self.lengths.model_dump(mode="json"),
                "adapters": {"count": self.adapters, "ranks": list(self.ranks),
                             "popularity": self.popularity.model_dump(mode="json")},
                "rank_popularity": {"mode": self.rank_skew.mode, "alpha": self.rank_skew.alpha,
                                    "lam": self.rank_skew.lam}}

    def _rng(self, part: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, 100 + part])

    def _arrivals(self, rps: float) -> np.ndarray:
        # enough unit-rate gaps for the window with overwhelming probability; a prefix of one stream
        expected = rps * self.duration_s
        gaps = self._rng(1).standard_exponential(int(expected + 10 * expected ** 0.5 + 20))
        times = np.cumsum(gaps) / rps
        return times[times < self.duration_s]

    def _pool(self) -> Adapters:
        return Adapters(count=self.adapters, ranks=list(self.ranks), popularity=self.popularity)

    def _adapter_ranks(self) -> np.ndarray:
        return adapter_ranks(self._pool(), self.seed)

    def _choose(self, times: np.ndarray) -> np.ndarray:
        """Rank first (by the rank popularity at the request's time), then an adapter of that rank
        by its share of the pool's popularity within the rank."""
        draws = self._rng(3).random((len(times), 2))
        shares = self.rank_skew.shares(len(self.ranks), times / self.duration_s)
        rank_index = _pick_rows(np.cumsum(shares, axis=1), draws[:, 0])
        adapter_rank, weight = self._adapter_ranks(), adapter_shares(self._pool(), self.seed)
        chosen = np.empty(len(times), dtype=np.int64)
        for i, rank in enumerate(self.ranks):
            members = np.flatnonzero(adapter_rank == rank)
            rows = np.flatnonzero(rank_index == i)
            cdf = np.cumsum(weight[members]) / weight[members].sum()
            chosen[rows] = members[np.minimum(np.searchsorted(cdf, draws[rows, 1], side="right"), len(members) - 1)]
        return chosen


def _pick_rows(cdf: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Per row, the first column whose cumulative share exceeds u (u in [0, 1))."""
    picked = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    return np.minimum(picked, cdf.shape[1] - 1)


def rank_mix(trace: Trace, ranks: Sequence[int]) -> dict[int, float]:
    """Share of the trace's requests per rank (what the rank popularity produced)."""
    counts = {rank: 0 for rank in ranks}
    for r in trace.requests:
        counts[r.rank] = counts.get(r.rank, 0) + 1
    return {rank: c / max(1, len(trace.requests)) for rank, c in counts.items()}
