"""`loraplex bench schedulers`, real-engine side: the schedulers on the tiny model, made locally.

The command itself (arguments, the workload, the twin side, the sweep, tables, JSON) is
`loraplex_bench.scheduler_compare`; this module runs the same kind of trace on the real engine: a fresh
tiny Llama (fp32), one random PEFT adapter per adapter the trace uses (ranks as drawn, all seven
target modules), and for every run a fresh `LLM` driven in wall time by the twin's replay loop.

Lengths are the Azure rows multiplied by `--engine-length-scale` (default 0.25: the CPU model would
take minutes per run at full length) and the trace is short (`--engine-requests`). The page pool and
the EMULATED host->device bandwidth are chosen as `bench memory` chooses them (its helpers, reused):
the twin's pool scaled so that an adapter takes the same share of it, and a copy that costs the same
multiple of a decode step as on the what-if H100. FIFO's saturation rate is the requests per second
of one burst run (every request at t = 0) unless `--engine-saturation-rps` gives it; the throughput at
the SLO is the best of the loads run (no bisection: every probe costs its arrival window in wall time).
Other work on the machine slows every run: compare runs of one invocation only.
"""

from __future__ import annotations

import argparse
import gc
import math
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.runtime.model.config import ModelConfig

from loraplex.engine.core import EngineCore
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.replay import WaitUntil, replay
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.spec.adapter import AdapterId
from loraplex.spec.errors import CommandError
from loraplex.util.clock import Clock
from loraplex_bench import memory_engine
from loraplex_bench.interleave import Baton, Lane, Lapped, StepClock, interleave
from loraplex_bench.output import stage
from loraplex_bench.scheduler_compare import (
    BASELINE,
    CLOCKS,
    Block,
    ClientCore,
    Observed,
    RunAt,
    RunRound,
    at_rate,
    drive,
    observe,
    parse_list,
    policy_of,
    scheduler_options,
    schedulers_of,
    set_slo,
    sweep,
    trace_spec,
    unit_workload,
    workloads_of,
)

if TYPE_CHECKING:
    from loraplex_agent.runtime.llm import LLM

FIRST_TOKEN_ID = 3  # ids below are the tiny model's special tokens
STEP_TIMERS = {"steps": time.perf_counter, "cpu-steps": time.process_time}  # --engine-clock: what times a step


def run_engine(args: argparse.Namespace) -> list[Block]:
    from loraplex_agent.tools.tiny_model import make_tiny_model
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    reference = memory_engine.reference_profile(args.profile)
    args = argparse.Namespace(**vars(args))  # the slot count defaults to the twin's, as a copy
    args.max_loras = args.max_loras or int(reference.engine["max_loras"])
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-schedulers-") as tmp:
        base_dir = make_tiny_model(Path(tmp) / "tiny", num_adapters=0, seed=args.seed).base_dir
        config = ModelConfig.from_dir(base_dir)
        spec = trace_spec(args, "engine", config.max_position_embeddings)
        kv_token, per_rank = memory_engine.model_bytes(config)
        num_blocks = args.engine_num_blocks or memory_engine.scaled_pool(reference, kv_token, per_rank)
        blocks, link = [], None
        for workload in workloads_of(args):
            trace = unit_workload(workload, spec, args.traces_dir)
            stage(f"engine: writing {len(trace.adapters())} adapters of {workload} ...")
            adapters = _write_adapters(base_dir, trace.adapters(), Path(tmp) / f"adapters-{workload}", args.seed)
            # bench memory's calibration (and warm-up), so that both benches emulate the same link; once
            link = link or memory_engine.calibrated_bandwidth(args, base_dir, adapters, reference, per_rank)
            gbps, calibration = link
            side = EngineSide(args, base_dir, adapters, num_blocks, gbps, config.vocab_size)
            settings = {"workload": workload, **_settings(args, trace, num_blocks, gbps, calibration)}
            blocks += [_policy_block(side, trace, policy, settings)
                       for policy in parse_list(args.memory_policy, "--memory-policy", str)]
        return blocks


def _policy_block(side: EngineSide, trace: Trace, policy: str, settings: dict[str, Any]) -> Block:
    block = Block("engine", policy, settings, baseline_policy=policy_of(side.args, policy, BASELINE))
    side.calibrate(block, trace)
    run_round = side.interleaved_round(block, trace) if side.args.engine_clock in STEP_TIMERS else None
    sweep(block, side.run_at(trace, policy), schedulers_of(side.args), parse_list(side.args.loads, "--loads", float),
          search=False, repeats=side.args.engine_repeats, run_round=run_round)
    return block


def _write_adapters(base_dir: Path, ranks: dict[str, int], out: Path, seed: int) -> dict[str, Path]:
    from loraplex_agent.tools.tiny_model import BASE_DIR_NAME, write_random_adapters
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    dirs = write_random_adapters(model, out, len(ranks), list(ranks.values()), seed, BASE_DIR_NAME)
    return dict(zip(ranks, dirs.values(), strict=True))


def _settings(args: argparse.Namespace, trace: Trace, num_blocks: int, gbps: float | None,
              calibration: dict[str, float]) -> dict[str, Any]:
    link = "real (CUDA)" if gbps is None else f"EMULATED {gbps:.3g} GB/s"
    print(f"engine: tiny Llama fp32 on {args.device}; Azure lengths x {args.engine_length_scale} (scaled DOWN); "
          f"{len(trace.requests)} requests; {num_blocks} pages; host->device {link}; clock: {CLOCKS[args.engine_clock]}",
          flush=True)
    return {"model": "tiny Llama (hidden 256, 4 layers, fp32)", "device": args.device, "clock": args.engine_clock,
            "requests": len(trace.requests), "length_scale": args.engine_length_scale, "num_pages": num_blocks,
            "max_num_seqs": args.engine_max_num_seqs, "max_batched_tokens": args.engine_max_batched_tokens,
            "max_tokens": args.max_tokens, "emulated_h2d_gbps": gbps, "calibration": calibration,
            "spec": trace.workload}


class EngineSide:
    """Fresh real engines over one set of adapters (read from disk once), one per run."""

    def __init__(self, args: argparse.Namespace, base_dir: Path, adapters: dict[str, Path], num_blocks: int,
                 gbps: float | None, vocab_size: int) -> None:
        self.args = args
        self.base_dir = base_dir
        self.adapters = adapters
        self.num_blocks = num_blocks
        self.gbps = gbps
        self.vocab_size = vocab_size  # also the stop token: outside the vocabulary, the model never samples it
        self.options = scheduler_options(args)
        self.hosts: dict[str, HostAdapter] = {}

    @contextmanager
    def engine(self, scheduler: str, policy: str, clock: Clock | None = None) -> Iterator[tuple[LLM, dict[str, AdapterId]]]:
        """A fresh engine for one run (on `clock`, default the monotonic one), closed after it; the
        garbage of earlier runs is collected before it starts and Python's cyclic collector is paused
        inside, as in the twin. Otherwise an earlier run's engine (its page pool, thousands of pages and
        requests in reference cycles) is traced and freed by whichever later run the collector happens
        to interrupt."""
        gc.collect()
        llm, ids = self.llm(scheduler, policy, clock)
        try:
            with cyclic_gc_paused():
                yield llm, ids
        finally:
            llm.executor.close()

    def llm(self, scheduler: str, policy: str, clock: Clock | None = None) -> tuple[LLM, dict[str, AdapterId]]:
        from loraplex_agent.runtime.llm import LLM

        args = self.args
        try:
            llm = LLM(self.base_dir, dtype="float32", device=args.device, num_blocks=self.num_blocks,
                      max_num_seqs=args.engine_max_num_seqs, max_num_batched_tokens=args.engine_max_batched_tokens,
                      max_loras=args.max_loras, max_lora_rank=args.max_lora_rank, scheduler=scheduler,
                      scheduler_options=self.options.get(scheduler, {}), memory_policy=policy,
                      num_host_blocks=args.host_blocks, emulate_h2d_gbps=self.gbps, threads=args.threads,
                      clock=clock)
        except ValueError as exc:
            raise CommandError(f"engine, {policy}, {scheduler}: {exc}") from None
        for name, path in self.adapters.items():
            if name in self.hosts:  # host weights are read-only: every engine may share them
                llm.register(self.hosts[name])
            else:
                self.hosts[name] = llm.adapters.host(llm.add_adapter(name, path).id)
        return llm, {name: host.id for name, host in self.hosts.items()}

    def prompt(self, request: TraceRequest) -> list[int]:
        rng = np.random.default_rng([self.args.seed, zlib.crc32(request.request_id.encode())])
        return rng.integers(FIRST_TOKEN_ID, self.vocab_size, request.prompt_len).tolist()

    def calibrate(self, block: Block, trace: Trace) -> None:
        """The SLO (from FIFO unloaded) and, unless given or measured in each round, FIFO's saturation rate."""
        baseline = policy_of(self.args, block.memory_policy, BASELINE)
        with self.engine(BASELINE, baseline) as (llm, ids):
            set_slo(block, llm.core, trace.requests[:self.args.engine_unloaded_requests], ids, self.prompt, self.args)
        if self.args.engine_saturation_rps:
            block.saturation_rps, block.saturation_method = self.args.engine_saturation_rps, "given"
            return
        if self.args.engine_clock in STEP_TIMERS:
            return  # each round measures its own (`interleaved_round`)
        stage(f"engine ({block.memory_policy}): FIFO's saturation rate (a burst of the trace) ...")
        burst = Trace([replace(r, arrival_s=0.0) for r in trace.requests], dict(trace.workload))
        with self.engine(BASELINE, baseline) as (llm, ids):
            log = drive(llm.core, burst, ids, self.prompt, self._sleep_until(llm), self.args.max_tokens,
                        self.vocab_size)
        block.saturation_rps = len(log.requests) / (log.end - log.origin)
        block.saturation_method = "requests/s of FIFO serving the whole trace at once"

    def run_at(self, trace: Trace, policy: str) -> RunAt:
        def run_one(scheduler: str, rps: float) -> Observed:
            scaled = at_rate(trace, rps)
            with self.engine(scheduler, policy_of(self.args, policy, scheduler)) as (llm, ids):
                log = drive(llm.core, scaled, ids, self.prompt, self._sleep_until(llm), self.args.max_tokens,
                            self.vocab_size)
                return observe(llm.core, log, scaled)

        return run_one

    def interleaved_round(self, block: Block, trace: Trace) -> RunRound:
        """A round on step clocks (`loraplex_bench.interleave`): FIFO's saturation rate measured in the
        round (unless given), then every scheduler's engine at the load, stepped in turn, the first in
        the round's order first. The block's rate is the mean of the rounds' so far."""
        rates: list[float] = []
        baseline = policy_of(self.args, block.memory_policy, BASELINE)

        def run_round(order: list[str], load: float, tag: str) -> dict[str, Observed]:
            rps = self.args.engine_saturation_rps
            if not rps:
                stage(f"engine ({block.memory_policy}): FIFO's saturation rate on the step clock{tag} ...")
                burst = Trace([replace(r, arrival_s=0.0) for r in trace.requests], dict(trace.workload, rps=math.inf))
                [run] = self.interleaved([(BASELINE, baseline)], burst)
                rates.append(len(run.requests) / run.elapsed_s)
                rps = rates[-1]
                block.saturation_rps = float(np.mean(rates))
                block.saturation_method = ("requests/s of FIFO serving the whole trace at once on the step clock, "
                                           "measured in each round (mean)")
            stage(f"engine ({block.memory_policy}): {', '.join(order)} interleaved at {load:.3g} x saturation "
                  f"({load * rps:.3g} req/s){tag} ...")
            runs = self.interleaved([(name, policy_of(self.args, block.memory_policy, name)) for name in order],
                                    at_rate(trace, load * rps))
            return dict(zip(order, runs, strict=True))

        return run_round

    def interleaved(self, engines: list[tuple[str, str]], trace: Trace) -> list[Observed]:
        """`trace` through a fresh engine per (scheduler, memory policy), in one process, step by step."""
        clocks = [StepClock(STEP_TIMERS[self.args.engine_clock]) for _ in engines]
        baton = Baton(clocks)
        threads = torch.get_num_threads()
        with ExitStack() as stack:
            opened = [stack.enter_context(self.engine(name, policy, clock))
                      for (name, policy), clock in zip(engines, clocks, strict=True)]

            def run(i: int) -> Observed:
                torch.set_num_threads(threads)  # a thread's own setting: the caller's does not carry over
                llm, ids = opened[i]
                core = llm.core
                core.executor = Lapped(core.executor, clocks[i])
                client = ClientCore(core, self.args.max_tokens, self.vocab_size, clocks[i].timer)
                log = replay(cast(EngineCore, Lane(client, baton, i, clocks[i])), trace, ids, self.prompt,
                             partial(baton.jump, i))
                return observe(core, log, trace)

            return interleave(baton, [partial(run, i) for i in range(len(engines))])

    @staticmethod
    def _sleep_until(llm: LLM) -> WaitUntil:
        clock = llm.core.clock

        def sleep_until(t: float) -> None:
            time.sleep(max(0.0, t - clock.now()))

        return sleep_until
