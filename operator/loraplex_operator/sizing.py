"""Pure: what the minimum-GPU planner is asked for one pool (`sizing.estimator: planner`).

The planner takes requests/s per adapter and mean lengths; the pool observes tokens/s per adapter
(the router counts prompt + output tokens). The forecast the placement uses is converted with the
lengths of `spec.sizing`. Rates are rounded up to the next step of a 5% geometric grid: a plan is
then reused while demand wobbles within a step, and never under-sized by the rounding.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

from loraplex.latency.profile import Profile
from loraplex.placement.snapshot import PlacementAdapter
from loraplex.sim.metrics import Slo
from loraplex.sim.planner import AdapterDemand, TwinOracle, WorkloadSummary
from loraplex.spec.crd import AdapterPoolSpec, SizingSpec, SloSpec

RATE_STEP = 1.05
# An adapter with no demand still needs a slot somewhere; the twin needs a positive rate to draw from.
MIN_RATE_RPS = 1e-3
# The pool's SLO is stated as P95 latencies: a planned server must meet it for 95% of its requests.
SLO_ATTAINMENT = 0.95


def rounded_rate(rate_rps: float) -> float:
    """`rate_rps` raised to the next point of the grid MIN_RATE_RPS * RATE_STEP**k."""
    if not math.isfinite(rate_rps) or rate_rps < 0:
        raise ValueError(f"a request rate must be finite and >= 0, got {rate_rps}")
    if rate_rps <= MIN_RATE_RPS:
        return MIN_RATE_RPS
    # the tolerance keeps a grid point on itself despite the float error of log()
    steps = math.ceil(math.log(rate_rps / MIN_RATE_RPS, RATE_STEP) - 1e-6)
    return MIN_RATE_RPS * RATE_STEP ** steps


def workload_summary(adapters: Sequence[PlacementAdapter], sizing: SizingSpec) -> WorkloadSummary | None:
    """The planner's input from the placement's adapters (forecast tokens/s, rank); None without adapters."""
    if not adapters:
        return None
    tokens_per_request = sizing.prompt_tokens + sizing.output_tokens
    demands = tuple(AdapterDemand(a.name, a.rank, rounded_rate(a.demand_tps / tokens_per_request))
                    for a in sorted(adapters, key=lambda a: a.name))
    return WorkloadSummary(demands, float(sizing.prompt_tokens), float(sizing.output_tokens))


def check_profile(profile: Profile, sizing: SizingSpec) -> None:
    """Raises ValueError when the profile's engine cannot run a request of the spec's mean lengths."""
    limit = int(profile.engine["max_model_len"])
    if sizing.prompt_tokens + sizing.output_tokens > limit:
        raise ValueError(f"sizing.promptTokens + sizing.outputTokens = {sizing.prompt_tokens + sizing.output_tokens} "
                         f"exceeds the max_model_len {limit} of profile {profile.name!r}")


def planner_slo(slo: SloSpec) -> Slo:
    """The pool's latency SLO as the twin judges it per request."""
    return Slo(slo.ttft_p95_seconds, slo.tbt_p95_seconds)


def planner_oracle(profile: Profile, spec: AdapterPoolSpec) -> TwinOracle:
    """The twin oracle a pool is planned with: a server counts as full when it would starve or miss
    the pool's SLO for more than 5% of its requests."""
    return TwinOracle(profile, spec.sizing.oracle_seconds, slo=planner_slo(spec.placement.slo),
                      slo_target=SLO_ATTAINMENT)


def plan_key(summary: WorkloadSummary, spec: AdapterPoolSpec) -> str:
    """A digest of everything the plan depends on: equal keys, equal plans."""
    sizing, slo = spec.sizing, spec.placement.slo
    text = json.dumps([sizing.profile, sizing.oracle_seconds, spec.engine.max_loras, slo.ttft_p95_seconds,
                       slo.tbt_p95_seconds, summary.prompt_len, summary.output_len,
                       [[a.name, a.rank, a.rate_rps] for a in summary.adapters]])
    return hashlib.sha256(text.encode()).hexdigest()
