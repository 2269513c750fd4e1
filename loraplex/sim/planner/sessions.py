"""The fewest servers (and adapter slots) that serve a multi-turn chat workload at the SLO, per router
profile: `loraplex sim plan --sessions SPEC --routing loraserve,prefix-aware`.

The greedy planner packs adapters from per-GPU runs of open-loop requests that share nothing, so it
cannot see what routing a conversation back to the server that holds its KV saves. Here each server
count tried is one run of the session cluster twin (`loraplex.sim.session_cluster`: the real
placement on that many servers, the real router profile, the real engine core per server with its
prefix cache), judged by the baseline comparison's search and criterion (`compare.ServerSearch`):
no starvation in total or on any server, and the SLO attainment of every turn at least the target.
Sessions are closed loop (a turn exists once the previous reply is out), so the arrival window is
the turns' own and an overloaded cluster shows mostly in TTFT: the SLO decides, seldom starvation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.latency.profile import Profile
from loraplex.placement import OperatingPoints
from loraplex.sim.metrics import Slo, Summary, starved_servers, summarize
from loraplex.sim.operating_points import operating_points
from loraplex.sim.planner.compare import MAX_SERVERS, ServerSearch, Trial
from loraplex.sim.session_cluster import (
    SessionClusterConfig,
    SessionClusterSummary,
    place_sessions,
    session_trace,
    simulate_session_cluster,
    summarize_session_cluster,
)
from loraplex.sim.sessions import SessionWorkload


@dataclass
class SessionSearch(ServerSearch):
    """The server-count search of one router profile on one session workload."""

    workload: SessionWorkload
    profile: Profile
    routing: str
    slo: Slo
    target: float
    placement: str = "loraserve"
    replicas: int = 3
    seed: int = 0
    points: OperatingPoints | None = None
    trials: list[Trial] = field(default_factory=list)
    runs: dict[tuple[int, int], SessionClusterSummary] = field(default_factory=dict)  # (servers, slots) -> run

    @property
    def label(self) -> str:
        return f"routing {self.routing}"

    def halve(self, slots: int, start: int) -> int:
        """`start` halved while the half passes: where the walk of `fewest` begins. The placement's
        estimate counts the re-sent history tokens as work (all of them under a profile without a
        prefix index), and the prefix cache makes many of them free, so it can be several times the
        answer; halving gets near it in a few runs."""
        while start > 1 and not self.verdict(start // 2, slots).starved:
            start //= 2
        return start

    def outcome(self, servers: int, slots: int) -> tuple[Summary, int]:
        """The servers' slots are sized for the workload's largest rank."""
        overrides = {"max_loras": slots, "max_lora_rank": max(self.workload.adapters.values())}
        config = SessionClusterConfig(servers, self.routing, self.replicas, self.placement, self.seed, overrides,
                                      operating_points=self.points)
        run = simulate_session_cluster(self.workload, self.profile, config)
        self.runs[(servers, slots)] = summarize_session_cluster(run)
        window = max((r.arrival_s for r in run.results), default=0.0) or 1.0
        return summarize(run.results, window, run.elapsed_s, self.slo), starved_servers(run.results, window)


@dataclass
class SessionPlan:
    routing: str
    servers: int
    slots: int  # adapter slots per server (A_max)
    slo_attainment: float
    prefix_hit_rate: float  # what the engines saw at that count
    ttft_later_mean_s: float  # turns after the first
    ttft_p99_s: float
    placement_estimate: int  # the placement's required_servers for the demand this routing's router counts
    trials: list[Trial]  # every run of the search


def plan_sessions(workload: SessionWorkload, profile: Profile, routings: list[str], slo: Slo, target: float,
                  slots: list[int], placement: str = "loraserve", replicas: int = 3, seed: int = 0,
                  limit: int = MAX_SERVERS, points: OperatingPoints | None = None,
                  say: Callable[[str], None] = lambda _: None) -> list[SessionPlan]:
    """Each routing's fewest servers over the slot counts in `slots` (one entry: fixed slots), its
    search started at the placement's own estimate for the demand that routing's router counts (under a
    prefix profile, without the prompt tokens its index predicts cached: `session_demand`). Operating
    points: measured on the twin for the workload unless given. Raises RuntimeError when a routing
    still fails with `limit` servers."""
    max_rank = max(workload.adapters.values())
    if points is None:
        say(f"{len(workload.sessions)} sessions, {workload.num_turns} turns: operating points")
        points = operating_points(profile, sorted(set(workload.adapters.values())), session_trace(workload),
                                  profile.engine_config(max_loras=slots[0], max_lora_rank=max_rank))
    out = []
    for routing in routings:
        estimate = SessionClusterConfig(1, routing, replicas, placement, seed, operating_points=points)
        estimated = place_sessions(workload, profile, estimate, max_rank).required_servers
        start = min(limit, estimated)
        say(f"routing {routing}: the fewest servers from {start}")
        search = SessionSearch(workload, profile, routing, slo, target, placement, replicas, seed, points)
        verdict, chosen = search.best_slots(slots, search.halve(slots[0], start), limit)
        run = search.runs[(verdict.gpus, chosen)]
        out.append(SessionPlan(routing, verdict.gpus, chosen, verdict.slo_attainment, run.prefix_hit_rate,
                               run.ttft_later_mean_s, run.ttft_p99_s, estimated, search.trials))
    return out
