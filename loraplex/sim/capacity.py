"""The highest request rate a server sustains without starving, found with the twin."""

from __future__ import annotations

from collections.abc import Callable

from loraplex.engine.config import EngineConfig
from loraplex.latency.profile import Profile
from loraplex.sim.metrics import trace_duration
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace

TraceAt = Callable[[float], Trace]


def saturation_rps(profile: Profile, trace_at: TraceAt, config: EngineConfig | None = None,
                   low: float = 0.05, high: float = 16.0, rel_tol: float = 0.03) -> float:
    """Bisection on the rate (geometric): `trace_at(rps)` builds the workload at that rate."""
    if _starves(profile, trace_at(low), config):
        return low
    while not _starves(profile, trace_at(high), config):
        low, high = high, high * 4
    while high / low > 1 + rel_tol:
        mid = (low * high) ** 0.5
        if _starves(profile, trace_at(mid), config):
            high = mid
        else:
            low = mid
    return low


def _starves(profile: Profile, trace: Trace, config: EngineConfig | None) -> bool:
    # an overloaded run is cut at 1.5x its arrival window: it has starved by then
    horizon = 1.5 * trace_duration(trace)
    return simulate_server(trace, profile, config, horizon_s=horizon).summary.starved
