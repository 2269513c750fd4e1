"""GPUs needed at the same SLO: the planner's plan against replicate-all and random placement.

Every policy gets the same servers: the profile's hardware, its slots sized for the largest rank
it serves. Slots are either fixed (`max_loras` for every policy; the planner may choose fewer per
GPU, never more) or, when the profile charges KV memory for them, each policy's own choice: the
planner picks A_max per GPU, and a baseline searches `SLOT_CHOICES` (as many as memory allows) for
the count that needs the fewest servers. The plan is checked as it would be deployed (one engine
per GPU with its A_max slots of its largest rank, each adapter routed to its GPU): no GPU may
starve. A baseline's count is the fewest servers with which the cluster twin (real router,
placement, scheduler and LRU slot residency, adapter loads charged by the profile) neither starves
(in total or on any server) nor falls below the target SLO attainment.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from loraplex.latency.profile import Profile
from loraplex.placement import OperatingPoints
from loraplex.sim.cluster import ClusterConfig, simulate_cluster
from loraplex.sim.metrics import RequestResult, Slo, Summary, summarize, trace_duration
from loraplex.sim.planner.greedy import Plan
from loraplex.sim.planner.oracle import fits_memory
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace, TraceRequest

BASELINES = ("replicate-all", "random")
SLOT_CHOICES = (8, 16, 32, 64, 128, 256, 512)
MAX_SERVERS = 256  # a baseline search gives up beyond this many servers


@dataclass
class Verdict:
    gpus: int
    starved: bool
    slo_attainment: float


@dataclass(frozen=True)
class Trial:
    servers: int
    slots: int
    passed: bool
    slo_attainment: float


@dataclass
class Baseline:
    policy: str
    gpus: int  # replicate-all: its count; random: the median over seeds
    per_seed: list[int]
    slo_attainment: list[float]  # at the chosen count, per seed
    slots: list[int]  # the adapter slots per server at the chosen count, per seed
    trials: list[list[Trial]]  # every cluster twin run of the search, per seed


def check_plan(plan: Plan, trace: Trace, profile: Profile, slo: Slo) -> Verdict:
    results: list[RequestResult] = []
    starved = False
    duration = trace_duration(trace)
    for gpu, requests in enumerate(split_by_gpu(plan, trace)):
        part = Trace(requests, {"duration_s": duration})
        if not part.requests:
            continue
        config = profile.engine_config(max_loras=plan.a_max[gpu], max_lora_rank=max(part.adapters().values()))
        run = simulate_server(part, profile, config, slo)
        starved |= run.summary.starved
        results += run.results
    attainment = summarize(results, duration, duration, slo).slo_attainment or 0.0
    return Verdict(plan.num_gpus, starved, attainment)


def split_by_gpu(plan: Plan, trace: Trace) -> list[list[TraceRequest]]:
    """Each GPU's requests: an adapter's requests go to its GPUs in arrival order by smooth weighted
    round robin over its shares, so every GPU gets its share at every point of the trace."""
    per_gpu: list[list[TraceRequest]] = [[] for _ in range(plan.num_gpus)]
    credit: dict[str, dict[int, float]] = {}
    for request in trace.requests:
        shares = plan.assignment.get(request.adapter or "")
        if shares is None:
            continue  # a base-model request: the planner packs adapters
        if len(shares) == 1:
            per_gpu[next(iter(shares))].append(request)
            continue
        owed = credit.setdefault(request.adapter, dict.fromkeys(shares, 0.0))
        for gpu, share in shares.items():
            owed[gpu] += share
        gpu = max(owed, key=lambda g: (owed[g], -g))
        owed[gpu] -= 1.0
        per_gpu[gpu].append(request)
    return per_gpu


def slot_choices(profile: Profile, max_rank: int) -> list[int]:
    """The slot counts a baseline may try: those whose KV cache still holds a full-length request,
    nearest to the profile's own `max_loras` first (the first one pays for the full server search)."""
    choices = [s for s in SLOT_CHOICES if fits_memory(profile, s, max_rank)]
    if not choices:
        raise ValueError(f"profile {profile.name}: not even {SLOT_CHOICES[0]} slots of rank {max_rank} fit its memory")
    default = int(profile.engine["max_loras"])
    return sorted(choices, key=lambda s: (abs(math.log(s / default)), s))


class ServerSearch:
    """The fewest servers (and adapter slots) with which a cluster twin passes: it starves neither in
    total nor on any server, and its SLO attainment reaches `target`. A subclass says what one run
    is (`outcome`) and keeps `target`, `trials` (every run of its search) and `label`."""

    target: float
    trials: list[Trial]
    label: str

    def outcome(self, servers: int, slots: int) -> tuple[Summary, int]:
        """One run with `servers` servers of `slots` slots: its summary and how many servers starved."""
        raise NotImplementedError

    def verdict(self, servers: int, slots: int) -> Verdict:
        """`starved` is True when the cluster starves, any server starves, or attainment < target.
        A count already tried with these slots is answered from its trial."""
        tried = next((t for t in self.trials if (t.servers, t.slots) == (servers, slots)), None)
        if tried is not None:
            return Verdict(servers, not tried.passed, tried.slo_attainment)
        summary, starved_servers = self.outcome(servers, slots)
        attainment = summary.slo_attainment or 0.0
        failed = summary.starved or starved_servers > 0 or attainment < self.target
        self.trials.append(Trial(servers, slots, not failed, attainment))
        return Verdict(servers, failed, attainment)

    def fewest(self, slots: int, start: int, limit: int = MAX_SERVERS) -> Verdict | None:
        """The fewest servers that pass with `slots`, or None when even `limit` fail. The search
        starts at `start` and walks down while it passes, or up until it does: it assumes more
        servers never hurt."""
        verdict = self.verdict(start, slots)
        if not verdict.starved:
            while verdict.gpus > 1 and not (lower := self.verdict(verdict.gpus - 1, slots)).starved:
                verdict = lower
            return verdict
        for servers in range(start + 1, limit + 1):
            verdict = self.verdict(servers, slots)
            if not verdict.starved:
                return verdict
        return None

    def best_slots(self, choices: list[int], start: int, limit: int = MAX_SERVERS) -> tuple[Verdict, int]:
        """The fewest servers over the slot counts in `choices`, and the slots that achieve it. After
        the first count, a count is only asked whether it passes with one server fewer than the best
        so far (and then walked down): a count that cannot beat the best costs a single twin run."""
        best = self.fewest(choices[0], start, limit)
        if best is None:
            raise RuntimeError(f"{self.label}: still starving or below the SLO with {limit} servers")
        chosen = choices[0]
        for slots in choices[1:]:
            if best.gpus == 1:
                break
            fewer = self.fewest(slots, best.gpus - 1, best.gpus - 1)
            if fewer is not None:
                best, chosen = fewer, slots
        return best, chosen


@dataclass
class BaselineSearch(ServerSearch):
    """The server-count search of one baseline policy and seed on the cluster twin; `trials` records
    every run it made, so a result file shows why one server fewer was not enough."""

    policy: str
    trace: Trace
    profile: Profile
    slo: Slo
    target: float
    seed: int = 0
    points: OperatingPoints | None = None
    trials: list[Trial] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.policy

    def outcome(self, servers: int, slots: int) -> tuple[Summary, int]:
        """The servers' slots are sized for the trace's largest rank."""
        overrides = {"max_loras": slots, "max_lora_rank": max(self.trace.adapters().values())}
        config = ClusterConfig(servers, placement=self.policy, interval_s=1e9, seed=self.seed,
                               engine_overrides=overrides, operating_points=self.points)
        run = simulate_cluster(self.trace, self.profile, config, self.slo)
        return run.summary, run.info["starved_servers"]


def compare_baselines(trace: Trace, profile: Profile, slo: Slo, target: float, slots: list[int], start: int,
                      random_seeds: int = 3, points: OperatingPoints | None = None) -> list[Baseline]:
    """replicate-all once (its placement does not depend on the seed; routing does, slightly) and
    random once per seed, reporting the median count. Each run takes the best of `slots` (one
    entry: fixed slots for everyone). Every run starts at the planner's count: random placement is
    not monotone in the server count (a seed that passes with 5 servers can fail with 6), so a
    walk started elsewhere, e.g. at the previous seed's count, can stop at a worse answer."""
    out = []
    for policy in BASELINES:
        searches = [BaselineSearch(policy, trace, profile, slo, target, seed, points)
                    for seed in range(random_seeds if policy == "random" else 1)]
        runs = [search.best_slots(slots, start) for search in searches]
        counts = [v.gpus for v, _ in runs]
        out.append(Baseline(policy, int(statistics.median_low(counts)), counts, [v.slo_attainment for v, _ in runs],
                            [chosen for _, chosen in runs], [search.trials for search in searches]))
    return out


def baseline_json(baseline: Baseline) -> dict:
    return asdict(baseline)
