"""`loraplex bench memory`: the engine's memory policies side by side on multi-turn chat sessions.

One run compares `unified` (one page pool, prefix cache, adapter cache, swapper), `lru-static`
(vLLM's fixed slots) and `no-cache` (S-LoRA's drop-when-idle) on the same session workload
(`loraplex.sim.sessions`), in the twin with a profile (default: the what-if H100 / Llama-3.1-8B
one) and on the real engine (the tiny CPU model, `loraplex_bench.memory_engine`, which needs
torch). Every policy gets the same page pool: `lru-static` carves its slots out of it, the others
page adapters into it. The headline is each policy's mean TTFT over `lru-static`'s (FastLibra
reports <= 0.40x; our goal for `unified` is <= 0.35x).

This module is the twin side, the arguments, the tables and the JSON report; it imports no torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.config import EngineConfig
from loraplex.latency.profile import Profile
from loraplex.sim.sessions import (
    DEFAULT_RANKS,
    PromptTokens,
    SessionSpec,
    SessionSummary,
    SessionWorkload,
    make_sessions,
)
from loraplex.spec.engine_settings import add_engine_settings
from loraplex.spec.errors import CommandError
from loraplex_bench.output import write_bench_json

BASELINE = "lru-static"
GOAL_RATIO = 0.35  # ours, issue 10
PAPER_RATIO = 0.40  # FastLibra's mean-TTFT reduction against vLLM
TWIN_VOCAB = 32000  # the twin's token ids only need to be distinct, never decoded


@dataclass(frozen=True)
class Variant:
    name: str
    policy: str
    prefix_cache: bool = True


@dataclass
class PolicyResult:
    variant: str
    policy: str
    prefix_cache: bool
    summary: SessionSummary
    ttft_ratio: float | None = None  # mean TTFT over lru-static's


@dataclass
class SideReport:
    side: str  # "twin" or "engine"
    settings: dict[str, Any]  # what the side ran on, printed above its table
    results: list[PolicyResult] = field(default_factory=list)


def variants(with_no_prefix: bool) -> list[Variant]:
    out = [Variant("unified", "unified"), Variant("lru-static", "lru-static"), Variant("no-cache", "no-cache")]
    if with_no_prefix:
        out.insert(1, Variant("unified-no-prefix", "unified", prefix_cache=False))
    return out


# ---- arguments ------------------------------------------------------------------------------

def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=["twin", "engine", "both"], default="both")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=0)
    w = p.add_argument_group("session workload (both sides)")
    w.add_argument("--adapters", type=int, default=100)
    w.add_argument("--ranks", default=",".join(map(str, DEFAULT_RANKS)), help="adapter ranks, drawn uniformly")
    w.add_argument("--zipf", type=float, default=1.0, help="popularity exponent over adapters")
    w.add_argument("--turns", type=float, default=5.0, help="mean turns per session (geometric)")
    w.add_argument("--think", type=float, default=5.0, help="mean think time between turns, s (exponential)")
    w.add_argument("--system-prompt", type=int, default=64, help="tokens of each adapter's system prompt")
    w.add_argument("--duration", type=float, default=None, help="arrival window in seconds (default: none)")
    t = p.add_argument_group("twin")
    t.add_argument("--profile", default="whatif-h100-llama8b", help="profile name or file")
    t.add_argument("--sessions", type=int, default=400, help="sessions (twin)")
    t.add_argument("--rate", type=float, default=1.0, help="sessions per second (twin)")
    t.add_argument("--length-scale", type=float, default=1.0, help="multiply token counts (twin)")
    e = p.add_argument_group("real engine (tiny CPU model)")
    e.add_argument("--engine-sessions", type=int, default=40)
    e.add_argument("--engine-rate", type=float, default=0.5, help="sessions per second")
    e.add_argument("--engine-length-scale", type=float, default=0.25, help="multiply token counts")
    e.add_argument("--engine-num-blocks", type=int, default=None,
                   help="pages of the pool (default: the twin's pool scaled so that adapters take the same share)")
    e.add_argument("--emulate-h2d-gbps", type=float, default=None, metavar="GBPS",
                   help="EMULATED host->device bandwidth (default: calibrated so that an adapter copy costs what "
                        "it costs against a decode step on the what-if H100)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or auto (on CUDA copies are real, not emulated)")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_memory_args(p).add_argument("--no-prefix-cache", action="store_true",
                                    help="also run unified with the prefix cache off")


def add_memory_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The engine's memory, the same on both sides (`bench memory` and `bench schedulers`)."""
    m = p.add_argument_group("engine memory (both sides)")
    add_engine_settings(m, "max_loras", "max_lora_rank",
                        max_loras={"default": None, "help": "lru-static slots (default: the profile's)"},
                        max_lora_rank={"default": 128, "help": None})
    m.add_argument("--host-blocks", type=int, default=None, help="host KV blocks (default: as many as the device)")
    return m


def parse_ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise CommandError(f"--ranks must be comma-separated integers, not {text!r}") from None
    if not ranks or min(ranks) < 1:
        raise CommandError(f"--ranks needs ranks >= 1, not {text!r}")
    return ranks


def session_spec(args: argparse.Namespace, side: str, max_model_len: int) -> SessionSpec:
    """The workload of one side: shared settings, with the engine's own count, rate and scale."""
    engine = side == "engine"
    try:
        return SessionSpec(
            num_adapters=args.adapters, ranks=parse_ranks(args.ranks), zipf_s=args.zipf,
            rate=args.engine_rate if engine else args.rate,
            num_sessions=args.engine_sessions if engine else args.sessions, duration_s=args.duration,
            mean_turns=args.turns, think_mean_s=args.think,
            length_scale=args.engine_length_scale if engine else args.length_scale,
            system_prompt_tokens=args.system_prompt, max_model_len=max_model_len, seed=args.seed)
    except ValueError as exc:
        raise CommandError(str(exc)) from None


def check_args(args: argparse.Namespace) -> None:
    top = max(parse_ranks(args.ranks))
    if args.max_lora_rank < top:
        raise CommandError(f"--max-lora-rank {args.max_lora_rank} is below the largest adapter rank {top}")
    for flag in ("max_loras", "host_blocks", "engine_num_blocks", "emulate_h2d_gbps", "threads"):
        value = getattr(args, flag)
        if value is not None and (value <= 0 if flag != "host_blocks" else value < 0):
            raise CommandError(f"--{flag.replace('_', '-')} must be positive, not {value}")


# ---- the twin -------------------------------------------------------------------------------

def run_twin(args: argparse.Namespace, chosen: list[Variant]) -> SideReport:
    from loraplex.latency.profile import load_profile

    try:
        profile = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    block = int(profile.engine["block_size"])
    num_blocks = profile.memory.kv_tokens_base // block
    max_loras = args.max_loras or int(profile.engine["max_loras"])
    host = num_blocks if args.host_blocks is None else args.host_blocks
    spec = session_spec(args, "twin", int(profile.engine["max_model_len"]))
    workload = make_sessions(spec)
    report = SideReport("twin", {
        "profile": profile.name, "hardware": profile.hardware, "num_pages": num_blocks, "block_size": block,
        "lru_static_kv_pages": max(0, profile.memory.kv_tokens(max_loras, args.max_lora_rank)) // block,
        "host_blocks": host, "max_loras": max_loras, "max_lora_rank": args.max_lora_rank,
        "h2d_gbps": profile.memory.h2d_gbps, "sessions": len(workload.sessions), "turns": workload.num_turns,
        "spec": asdict(spec)})
    for variant in chosen:
        config = _twin_config(profile, variant, num_blocks, max_loras, args.max_lora_rank, host)
        report.results.append(PolicyResult(variant.name, variant.policy, variant.prefix_cache,
                                           twin_summary(profile, config, workload)))
    return report


def _twin_config(profile: Profile, variant: Variant, num_blocks: int, max_loras: int, max_lora_rank: int,
                 host_blocks: int) -> EngineConfig:
    """The profile's engine with the whole pool, except under lru-static: there the profile sizes the
    KV cache net of the slots (its measured slot cost), and the twin gives slots no pages of it."""
    pool = {} if variant.policy == "lru-static" else {"num_blocks": num_blocks}
    try:
        return profile.engine_config(max_loras=max_loras, max_lora_rank=max_lora_rank, memory_policy=variant.policy,
                                     prefix_cache=variant.prefix_cache, num_host_blocks=host_blocks, **pool)
    except ValueError as exc:
        raise CommandError(f"{variant.name}: {exc}") from None


def twin_summary(profile: Profile, config: EngineConfig, workload: SessionWorkload) -> SessionSummary:
    """One policy's run of `workload` in the twin."""
    from loraplex.sim.gc_pause import cyclic_gc_paused
    from loraplex.sim.replay import register_adapters
    from loraplex.sim.server import make_sim_engine
    from loraplex.sim.sessions import run_sessions, summarize_sessions

    try:
        core, clock = make_sim_engine(profile, config)
    except ValueError as exc:  # e.g. lru-static slots that leave no KV pages
        raise CommandError(f"{config.memory_policy}: {exc}") from None
    register_adapters(core, workload.adapters)

    def jump(t: float) -> None:
        clock.advance(max(0.0, t - clock.now()))

    with cyclic_gc_paused():
        run = run_sessions(core, workload, jump, PromptTokens(TWIN_VOCAB, seed=workload.spec.seed))
    return summarize_sessions(run)


# ---- report ---------------------------------------------------------------------------------

def add_ratios(report: SideReport) -> None:
    base = next((r.summary.ttft_mean_s for r in report.results if r.variant == BASELINE), None)
    for r in report.results:
        r.ttft_ratio = r.summary.ttft_mean_s / base if base else None


def print_report(report: SideReport) -> None:
    shown = {k: v for k, v in report.settings.items() if k not in ("spec", "hardware", "calibration")}
    print(f"\n== {report.side}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in shown.items()))
    print(f"{'policy':<19}{'turns':>6}{'TTFT mean ms':>13}{'TTFT p99 ms':>12}{'TBT p50 ms':>11}"
          f"{'adapter hit':>12}{'prefix hit':>11}{'copied GB':>10}{'invalid KV':>11}{'TTFT/lru':>9}")
    for r in report.results:
        s = r.summary
        ratio = "" if r.ttft_ratio is None else f"{r.ttft_ratio:.2f}x"
        print(f"{r.variant:<19}{s.finished:>6}{s.ttft_mean_s * 1e3:>13.1f}{s.ttft_p99_s * 1e3:>12.1f}"
              f"{s.tbt_p50_s * 1e3:>11.2f}{s.adapter_hit_rate:>12.1%}{s.prefix_hit_rate:>11.1%}"
              f"{s.copied_bytes / 1e9:>10.2f}{s.invalid_kv_pages:>11}{ratio:>9}")
    unified = next((r for r in report.results if r.variant == "unified"), None)
    if unified is not None and unified.ttft_ratio is not None:
        verdict = "met" if unified.ttft_ratio <= GOAL_RATIO else "NOT met"
        print(f"unified mean TTFT = {unified.ttft_ratio:.2f}x lru-static's (goal <= {GOAL_RATIO}x: {verdict}; "
              f"FastLibra reports <= {PAPER_RATIO}x)")


def write_json(path: Path, args: argparse.Namespace, reports: list[SideReport]) -> None:
    write_bench_json(path, "bench memory", args, {"goal_ratio": GOAL_RATIO, "paper_ratio": PAPER_RATIO,
                                                   "sides": [asdict(r) for r in reports]})


# ---- the command ----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    check_args(args)
    chosen = variants(args.no_prefix_cache)
    reports = []
    if args.side in ("twin", "both"):
        reports.append(run_twin(args, chosen))
    if args.side in ("engine", "both"):
        reports.append(_engine_side()(args, chosen))
    for report in reports:
        add_ratios(report)
        print_report(report)
    if args.json:
        write_json(Path(args.json), args, reports)
    return 0


def _engine_side() -> Callable[[argparse.Namespace, list[Variant]], SideReport]:
    try:  # torch and the agent load only when the real engine runs
        from loraplex_bench.memory_engine import run_engine
    except ImportError as exc:
        raise CommandError(f"the real-engine side needs the agent and torch ({exc}); run with --side twin") from None
    return run_engine
