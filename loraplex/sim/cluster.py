"""Cluster mode: N twin servers behind the real router policy, re-placed by the real placement
policy every interval (the routing table is swapped at once, as routers do on a new version).

A discrete-event loop over per-server virtual clocks. A server's step runs from its clock to clock +
step latency; requests routed to it meanwhile join at its next step boundary, as in the real engine.
Servers share nothing between arrivals, so each is stepped lazily: only when an arrival needs its
state (the server it joins, or a routing candidate whose load the router reads) is it stepped up to
the arrival time, every step that starts at or before it, which is exactly the state a loop over all
servers in time order would show.

A router that reads the live batch (rank-aware) sees each candidate's open requests by rank as of
the arrival, or, with `batch_refresh_s`, as of the server's last heartbeat no older than that, plus
the requests routed to it since (what the real router's snapshot offers it).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from loraplex.engine.request import Request, RequestStatus
from loraplex.latency.profile import Profile
from loraplex.placement import (
    DEFAULT_HYSTERESIS,
    OperatingPoints,
    PlacementAdapter,
    PlacementInput,
    PlacementServer,
    make_policy,
)
from loraplex.routing import RoutingTable
from loraplex.routing.pipeline import Candidate, Residency, RouteRequest, make_profile
from loraplex.routing.rank_aware import LatencyModel, RankAwareConfig
from loraplex.routing.records import ServerBatch
from loraplex.sim.executor import SimExecutor
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.metrics import (
    RequestResult,
    Slo,
    Summary,
    Tally,
    offered_tokens,
    result_of,
    trace_duration,
)
from loraplex.sim.operating_points import operating_points
from loraplex.sim.replay import PROGRESS_EVERY, check_fits, make_request, register_adapters, sim_adapter_id
from loraplex.sim.server import make_sim_engine, sim_prompt
from loraplex.sim.spans import step
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.spec.adapter import AdapterId


@dataclass
class ClusterConfig:
    servers: int
    placement: str = "loraserve"
    routing: str = "loraserve"  # router profile (loraplex.routing.pipeline.PROFILES)
    interval_s: float = 60.0
    hysteresis: float = DEFAULT_HYSTERESIS  # loraserve's (0: the paper's fresh packing)
    seed: int = 0
    engine_overrides: dict = field(default_factory=dict)
    operating_points: OperatingPoints | None = None  # default: measured on the twin for this profile
    # rank-aware routing: latency model, SLO, constants (default: the twin profile's own latency model)
    rank_aware: RankAwareConfig | None = None
    batch_refresh_s: float | None = None  # live batches as of heartbeats this often; None: exact
    # per-request rows in ClusterRun.results and exact percentiles; False: a streamed summary only
    # (percentiles from a quantile sketch), so memory does not grow with the trace
    keep_results: bool = True
    progress: Callable[[float], None] | None = None  # told the trace time every PROGRESS_EVERY arrivals
    exact: bool = False  # every engine step run one by one (the reference); default: decode spans at once


@dataclass
class ClusterRun:
    results: list[RequestResult]
    summary: Summary
    info: dict


class _Server:
    def __init__(self, index: int, profile: Profile, overrides: dict, adapters: dict[str, int],
                 ids: dict[str, AdapterId], done: Callable[[RequestResult], None], exact: bool = False) -> None:
        self.index = index
        self.id = f"sim-{index}"
        self.core, self.clock = make_sim_engine(profile, profile.engine_config(**overrides))
        self.ids = register_adapters(self.core, adapters, ids)
        self.ranks = {self.ids[name]: rank for name, rank in adapters.items()}
        self.live: dict[str, Request] = {}  # unfinished ones: a finished one leaves as its result
        self.num_requests = 0
        self.open: list[Request] = []  # unfinished ones, pruned when the batch is read
        self._heartbeat: tuple[float, ServerBatch] | None = None
        self._scheduler = self.core.scheduler
        self._holds = self.core.memory.holds
        self._max_rank = self.core.config.max_lora_rank
        self._executor = cast(SimExecutor, self.core.executor)
        self._exact = exact
        self._done = done

    def advance(self, until: float) -> None:
        """Run every step that starts at or before `until` (spans of plain decodes at once unless exact)."""
        core, clock, scheduler, executor, exact = self.core, self.clock, self._scheduler, self._executor, self._exact
        while scheduler.has_unfinished() and clock.now() <= until:
            outputs = step(core, executor, until, exact=exact)
            if outputs is None:
                if scheduler.has_unfinished():
                    raise RuntimeError(f"{self.id} admits none of its waiting requests while idle")
                continue
            for output in outputs:
                if output.finished:
                    self.finish(self.live.pop(output.request_id))

    def finish(self, request: Request) -> None:
        self._done(result_of(request, 0.0, request.adapter.name if request.adapter else None, self.id))

    def table_candidate(self, phi: float) -> Candidate:
        """The server as a router that reads no load sees it: the table's φ and its static limits. Every
        twin server holds every adapter in host memory; the GPU tier and the queue are live state."""
        return Candidate(self.id, phi=phi, residency=Residency.HOST, max_rank=self._max_rank)

    def candidate(self, adapter: str | None, phi: float, batch: ServerBatch | None = None) -> Candidate:
        """The server's live state: step it up to the arrival first."""
        scheduler = self._scheduler
        resident = adapter is not None and self._holds(self.ids[adapter])
        return Candidate(self.id, phi=phi, residency=Residency.GPU if resident else Residency.HOST,
                         queue_depth=scheduler.num_running + scheduler.num_waiting, max_rank=self._max_rank,
                         batch=batch)

    def batch(self, now: float, refresh_s: float | None) -> ServerBatch:
        """Its open requests by rank (stepped up to `now`). With `refresh_s`, the batch of its last
        heartbeat plus the requests opened since, as a router sees it: a heartbeat is taken at the
        first read in each `refresh_s` window, so it is less than `refresh_s` old when used."""
        finished = RequestStatus.FINISHED
        self.open = [r for r in self.open if r.status is not finished]
        if refresh_s is not None and self._heartbeat is not None and now - self._heartbeat[0] < refresh_s:
            return self._heartbeat[1].with_open_requests(len(self.open))
        ranks = self.ranks
        batch = ServerBatch.from_requests(
            (ranks[r.adapter] if r.adapter else 0, r.adapter.name if r.adapter else None,
             max(0, r.num_prompt_tokens - r.num_computed_tokens), r.num_tokens) for r in self.open)
        if refresh_s is not None:
            self._heartbeat = (now - (now % refresh_s), batch)
        return batch


class _Cluster:
    def __init__(self, trace: Trace, profile: Profile, config: ClusterConfig, slo: Slo | None = None) -> None:
        self.config = config
        self.adapters = trace.adapters()
        ids = {name: sim_adapter_id(name) for name in self.adapters}  # one set of ids shared by every server
        self.slo = slo
        self.tally = Tally(trace_duration(trace), slo)  # without the rows, the summary streams
        self.results: list[RequestResult] = []
        done = self.results.append if config.keep_results else self.tally.add
        self.servers = [_Server(i, profile, config.engine_overrides, self.adapters, ids, done, config.exact)
                        for i in range(config.servers)]
        self.by_id = {s.id: s for s in self.servers}
        rng = random.Random(config.seed)
        rank_aware = config.rank_aware or RankAwareConfig(LatencyModel.from_coefficients(profile.coefficients,
                                                                                         profile.name))
        self.router = make_profile(config.routing, random.Random(rng.random()), rank_aware=rank_aware)
        self._router_reads_load = self.router.reads_load
        self._router_reads_batch = self.router.reads_batch
        self.policy = make_policy(config.placement, random.Random(rng.random()), hysteresis=config.hysteresis)
        max_rank = self.servers[0].core.config.max_lora_rank
        self.placement_servers = [PlacementServer(s.id, max_rank) for s in self.servers]
        self.points = config.operating_points or operating_points(profile, sorted(set(self.adapters.values())),
                                                                  trace, self.servers[0].core.config)
        self.table: RoutingTable | None = None
        self._offers: dict[str, list[tuple[_Server, float]]] = {}  # adapter -> (server, φ > 0), this table
        self._table_candidates: dict[str, list[Candidate]] = {}  # adapter -> its offers as table candidates
        self.window_tokens: dict[str, int] = {}
        self.placements = 0
        self.required_servers: list[int] = []
        self.adapter_moves = 0    # (adapter, server) routes a table added over the one before it
        self.placement_s = 0.0    # wall time spent in the policy

    def place(self, now: float, demand_tps: dict[str, float]) -> None:
        adapters = [PlacementAdapter(name, sim_adapter_id(name).digest, rank, demand_tps.get(name, 0.0))
                    for name, rank in sorted(self.adapters.items())]
        started = time.perf_counter()
        placement = self.policy.place(PlacementInput(self.placement_servers, adapters, self.points, self.table))
        self.placement_s += time.perf_counter() - started
        table = placement.to_table(self.placements + 1, now, adapters)
        if self.table is not None:
            self.adapter_moves += _added_routes(self.table, table)
        self.table = table
        self._offers, self._table_candidates = {}, {}
        self.placements += 1
        self.required_servers.append(placement.required_servers)

    def route(self, request: TraceRequest) -> _Server:
        """Let the router pick a server and step that server up to the arrival. Candidates whose live
        state the router reads are stepped up to it before the pick."""
        # The assigned filter keeps only φ > 0 servers when there are any, so offering just those
        # gives the same pick and saves building one candidate per server per request. Over φ > 0
        # servers the filters read no load, so a router whose scorers read none either (LoRAServe's
        # φ alone) picks from the table: its candidates are built once per table, and no server but
        # the chosen one is stepped (stepping is deterministic per server, so results are the same).
        adapter, arrival = request.adapter, request.arrival_s
        offers = self._offers_for(adapter)
        if offers and not self._router_reads_load:
            candidates = self._table_candidates.get(adapter)
            if candidates is None:
                candidates = self._table_candidates[adapter] = [s.table_candidate(phi) for s, phi in offers]
        else:
            offers = offers or [(s, 0.0) for s in self.servers]
            for server, _ in offers:
                server.advance(arrival)
            if self._router_reads_batch:
                refresh = self.config.batch_refresh_s
                candidates = [server.candidate(adapter, phi, server.batch(arrival, refresh)) for server, phi in offers]
            else:
                candidates = [server.candidate(adapter, phi) for server, phi in offers]
        route = RouteRequest(adapter, request.rank or None, request.prompt_len)
        chosen = self.by_id[self.router.pick(route, candidates).server_id]
        chosen.advance(arrival)  # already done when the candidates were stepped
        return chosen

    def _offers_for(self, adapter: str | None) -> list[tuple[_Server, float]]:
        if adapter is None or self.table is None:
            return []
        offers = self._offers.get(adapter)
        if offers is None:
            phis = {r.server: r.weight for r in self.table.routes(adapter)}  # the last φ of a server wins
            offers = self._offers[adapter] = [(self.by_id[sid], phi) for sid, phi in phis.items()]
        return offers


def simulate_cluster(trace: Trace, profile: Profile, config: ClusterConfig, slo: Slo | None = None) -> ClusterRun:
    if config.servers < 1:
        raise ValueError("a cluster needs at least one server")
    config_0 = profile.engine_config(**config.engine_overrides)
    check_fits(trace, config_0.max_model_len, config_0.max_lora_rank)
    with cyclic_gc_paused():
        cluster = _Cluster(trace, profile, config, slo)
        duration = trace_duration(trace)
        cluster.place(0.0, _mean_demand(trace, duration))  # the declared (expected) demand of every adapter
        next_placement = config.interval_s
        for i, request in enumerate(trace.requests):
            if config.progress is not None and i % PROGRESS_EVERY == 0:
                config.progress(request.arrival_s)
            while request.arrival_s >= next_placement:
                cluster.place(next_placement, {a: t / config.interval_s for a, t in cluster.window_tokens.items()})
                cluster.window_tokens = {}
                next_placement += config.interval_s
            _admit(cluster, request)
        for server in cluster.servers:
            server.advance(float("inf"))
        return _collect(cluster, trace)


def _admit(cluster: _Cluster, request: TraceRequest) -> None:
    server = cluster.route(request)  # stepped up to the arrival
    if request.adapter is not None:
        cluster.window_tokens[request.adapter] = (cluster.window_tokens.get(request.adapter, 0)
                                                  + request.prompt_len + request.output_len)
    if not server.core.has_unfinished():  # idle: its clock jumps to the arrival
        server.clock.advance(max(0.0, request.arrival_s - server.clock.now()))
    req = make_request(request, 0.0, server.ids[request.adapter] if request.adapter else None, sim_prompt)
    server.core.add_request(req)
    server.live[req.request_id] = req
    server.num_requests += 1
    if cluster._router_reads_batch:
        server.open.append(req)


def _mean_demand(trace: Trace, duration: float) -> dict[str, float]:
    return {a: t / duration for a, t in trace.rows().tokens_by_adapter().items()}


def _added_routes(before: RoutingTable, after: RoutingTable) -> int:
    """Routes of `after` whose server did not route that adapter in `before`: adapters to load."""
    return sum(len({r.server for r in after.routes(name)} - {r.server for r in before.routes(name)})
               for name in after.entries)


def _collect(cluster: _Cluster, trace: Trace) -> ClusterRun:
    for server in cluster.servers:  # none is left once every server ran to the end; kept for safety
        for request in server.live.values():
            server.finish(request)
    results, tally = cluster.results, cluster.tally
    if cluster.config.keep_results:  # the rows in arrival order, and exact percentiles from them
        results.sort(key=lambda r: r.arrival_s)
        tally = Tally(tally.duration_s, cluster.slo, exact=True)
        for r in results:
            tally.add(r)
    end = max(s.clock.now() for s in cluster.servers)
    summary = tally.summary(end, offered_tokens(trace))
    info = {"servers": len(cluster.servers), "placement": cluster.config.placement,
            "placements": cluster.placements, "required_servers": cluster.required_servers,
            "adapter_moves": cluster.adapter_moves, "placement_s": cluster.placement_s,
            "starved_servers": tally.starved_servers,
            "requests_per_server": [s.num_requests for s in cluster.servers],
            "operating_points": {str(r): round(t, 1) for r, t in cluster.points.tokens_per_second.items()}}
    return ClusterRun(results, summary, info)
