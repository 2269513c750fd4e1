"""`loraplex bench alora`: a pipeline of checker adapters on one conversation, as activated LoRAs
and, with the same weights, as standard LoRAs; on a local stack and in the twin.

The workload: `--sessions` multi-turn chats, all running at once. Each turn sends a user message to
the base model; once its answer is back, k checker requests (k in `--ks`) go out together, each to
its own adapter, on the conversation plus the answer plus a user message that starts with the
checker's invocation (`loraplex_agent.tools.tiny_model.INVOCATION`). The turn (the pipeline) ends with
the last checker's answer; the next turn then re-sends the conversation. The checkers are
aloraNN-r8 (activated LoRAs: the base model's KV of the conversation is theirs too) or loraNN-r8
(the same weights as standard LoRAs: each recomputes the conversation under its own adapter).

Engine side: a `loraplex up` stack (redis-server, --agents agents on a fresh tiny model in float32 with six
adapters of each kind, the prefix-aware router, every adapter on every agent), the workload driven
through the router with the `openai` client over streamed chat completions. The system prompt and
messages are whole words of the vocabulary and the answers are kept to whole words
(`loraplex_bench.prefix_routing_engine` says why), so a re-sent conversation tokenizes as it was
computed. Each run tags its text with its mode, k and round, so no run finds another's KV; with
`--rounds 2` the modes run in ABBA order and each row pools its rounds. TTFT is measured at the
client; `cached` is the sum of `usage.prompt_tokens_details.cached_tokens` over the responses, and
`engine hits` the change of the agents' `vllm:prefix_cache_hits` over the run. The serving CPU per
request: the CPU time (user + system, /proc) of this process (the client), the router, redis-server
and the agents over the run, less the agents' engine threads (`loraplex:engine_thread_cpu_seconds`),
over the requests: what serving a request costs the host outside the engines' steps (HTTP and SSE,
routing, chat template, tokenizing, the client's own work).

Both sides run the engines with `--long-prefill-token-threshold` (the pool's
`engine.longPrefillTokenThreshold`), the same for both arms.

Twin side: the same workload (its rounds too, in the same order, the router's random draws running
on over all of them as in the stack's one router process) on token ids through --agents real
`EngineCore`s on one virtual timeline (`loraplex.sim.server.make_sim_engine`, latency profile
`--profile`), every request routed
by the router's own `prefix-aware` profile (the same --routing-option knobs) over a prefix index of
the prompts' token blocks and its in-flight counts, so a fan-out that overloads its conversation's
server spills as it does on the stack; the engine's own prefix cache keys an activated LoRA's
conversation as the base model's, as on the agents. EMULATION of the local stack's host: every
request reaches its engine one serving path (client, router, HTTP, chat template) after it is sent,
its serving CPU spread evenly over that path, and the engines' steps stretch by the cores they share
with each other, with the serving work then in flight and with a background load
(`loraplex.sim.shared_host`, `--twin-host-cores`). All three come from the engine side when it ran in
the same command or is given with `--engine-json`: the serving path is its mean client TTFT minus the
agents' own TTFT metric, the serving CPU its measured CPU per request outside the engine threads, the
background its load average beyond its agents and one for the router and client.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import random
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import CommandError
from loraplex_bench.output import stage, write_bench_json

MODES = ("alora", "lora")
POOL = "alora"
TIMEOUT_S = 600.0


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=["engine", "twin", "both"], default="both")
    p.add_argument("--ks", default="1,3,6", help="checkers per turn, comma-separated (at most 6)")
    p.add_argument("--sessions", type=int, default=6, help="chats running at once")
    p.add_argument("--turns", type=int, default=2, help="turns (pipelines) per chat")
    p.add_argument("--system-tokens", type=int, default=1300, help="words of the system prompt (one token each)")
    p.add_argument("--user-tokens", type=int, default=60, help="words of a user message")
    p.add_argument("--answer-tokens", type=int, default=24, help="tokens of a base answer")
    p.add_argument("--check-tokens", type=int, default=4, help="tokens of a checker's answer")
    p.add_argument("--agents", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds of every mode, in ABBA order, pooled")
    p.add_argument("--routing-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the prefix-aware router (repeatable), e.g. load_slack=6: a turn fans out k "
                   "checkers at once, and the load ceiling (load_factor x the least queue + load_slack) sends "
                   "those past it to a server without the conversation")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="tokens of one prompt an engine step computes at most, on the agents and in the twin "
                   "(the pool's engine.longPrefillTokenThreshold; 0: the whole step budget)")
    p.add_argument("--profile", default="cpu-tiny", help="the twin's latency profile: name or file")
    p.add_argument("--twin-host-cores", type=float, default=float(os.cpu_count() or 1),
                   help="EMULATION: the cores the twin's agents share (default: this machine's, where the engine "
                   "side's agents run)")
    p.add_argument("--twin-background", type=float, default=0.0,
                   help="EMULATION: other processes keeping a core busy meanwhile (the router and the client, "
                   "other jobs on the machine)")
    p.add_argument("--twin-serving-ms", type=float, default=0.0,
                   help="the serving path per request (client, router, HTTP, chat template) when the engine side "
                   "did not run to measure it")
    p.add_argument("--twin-serving-cpu-ms", type=float, default=0.0,
                   help="EMULATION: the CPU a request's serving path takes on the shared cores when the engine side "
                   "did not run to measure it (needs --twin-serving-ms)")
    p.add_argument("--engine-json", default=None, metavar="PATH",
                   help="with --side twin: the twin against an engine side recorded earlier (its --json): its "
                   "measured serving path, its CPU and the background load are the twin's, its rows join the table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows here")


@dataclass
class Row:
    """One mode at one k, on one side, pooled over its rounds."""

    side: str
    mode: str
    k: int
    pipelines: int
    checker_ttft_s: float  # mean over every checker request
    base_ttft_s: float  # mean over the base model's answers
    pipelines_per_s: float  # finished pipelines over the summed run time
    checker_prompt: int  # prompt tokens of all checkers
    checker_cached: int  # of those, reported cached
    cached: int = 0  # every response's reported cached tokens (base and checkers)
    engine_hits: float | None = None  # the agents' prefix hits over the runs (engine side)
    errors: int = 0
    serving_s: float | None = None  # engine side: mean client TTFT minus the agents' own (their TTFT metric)
    load: float | None = None  # engine side: the machine's 1-minute load average over the runs
    serving_cpu_s: float | None = None  # engine side: CPU per request outside the agents' engine threads
    engine_cpu_s: float | None = None  # CPU per request of the engines' steps (twin: as profiled, unstretched)


@dataclass
class Run:
    """One run's requests: (kind, TTFT, prompt tokens, cached tokens) and its duration."""

    requests: list[tuple[str, float, int, int]] = field(default_factory=list)
    pipelines: int = 0
    elapsed_s: float = 0.0
    hits: float = 0.0
    errors: int = 0
    agent_ttft_s: float = 0.0  # the agents' vllm:time_to_first_token_seconds over the run: sum
    agent_firsts: float = 0.0  # and count
    load: float = 0.0  # the 1-minute load average, mean of its readings at the run's start and end
    cpu_s: float = 0.0  # CPU time of the stack's processes and the client over the run
    engine_cpu_s: float = 0.0  # of that, the agents' engine threads (twin: its steps' profiled seconds)


def pooled(side: str, mode: str, k: int, runs: list[Run]) -> Row:
    requests = [r for run in runs for r in run.requests]
    checkers = [r for r in requests if r[0] == "checker"]
    firsts = sum(r.agent_firsts for r in runs)
    serving = _mean(r[1] for r in requests) - sum(r.agent_ttft_s for r in runs) / firsts if firsts else None
    engine = side == "engine"
    return Row(side, mode, k, sum(r.pipelines for r in runs), _mean(r[1] for r in checkers),
               _mean(r[1] for r in requests if r[0] == "base"),
               sum(r.pipelines for r in runs) / sum(r.elapsed_s for r in runs),
               sum(r[2] for r in checkers), sum(r[3] for r in checkers), sum(r[3] for r in requests),
               sum(r.hits for r in runs) if engine else None, sum(r.errors for r in runs), serving,
               _mean(r.load for r in runs) if engine else None,
               sum(r.cpu_s - r.engine_cpu_s for r in runs) / len(requests) if engine and requests else None,
               sum(r.engine_cpu_s for r in runs) / len(requests) if requests else None)


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else float("nan")


def checker_names(mode: str, k: int) -> list[str]:
    return [f"{mode}{i:02d}-r8" for i in range(k)]


def abba(rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in the order both sides run them: every mode each round, ABBA."""
    return [(r, mode) for r in range(rounds) for mode in (MODES if r % 2 == 0 else MODES[::-1])]


def parse_ks(text: str) -> list[int]:
    try:
        ks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"--ks must be comma-separated integers, not {text!r}") from None
    if not ks or any(not 1 <= k <= 6 for k in ks):
        raise CommandError(f"--ks takes 1 to 6 checkers per turn, not {text!r}")
    return ks


def run(args: argparse.Namespace) -> int:
    ks = parse_ks(args.ks)
    if args.sessions < 1 or args.turns < 1 or args.agents < 1 or args.rounds < 1:
        raise CommandError("--sessions, --turns, --agents and --rounds must be >= 1")
    if args.twin_serving_cpu_ms < 0 or (args.twin_serving_cpu_ms > 0 and args.twin_serving_ms <= 0):
        raise CommandError("--twin-serving-cpu-ms must be >= 0, and > 0 only with a --twin-serving-ms > 0 to "
                           "spread it over")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-alora-") as tmp:
        from loraplex_agent.tools.tiny_model import invocation_tokens, make_tiny_model

        stage("a tiny model with six adapters of each kind")
        tiny = make_tiny_model(Path(tmp) / "tiny", num_adapters=6, ranks=(8,), seed=args.seed, alora_adapters=6)
        if args.side in ("engine", "both"):
            rows += run_engine(args, ks, tiny.base_dir, Path(tmp))
        elif args.engine_json:
            rows += recorded_engine_rows(Path(args.engine_json), args, ks)
        if args.side in ("twin", "both"):
            rows = run_twin(args, ks, invocation_tokens(tiny.base_dir), measured_host(rows, args.agents)) + rows
    print(report(rows))
    if args.json:
        write_bench_json(Path(args.json), "bench alora", args, {"rows": [asdict(r) for r in rows]})
    return 0


SAME_WORKLOAD = ("sessions", "turns", "system_tokens", "user_tokens", "answer_tokens", "check_tokens", "agents",
                 "long_prefill_token_threshold")


def recorded_engine_rows(path: Path, args: argparse.Namespace, ks: list[int]) -> list[Row]:
    """The engine side's rows of an earlier run's --json, at the chosen ks, of the same workload."""
    try:
        doc = json.loads(path.read_text())
        rows = [Row(**r) for r in doc["rows"] if r["side"] == "engine"]
        recorded = doc["parameters"]
        differ = [k for k in SAME_WORKLOAD if recorded[k] != getattr(args, k)]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CommandError(f"--engine-json {path}: not the JSON of a `bench alora` engine side ({exc})") from None
    if differ:
        raise CommandError(f"--engine-json {path} ran another workload: " + ", ".join(
            f"--{k.replace('_', '-')} {recorded[k]}" for k in differ))
    missing = sorted(set(ks) - {r.k for r in rows})
    if missing:
        raise CommandError(f"--engine-json {path} has no engine rows at k={','.join(map(str, missing))}")
    return [r for r in rows if r.k in ks]


@dataclass(frozen=True)
class TwinHost:
    """What the twin takes of the engine side's host at one k."""

    serving_s: float  # the serving path per request
    serving_cpu_s: float  # the CPU it takes (EMULATION: spread over the path, on the shared cores)
    background: float  # other processes keeping a core busy


def measured_host(rows: list[Row], agents: int) -> dict[int, TwinHost]:
    """k -> what the engine side measured of its host there, both modes' runs pooled: the serving path
    per request, its CPU (0 from a recording made before it was measured), and the background load: the
    load average beyond the stack's own agents and one more for its router and client."""
    by_k: dict[int, list[Row]] = {}
    for r in rows:
        if r.side == "engine" and r.serving_s is not None and r.load is not None:
            by_k.setdefault(r.k, []).append(r)
    return {k: TwinHost(float(np.mean([r.serving_s for r in v])),
                        float(np.mean([r.serving_cpu_s or 0.0 for r in v])),
                        max(0.0, float(np.mean([r.load for r in v])) - agents - 1))
            for k, v in by_k.items()}


def report(rows: list[Row]) -> str:
    lines = ["| side | k | checkers | checker TTFT | × LoRA | base TTFT | pipelines/s | × LoRA | checker prompt "
             "| cached | engine hits |", "|" + "---|" * 11]
    by = {(r.side, r.mode, r.k): r for r in rows}
    for r in rows:
        lora = by.get((r.side, "lora", r.k))
        ttft = f"**{r.checker_ttft_s / lora.checker_ttft_s:.2f}×**" if lora else "–"
        speed = f"**{r.pipelines_per_s / lora.pipelines_per_s:.2f}×**" if lora else "–"
        hits = f"{r.engine_hits:.0f}" if r.engine_hits is not None else "–"
        lines.append(f"| {r.side} | {r.k} | {r.mode} | {r.checker_ttft_s * 1e3:.1f} ms | {ttft} | "
                     f"{r.base_ttft_s * 1e3:.1f} ms | {r.pipelines_per_s:.2f} | {speed} | {r.checker_prompt} | "
                     f"{r.checker_cached} ({r.checker_cached / max(1, r.checker_prompt):.0%}); all {r.cached} | "
                     f"{hits} |" + (f" {r.errors} errors" if r.errors else ""))
    return "\n".join(lines)


# ---- twin -------------------------------------------------------------------------------------

def run_twin(args: argparse.Namespace, ks: list[int], invocation: list[int],
             measured: dict[int, TwinHost] | None = None) -> list[Row]:
    """`measured`: k -> the host as the engine side measured it; else `--twin-serving-ms`,
    `--twin-serving-cpu-ms` and `--twin-background`."""
    from loraplex.latency.profile import load_profile

    given = TwinHost(args.twin_serving_ms / 1e3, args.twin_serving_cpu_ms / 1e3, args.twin_background)
    profile = load_profile(args.profile)
    picks = random.Random(args.seed)  # one router's draws over every run, as the stack's one router process
    rows = []
    for k in ks:
        host = (measured or {}).get(k, given)
        stage(f"twin, k={k}: serving path {host.serving_s * 1e3:.0f} ms, EMULATION: its CPU "
              f"{host.serving_cpu_s * 1e3:.1f} ms per request on {args.twin_host_cores:g} cores shared with the "
              f"engines' steps, background load {host.background:.1f}")
        runs: dict[str, list[Run]] = {m: [] for m in MODES}
        for _, mode in abba(args.rounds):  # the engine side's rounds, in its order
            runs[mode].append(twin_run(args, profile, mode, k, invocation, host, picks))
        rows += [pooled("twin", mode, k, r) for mode, r in runs.items()]
        stage(f"twin, k={k}, per request: " + "; ".join(f"{r.mode}: engine steps' CPU {_ms(r.engine_cpu_s)}"
                                                        for r in rows[-len(MODES):]))
    return rows


def twin_engine_config(profile, args: argparse.Namespace):  # noqa: ANN001, ANN201 - a Profile, an EngineConfig
    """The profile's engine settings with the stack's prefill chunking."""
    return profile.engine_config(long_prefill_token_threshold=args.long_prefill_token_threshold)


def twin_run(args: argparse.Namespace, profile, mode: str, k: int, invocation: list[int], host: TwinHost,
             picks: random.Random) -> Run:
    """The agents' engines on one virtual timeline behind the router's `prefix-aware` profile (its
    prefix index over the prompts' token blocks, its in-flight counts, its draws from `picks`), every
    request reaching its engine `host.serving_s` after it is sent, the engines' steps stretched by the
    cores they share with each other and with the serving work in flight (EMULATION:
    `loraplex.sim.shared_host`)."""
    from loraplex.sim.shared_host import SharedHost

    out, shared = Run(), SharedHost(args.twin_host_cores, host.background)
    twin = _Twin(args, profile, mode, k, invocation, host, shared, out, picks)
    twin.run()
    out.elapsed_s, out.engine_cpu_s = max(s.clock.now() for s in twin.servers), shared.steps_cpu_s
    return out


@dataclass
class _TwinServer:
    id: str
    core: Any  # an EngineCore on the twin's executor
    clock: Any  # its ManualClock
    due: list[tuple[float, int, Request]] = field(default_factory=list)  # (arrival at the engine, order, request)
    in_flight: int = 0  # requests the router sent here that have not finished (the router's own count)
    beats: list[tuple[float, int]] = field(default_factory=list)  # its last heartbeats: (when, its load then)
    phase: float = 0.0  # its first heartbeat

    def heartbeat(self, now: float, interval: float) -> None:
        """The agent's heartbeats up to `now`, one every `interval`: its engine's running + waiting
        requests (`ServerLoad`), as of its last step."""
        while now >= (self.beats[-1][0] + interval if self.beats else self.phase):
            at = self.beats[-1][0] + interval if self.beats else self.phase
            self.beats = [*self.beats[-3:], (at, self.core.scheduler.num_running + self.core.scheduler.num_waiting)]

    def load_seen(self, now: float, poll: float) -> int:
        """The load of its last heartbeat that the router, reading the registry every `poll`, has read by `now`."""
        read = now - now % poll
        return next((load for at, load in reversed(self.beats) if at <= read), 0)


class _Twin:
    """Plays every session's pipelines: the client's sends, the router's picks, the engines' steps,
    one event at a time in time order (a send or an arrival once every busy engine's clock has passed
    it, else the step of the busy engine furthest behind)."""

    def __init__(self, args: argparse.Namespace, profile, mode: str, k: int, invocation: list[int],
                 measured: TwinHost, host, out: Run, picks: random.Random) -> None:
        from loraplex_local.flags import StackConfig

        from loraplex.routing.pipeline import make_profile, prefix_config
        from loraplex.routing.prefix import PrefixConfig, PrefixIndex
        from loraplex.routing.rank_aware import parse_options
        from loraplex.sim.server import make_sim_engine

        self.args, self.out, self.invocation, self.host = args, out, invocation, host
        self.serving_s, self.serving_cpu_s = measured.serving_s, measured.serving_cpu_s
        self.alora = mode == "alora"
        self.heartbeat_s = StackConfig().heartbeat_interval_s  # the engine side's stack's
        self.ids = {name: AdapterId(name, "sha256:" + name) for name in checker_names(mode, k)}
        self.servers = []
        for server in range(args.agents):
            core, clock = make_sim_engine(profile, twin_engine_config(profile, args))
            core.executor.host = host
            for adapter in self.ids.values():
                core.add_adapter(AdapterInfo(adapter, 8, 8 * profile.memory.adapter_bytes_per_rank,
                                             invocation_tokens=tuple(invocation) if self.alora else ()))
            # the agents' heartbeats are not in step with each other, nor with the router's reads
            self.servers.append(_TwinServer(f"twin-{server}", core, clock,
                                            phase=server * self.heartbeat_s / args.agents))
        options = PrefixConfig.from_options(parse_options(args.routing_option))
        self.router = make_profile("prefix-aware", picks, prefix=options)
        self.index = PrefixIndex(prefix_config(self.router))
        self.block = twin_engine_config(profile, args).block_size
        self.conversation = {s: _ids(("system", s), args.system_tokens) for s in range(args.sessions)}
        self.turn = dict.fromkeys(range(args.sessions), 0)
        self.waiting: dict[int, set[str]] = {}  # session -> its requests in flight
        self.requests: dict[str, tuple[int, str, Request, _TwinServer]] = {}
        self.sends: list[tuple[float, int, int]] = [(0.0, s, 0) for s in range(args.sessions)]  # base questions

    def run(self) -> None:
        while True:
            busy = [s for s in self.servers if s.core.has_unfinished()]
            step_at = min((s.clock.now() for s in busy), default=float("inf"))
            send_at = self.sends[0][0] if self.sends else float("inf")
            due = min((s for s in self.servers if s.due), key=lambda s: s.due[0][0], default=None)
            due_at = due.due[0][0] if due is not None else float("inf")
            if min(send_at, due_at, step_at) == float("inf"):
                return
            if send_at <= min(due_at, step_at):
                sent, session, _ = heapq.heappop(self.sends)
                self._ask_base(session, sent)
            elif due_at <= step_at:
                arrival, _, request = heapq.heappop(due.due)
                if not due.core.has_unfinished():  # idle: its clock jumps to the arrival
                    due.clock.advance(max(0.0, arrival - due.clock.now()))
                due.core.add_request(request)
            else:
                self._step(min(busy, key=lambda s: s.clock.now()))

    def _step(self, server: _TwinServer) -> None:
        server.heartbeat(server.clock.now(), self.heartbeat_s)
        for output in server.core.step():
            if output.finished:
                self._finish(output.request_id, server.clock.now())

    def _route(self, adapter: str | None, prompt: list[int], sent: float) -> _TwinServer:
        """The router's pick: prefix-aware over its index of the prompt's blocks (an activated LoRA's:
        the base model's blocks before the invocation), queue depth its in-flight count or the load
        in the agent's last heartbeat it has read, whichever is larger, as the router's snapshot takes
        it: the stack's agents beat every `StackConfig.heartbeat_interval_s`, its router reads them
        every `ROUTER_POLL_INTERVAL_S`, so a load it sees can be 1.5 s old."""
        from loraplex_local.flags import ROUTER_POLL_INTERVAL_S

        from loraplex.routing.pipeline import Candidate, Residency, RouteRequest
        from loraplex.routing.prefix import adapter_seed, alora_token_keys, token_keys

        if adapter is not None and self.alora:
            keys = alora_token_keys(self.invocation, prompt, self.block)
        else:
            keys = token_keys(adapter_seed(adapter, self.ids[adapter].digest if adapter else ""), prompt, self.block)
        matches = self.index.matches((s.id for s in self.servers), keys, sent)
        for server in self.servers:
            server.heartbeat(sent, self.heartbeat_s)
        candidates = [Candidate(s.id, phi=1.0 / len(self.servers), residency=Residency.GPU,
                                queue_depth=max(s.in_flight, s.load_seen(sent, ROUTER_POLL_INTERVAL_S)),
                                prefix_blocks=matches.get(s.id, 0)) for s in self.servers]
        route = RouteRequest(adapter, 8 if adapter else None, len(prompt), len(keys),
                             alora=adapter is not None and self.alora)
        picked = self.router.pick(route, candidates).server_id
        chosen = next(s for s in self.servers if s.id == picked)
        self.index.record(chosen.id, keys, sent)
        return chosen

    def _submit(self, session: int, kind: str, prompt: list[int], adapter: str | None, tokens: int,
                sent: float) -> None:
        request_id = f"s{session}-t{self.turn[session]}-{kind}-{len(self.waiting.get(session, ()))}"
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        server = self._route(adapter, prompt, sent)
        request = Request(request_id, prompt, sampling, adapter=self.ids[adapter] if adapter else None,
                          arrival_time=sent + self.serving_s)
        self.requests[request_id] = (session, kind, request, server)
        self.host.serve(sent, self.serving_s, self.serving_cpu_s)
        self.waiting.setdefault(session, set()).add(request_id)
        server.in_flight += 1
        heapq.heappush(server.due, (request.arrival_time, len(self.requests), request))

    def _ask_base(self, session: int, sent: float) -> None:
        self.conversation[session] += _ids((session, self.turn[session]), self.args.user_tokens)
        self._submit(session, "base", list(self.conversation[session]), None, self.args.answer_tokens, sent)

    def _finish(self, request_id: str, now: float) -> None:
        """Records a finished request (its TTFT as the client sees it: the serving path included);
        the base answer's checkers go out, the last checker's end starts the next turn."""
        session, kind, request, server = self.requests[request_id]
        server.in_flight -= 1
        self.out.requests.append((kind, request.first_token_time - request.arrival_time + self.serving_s,
                                  request.num_prompt_tokens, request.num_cached_tokens))
        self.waiting[session].discard(request_id)
        if kind == "base":
            self.conversation[session] += request.output_token_ids
            for i, name in enumerate(self.ids):
                check = self.conversation[session] + self.invocation + _ids(("check", session, i), 8)
                self._submit(session, "checker", check, name, self.args.check_tokens, now)
            return
        if self.waiting[session]:
            return
        self.out.pipelines += 1
        self.turn[session] += 1
        if self.turn[session] < self.args.turns:
            heapq.heappush(self.sends, (now, session, self.turn[session]))


def _ids(key: tuple, count: int) -> list[int]:
    """Token ids of no meaning, seeded by `key` (the twin's stand-in for words)."""
    rng = np.random.default_rng([zlib.crc32(str(part).encode()) for part in key])
    return [int(t) for t in rng.integers(300, 8000, count)]


# ---- engine -----------------------------------------------------------------------------------

def run_engine(args: argparse.Namespace, ks: list[int], model: Path, workdir: Path) -> list[Row]:
    from loraplex_local.stack import StackConfig, running_stack

    from loraplex.ports import free_port_block
    from loraplex_bench.prefix_routing_engine import vocabulary, wait_placed, warm_up

    words = vocabulary(model / "tokenizer.json")
    adapters = [n for mode in MODES for n in checker_names(mode, 6)]
    manifests = write_manifests(workdir / "manifests", model, adapters, args.agents, args.long_prefill_token_threshold)
    first = free_port_block(args.agents + 2)
    config = StackConfig(agents=args.agents, manifests=manifests, model=model, redis_port=first,
                         router_port=first + 1, agent_base_port=first + 2, workdir=workdir,
                         router_args=["--log-level", "warning", "--profile", "prefix-aware",
                                      *(f"--routing-option={o}" for o in args.routing_option)])
    rows = []
    with running_stack(config) as stack:
        wait_placed(stack, adapters, args.agents)
        warm_up(stack.router_url, adapters, stage)
        agents = [s.url for s in stack.store.healthy_servers()]
        pids = [c.process.pid for c in (*stack.agents.values(), stack.router, stack.redis) if c is not None]
        for k in ks:
            runs: dict[str, list[Run]] = {m: [] for m in MODES}
            for round_, mode in abba(args.rounds):
                stage(f"engine, k={k}, {mode}, round {round_ + 1} of {args.rounds}")
                runs[mode].append(engine_run(stack.router_url, agents, pids, args, words, mode, k,
                                             f"{mode} {k} {round_}"))
            rows += [pooled("engine", mode, k, r) for mode, r in runs.items()]
            stage(f"engine, k={k}, per request: " + "; ".join(
                f"{r.mode}: serving path {_ms(r.serving_s)}, serving CPU {_ms(r.serving_cpu_s)}, engine steps' CPU "
                f"{_ms(r.engine_cpu_s)}" for r in rows[-len(MODES):]))
    return rows


def write_manifests(folder: Path, model: Path, adapters: list[str], agents: int, threshold: int) -> Path:
    """The pool on the tiny model and a LoRADeployment per adapter, on every agent."""
    folder.mkdir(parents=True)
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": POOL},
            # float32 on the CPU, as the twin's cpu-tiny profile was measured (the pool's default, bfloat16, is
            # for GPUs)
            "spec": {"baseModel": {"name": "base", "source": f"file://{model.resolve()}", "dtype": "float32"},
                     "engine": {"longPrefillTokenThreshold": threshold},
                     "placement": {"intervalSeconds": 600}}}
    (folder / "pool.yaml").write_text(json.dumps(pool))
    for name in adapters:
        doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRADeployment", "metadata": {"name": name},
               "spec": {"pool": POOL, "adapter": {"source": f"file://{(model.parent / 'adapters' / name).resolve()}"},
                        "replicas": {"min": agents, "max": agents}}}
        (folder / f"{name}.yaml").write_text(json.dumps(doc))
    return folder


def engine_run(url: str, agents: list[str], pids: list[int], args: argparse.Namespace, words, mode: str, k: int,
               tag: str) -> Run:
    """One run of the workload through the router; `pids`: the stack's processes, whose CPU time
    (with this process's, the client's) the run records."""
    from loraplex_bench.prefix_routing_engine import metric_sums
    from loraplex_bench.rss import cpu_seconds

    names = ("vllm:prefix_cache_hits", "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
             "loraplex:engine_thread_cpu_seconds")

    def sums() -> np.ndarray:
        return np.sum([metric_sums(a + "/metrics", *names) for a in agents], axis=0)

    def cpu() -> float:
        return time.process_time() + sum(cpu_seconds(pid) or 0.0 for pid in pids)

    out = Run()
    before, load = sums(), os.getloadavg()[0]
    started, cpu_started = time.monotonic(), cpu()
    asyncio.run(_drive(url, args, words, checker_names(mode, k), tag, out))
    out.elapsed_s, out.cpu_s = time.monotonic() - started, cpu() - cpu_started
    out.load = (load + os.getloadavg()[0]) / 2
    out.hits, out.agent_ttft_s, out.agent_firsts, out.engine_cpu_s = (float(x) for x in sums() - before)
    return out


async def _drive(url: str, args: argparse.Namespace, words, checkers: list[str], tag: str, out: Run) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0) as api:
        await asyncio.gather(*(_session(api, args, words, checkers, tag, s, out) for s in range(args.sessions)))


async def _session(api, args: argparse.Namespace, words, checkers: list[str], tag: str, index: int, out: Run) -> None:
    from loraplex_agent.tools.tiny_model import INVOCATION

    from loraplex_bench.prefix_routing_engine import word_text

    messages = [{"role": "system", "content": f"{tag} {index} " + word_text(words.words, ("system", index),
                                                                           args.system_tokens)}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": word_text(words.words, (index, turn), args.user_tokens)})
        answer = await _ask(api, "base", messages, args.answer_tokens, words, out)
        if answer is None:
            return
        messages.append({"role": "assistant", "content": answer})
        asks = [_ask(api, name, [*messages, {"role": "user", "content": INVOCATION + word_text(
            words.words, ("check", index, i), 8)}], args.check_tokens, words, out) for i, name in enumerate(checkers)]
        if any(a is None for a in await asyncio.gather(*asks)):
            return
        out.pipelines += 1


async def _ask(api, model: str, messages: list[dict], tokens: int, words, out: Run) -> str | None:
    """One streamed chat completion; its text, or None (counted) on an error."""
    import openai

    sent, first, parts, usage = time.monotonic(), None, [], None
    try:
        stream = await api.chat.completions.create(
            model=model, messages=messages, max_tokens=tokens, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}, logit_bias=words.reply_bias)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.OpenAIError:
        out.errors += 1
        return None
    if first is None or usage is None:
        out.errors += 1
        return None
    out.requests.append(("base" if model == "base" else "checker", first - sent, usage.prompt_tokens,
                         usage.prompt_tokens_details.cached_tokens))
    return "".join(parts)
