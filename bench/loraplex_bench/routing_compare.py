"""`loraplex bench routing`: rank-aware vs loraserve vs least-loaded routing in the cluster twin, on
rank-skewed workloads (issue 13): throughput at the SLO and P95 time between tokens.

Setup. N twin servers behind the real router policy (`loraplex.routing.pipeline`), re-placed every
`--interval` by a placement policy; each placement is its own comparison, because routing can only
choose among the servers the table assigns an adapter to: under `replicate-all` (Toppings' setting,
every server holds every adapter) routing decides everything, under `loraserve` (the default
product path) the placement has already grouped adapters by rank. Traces are LoRAServe's
rank-skewed ones (`rank_skew`): requests pick a rank by a rank popularity, then an adapter of it;
every contender sees the same traces (common random numbers across rates).

Latency model. A profile (default the what-if H100 / Llama-3.1-8B one, published constants) plus a
rank term (`--rank-term`), since that profile has none: Toppings' Eq. 2 fitted to its Fig. 6 numbers
(notes §6.1: Llama2-7B on an A100), BGMV (padded kernels, batch x max rank, 1/256 ms) by default or
MBGMV (unpadded, sum of ranks, 0.00234 ms); `profile` keeps the profile's own terms. The rank-aware
router evaluates the same model (the paper fits it with R^2 = 0.96).

SLO. Time between tokens: `--slo-tbt`, by default 1.5x the decode step of `--slo-batch` (32)
sequences on the base model without LoRA (the paper's "1.5x the time per token without LoRA"; 32 is
its largest profiled batch). The rank-aware router excludes servers whose predicted step would break
it. A rate meets the SLO when P95 TBT (per request: the mean time between its output tokens) is
within it (i.e. at least 95% of requests meet it), P95 TTFT within `--slo-ttft` and nothing starves.

Per workload and placement: operating points measured once on the twin (`loraserve` placement needs
them); each routing's highest rate at the SLO by geometric bisection; then P95 TBT of every routing
at the rate loraserve routing sustains and at the rate rank-aware sustains; ratios against loraserve.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from loraplex.latency.profile import Profile, load_profile
from loraplex.placement import POLICY_NAMES, OperatingPoints
from loraplex.routing.pipeline import PROFILES
from loraplex.routing.rank_aware import LatencyModel, RankAwareConfig
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.lengths import Lengths
from loraplex.sim.metrics import Slo, Summary
from loraplex.sim.operating_points import HEADROOM, operating_points
from loraplex.sim.rank_skew import RANK_MODES, RankSkew, SkewedWorkload
from loraplex.sim.trace import Trace
from loraplex.spec.engine_settings import add_engine_settings
from loraplex.spec.errors import CommandError
from loraplex_bench.output import add_plots_arg, stage, write_bench_json
from loraplex_bench.placement_compare import Probe, Search, bisect_rate, ratio, search_series
from loraplex_bench.report import Series, plot_series

BASELINE = "loraserve"
OURS = "rank-aware"
DEFAULT_ROUTINGS = ("rank-aware", "loraserve", "least-loaded")
DEFAULT_PLACEMENTS = ("replicate-all", "loraserve")
# Toppings' Eq. 2 fitted to its Fig. 6 example (papers/toppings.md §6.1), seconds per unit
RANK_TERMS = {"bgmv": {"batch_x_max_rank": 1e-3 / 256}, "mbgmv": {"rank_sum": 0.00234375e-3}}
RANK_COEFFICIENTS = ("rank_sum", "batch_x_max_rank", "prefill_rank_tokens")


def with_rank_term(profile: Profile, term: str) -> Profile:
    """`profile` with Toppings' rank term `term` (bgmv, mbgmv) in place of its own rank terms;
    `profile` keeps it as it is."""
    if term == "profile":
        return profile
    if term not in RANK_TERMS:
        raise ValueError(f"unknown rank term {term!r}; choose bgmv, mbgmv or profile")
    kept = {k: v for k, v in profile.coefficients.items() if k not in RANK_COEFFICIENTS}
    return profile.model_copy(update={"name": f"{profile.name}+{term}", "coefficients": kept | RANK_TERMS[term]})


def no_lora_step_s(profile: Profile, batch: int) -> float:
    """One decode step of `batch` sequences on the base model alone (no adapter, no context terms)."""
    c = profile.coefficients
    return c.get("intercept", 0.0) + c.get("batch", 0.0) * batch


@dataclass(frozen=True)
class TbtSlo:
    tbt_p95_s: float
    ttft_p95_s: float

    def met(self, summary: Summary) -> bool:
        tbt, ttft = summary.tpot_s.get("p95"), summary.ttft_s.get("p95")
        return (not summary.starved and tbt is not None and ttft is not None
                and tbt <= self.tbt_p95_s and ttft <= self.ttft_p95_s)


@dataclass(frozen=True)
class RoutingProbe(Probe):
    p95_tbt_s: float | None = None
    mean_tbt_s: float | None = None
    slo_attainment: float | None = None  # requests meeting both bounds
    requests_per_server: tuple[int, ...] = ()


@dataclass(frozen=True)
class RoutingSetup:
    profile: Profile
    slo: TbtSlo
    servers: int = 8
    interval_s: float = 30.0
    seed: int = 0
    engine_overrides: dict = field(default_factory=dict)
    batch_refresh_s: float | None = None  # None: the router sees each server's batch as of the arrival


def probe(setup: RoutingSetup, placement: str, routing: str, trace: Trace, points: OperatingPoints,
          rank_aware: RankAwareConfig) -> RoutingProbe:
    config = ClusterConfig(servers=setup.servers, placement=placement, routing=routing, interval_s=setup.interval_s,
                           seed=setup.seed, engine_overrides=setup.engine_overrides, operating_points=points,
                           rank_aware=rank_aware, batch_refresh_s=setup.batch_refresh_s)
    run = simulate_cluster(trace, setup.profile, config, Slo(setup.slo.ttft_p95_s, setup.slo.tbt_p95_s))
    s = run.summary
    return RoutingProbe(float(trace.workload["rps"]), setup.slo.met(s), s.ttft_s.get("p95"), s.starved,
                        run.info["starved_servers"], p95_tbt_s=s.tpot_s.get("p95"), mean_tbt_s=s.tpot_s.get("mean"),
                        slo_attainment=s.slo_attainment, requests_per_server=tuple(run.info["requests_per_server"]))


@dataclass
class PlacementResult:
    placement: str
    searches: dict[str, Search]  # routing -> its bisection
    at_rates: dict[str, dict[str, RoutingProbe]]  # "loraserve" / "rank-aware" rate -> routing -> probe there


@dataclass
class WorkloadResult:
    workload: SkewedWorkload
    operating_points: OperatingPoints
    avg_output_tokens: float
    placements: list[PlacementResult]


def compare_workload(setup: RoutingSetup, workload: SkewedWorkload, placements: Sequence[str],
                     routings: Sequence[str], rel_tol: float = 0.1,
                     progress: Callable[[str], None] | None = None) -> WorkloadResult:
    sample = workload.at(max(1.0, 200 / workload.duration_s))  # lengths only: OP profiling, the bracket
    config = setup.profile.engine_config(**setup.engine_overrides)
    points = operating_points(setup.profile, workload.ranks, sample, config, setup.seed)
    avg_output = float(np.mean([r.output_len for r in sample.requests]))
    rank_aware = RankAwareConfig(LatencyModel.from_coefficients(setup.profile.coefficients, setup.profile.name),
                                 slo_tpot_s=setup.slo.tbt_p95_s, avg_output_tokens=avg_output)
    tokens = float(np.mean([r.prompt_len + r.output_len for r in sample.requests]))
    ideal = setup.servers * max(points.tokens_per_second.values()) / HEADROOM / tokens
    results = []
    for placement in placements:
        def run_at(rps: float, routing: str, placement: str = placement) -> RoutingProbe:
            return probe(setup, placement, routing, workload.at(rps), points, rank_aware)

        searches: dict[str, Search] = {}
        for routing in routings:
            searches[routing] = bisect_rate(lambda rps, r=routing: run_at(rps, r), ideal / 4, ideal * HEADROOM,
                                            rel_tol)
            if progress:
                progress(f"{workload.rank_skew.label} / {placement} placement / {routing} routing: "
                         f"{searches[routing].max_rps:.1f} rps at the SLO ({len(searches[routing].probes)} probes)")
        at_rates: dict[str, dict[str, RoutingProbe]] = {}
        for anchor in (BASELINE, OURS):
            rate = searches[anchor].max_rps if anchor in searches else 0.0
            if rate > 0 and all(next(iter(done.values())).rps != rate for done in at_rates.values()):
                at_rates[anchor] = {routing: _probe_at(searches[routing], rate) or run_at(rate, routing)
                                    for routing in routings}
        results.append(PlacementResult(placement, searches, at_rates))
    return WorkloadResult(workload, points, avg_output, results)


def _probe_at(search: Search, rps: float) -> RoutingProbe | None:
    """The bisection's own probe at exactly this rate, if it made one."""
    for p in search.probes:
        if p.rps == rps and isinstance(p, RoutingProbe):
            return p
    return None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(results: Sequence[WorkloadResult], routings: Sequence[str]) -> str:
    """One row per workload and placement: each routing's rps at the SLO, its ratio over loraserve,
    and P95 TBT of each routing at the rate loraserve routing sustains, with its ratio."""
    others = [r for r in routings if r != BASELINE]
    header = (["workload", "placement"] + [f"{r} rps" for r in routings]
              + [f"{r}/{BASELINE} rps" for r in others if BASELINE in routings]
              + [f"{r} P95 TBT ms" for r in routings] + [f"{r}/{BASELINE} TBT" for r in others if BASELINE in routings])
    rows = [header]
    for result in results:
        for placed in result.placements:
            rates = {r: placed.searches[r].max_rps for r in routings}
            at = placed.at_rates.get(BASELINE, {})
            tbt = {r: at[r].p95_tbt_s if r in at else None for r in routings}
            row = [result.workload.rank_skew.label, placed.placement] + [f"{rates[r]:.1f}" for r in routings]
            if BASELINE in routings:
                row += [_x(ratio(rates[r], rates[BASELINE])) for r in others]
            row += [_ms(tbt[r]) for r in routings]
            if BASELINE in routings:
                row += [_x(tbt[r] / tbt[BASELINE] if tbt[r] is not None and tbt[BASELINE] else None) for r in others]
            rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def format_at_rates(results: Sequence[WorkloadResult], routings: Sequence[str]) -> str:
    """P95 / mean TBT, P95 TTFT and SLO attainment of every routing at the two anchor rates."""
    lines = []
    for result in results:
        for placed in result.placements:
            for anchor, probes in placed.at_rates.items():
                rps = next(iter(probes.values())).rps
                cells = [f"{r}: P95 TBT {_ms(p.p95_tbt_s)} ms, mean {_ms(p.mean_tbt_s)} ms, P95 TTFT "
                         f"{_ms(p.p95_ttft_s)} ms, attainment {_pct(p.slo_attainment)}"
                         for r, p in probes.items() if r in routings]
                lines.append(f"{result.workload.rank_skew.label} / {placed.placement}, at {rps:.1f} rps ({anchor}'s "
                             f"rate at the SLO):\n  " + "\n  ".join(cells))
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _csv(kind: Callable) -> Callable[[str], list]:
    return lambda text: [kind(x.strip()) for x in text.split(",") if x.strip()]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="whatif-h100-llama8b", help="latency profile: file or shipped name")
    p.add_argument("--rank-term", choices=["bgmv", "mbgmv", "profile"], default="bgmv",
                   help="rank term of the step latency: Toppings' BGMV (batch x max rank) or MBGMV (sum of ranks) "
                        "fit, replacing the profile's own; profile: keep the profile's (the what-if H100 has none)")
    p.add_argument("--servers", type=int, default=8, help="twin servers (Toppings' testbed: 8)")
    p.add_argument("--routings", type=_csv(str), default=list(DEFAULT_ROUTINGS),
                   help=f"routing profiles, comma-separated: {', '.join(sorted(PROFILES))}")
    p.add_argument("--placements", type=_csv(str), default=list(DEFAULT_PLACEMENTS),
                   help="placement policies, one comparison each")
    p.add_argument("--workloads", type=_csv(str), default=["power", "shifting_skew"],
                   help=f"rank popularities, comma-separated: {', '.join(RANK_MODES)}")
    p.add_argument("--alpha", type=float, default=1.0, help="power: rank share ~ i^-alpha")
    p.add_argument("--lam", type=float, default=0.5, help="exponential: rank share ~ exp(-lam i)")
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--ranks", type=_csv(int), default=[8, 16, 32, 64, 128])
    p.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals per probe")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between placements")
    p.add_argument("--slo-tbt", type=float, default=None,
                   help="P95 time-between-tokens bound in seconds (default: --slo-factor x the no-LoRA step)")
    p.add_argument("--slo-factor", type=float, default=1.5)
    p.add_argument("--slo-batch", type=int, default=32, help="batch of the no-LoRA reference step")
    p.add_argument("--slo-ttft", type=float, default=2.0, help="P95 TTFT bound in seconds")
    p.add_argument("--heartbeat", type=float, default=0.0,
                   help="rank-aware reads batches from heartbeats this often (s), plus the requests routed "
                        "since, as the real router does; 0: as of each arrival")
    p.add_argument("--rel-tol", type=float, default=0.1, help="bisection stops when high/low <= 1 + this")
    p.add_argument("--lengths", choices=["azure23_conv", "azure23_code", "fixed"], default="azure23_conv")
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--prompt-len", type=int, default=512, help="--lengths fixed")
    p.add_argument("--output-len", type=int, default=128, help="--lengths fixed")
    add_engine_settings(p, "max_loras", max_loras={"default": None, "help": "override the profile's adapter slots"})
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--traces-dir", default=None, help="folder of the Azure 2023 CSVs (default: the shipped ones)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every probe and the tables as JSON here")
    add_plots_arg(p, "P95 TBT, P95 TTFT and SLO attainment at each rate probed, per routing, for each workload "
                  "and placement")


def build(args: argparse.Namespace) -> tuple[RoutingSetup, list[SkewedWorkload]]:
    unknown = sorted(set(args.routings) - set(PROFILES)) + sorted(set(args.placements) - set(POLICY_NAMES))
    if unknown or not args.routings or not args.placements:
        raise CommandError(f"unknown routing profiles or placement policies {unknown}; routing: "
                           f"{', '.join(sorted(PROFILES))}; placement: {', '.join(POLICY_NAMES)}")
    if args.servers < 1 or args.duration <= 0 or args.rel_tol <= 0 or args.slo_ttft <= 0 or args.heartbeat < 0:
        raise CommandError("--servers, --duration, --rel-tol and --slo-ttft must be positive, --heartbeat >= 0")
    try:
        profile = with_rank_term(load_profile(args.profile), args.rank_term)
        lengths = Lengths(profile=args.lengths, scale=1.0 if args.lengths == "fixed" else args.length_scale,
                          prompt_len=args.prompt_len, output_len=args.output_len,
                          max_model_len=int(profile.engine["max_model_len"]))
        ranks = tuple(sorted(set(args.ranks)))
        workloads = [SkewedWorkload(RankSkew(mode, args.alpha, args.lam), args.adapters, ranks, args.duration, lengths,
                                    seed=args.seed, traces_dir=args.traces_dir) for mode in args.workloads]
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    slo_tbt = args.slo_tbt or args.slo_factor * no_lora_step_s(profile, args.slo_batch)
    # servers must hold the top rank; the latency model is linear in rank, so higher ranks extrapolate
    overrides: dict = {"max_lora_rank": max(int(profile.engine["max_lora_rank"]), max(ranks))}
    if args.max_loras:
        overrides["max_loras"] = args.max_loras
    setup = RoutingSetup(profile, TbtSlo(slo_tbt, args.slo_ttft), args.servers, args.interval, args.seed, overrides,
                         args.heartbeat or None)
    return setup, workloads


def run(args: argparse.Namespace) -> int:
    setup, workloads = build(args)
    print(f"twin, profile {setup.profile.name}, {setup.servers} servers; SLO: P95 TBT <= "
          f"{setup.slo.tbt_p95_s * 1e3:.1f} ms, P95 TTFT <= {setup.slo.ttft_p95_s:g} s, no starvation", flush=True)
    started = time.perf_counter()
    results = []
    for workload in workloads:
        try:
            results.append(compare_workload(setup, workload, args.placements, args.routings, args.rel_tol,
                                            progress=stage))
        except FileNotFoundError as exc:
            raise CommandError(str(exc)) from None
    table, detail = format_table(results, args.routings), format_at_rates(results, args.routings)
    wall = time.perf_counter() - started
    print(f"\nrps at the SLO, and P95 TBT at the rate {BASELINE} routing sustains\n{table}\n\n{detail}\n"
          f"wall time {wall:.0f} s")
    if args.json:
        write_bench_json(Path(args.json), "bench routing", args, {
            "profile": setup.profile.model_dump(mode="json"), "slo": asdict(setup.slo), "wall_s": wall,
            "table": table, "workloads": [
                {"workload": r.workload.header(None), "operating_points": r.operating_points.tokens_per_second,
                 "avg_output_tokens": r.avg_output_tokens,
                 "placements": [asdict(p) for p in r.placements]} for r in results]})
    if args.plots:
        plot_series([one for r in results for one in routing_series(r)], Path(args.plots))
    return 0


ROUTING_METRICS = (("p95_tbt_s", "P95 TBT (s)"), ("p95_ttft_s", "P95 TTFT (s)"),
                   ("slo_attainment", "SLO attainment (fraction)"))


def routing_series(result: WorkloadResult) -> list[Series]:
    mode = result.workload.rank_skew.mode
    return [one for placed in result.placements for one in search_series(
        f"routing-{mode}-{placed.placement}", f"routing, {mode} ranks, {placed.placement} placement",
        placed.searches, ROUTING_METRICS)]
