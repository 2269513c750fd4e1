"""`loraplex bench alora`: a pipeline of checker adapters on one conversation, as activated LoRAs
and, with the same weights, as standard LoRAs; on a local stack and in the twin.

The workload: `--sessions` multi-turn chats, all running at once. Each turn sends a user message to
the base model; once its answer is back, k checker requests (k in `--ks`) go out together, each to
its own adapter, on the conversation plus the answer plus a user message that starts with the
checker's invocation (`loraplex_agent.tools.tiny_model.INVOCATION`). The turn (the pipeline) ends with
the last checker's answer; the next turn then re-sends the conversation. The checkers are
aloraNN-r8 (activated LoRAs: the base model's KV of the conversation is theirs too) or loraNN-r8
(the same weights as standard LoRAs: each recomputes the conversation under its own adapter).

Engine side: a `loraplex up` stack (redis-server, --agents agents on a fresh tiny model with six
adapters of each kind, the prefix-aware router, every adapter on every agent), the workload driven
through the router with the `openai` client over streamed chat completions. The system prompt and
messages are whole words of the vocabulary and the answers are kept to whole words
(`loraplex_bench.prefix_routing_engine` says why), so a re-sent conversation tokenizes as it was
computed. Each run tags its text with its mode, k and round, so no run finds another's KV; with
`--rounds 2` the modes run in ABBA order and each row pools its rounds. TTFT is measured at the
client; `cached` is the sum of `usage.prompt_tokens_details.cached_tokens` over the responses, and
`engine hits` the change of the agents' `vllm:prefix_cache_hits` over the run.

Twin side: the same workload on token ids through --agents real `EngineCore`s on a virtual clock
(`loraplex.sim.server.make_sim_engine`, latency profile `--profile`), each session on one server as
prefix-aware routing keeps it; the engine's own prefix cache keys an activated LoRA's conversation
as the base model's, as on the agents.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

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
    p.add_argument("--profile", default="cpu-tiny", help="the twin's latency profile: name or file")
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


@dataclass
class Run:
    """One run's requests: (kind, TTFT, prompt tokens, cached tokens) and its duration."""

    requests: list[tuple[str, float, int, int]] = field(default_factory=list)
    pipelines: int = 0
    elapsed_s: float = 0.0
    hits: float = 0.0
    errors: int = 0


def pooled(side: str, mode: str, k: int, runs: list[Run]) -> Row:
    requests = [r for run in runs for r in run.requests]
    checkers = [r for r in requests if r[0] == "checker"]
    return Row(side, mode, k, sum(r.pipelines for r in runs), _mean(r[1] for r in checkers),
               _mean(r[1] for r in requests if r[0] == "base"),
               sum(r.pipelines for r in runs) / sum(r.elapsed_s for r in runs),
               sum(r[2] for r in checkers), sum(r[3] for r in checkers), sum(r[3] for r in requests),
               sum(r.hits for r in runs) if side == "engine" else None, sum(r.errors for r in runs))


def _mean(values) -> float:
    values = list(values)
    return float(np.mean(values)) if values else float("nan")


def checker_names(mode: str, k: int) -> list[str]:
    return [f"{mode}{i:02d}-r8" for i in range(k)]


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
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-alora-") as tmp:
        from loraplex_agent.tools.tiny_model import invocation_tokens, make_tiny_model

        stage("a tiny model with six adapters of each kind")
        tiny = make_tiny_model(Path(tmp) / "tiny", num_adapters=6, ranks=(8,), seed=args.seed, alora_adapters=6)
        if args.side in ("twin", "both"):
            rows += run_twin(args, ks, invocation_tokens(tiny.base_dir))
        if args.side in ("engine", "both"):
            rows += run_engine(args, ks, tiny.base_dir, Path(tmp))
    print(report(rows))
    if args.json:
        write_bench_json(Path(args.json), "bench alora", args, {"rows": [asdict(r) for r in rows]})
    return 0


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

def run_twin(args: argparse.Namespace, ks: list[int], invocation: list[int]) -> list[Row]:
    from loraplex.latency.profile import load_profile

    profile = load_profile(args.profile)
    rows = []
    for k in ks:
        for mode in MODES:
            stage(f"twin, k={k}, {mode}")
            rows.append(pooled("twin", mode, k, [twin_run(args, profile, mode, k, invocation)]))
    return rows


def twin_run(args: argparse.Namespace, profile, mode: str, k: int, invocation: list[int]) -> Run:
    """Every server's sessions on its own simulated engine; the run lasts as long as the slowest."""
    from loraplex.sim.server import make_sim_engine

    out = Run()
    for server in range(args.agents):
        core, clock = make_sim_engine(profile)
        ids = {}
        for name in checker_names(mode, k):
            ids[name] = AdapterId(name, "sha256:" + name)
            core.add_adapter(AdapterInfo(ids[name], 8, 8 * profile.memory.adapter_bytes_per_rank,
                                         invocation_tokens=tuple(invocation) if mode == "alora" else ()))
        sessions = [s for s in range(args.sessions) if s % args.agents == server]
        _TwinServer(core, clock, args, ids, invocation, out).play(sessions)
        out.elapsed_s = max(out.elapsed_s, clock.now())
    return out


class _TwinServer:
    """Plays its sessions' pipelines on one simulated engine, event by event on its clock."""

    def __init__(self, core, clock, args: argparse.Namespace, ids: dict[str, AdapterId], invocation: list[int],
                 out: Run) -> None:
        self.core, self.clock, self.args, self.ids, self.out = core, clock, args, ids, out
        self.invocation = invocation
        self.waiting: dict[int, set[str]] = {}  # session -> its requests in flight
        self.conversation: dict[int, list[int]] = {}
        self.turn: dict[int, int] = {}
        self.requests: dict[str, tuple[int, str, Request]] = {}

    def play(self, sessions: list[int]) -> None:
        due = [(0.0, s) for s in sessions]
        heapq.heapify(due)
        for s in sessions:
            self.conversation[s], self.turn[s] = _ids(("system", s), self.args.system_tokens), 0
        while due or self.core.has_unfinished():
            if not self.core.has_unfinished():
                self.clock.advance(max(0.0, due[0][0] - self.clock.now()))
            while due and due[0][0] <= self.clock.now():
                self._ask_base(heapq.heappop(due)[1])
            for output in self.core.step():
                if output.finished and self._finish(output.request_id):
                    session = self.requests[output.request_id][0]
                    if self.turn[session] < self.args.turns:
                        heapq.heappush(due, (self.clock.now(), session))

    def _submit(self, session: int, kind: str, prompt: list[int], adapter: str | None, tokens: int) -> None:
        request_id = f"s{session}-t{self.turn[session]}-{kind}-{len(self.waiting.get(session, ()))}"
        sampling = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        request = Request(request_id, prompt, sampling, adapter=self.ids.get(adapter) if adapter else None)
        self.core.add_request(request)
        self.requests[request_id] = (session, kind, request)
        self.waiting.setdefault(session, set()).add(request_id)

    def _ask_base(self, session: int) -> None:
        self.conversation[session] += _ids((session, self.turn[session]), self.args.user_tokens)
        self._submit(session, "base", list(self.conversation[session]), None, self.args.answer_tokens)

    def _finish(self, request_id: str) -> bool:
        """Records a finished request; True when its session's pipeline is over."""
        session, kind, request = self.requests[request_id]
        self.out.requests.append((kind, request.first_token_time - request.arrival_time, request.num_prompt_tokens,
                                  request.num_cached_tokens))
        self.waiting[session].discard(request_id)
        if kind == "base":
            self.conversation[session] += request.output_token_ids
            for i, name in enumerate(self.ids):
                check = self.conversation[session] + self.invocation + _ids(("check", session, i), 8)
                self._submit(session, "checker", check, name, self.args.check_tokens)
            return False
        if self.waiting[session]:
            return False
        self.out.pipelines += 1
        self.turn[session] += 1
        return True


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
    manifests = write_manifests(workdir / "manifests", model, adapters, args.agents)
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
        for k in ks:
            runs: dict[str, list[Run]] = {m: [] for m in MODES}
            for round_ in range(args.rounds):
                for mode in MODES if round_ % 2 == 0 else reversed(MODES):
                    stage(f"engine, k={k}, {mode}, round {round_ + 1} of {args.rounds}")
                    runs[mode].append(engine_run(stack.router_url, agents, args, words, mode, k,
                                                 f"{mode} {k} {round_}"))
            rows += [pooled("engine", mode, k, r) for mode, r in runs.items()]
    return rows


def write_manifests(folder: Path, model: Path, adapters: list[str], agents: int) -> Path:
    """The pool on the tiny model and a LoRADeployment per adapter, on every agent."""
    folder.mkdir(parents=True)
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": POOL},
            "spec": {"baseModel": {"name": "base", "source": f"file://{model.resolve()}"},
                     "placement": {"intervalSeconds": 600}}}
    (folder / "pool.yaml").write_text(json.dumps(pool))
    for name in adapters:
        doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRADeployment", "metadata": {"name": name},
               "spec": {"pool": POOL, "adapter": {"source": f"file://{(model.parent / 'adapters' / name).resolve()}"},
                        "replicas": {"min": agents, "max": agents}}}
        (folder / f"{name}.yaml").write_text(json.dumps(doc))
    return folder


def engine_run(url: str, agents: list[str], args: argparse.Namespace, words, mode: str, k: int, tag: str) -> Run:
    from loraplex_bench.prefix_routing_engine import metric_sums

    def hits() -> float:
        return sum(metric_sums(a + "/metrics", "vllm:prefix_cache_hits")[0] for a in agents)

    out = Run()
    before, started = hits(), time.monotonic()
    asyncio.run(_drive(url, args, words, checker_names(mode, k), tag, out))
    out.elapsed_s, out.hits = time.monotonic() - started, hits() - before
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
