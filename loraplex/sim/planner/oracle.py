"""The planner's two questions about one GPU: its throughput and whether it starves.

`TwinOracle` answers by running the twin on the GPU's adapters at their rates, with the workload's
arrival burstiness (Poisson, or the GPU's share of a Gamma process); the trained surrogate
(`surrogate.py`) answers the same questions from the paper's 7 features.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from loraplex.latency.profile import Profile
from loraplex.sim.metrics import RequestResult, Slo
from loraplex.sim.planner.workload import AdapterDemand, WorkloadSummary
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace, requests_from


@dataclass(frozen=True)
class GpuLoad:
    adapters: tuple[AdapterDemand, ...]
    a_max: int  # adapter slots on the GPU (max_loras)
    prompt_len: float
    output_len: float
    length_rows: tuple[tuple[int, int], ...] = field(default=(), compare=False, hash=False)
    arrival_cv: float = 1.0  # of the whole workload's arrivals, of which the GPU gets its share
    workload_rate_rps: float = 0.0  # the whole workload's rate (0: the GPU's own)

    @classmethod
    def of(cls, workload: WorkloadSummary, adapters: tuple[AdapterDemand, ...], a_max: int) -> GpuLoad:
        """`adapters` on one GPU with `a_max` slots, under `workload`'s lengths and arrival process."""
        return cls(adapters, a_max, workload.prompt_len, workload.output_len, workload.length_rows,
                   workload.arrival_cv, workload.total_rate_rps)

    def features(self) -> list[float]:
        """The paper's 7 features: sum_rate, std_rate, max_size, mean_size, std_size, adapter_slots,
        served_adapters (population standard deviations)."""
        rates = np.asarray([a.rate_rps for a in self.adapters])
        ranks = np.asarray([a.rank for a in self.adapters], dtype=float)
        return [float(rates.sum()), float(rates.std()), float(ranks.max()), float(ranks.mean()),
                float(ranks.std()), float(self.a_max), float(len(self.adapters))]


class Oracle(Protocol):
    def throughput(self, gpu: GpuLoad) -> float: ...

    def starves(self, gpu: GpuLoad) -> bool: ...


class TwinOracle:
    """Runs the twin for every question (exact for the model, slower than a surrogate). Rates are
    raised by `headroom` so that a GPU judged just short of starving on one random draw of the
    workload does not starve on another. With an `slo`, a GPU whose SLO attainment falls below
    `slo_target` counts as starved too (our addition: the paper packs to the 90% throughput rule,
    where queues, and so TTFT, already grow)."""

    def __init__(self, profile: Profile, duration_s: float = 120.0, seed: int = 0, headroom: float = 1.1,
                 slo: Slo | None = None, slo_target: float = 0.0) -> None:
        self.profile = profile
        self.duration_s = duration_s
        self.seed = seed
        self.headroom = headroom
        self.slo = slo
        self.slo_target = slo_target
        self._cache: dict[GpuLoad, tuple[float, bool]] = {}

    def throughput(self, gpu: GpuLoad) -> float:
        return self._run(gpu)[0]

    def starves(self, gpu: GpuLoad) -> bool:
        return self._run(gpu)[1]

    def _run(self, gpu: GpuLoad) -> tuple[float, bool]:
        s_max = max(a.rank for a in gpu.adapters)  # the paper's S_max: slots sized for the GPU's largest rank
        if not fits_memory(self.profile, gpu.a_max, s_max):
            return 0.0, True  # a memory error: the paper treats it like starvation
        if gpu not in self._cache:
            trace = gpu_trace(gpu, self.duration_s, self.seed, self.headroom)
            config = self.profile.engine_config(max_loras=gpu.a_max, max_lora_rank=s_max)
            # throughput over the arrival window, as the paper's twin measures it: a drain tail after
            # the last arrival is not starvation (on a slow GPU model, a few long requests at light
            # load would otherwise look starved in a short run)
            run = simulate_server(trace, self.profile, config, horizon_s=self.duration_s)
            missed = self.slo is not None and attainment_by(run.results, self.slo, self.duration_s) < self.slo_target
            summary = run.summary
            self._cache[gpu] = (summary.throughput_tokens_per_s, summary.starved or missed)
        return self._cache[gpu]


def attainment_by(results: list[RequestResult], slo: Slo, horizon_s: float) -> float:
    """SLO attainment over the requests whose TTFT is decided by `horizon_s`: those that got their
    first token, and those still waiting past their deadline. A request the run stopped before its
    deadline is left out (the horizon cut it off, not the GPU), and so is the TPOT of one that had
    not finished: counting them as misses would call any GPU with long replies full."""
    met = decided = 0
    for r in results:
        if r.ttft_s is None and (slo.ttft_s is None or r.arrival_s + slo.ttft_s > horizon_s):
            continue
        decided += 1
        met += (r.ttft_s is not None and (slo.ttft_s is None or r.ttft_s <= slo.ttft_s)
                and (slo.tpot_s is None or r.tpot_s is None or r.tpot_s <= slo.tpot_s))
    return met / decided if decided else 1.0


def fits_memory(profile: Profile, slots: int, max_rank: int) -> bool:
    """No memory error: the KV cache left after the adapter slots holds one full-length request."""
    return profile.memory.kv_tokens(slots, max_rank) >= int(profile.engine["max_model_len"])


def gpu_trace(gpu: GpuLoad, duration_s: float, seed: int, rate_factor: float = 1.0) -> Trace:
    """The GPU's requests over `duration_s` at its adapters' rates (x rate_factor): with Poisson
    arrivals, each adapter's own stream; otherwise the GPU's random share of a Gamma renewal process
    at the whole workload's rate (the GPU sees its share of the bursts). Lengths drawn from the
    workload's rows, or the means when there are none."""
    rng = np.random.default_rng(seed)
    rows = (_own_streams if gpu.arrival_cv == 1.0 else _shared_bursts)(gpu, duration_s, rng, rate_factor)
    rows.sort()
    if gpu.length_rows:
        picks = rng.integers(0, len(gpu.length_rows), len(rows))
        lengths = [gpu.length_rows[i] for i in picks]
    else:
        lengths = [(max(1, round(gpu.prompt_len)), max(1, round(gpu.output_len)))] * len(rows)
    return Trace(requests_from((t, name, rank, p, o) for (t, name, rank), (p, o) in zip(rows, lengths, strict=True)),
                 {"duration_s": duration_s})


def _own_streams(gpu: GpuLoad, duration_s: float, rng: np.random.Generator,
                 rate_factor: float) -> list[tuple[float, str, int]]:
    rows = []
    for a in gpu.adapters:
        rate = a.rate_rps * rate_factor
        times = np.cumsum(rng.exponential(1.0 / rate, int(rate * duration_s * 1.5) + 10))
        rows += [(float(t), a.name, a.rank) for t in times[times < duration_s]]
    return rows


def _shared_bursts(gpu: GpuLoad, duration_s: float, rng: np.random.Generator,
                   rate_factor: float) -> list[tuple[float, str, int]]:
    rates = np.asarray([a.rate_rps for a in gpu.adapters])
    total = max(gpu.workload_rate_rps, float(rates.sum())) * rate_factor
    shape = 1.0 / gpu.arrival_cv ** 2
    gaps = rng.gamma(shape, 1.0 / (shape * total), int(total * duration_s * 1.5) + 10)
    times = np.cumsum(gaps)
    times = times[times < duration_s]
    times = times[rng.random(len(times)) < rates.sum() * rate_factor / total]
    picks = rng.choice(len(rates), len(times), p=rates / rates.sum())
    return [(float(t), gpu.adapters[i].name, gpu.adapters[i].rank) for t, i in zip(times, picks, strict=True)]
