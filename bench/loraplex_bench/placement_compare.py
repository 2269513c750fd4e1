"""Throughput at the SLO per placement policy, in the cluster twin (LoRAServe's main metric).

For each rank-skewed workload and each contender (a placement policy, with loraserve's hysteresis),
a geometric bisection over the offered rate finds the highest rate at which the N-server twin still
meets the SLO: P95 TTFT within the bound and no starvation. Every contender sees the same traces
(common random numbers, `rank_skew`) and the same operating points, measured once per workload.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from loraplex.engine.config import EngineConfig
from loraplex.latency.profile import Profile
from loraplex.placement import POLICY_NAMES, OperatingPoints
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.metrics import Slo, Summary
from loraplex.sim.operating_points import HEADROOM, operating_points
from loraplex.sim.rank_skew import SkewedWorkload
from loraplex.sim.trace import Trace
from loraplex_bench.report import Series, slug


@dataclass(frozen=True)
class Contender:
    label: str
    placement: str
    hysteresis: float = 0.0  # loraserve and min-cost-flow only; the baselines ignore it


# Policies with a hysteresis: one contender per value
WITH_HYSTERESIS = ("loraserve", "min-cost-flow")


def make_contenders(policies: Sequence[str], hysteresis: Sequence[float] = (0.0, 0.1)) -> list[Contender]:
    """One contender per policy, and per hysteresis for loraserve and min-cost-flow (0 is the
    paper's behaviour)."""
    unknown = sorted(set(policies) - set(POLICY_NAMES))
    if unknown or not policies:
        raise ValueError(f"unknown placement policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if set(policies) & set(WITH_HYSTERESIS) and (not hysteresis or min(hysteresis) < 0):
        raise ValueError("loraserve and min-cost-flow need at least one hysteresis value, each >= 0")
    out = []
    for name in policies:
        if name in WITH_HYSTERESIS:
            out += [Contender(f"{name}(h={h:g})", name, h) for h in hysteresis]
        else:
            out.append(Contender(name, name))
    return out


@dataclass(frozen=True)
class SloTarget:
    p95_ttft_s: float

    def met(self, summary: Summary) -> bool:
        p95 = summary.ttft_s.get("p95")
        return not summary.starved and p95 is not None and p95 <= self.p95_ttft_s


@dataclass(frozen=True)
class Probe:
    rps: float
    met: bool
    p95_ttft_s: float | None
    starved: bool
    starved_servers: int
    moves_per_hour: float = 0.0  # (adapter, server) routes the tables added, per simulated hour
    placement_s: float = 0.0     # mean wall time of one placement


@dataclass
class Search:
    """The highest rate that met the SLO (0.0 when even the lowest probe failed) and every probe."""

    max_rps: float
    probes: list[Probe] = field(default_factory=list)


@dataclass(frozen=True)
class TwinSetup:
    profile: Profile
    servers: int = 8
    interval_s: float = 30.0
    seed: int = 0
    engine_overrides: dict = field(default_factory=dict)

    def engine_config(self) -> EngineConfig:
        return self.profile.engine_config(**self.engine_overrides)


def bisect_rate(probe_at: Callable[[float], Probe], low: float, high: float, rel_tol: float = 0.05,
                floor: float | None = None) -> Search:
    """Geometric bisection for the highest passing rate, assuming passing is monotone in the rate.
    The bracket widens if `low` fails (down to `floor`, default low/16) or `high` passes."""
    if not 0 < low < high or rel_tol <= 0:
        raise ValueError(f"need 0 < low < high and rel_tol > 0, got {low}, {high}, {rel_tol}")
    floor = low / 16 if floor is None else floor
    probes: list[Probe] = []

    def met(rps: float) -> bool:
        probes.append(probe_at(rps))
        return probes[-1].met

    while not met(low):
        if low / 2 < floor:
            return Search(0.0, probes)
        low, high = low / 2, low
    while met(high):
        low, high = high, high * 2
    while high / low > 1 + rel_tol:
        mid = (low * high) ** 0.5
        low, high = (mid, high) if met(mid) else (low, mid)
    return Search(low, probes)


def probe(setup: TwinSetup, contender: Contender, trace: Trace, points: OperatingPoints, slo: SloTarget) -> Probe:
    config = ClusterConfig(servers=setup.servers, placement=contender.placement, interval_s=setup.interval_s,
                           hysteresis=contender.hysteresis, seed=setup.seed,
                           engine_overrides=setup.engine_overrides, operating_points=points)
    run = simulate_cluster(trace, setup.profile, config, Slo(slo.p95_ttft_s))
    return Probe(float(trace.workload["rps"]), slo.met(run.summary), run.summary.ttft_s.get("p95"),
                 run.summary.starved, run.info["starved_servers"],
                 run.info["adapter_moves"] * 3600 / max(trace.duration_s, 1e-9),
                 run.info["placement_s"] / max(1, run.info["placements"]))


@dataclass
class WorkloadResult:
    workload: SkewedWorkload
    operating_points: OperatingPoints
    searches: dict[str, Search]  # contender label -> search


def compare_workload(setup: TwinSetup, workload: SkewedWorkload, contenders: Sequence[Contender],
                     slo: SloTarget, rel_tol: float = 0.1,
                     progress: Callable[[str], None] | None = None) -> WorkloadResult:
    """One bisection per contender, over a bracket from the cluster's ideal capacity."""
    sample = workload.at(max(1.0, 200 / workload.duration_s))  # lengths only: the OP profiling sample
    points = operating_points(setup.profile, workload.ranks, sample, setup.engine_config(), setup.seed)
    ideal = _ideal_cluster_rps(setup.servers, points, sample)
    searches = {}
    for contender in contenders:
        # an overloaded probe costs the most (the twin drains its queues), so the bracket starts
        # below the ideal capacity; bisect_rate widens it if a contender does better
        searches[contender.label] = bisect_rate(
            lambda rps, c=contender: probe(setup, c, workload.at(rps), points, slo), ideal / 4, ideal * HEADROOM,
            rel_tol)
        if progress:
            progress(f"{workload.rank_skew.label} {contender.label}: {searches[contender.label].max_rps:.1f} rps "
                     f"({len(searches[contender.label].probes)} probes)")
    return WorkloadResult(workload, points, searches)


def _ideal_cluster_rps(servers: int, points: OperatingPoints, sample: Trace) -> float:
    """Every server at the saturation rate of the cheapest rank: no placement can beat it."""
    tokens = sum(r.prompt_len + r.output_len for r in sample.requests) / len(sample.requests)
    return servers * max(points.tokens_per_second.values()) / HEADROOM / tokens


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def search_series(name: str, title: str, searches: dict[str, Search],
                  metrics: Sequence[tuple[str, str]]) -> list[Series]:
    """A figure per (probe field, axis label) of `metrics`: its value at each rate probed, a line per
    contender (the `searches`' keys)."""
    return [Series(f"{name}-{slug(metric)}-vs-rps", f"{title}: {label}",
                   "offered load (req/s)", label,
                   {key: [(p.rps, getattr(p, metric)) for p in search.probes if getattr(p, metric) is not None]
                    for key, search in searches.items()}) for metric, label in metrics]


def format_table(results: Sequence[WorkloadResult], contenders: Sequence[Contender]) -> str:
    """Max rps at the SLO per workload (rows) and contender (columns), then each loraserve
    contender's ratio over each baseline; '-' where the baseline met the SLO at no rate probed."""
    ours = [c.label for c in contenders if c.placement == "loraserve"]
    baselines = [c.label for c in contenders if c.placement != "loraserve"]
    pairs = [(a, b) for a in ours for b in baselines]
    header = ["workload"] + [c.label for c in contenders] + [f"{a}/{b}" for a, b in pairs]
    rows = [header]
    for result in results:
        rates = {label: s.max_rps for label, s in result.searches.items()}
        ratios = [ratio(rates[a], rates[b]) for a, b in pairs]
        rows.append([result.workload.rank_skew.label] + [f"{rates[c.label]:.1f}" for c in contenders]
                    + ["-" if r is None else f"{r:.2f}x" for r in ratios])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def format_costs(results: Sequence[WorkloadResult], contenders: Sequence[Contender]) -> str:
    """Per workload and contender: adapter moves per hour and mean placement time, at the highest
    rate that met the SLO (the lowest probe when none did)."""
    rows = [["workload", "contender", "max rps", "moves/h", "placement ms"]]
    for result in results:
        for c in contenders:
            search = result.searches[c.label]
            at = max((p for p in search.probes if p.met), key=lambda p: p.rps, default=None) or min(
                search.probes, key=lambda p: p.rps)
            rows.append([result.workload.rank_skew.label, c.label, f"{search.max_rps:.1f}",
                         f"{at.moves_per_hour:.0f}", f"{at.placement_s * 1000:.1f}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) if i > 1 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
