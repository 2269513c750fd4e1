"""A lower bound on the servers any placement needs: the workload's total request rate over the
most one server sustains when every request is for a single adapter of the workload's smallest rank.

One adapter is the cheapest mix a server can see (no adapter loads, no rank mixing, the smallest
LoRA cost), so no placement, replicated or not, fits the workload on fewer servers. It puts the
planner's count, and a tie with a baseline, in proportion.
"""

from __future__ import annotations

import math

from loraplex.latency.profile import Profile
from loraplex.sim.metrics import Slo
from loraplex.sim.planner.oracle import GpuLoad, TwinOracle
from loraplex.sim.planner.workload import AdapterDemand, WorkloadSummary

PRECISION = 0.02  # relative width of the bracket around one server's highest sustainable rate


def server_floor(summary: WorkloadSummary, profile: Profile, slo: Slo, slo_target: float,
                 duration_s: float = 120.0, seed: int = 0) -> int:
    """ceil(total rate / the lowest rate found to starve one single-adapter server): a lower bound,
    since the bracket's upper end is used. The twin runs at the workload's own rates (no headroom)."""
    oracle = TwinOracle(profile, duration_s, seed, headroom=1.0, slo=slo, slo_target=slo_target)
    rank = min(a.rank for a in summary.adapters)

    def starves(rate: float) -> bool:
        one = (AdapterDemand("floor", rank, rate),)
        return oracle.starves(GpuLoad.of(summary, one, 1))

    total = sum(a.rate_rps for a in summary.adapters)
    if not starves(total):
        return 1
    low, high = 0.0, total
    while high - low > PRECISION * high:
        middle = (low + high) / 2
        low, high = (low, middle) if starves(middle) else (middle, high)
    return math.ceil(total / high)
