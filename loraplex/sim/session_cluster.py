"""Multi-turn chat sessions on N twin servers behind the real router policy, prefix index included.

The cluster twin (`loraplex.sim.cluster`) replays open-loop traces whose requests share nothing; a
conversation's next turn, though, exists only once its previous reply is out, and re-sends that
reply, so where its KV lives is what prefix-aware routing is about. Here each server is the real
EngineCore on a virtual clock (prefix cache and all), the placement is the real policy (each
adapter on at least `replicas` servers), and every turn is routed by the real profile. Profiles
with a prefix filter read the real `PrefixIndex` over the prompt's token blocks of the engine's
block size: the router of the twin hashes tokens where the real router hashes text, so the twin
shows what routing on prefixes can win, with the index's LRU and TTL, not the text chunking's loss.

One event loop in time order: the next due turn is submitted once every busy server's clock has
passed it (so every reply due before it has been seen and its next turn queued), otherwise the
busy server with the earliest clock runs one step. Requests routed to a server mid-step join it at
its next step, as in the real engine.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

import numpy as np

from loraplex.engine.core import EngineCore
from loraplex.engine.request import Request
from loraplex.latency.profile import Profile
from loraplex.placement import OperatingPoints, PlacementAdapter, PlacementInput, PlacementServer, make_policy
from loraplex.routing.demand import demand_tokens
from loraplex.routing.pipeline import Candidate, Residency, RouteRequest, make_profile, prefix_config
from loraplex.routing.prefix import PrefixConfig, PrefixIndex, adapter_seed, alora_token_keys, token_keys
from loraplex.routing.table import RoutingTable
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.metrics import RequestResult, result_of, trace_duration
from loraplex.sim.operating_points import operating_points
from loraplex.sim.replay import register_adapters, sim_adapter_id
from loraplex.sim.server import make_sim_engine
from loraplex.sim.sessions import PromptTokens, SessionWorkload, turn_sampling
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.spec.alora import invocation_start
from loraplex.util.clock import ManualClock

TWIN_VOCAB = 32000  # the twin's token ids only need to be distinct, never decoded


@dataclass
class SessionClusterConfig:
    servers: int = 16
    routing: str = "loraserve"
    replicas: int = 3  # servers each adapter is placed on, at least (LoRADeployment replicas.min)
    placement: str = "loraserve"
    seed: int = 0
    engine_overrides: dict = field(default_factory=dict)
    prefix: PrefixConfig | None = None  # the prefix filter's and index's knobs (default PrefixConfig())
    # where the prefix filter learns what each server holds: "index" (the router's approximate index)
    # or "engine" (each engine's own prefix cache, read at the pick: precise KV events with no lag)
    prefix_source: str = "index"
    operating_points: OperatingPoints | None = None  # default: measured on the twin for this workload


@dataclass(frozen=True)
class TurnResult:
    session: int
    turn: int
    adapter: str
    server: str
    arrival_s: float
    ttft_s: float | None
    finished_s: float | None
    output_tokens: int
    predicted_blocks: int  # prompt blocks the router's index said the chosen server holds
    prompt_blocks: int


@dataclass
class SessionClusterRun:
    turns: list[TurnResult]
    elapsed_s: float
    prefix_hit_rate: float  # what the engines saw: cached prompt tokens over prompt tokens looked up
    predicted_hit_rate: float | None  # what the router predicted, in blocks (None: it keeps no index)
    table: RoutingTable
    results: list[RequestResult]  # the turns as the twin's request results, in arrival order (SLO, starvation)


class _Server:
    def __init__(self, index: int, core: EngineCore, clock: ManualClock, ids: dict) -> None:
        self.id = f"sim-{index}"
        self.core, self.clock, self.ids = core, clock, ids
        self.max_rank = core.config.max_lora_rank

    def cached_blocks(self, adapter: str, prompt: list[int]) -> int:
        """Leading blocks of the prompt its prefix cache holds now (0 without a prefix cache); an
        activated LoRA's, the base model's blocks before its invocation."""
        tree = getattr(self.core.memory, "tree", None)
        if tree is None:
            return 0
        invocation = self.core.adapters[adapter].invocation_tokens
        if invocation:
            start = invocation_start(prompt, invocation)
            return tree.cached_blocks(None, prompt[:start] if start is not None else prompt)
        return tree.cached_blocks(self.ids[adapter], prompt)

    def candidate(self, adapter: str, phi: float, prefix_blocks: int) -> Candidate:
        scheduler = self.core.scheduler
        resident = self.core.memory.holds(self.ids[adapter])
        return Candidate(self.id, phi=phi, residency=Residency.GPU if resident else Residency.HOST,
                         queue_depth=scheduler.num_running + scheduler.num_waiting, max_rank=self.max_rank,
                         prefix_blocks=prefix_blocks)


def session_trace(workload: SessionWorkload) -> Trace:
    """The sessions' turns as a trace with each turn's prompt grown by the history before it: the
    lengths operating points are measured with."""
    requests = []
    for s in workload.sessions:
        context = workload.spec.system_prompt_tokens
        for k, turn in enumerate(s.turns):
            context += turn.user_tokens
            requests.append(TraceRequest(f"s{s.index}-t{k}", s.arrival_s, s.adapter, workload.adapters[s.adapter],
                                         context, turn.output_tokens))
            context += turn.output_tokens
    return Trace(requests, {"duration_s": max((r.arrival_s for r in requests), default=1.0) or 1.0})


def session_demand(workload: SessionWorkload, block: int, duration: float) -> dict[str, float]:
    """Each adapter's mean demand in tokens/s as the router counts it (`routing.demand.demand_tokens`).
    `block`: the tokens of a prefix block when the routing keeps a prefix index, else 0. Its prediction
    for a later turn is the previous turn's prompt in full blocks (what the index recorded for the
    server that took it, where the prefix filter sends the conversation back); a first turn is
    predicted nothing (its system prompt may be held where it lands: the count errs high)."""
    demand: dict[str, float] = {}
    for s in workload.sessions:
        context, held = workload.spec.system_prompt_tokens, 0
        for turn in s.turns:
            context += turn.user_tokens
            tokens = demand_tokens(context, turn.output_tokens, held // block if block else 0, block)
            demand[s.adapter] = demand.get(s.adapter, 0.0) + tokens / duration
            held = context
            context += turn.output_tokens
    return demand


def place_sessions(workload: SessionWorkload, profile: Profile, config: SessionClusterConfig,
                   max_rank: int) -> RoutingTable:
    """The placement policy's table for the workload's mean demand (`session_demand`: as the router counts
    it under `config.routing`), each adapter on `replicas` servers."""
    trace = session_trace(workload)
    engine = profile.engine_config(**config.engine_overrides)
    prefixes = prefix_config(make_profile(config.routing, random.Random(0), prefix=config.prefix)) is not None
    demand = session_demand(workload, engine.block_size if prefixes else 0, trace_duration(trace))
    points = config.operating_points or operating_points(profile, sorted(set(workload.adapters.values())), trace,
                                                         engine)
    adapters = [PlacementAdapter(name, sim_adapter_id(name).digest, rank, demand.get(name, 0.0),
                                 min_replicas=min(config.replicas, config.servers))
                for name, rank in sorted(workload.adapters.items())]
    servers = [PlacementServer(f"sim-{i}", max_rank) for i in range(config.servers)]
    policy = make_policy(config.placement, random.Random(config.seed))
    return policy.place(PlacementInput(servers, adapters, points)).to_table(1, 0.0, adapters)


def simulate_session_cluster(workload: SessionWorkload, profile: Profile,
                             config: SessionClusterConfig) -> SessionClusterRun:
    if config.servers < 1:
        raise ValueError("a cluster needs at least one server")
    with cyclic_gc_paused():
        return _SessionCluster(workload, profile, config).run()


class _SessionCluster:
    def __init__(self, workload: SessionWorkload, profile: Profile, config: SessionClusterConfig) -> None:
        self.workload = workload
        engine_config = profile.engine_config(**config.engine_overrides)
        ids = {name: sim_adapter_id(name) for name in workload.adapters}
        self.tokens = PromptTokens(TWIN_VOCAB, seed=workload.spec.seed)
        self.invocations = workload.invocations(self.tokens)
        self.servers = []
        for i in range(config.servers):
            core, clock = make_sim_engine(profile, engine_config)
            self.servers.append(_Server(i, core, clock, register_adapters(core, workload.adapters, ids,
                                                                          invocations=self.invocations)))
        self.by_id = {s.id: s for s in self.servers}
        self.table = place_sessions(workload, profile, config, engine_config.max_lora_rank)
        rng = random.Random(config.seed)
        if config.prefix_source not in ("index", "engine"):
            raise ValueError(f"prefix_source must be index or engine, not {config.prefix_source!r}")
        self.router = make_profile(config.routing, random.Random(rng.random()), prefix=config.prefix)
        prefix = prefix_config(self.router)
        self.index = PrefixIndex(prefix) if prefix is not None else None
        self.precise = config.prefix_source == "engine"
        self.block = engine_config.block_size
        self.offers = {a: [(self.by_id[r.server], r.weight) for r in self.table.routes(a)] for a in workload.adapters}
        self.due = [(s.arrival_s, s.index, 0) for s in workload.sessions]
        heapq.heapify(self.due)
        self.last: dict[int, Request] = {}
        self.live: dict[str, tuple[_Server, int, int, float, int, int]] = {}
        self.results: list[TurnResult] = []
        self.requests: list[RequestResult] = []

    def run(self) -> SessionClusterRun:
        while True:
            busy = [s for s in self.servers if s.core.has_unfinished()]
            step_at = min((s.clock.now() for s in busy), default=float("inf"))
            due_at = self.due[0][0] if self.due else float("inf")
            if due_at == step_at == float("inf"):
                break
            if due_at <= step_at:
                _, session, turn = heapq.heappop(self.due)
                self._submit(session, turn, due_at)
            else:
                self._step(min(busy, key=lambda s: s.clock.now()))
        return self._summary()

    def _submit(self, index: int, turn: int, at: float) -> None:
        session = self.workload.sessions[index]
        spec = session.turns[turn]
        new = self.tokens.user(index, turn, spec.user_tokens, session.adapter in self.invocations)
        previous = self.last.get(index)
        prompt = (self.tokens.system(self.workload.adapter_index(session.adapter),
                                     self.workload.spec.system_prompt_tokens) + new if previous is None
                  else previous.prompt_token_ids + previous.output_token_ids + new)
        server, predicted, blocks = self._route(session.adapter, prompt, at)
        if not server.core.has_unfinished():  # idle: its clock jumps to the arrival
            server.clock.advance(max(0.0, at - server.clock.now()))
        request = Request(f"s{index}-t{turn}", prompt, turn_sampling(spec.output_tokens),
                          adapter=server.ids[session.adapter], arrival_time=at)
        server.core.add_request(request)
        self.last[index] = request
        self.live[request.request_id] = (server, index, turn, at, predicted, blocks)

    def _route(self, adapter: str, prompt: list[int], at: float) -> tuple[_Server, int, int]:
        offers = self.offers[adapter]
        invocation = self.invocations.get(adapter, ())
        if self.index is None:
            keys = []
        elif invocation:  # as the router keys it: the base model's conversation before the invocation
            keys = alora_token_keys(invocation, prompt, self.block)
        else:
            keys = token_keys(adapter_seed(adapter, sim_adapter_id(adapter).digest), prompt, self.block)
        if self.index is None:
            matches = {}
        elif self.precise:
            matches = {s.id: s.cached_blocks(adapter, prompt) for s, _ in offers}
        else:
            matches = self.index.matches((s.id for s, _ in offers), keys, at)
        candidates = [server.candidate(adapter, phi, matches.get(server.id, 0)) for server, phi in offers]
        route = RouteRequest(adapter, self.workload.adapters[adapter], len(prompt), len(keys), alora=bool(invocation))
        chosen = self.by_id[self.router.pick(route, candidates).server_id]
        if self.index is not None:
            self.index.record(chosen.id, keys, at)
        return chosen, matches.get(chosen.id, 0), len(keys)

    def _step(self, server: _Server) -> None:
        steps = server.core.num_steps
        outputs = server.core.step()
        if not outputs and server.core.num_steps == steps and server.core.has_unfinished():
            raise RuntimeError(f"{server.id} admits none of its waiting requests while idle")
        now = server.clock.now()
        for out in outputs:
            if out.finished:
                self._finished(out.request_id, now)

    def _finished(self, request_id: str, now: float) -> None:
        server, index, turn, at, predicted, blocks = self.live.pop(request_id)
        request = self.last[index]
        first, adapter = request.first_token_time, self.workload.sessions[index].adapter
        self.results.append(TurnResult(index, turn, adapter, server.id, at, None if first is None else first - at,
                                       now, len(request.output_token_ids), predicted, blocks))
        self.requests.append(result_of(request, 0.0, adapter, server.id))
        turns = self.workload.sessions[index].turns
        if turn + 1 < len(turns):
            heapq.heappush(self.due, (now + turns[turn + 1].think_s, index, turn + 1))

    def _summary(self) -> SessionClusterRun:
        stats = [s.core.memory_stats() for s in self.servers]
        queried = sum(m.prefix_queries_tokens for m in stats)
        blocks = sum(r.prompt_blocks for r in self.results)
        predicted = sum(r.predicted_blocks for r in self.results) / blocks if self.index is not None and blocks else None
        end = max((r.finished_s or 0.0) for r in self.results) if self.results else 0.0
        return SessionClusterRun(sorted(self.results, key=lambda r: r.arrival_s), end,
                                 sum(m.prefix_hit_tokens for m in stats) / queried if queried else 0.0,
                                 predicted, self.table, sorted(self.requests, key=lambda r: r.arrival_s))


@dataclass(frozen=True)
class SessionClusterSummary:
    turns: int
    ttft_mean_s: float
    ttft_later_mean_s: float  # turns after the first
    ttft_p99_s: float
    throughput_tps: float  # output tokens over the run's length
    prefix_hit_rate: float
    predicted_hit_rate: float | None
    max_server_share: float  # the busiest server's share of the turns


def summarize_session_cluster(run: SessionClusterRun) -> SessionClusterSummary:
    ttfts = [r.ttft_s for r in run.turns if r.ttft_s is not None]
    later = [r.ttft_s for r in run.turns if r.ttft_s is not None and r.turn > 0]
    counts: dict[str, int] = {}
    for r in run.turns:
        counts[r.server] = counts.get(r.server, 0) + 1

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else float("nan")

    return SessionClusterSummary(
        turns=len(run.turns), ttft_mean_s=mean(ttfts), ttft_later_mean_s=mean(later),
        ttft_p99_s=float(np.percentile(ttfts, 99)) if ttfts else float("nan"),
        throughput_tps=sum(r.output_tokens for r in run.turns) / run.elapsed_s if run.elapsed_s else 0.0,
        prefix_hit_rate=run.prefix_hit_rate, predicted_hit_rate=run.predicted_hit_rate,
        max_server_share=max(counts.values()) / len(run.turns) if run.turns else 0.0)
