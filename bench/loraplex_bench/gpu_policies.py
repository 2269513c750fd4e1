"""Parts 5 and 6 of the GPU run: copies, CPU assist and the engine policies on the device.

Part 5 probes adapters cold and warm with CPU assist off and on (`bench cpu-assist`'s probes, on the
run's shape) and measures host->device copy bandwidth from pageable and from pinned memory. On CUDA
the engine copies adapters from pinned memory (`loraplex_agent.runtime.pinned_adapters`): the part says so
(`engine_copies_from`) and how many of its adapters were staged there.

Part 6 runs the drivers of `bench memory` (multi-turn chat sessions, `loraplex.sim.sessions`) and of
`bench schedulers` (its engine side's calibration and sweep) on engines of the run's shape. The page
pool holds `Sizes.pool_share` of the adapters' weights, so they cannot all be resident: real memory
pressure, with real copies on CUDA (on the CPU a copy is a memcpy, and nothing is emulated here).
What part 7 needs to replay the same workloads in the twin is left in `GpuRun.shared`.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict
from typing import Any

import torch
from loraplex_agent.runtime.device import adapter_bytes_per_rank, kv_block_bytes

from loraplex.sim.sessions import PromptTokens, make_sessions, run_sessions, summarize_sessions
from loraplex.util.clock import Clock
from loraplex_bench import memory_compare, scheduler_compare
from loraplex_bench.cpu_assist import probe_adapters
from loraplex_bench.gpu import RANKS, Bench
from loraplex_bench.gpu_state import GpuRun
from loraplex_bench.scheduler_engine import EngineSide

POLICIES = (memory_compare.Variant("unified", "unified"), memory_compare.Variant("lru-static", "lru-static"))
SCHEDULERS = ("chameleon", scheduler_compare.BASELINE)


# ---- part 5 -----------------------------------------------------------------------------------------

def cold_warm(run: GpuRun, out: dict[str, Any]) -> None:
    s = run.sizes
    out["h2d_gbps"] = h2d_bandwidth(run.device, s.h2d_bytes)
    out["goal"] = "cold/warm mean TTFT <= 1.05 with cpu assist (Toppings: ~1.07 over all-cached)"
    out["passes"] = passes = []
    ranks = [RANKS[i % len(RANKS)] for i in range(s.assist_adapters)]
    for assist in (False, True):
        if run.over():
            break
        bench = run.bench(s.assist_blocks, True, max_model_len=s.assist_prompt_len + 256, cpu_assist=assist,
                          max_num_batched_tokens=max(512, s.assist_prompt_len))
        try:
            names = [a.name for a in bench.add_adapters(ranks)]
            result = probe_adapters(bench, names, s.assist_prompt_len, s.assist_background, assist)
            staged = bench.executor.pinned  # adapters staged in pinned memory (CUDA): their copies are DMA
            out["engine_copies_from"] = "pinned" if staged is not None else "pageable"
            out["engine_pinned"] = {"adapters": len(staged), "bytes": staged.nbytes} if staged is not None else None
        finally:
            bench.close()
            run.free()
        passes.append({**asdict(result), "cold_over_warm": result.cold_over_warm})
        print(f"cpu assist {'on ' if assist else 'off'}: cold/warm mean TTFT {result.cold_over_warm:.3f} "
              f"(ranks {ranks}, assisted layer-groups {result.assisted_layers})", flush=True)


def h2d_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """GB/s of a host->device copy from pageable and from pinned memory (none on the CPU)."""
    if device.type != "cuda":
        return {}
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = {}
    for kind, src in (("pageable", torch.empty(nbytes, dtype=torch.uint8)),
                      ("pinned", torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        rates[kind] = 3 * nbytes / (time.perf_counter() - began) / 1e9
    print(f"host->device copies: {rates['pageable']:.1f} GB/s pageable, {rates['pinned']:.1f} GB/s pinned", flush=True)
    return rates


# ---- part 6 -----------------------------------------------------------------------------------------

def policies(run: GpuRun, out: dict[str, Any]) -> None:
    s = run.sizes
    mem_args = command_defaults(memory_compare.configure, adapters=s.policy_adapters,
                                ranks=",".join(map(str, RANKS)), turns=s.turns, think=s.think_s,
                                engine_sessions=s.sessions, engine_rate=s.session_rate,
                                engine_length_scale=s.length_scale, seed=run.args.seed)
    workload = make_sessions(memory_compare.session_spec(mem_args, "engine", s.max_model_len))
    pool = pool_pages(run, list(workload.adapters.values()))
    engine = {"max_model_len": s.max_model_len, "max_num_seqs": s.max_num_seqs,
              "max_num_batched_tokens": s.max_batched_tokens, "max_loras": s.max_loras,
              "num_host_blocks": int(s.host_share * pool)}
    settings = {"num_pages": pool, "page_bytes": kv_block_bytes(run.config, 16, run.dtype),
                "session_horizon_s": s.session_horizon_s, "pool_share_of_adapters": s.pool_share, **engine,
                "sessions": len(workload.sessions),
                "turns": workload.num_turns, "adapters": len(workload.adapters), "spec": asdict(workload.spec)}
    run.shared.update(pool=pool, engine=engine, sessions=workload)
    report = memory_compare.SideReport("engine", settings)
    out["memory"] = asdict(report)
    for variant in POLICIES:
        if run.over():
            break
        bench = run.bench(pool, True, memory_policy=variant.policy, prefix_cache=variant.prefix_cache, **engine)
        try:
            bench.add_adapters(list(workload.adapters.values()), names=list(workload.adapters))
            summary = summarize_sessions(run_sessions(bench.core, workload, BenchSide._sleep_until(bench),
                                                      PromptTokens(run.config.vocab_size, seed=workload.spec.seed),
                                                      horizon_s=s.session_horizon_s))
        finally:
            bench.close()
            run.free()
        report.results.append(memory_compare.PolicyResult(variant.name, variant.policy, variant.prefix_cache, summary))
        memory_compare.add_ratios(report)
        out["memory"] = asdict(report)
        out.setdefault("memory_horizon_hit", {})[variant.name] = summary.elapsed_s >= s.session_horizon_s
    memory_compare.print_report(report)
    out["memory_goal"] = f"unified mean TTFT <= {memory_compare.GOAL_RATIO}x lru-static's (FastLibra: <= 0.40x)"
    if run.over():
        out["schedulers_skipped"] = "the part's budget was spent by the memory policies"
        return
    schedulers(run, out, pool, engine)


def schedulers(run: GpuRun, out: dict[str, Any], pool: int, engine: dict[str, Any]) -> None:
    """Chameleon vs FIFO at `sched_load` x FIFO's saturation, on `bench schedulers`' engine driver."""
    s = run.sizes
    args = command_defaults(scheduler_compare.configure, adapters=s.policy_adapters, seed=run.args.seed,
                            engine_requests=s.sched_requests, engine_length_scale=s.length_scale,
                            engine_unloaded_requests=s.sched_unloaded, engine_max_num_seqs=s.max_num_seqs,
                            engine_max_batched_tokens=s.max_batched_tokens, schedulers=",".join(SCHEDULERS),
                            loads=str(s.sched_load), max_loras=s.max_loras, device=str(run.device),
                            engine_clock="wall")  # one engine at a time: the device holds one
    trace = scheduler_compare.unit_workload(scheduler_compare.PAPER_WORKLOAD,
                                            scheduler_compare.trace_spec(args, "engine", s.max_model_len))
    block = scheduler_compare.Block("engine", "unified", {"num_pages": pool, **engine, "requests": len(trace.requests),
                                                          "length_scale": s.length_scale},
                                    baseline_policy="unified")
    side = BenchSide(args, run, pool, engine, trace.adapters())
    try:
        side.calibrate(block, trace)
        scheduler_compare.sweep(block, side.run_at(trace, "unified"), list(SCHEDULERS),
                                [s.sched_load], search=False)
    finally:
        side.close()
        out["schedulers"] = asdict(block)
    run.shared.update(trace=trace, block=block, scheduler_args=args)
    scheduler_compare.print_block(block)
    out["schedulers_goal"] = f"Chameleon's P99 TTFT below FIFO's at {s.sched_load}x FIFO's capacity"


class BenchSide(EngineSide):
    """`bench schedulers`' engine side over the run's engines instead of the tiny model's `LLM`s: a
    fresh engine per run, the previous one closed first (each holds the model and the pool)."""

    def __init__(self, args: argparse.Namespace, run: GpuRun, pool: int, engine: dict[str, Any],
                 ranks: dict[str, int]) -> None:
        super().__init__(args, run.model_dir(), {}, pool, None, run.config.vocab_size)
        self.run = run
        self.settings = engine  # the run's engine settings (`engine` is the base class's context manager)
        self.ranks = ranks
        self.current: Bench | None = None

    def llm(self, scheduler: str, policy: str, clock: Clock | None = None) -> tuple[Any, dict]:
        if clock is not None:
            raise ValueError("the run's engines keep the wall clock (--engine-clock wall)")
        self.close()
        bench = self.run.bench(self.num_blocks, True, scheduler=scheduler,
                               scheduler_options=self.options.get(scheduler, {}), memory_policy=policy, **self.settings)
        ids = bench.add_adapters(list(self.ranks.values()), names=list(self.ranks))
        self.current = bench
        return bench, dict(zip(self.ranks, ids, strict=True))

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
            self.run.free()


def command_defaults(configure: Any, **overrides: Any) -> argparse.Namespace:
    """A benchmark command's arguments as its parser defaults them, with `overrides`."""
    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args([])
    for name, value in overrides.items():
        if not hasattr(args, name):
            raise AttributeError(f"the command has no --{name.replace('_', '-')}")
        setattr(args, name, value)
    return args


def pool_pages(run: GpuRun, ranks: list[int]) -> int:
    """`pool_share` of the pages every adapter would take, and at least the lru-static slots plus four
    full-length requests' KV."""
    s, page = run.sizes, kv_block_bytes(run.config, 16, run.dtype)
    per_rank = adapter_bytes_per_rank(run.config, run.dtype)
    adapters = sum(math.ceil(r * per_rank / page) for r in ranks)
    floor = s.max_loras * math.ceil(max(RANKS) * per_rank / page) + 4 * math.ceil(s.max_model_len / 16)
    return max(int(s.pool_share * adapters), floor)

