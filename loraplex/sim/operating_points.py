"""Operating points for placement, measured on the twin: OP[r] = the tokens/s one server sustains
serving rank-r adapters only, with the workload's own lengths, times a headroom factor that keeps
queueing (and so the latency SLO) in check."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from loraplex.engine.config import EngineConfig
from loraplex.latency.profile import Profile
from loraplex.placement import OperatingPoints
from loraplex.sim.capacity import saturation_rps
from loraplex.sim.trace import Trace, TraceRequest

HEADROOM = 0.8  # run servers at 80% of saturation: short queues, the SLO holds
SAMPLE_REQUESTS = 200
ADAPTERS_PER_POINT = 8


def operating_points(profile: Profile, ranks: Iterable[int], workload: Trace, config: EngineConfig | None = None,
                     seed: int = 0) -> OperatingPoints:
    rng = np.random.default_rng(seed)
    rows = [workload.requests[i] for i in rng.integers(0, len(workload.requests), SAMPLE_REQUESTS)]
    tokens = float(np.mean([r.prompt_len + r.output_len for r in rows]))
    points = {}
    for rank in ranks:
        rps = saturation_rps(profile, lambda rate, r=rank: _single_rank_trace(rows, r, rate, seed), config,
                             rel_tol=0.05)
        points[rank] = HEADROOM * rps * tokens
    return OperatingPoints(points, f"twin:{profile.name}")


def _single_rank_trace(rows: list[TraceRequest], rank: int, rps: float, seed: int) -> Trace:
    gaps = np.random.default_rng(seed + 1).exponential(1.0 / rps, len(rows))
    times = np.cumsum(gaps)
    return Trace([TraceRequest(f"op{i}", float(t), f"op-r{rank}-{i % ADAPTERS_PER_POINT}", rank, r.prompt_len, r.output_len)
                  for i, (t, r) in enumerate(zip(times, rows, strict=True))], {"duration_s": float(times[-1])})
