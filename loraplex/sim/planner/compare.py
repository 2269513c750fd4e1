"""GPUs needed at the same SLO: the planner's plan against replicate-all and random placement.

Every policy gets the same servers: the profile's hardware with `max_loras` adapter slots each (the
planner may choose fewer per GPU, never more). The plan is checked as it would be deployed (one
engine per GPU with its A_max slots, each adapter routed to its GPU): no GPU may starve. A
baseline's count is the fewest servers with which the cluster twin (real router, placement,
scheduler and LRU slot residency, adapter loads charged by the profile) neither starves (in total
or on any server) nor falls below the target SLO attainment.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from loraplex.placement import OperatingPoints
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.metrics import RequestResult, Slo, summarize, trace_duration
from loraplex.sim.planner.greedy import Plan
from loraplex.sim.profile import Profile
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace

BASELINES = ("replicate-all", "random")


@dataclass
class Verdict:
    gpus: int
    starved: bool
    slo_attainment: float


@dataclass
class Baseline:
    policy: str
    gpus: int  # replicate-all: its count; random: the median over seeds
    per_seed: list[int]
    slo_attainment: list[float]  # at the chosen count, per seed


def check_plan(plan: Plan, trace: Trace, profile: Profile, slo: Slo) -> Verdict:
    results: list[RequestResult] = []
    starved = False
    duration = trace_duration(trace)
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


def cluster_verdict(policy: str, servers: int, trace: Trace, profile: Profile, slo: Slo, target: float,
                    max_loras: int, seed: int = 0, points: OperatingPoints | None = None) -> Verdict:
    """`starved` is True when the cluster starves, any server starves, or attainment < target."""
    config = ClusterConfig(servers, placement=policy, interval_s=1e9, seed=seed,
                           engine_overrides={"max_loras": max_loras}, operating_points=points)
    run = simulate_cluster(trace, profile, config, slo)
    attainment = run.summary.slo_attainment or 0.0
    failed = run.summary.starved or run.info["starved_servers"] > 0 or attainment < target
    return Verdict(servers, failed, attainment)


def min_servers(policy: str, trace: Trace, profile: Profile, slo: Slo, target: float, max_loras: int,
                start: int = 1, limit: int = 256, seed: int = 0, points: OperatingPoints | None = None) -> Verdict:
    """The fewest servers with which `policy` passes (`cluster_verdict`). The search starts at `start`
    and walks down while it passes, or up until it does: it assumes more servers never hurt."""
    def at(n: int) -> Verdict:
        return cluster_verdict(policy, n, trace, profile, slo, target, max_loras, seed, points)

    verdict = at(start)
    if not verdict.starved:
        while verdict.gpus > 1 and not (lower := at(verdict.gpus - 1)).starved:
            verdict = lower
        return verdict
    for servers in range(start + 1, limit + 1):
        verdict = at(servers)
        if not verdict.starved:
            return verdict
    raise RuntimeError(f"{policy}: still starving or below the SLO with {limit} servers")


def compare_baselines(trace: Trace, profile: Profile, slo: Slo, target: float, max_loras: int, start: int,
                      random_seeds: int = 3, points: OperatingPoints | None = None) -> list[Baseline]:
    """replicate-all once (its placement does not depend on the seed; routing does, slightly) and
    random once per seed, reporting the median count."""
    out = []
    for policy in BASELINES:
        seeds = range(random_seeds if policy == "random" else 1)
        runs = [min_servers(policy, trace, profile, slo, target, max_loras, start, seed=s, points=points)
                for s in seeds]
        counts = [r.gpus for r in runs]
        out.append(Baseline(policy, int(statistics.median_low(counts)), counts, [r.slo_attainment for r in runs]))
    return out


def baseline_json(baseline: Baseline) -> dict:
    return asdict(baseline)
