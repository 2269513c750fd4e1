"""GPUs needed at the same SLO: the planner's plan against replicate-all and random placement.

The plan is checked as it would be deployed (one engine per GPU with A_max slots, each adapter
routed to its GPU): no GPU may starve. The baselines' count is the fewest servers with which the
cluster twin (real router and placement code) neither starves nor misses the SLO target.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.placement import OperatingPoints
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.metrics import RequestResult, Slo, summarize
from loraplex.sim.planner.greedy import Plan
from loraplex.sim.profile import Profile
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace


@dataclass
class Verdict:
    gpus: int
    starved: bool
    slo_attainment: float


def check_plan(plan: Plan, trace: Trace, profile: Profile, slo: Slo) -> Verdict:
    results: list[RequestResult] = []
    starved = False
    duration = float(trace.workload.get("duration_s") or trace.duration_s)
    for gpu in range(plan.num_gpus):
        names = set(plan.gpu_adapters(gpu))
        part = Trace([r for r in trace.requests if r.adapter in names], {"duration_s": duration})
        if not part.requests:
            continue
        run = simulate_server(part, profile, profile.engine_config(max_loras=plan.a_max[gpu]), slo)
        starved |= run.summary.starved
        results += run.results
    attainment = summarize(results, duration, duration, slo).slo_attainment or 0.0
    return Verdict(plan.num_gpus, starved, attainment)


def min_servers(policy: str, trace: Trace, profile: Profile, slo: Slo, target: float, start: int = 1,
                limit: int = 256, seed: int = 0, points: OperatingPoints | None = None) -> Verdict:
    """The fewest servers with which `policy` neither starves nor falls below `target` attainment."""
    servers = start
    while servers <= limit:
        run = simulate_cluster(trace, profile, ClusterConfig(servers, placement=policy, interval_s=1e9, seed=seed,
                                                              operating_points=points), slo)
        if not run.summary.starved and run.info["starved_servers"] == 0 and run.summary.slo_attainment >= target:
            return Verdict(servers, False, run.summary.slo_attainment)
        servers += 1
    raise RuntimeError(f"{policy}: still starving or below the SLO with {limit} servers")
