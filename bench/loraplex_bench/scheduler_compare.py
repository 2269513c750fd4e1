"""`loraplex bench schedulers`: `chameleon` vs `fifo` vs `sjf` vs `vtc` on one trace, at loads relative
to FIFO's saturation point, in the twin and on the real engine (issue 11).

Workload (`TraceSpec`), the same requests for every scheduler and load:
- Poisson arrivals (`arrivals.arrival_times`) drawn once at 1 request/s and compressed to each rate,
  so loads differ only in time: request ids, adapters and lengths are the same everywhere;
- (prompt, output) rows resampled from the Azure 2023 conversation trace (`lengths.sample_lengths`,
  profile `azure23_conv`; the CSV shipped in the package unless `--traces-dir`), multiplied by `--length-scale` and shaved to fit the model's context;
- 100 adapters, equal counts per rank of {8, 16, 32, 64, 128} (`workload.adapter_ranks`); a request
  picks its rank uniformly, then an adapter of that rank by Zipf popularity (`popularity.weights`,
  exponent `--zipf`): Chameleon's "uniform rank, power-law within a rank". `WorkloadSpec` cannot say
  this (its popularity is one vector over all adapters), so the adapter draw is done here.

Clients send realistic `max_tokens` (`--max-tokens`, default the context left) and a request stops at
its trace length on an injected stop token (`StopAtLength`): were `max_tokens` the true length, the
output-length predictor of `sjf` and `chameleon` would be clamped to the truth (docs/engine.md).

Per memory policy and side: FIFO's unloaded mean TTFT (the first requests, one at a time), the SLO
on P99 TTFT (`--slo-factor` x that mean; `--slo-basis e2e` takes the unloaded mean E2E instead, the
paper's "5x the average execution time at low load"), FIFO's saturation rate (twin:
`capacity.saturation_rps`, the highest rate whose window throughput keeps 90% of the offered; engine:
requests per second of a burst run), then every scheduler at each `--loads` fraction of it. Per run:
P50/P99 TTFT, P50 TBT (per-request mean time between tokens), throughput (prompt + output tokens/s),
goodput (tokens of requests meeting the TTFT SLO per second), fairness (Jain's index over adapters of
their mean TTFT, and the worst over the best), ratios to FIFO at the same load. Throughput at the SLO
is the paper's: the highest rate whose P99 TTFT meets the SLO (twin: bisection; engine: the best
load run).

`--workloads` runs other traces than this one (issue 28: workloads the schedulers were not tuned on,
`GENERATED`, from the workload generator), each with its own FIFO saturation and SLO, on both sides.
Every run also reports the P99 of arrival-to-admission (the part of TTFT an admission order decides),
the P99 TTFT of the requests below the median size, the P99 TTFT per fifth of the arrival window
(the paper's Fig. 15), the scheduler's `admission_limits` (what ended admission on the steps that
left requests waiting) and its idle capacity (`SchedulerStats.idle`: steps that ended with a free seat
and unused budget while a waiting request fitted, and why it was held); a last table gives every
run's ratios to FIFO at the same load, throughput included.

On the engine, `--engine-repeats N` runs every scheduler N times at each load in ABBA order
(`loraplex_bench.rounds`): each round is reported against FIFO's of the same round, and the block's
rows pool the rounds (percentiles over all their requests, tokens over their summed time).

This module is the twin side, the arguments, the tables and the JSON; the real engine side is
`loraplex_bench.scheduler_engine` (torch), imported when run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any, cast

import numpy as np

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.executor import Executor
from loraplex.engine.memory.paged_memory import no_adapter_pages
from loraplex.engine.memory.policies import MEMORY_POLICIES, make_memory
from loraplex.engine.messages import ExecutorResult, RequestOutput, SchedulerOutput
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request, SampledToken
from loraplex.engine.scheduling.schedulers import SCHEDULERS, make_scheduler, parse_scheduler_options
from loraplex.engine.scheduling.stats import IdleCapacity, SchedulerStats
from loraplex.latency.profile import Profile, load_profile
from loraplex.sim.arrivals import Arrivals, arrival_times
from loraplex.sim.capacity import saturation_rps
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.lengths import Lengths, sample_lengths
from loraplex.sim.metrics import RequestResult, Slo, offered_tokens, result_of, summarize, trace_duration
from loraplex.sim.popularity import Popularity, weights
from loraplex.sim.replay import (
    Prompt,
    ReplayLog,
    WaitUntil,
    check_fits,
    register_adapters,
    replay,
    replay_sampling,
)
from loraplex.sim.server import make_sim_engine, sim_prompt
from loraplex.sim.trace import Trace, TraceRequest, requests_from
from loraplex.sim.workload import Adapters, WorkloadSpec, adapter_ranks, generate
from loraplex.spec.adapter import AdapterId
from loraplex.spec.errors import CommandError
from loraplex.util.clock import ManualClock
from loraplex_bench.memory_compare import add_memory_args
from loraplex_bench.output import add_plots_arg, stage, write_bench_json
from loraplex_bench.report import Series, group_points, plot_series, slug
from loraplex_bench.rounds import abba

BASELINE = "fifo"
DEFAULT_SCHEDULERS = ("chameleon", "fifo", "sjf", "vtc")
GOAL = {"p99_ttft_change": -0.85, "slo_throughput_ratio": 2.0}  # ours, with the adapter cache (issue 11)
PAPER = {"p99_ttft_change": -0.807, "slo_throughput_ratio": 1.5}  # Chameleon vs S-LoRA, no adapter cache
TWIN_STOP_ID = 1  # the twin samples token 0 every step, so any other id is a stop token it never makes
FAIRNESS_MIN_REQUESTS = 2  # adapters with fewer finished requests say nothing about their latency
KNEE_MIN_LOAD, KNEE_MAX_LOAD, KNEE_TOL = 0.05, 4.0, 0.03  # bisection range and tolerance, x saturation
CLOCKS = {  # the engine side's --engine-clock
    "steps": "step-interleaved: the schedulers' engines in one process, stepped in turn, each on its own clock "
             "of measured step times (wall; no HTTP or serving path); FIFO's capacity measured in each round",
    "cpu-steps": "step-interleaved as steps, each step timed by the process's CPU time (stalls and sleeps inside "
                 "a step left out; best with --threads 1)",
    "wall": "wall time: one engine after the other, sleeping between arrivals; FIFO's capacity measured once"}


@dataclass(frozen=True)
class TraceSpec:
    requests: int = 2000  # expected arrivals (the unit-rate window in seconds)
    adapters: int = 100
    ranks: tuple[int, ...] = (8, 16, 32, 64, 128)
    zipf_s: float = 1.0
    lengths: str = "azure23_conv"
    length_scale: float = 1.0
    max_model_len: int = 4096
    seed: int = 0


@dataclass
class RunResult:
    """One scheduler at one load."""

    scheduler: str
    load: float  # fraction of FIFO's saturation rate
    rps: float
    requests: int
    finished: int
    digest: str  # of (id, adapter, prompt tokens, generated tokens) of every request as it ran
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tbt_p50_s: float | None
    throughput_tokens_per_s: float
    goodput_tokens_per_s: float  # tokens of requests whose TTFT met the SLO
    slo_attainment: float
    fairness_jain: float | None  # over adapters' mean TTFT; 1 is perfectly even, 1/n one adapter takes all
    fairness_max_min: float | None  # the worst adapter's mean TTFT over the best's
    preemptions: int = 0
    squashes: int = 0
    bypasses: int = 0
    predictor_rel_error: float | None = None
    wait_p99_s: float | None = None  # arrival to admission: the part of TTFT an admission order decides
    small_ttft_p99_s: float | None = None  # of the requests below the median prompt + output length
    admission_limits: dict[str, int] = field(default_factory=dict)  # waiting steps by what ended admission
    idle: IdleCapacity = field(default_factory=IdleCapacity)  # steps, seats, tokens idle while a request fitted
    idle_admissions: int = 0  # chameleon: started on what its quotas left idle (work-conserving)
    ahead: int = 0  # requests started while an earlier arrival of their run still waited (FIFO's order: 0 but for skips)
    ttft_p99_over_time_s: list[float | None] = field(default_factory=list)  # per fifth of the arrival window
    steps: int = 0  # engine steps
    step_ms: float = 0.0  # mean wall (engine) or simulated (twin) time of a step
    execute_ms: float = 0.0  # of which in the executor, on the run's clock (engine; the rest is the scheduler's and the driver's)
    execute_us_per_token: float = 0.0  # executor time per token it ran, prefill and decode (engine): the same work's cost
    adapter_loads: int = 0
    round: int | None = None  # of --engine-repeats (None: every round pooled, or the only run)
    rounds: int = 1  # runs pooled into this one
    p99_ttft_vs_fifo: float | None = None
    goodput_vs_fifo: float | None = None
    p50_ttft_vs_fifo: float | None = None
    small_p99_vs_fifo: float | None = None
    throughput_vs_fifo: float | None = None


@dataclass
class SloThroughput:
    """The highest rate whose P99 TTFT meets the SLO (Chameleon's throughput)."""

    scheduler: str
    method: str  # "search" (bisection) or "grid" (the highest of the loads run)
    load: float | None  # fraction of FIFO's saturation; None: not met even at the lowest load tried
    rps: float | None
    vs_fifo: float | None = None
    capped: bool = False  # met at the highest load tried (the grid's, or KNEE_MAX_LOAD): at least this
    probes: list[tuple[float, float | None]] = field(default_factory=list)  # (load, P99 TTFT s)


@dataclass
class Block:
    """One side under one memory policy."""

    side: str  # "twin" or "engine"
    memory_policy: str
    settings: dict[str, Any]
    baseline_policy: str = ""  # the memory policy FIFO runs on (the block's own unless --baseline-policy)
    saturation_rps: float = 0.0
    saturation_method: str = ""
    slo_basis: str = "ttft"  # what the SLO multiplies: FIFO's unloaded mean TTFT, or E2E
    unloaded_mean_s: float = 0.0
    slo_ttft_s: float = 0.0
    runs: list[RunResult] = field(default_factory=list)  # per scheduler and load (rounds pooled)
    rounds: list[RunResult] = field(default_factory=list)  # each round alone, when there are several
    slo_throughput: list[SloThroughput] = field(default_factory=list)


@dataclass
class Observed:
    """What one run leaves to measure; `measure` pools one or more of them into a `RunResult`."""

    requests: list[Request]
    results: list[RequestResult]
    duration_s: float  # the arrival window
    elapsed_s: float  # until the last request finished
    offered_tokens: int
    stats: SchedulerStats
    steps: int  # engine steps of the run
    adapter_loads: int  # adapter copies to the device
    execute_s: float  # seconds in the executor on the run's clock (the rest of a step is the scheduler's and the driver's)
    executed_tokens: int  # tokens the executor ran, prefill and decode
    rps: float  # the rate its trace arrived at


RunAt = Callable[[str, float], Observed]  # (scheduler, rps) -> its run
RunRound = Callable[[list[str], float, str], dict[str, Observed]]  # (schedulers in the round's order, load, tag)


# ---- the workload -----------------------------------------------------------------------------

def unit_trace(spec: TraceSpec, traces_dir: str | None = None) -> Trace:
    """The benchmark's requests at 1 request/s; `at_rate` compresses it to any rate."""
    rng = [np.random.default_rng([spec.seed, part]) for part in range(3)]
    times = arrival_times(Arrivals(process="poisson"), 1.0, float(spec.requests), rng[0])
    lengths = Lengths(profile=spec.lengths, scale=spec.length_scale, max_model_len=spec.max_model_len)
    try:
        prompt, output = sample_lengths(lengths, len(times), rng[1], traces_dir)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from None
    names, ranks = adapter_names_ranks(spec)
    chosen = choose_adapters(ranks, spec.ranks, spec.zipf_s, len(times), rng[2])
    rows = ((float(t), names[a], int(ranks[a]), int(p), int(o))
            for t, a, p, o in zip(times, chosen, prompt, output, strict=True))
    return Trace(requests_from(rows), {"duration_s": float(spec.requests), "rps": 1.0, **asdict(spec)})


# Workloads the schedulers were not tuned on (issue 28): the workload generator's, at 1 request/s (the
# run sets the seed, the length and the scale). "paper" is `TraceSpec`, the paper's evaluation shape.
PAPER_WORKLOAD = "paper"
GENERATED: dict[str, WorkloadSpec] = {
    "conv-200x8-32": WorkloadSpec(adapters=Adapters(count=200, ranks=[8, 16, 32],
                                                    popularity=Popularity(mode="zipf", zipf_s=1.0))),
    "code-200x8-32": WorkloadSpec(lengths=Lengths(profile="azure23_code"),
                                  adapters=Adapters(count=200, ranks=[8, 16, 32],
                                                    popularity=Popularity(mode="zipf", zipf_s=1.0))),
    "conv-bursty-100x8-128": WorkloadSpec(arrivals=Arrivals(process="gamma", cv=3.0),
                                          adapters=Adapters(count=100, ranks=[8, 16, 32, 64, 128])),
    "uniform-50x16-128": WorkloadSpec(lengths=Lengths(profile="uniform", uniform_range=(8, 2048)),
                                      adapters=Adapters(count=50, ranks=[16, 64, 128], rank_weights=[0.6, 0.3, 0.1],
                                                        popularity=Popularity(mode="zipf", zipf_s=1.5))),
    "code-1000x8-128": WorkloadSpec(seed=1, lengths=Lengths(profile="azure23_code"),
                                    adapters=Adapters(count=1000, ranks=[8, 16, 32, 64, 128],
                                                      popularity=Popularity(mode="zipf", zipf_s=0.8))),
}
WORKLOADS = (PAPER_WORKLOAD, *GENERATED)


def unit_workload(name: str, spec: TraceSpec, traces_dir: str | None = None) -> Trace:
    """Workload `name` at 1 request/s with `spec`'s length, seed, scale and context."""
    if name == PAPER_WORKLOAD:
        return unit_trace(spec, traces_dir)
    base = GENERATED[name]
    lengths = base.lengths.model_copy(update={"scale": spec.length_scale, "max_model_len": spec.max_model_len})
    workload = base.model_copy(update={"seed": base.seed + spec.seed, "duration_s": float(spec.requests),
                                       "rps": 1.0, "lengths": lengths})
    try:
        return generate(workload, traces_dir)
    except FileNotFoundError as exc:
        raise CommandError(str(exc)) from None


def adapter_names_ranks(spec: TraceSpec) -> tuple[list[str], np.ndarray]:
    adapters = Adapters(count=spec.adapters, ranks=list(spec.ranks))
    return adapters.names(), adapter_ranks(adapters, spec.seed)


def choose_adapters(ranks: np.ndarray, rank_set: Iterable[int], zipf_s: float, count: int,
                    rng: np.random.Generator) -> np.ndarray:
    """Each request's adapter index: a rank uniformly (of those some adapter has), then Zipf within it."""
    groups = [np.flatnonzero(ranks == r) for r in rank_set]
    groups = [g for g in groups if len(g)]
    which = rng.integers(0, len(groups), count)
    chosen = np.empty(count, dtype=np.int64)
    for i, members in enumerate(groups):
        picks = np.flatnonzero(which == i)
        share = weights(Popularity(mode="zipf", zipf_s=zipf_s), len(members))
        chosen[picks] = members[rng.choice(len(members), size=len(picks), p=share)]
    return chosen


def at_rate(trace: Trace, rps: float) -> Trace:
    """The same requests arriving `rps` times faster than the unit trace."""
    requests = [replace(r, arrival_s=round(r.arrival_s / rps, 6)) for r in trace.requests]
    return Trace(requests, dict(trace.workload, rps=rps, duration_s=trace_duration(trace) / rps))


# ---- clients: realistic max_tokens, stop at the trace's length ----------------------------------------

class StopAtLength:
    """An executor that samples a stop token as a request's `target`-th output token, and counts the time
    (`timer`: the run's clock, wall by default) and tokens of the executor it wraps."""

    def __init__(self, inner: Executor, stop_id: int, timer: Callable[[], float] = time.perf_counter) -> None:
        self.inner = inner
        self.stop = SampledToken(stop_id)
        self.targets: dict[str, int] = {}
        self.timer = timer
        self.seconds = 0.0  # time inside the inner executor: a step's time less the scheduler's
        self.tokens = 0  # tokens it ran, prefill and decode

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        start = self.timer()
        result = self.inner.execute(output)
        self.seconds += self.timer() - start
        self.tokens += output.num_tokens
        targets, sampled = self.targets, result.sampled
        for chunk in output.chunks:
            if chunk.sample and chunk.num_output_tokens + 1 >= targets.get(chunk.request_id, sys.maxsize):
                sampled[chunk.request_id] = self.stop
        return result


class ClientCore:
    """What `replay` drives: the engine, with each request sent as its client sends it. `replay` builds a
    request with max_tokens = its trace length; that becomes its stop target and max_tokens the cap. `timer`
    times the executor (`StopAtLength`)."""

    def __init__(self, core: EngineCore, max_tokens: str, stop_id: int,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.core = core
        self.clock = core.clock
        self.max_tokens = max_tokens
        self.stop_id = stop_id
        self.stops = StopAtLength(core.executor, stop_id, timer)
        core.executor = self.stops

    def add_request(self, request: Request) -> None:
        target = request.sampling.max_tokens
        self.stops.targets[request.request_id] = target
        left = self.core.config.max_model_len - request.num_prompt_tokens
        request.sampling = client_sampling(client_cap(self.max_tokens, target, left), self.stop_id)
        self.core.add_request(request)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    @property
    def num_steps(self) -> int:
        return self.core.num_steps


def client_cap(mode: str, target: int, context_left: int) -> int:
    """max_tokens as the client sends it: the true length ("exact"), the context left ("context", what
    an OpenAI server assumes when none is given), or a fixed number within the context."""
    if mode == "exact":
        return target
    return context_left if mode == "context" else min(int(mode), context_left)


@lru_cache(maxsize=8192)
def client_sampling(max_tokens: int, stop_id: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, stop_token_ids=(stop_id,))


def drive(core: EngineCore, trace: Trace, ids: dict[str, AdapterId], prompt: Prompt, wait_until: WaitUntil,
          max_tokens: str, stop_id: int) -> ReplayLog:
    """`trace` through `core` to the end, every request sent as `max_tokens` says."""
    client = ClientCore(core, max_tokens, stop_id)
    return replay(cast(EngineCore, client), trace, ids, prompt, wait_until)  # replay uses only what ClientCore has


def set_slo(block: Block, core: EngineCore, requests: list[TraceRequest], ids: dict[str, AdapterId], prompt: Prompt,
            args: argparse.Namespace) -> None:
    """The TTFT SLO: `--slo-factor` x FIFO's unloaded mean TTFT (issue 11) or E2E (the paper's basis)."""
    block.slo_basis = args.slo_basis
    block.unloaded_mean_s = unloaded_mean(core, requests, ids, prompt, whole=args.slo_basis == "e2e")
    block.slo_ttft_s = args.slo_factor * block.unloaded_mean_s


def unloaded_mean(core: EngineCore, requests: list[TraceRequest], ids: dict[str, AdapterId], prompt: Prompt,
                  whole: bool) -> float:
    """Mean TTFT (or E2E when `whole`) of `requests` sent one at a time: each alone on the engine, so
    nothing queues; cold adapters load as they would."""
    latencies = []
    for r in requests:
        request = Request(r.request_id, prompt(r), replay_sampling(r.output_len if whole else 1),
                          ids[r.adapter] if r.adapter else None, arrival_time=core.clock.now())
        core.add_request(request)
        while not request.is_finished:
            steps = core.num_steps
            core.step()
            if core.num_steps == steps and not request.is_finished:
                raise RuntimeError("the engine runs no step for a request alone on it")
        latencies.append((request.finished_time if whole else request.first_token_time) - request.arrival_time)
    return float(np.mean(latencies))


# ---- one run's numbers ----------------------------------------------------------------------------

def observe(core: EngineCore, log: ReplayLog, trace: Trace) -> Observed:
    results = [result_of(r, log.origin, r.adapter.name if r.adapter else None) for r in log.requests]
    engine = core.stats()
    executor = core.executor
    timed = isinstance(executor, StopAtLength)
    return Observed(log.requests, results, trace_duration(trace), log.end - log.origin, offered_tokens(trace),
                    core.scheduler_stats(), engine.steps_total, engine.adapter_loads_total,
                    executor.seconds if timed else 0.0, executor.tokens if timed else 0, float(trace.workload["rps"]))


def measure(runs: list[Observed], scheduler: str, rps: float, slo_s: float) -> RunResult:
    """One run's numbers, or several runs' pooled: percentiles over all their requests, tokens over
    their summed time, counters summed."""
    results = [r for run in runs for r in run.results]
    requests = [r for run in runs for r in run.requests]
    duration = sum(run.duration_s for run in runs)
    elapsed = sum(max(run.elapsed_s, run.duration_s) for run in runs)
    summary = summarize(results, duration, elapsed, Slo(ttft_s=slo_s), sum(run.offered_tokens for run in runs))
    good = sum(r.prompt_len + r.generated for r in results if r.finished and r.ttft_s <= slo_s)
    jain, spread = fairness(results)
    stats = [run.stats for run in runs]
    errors = [s.predictor.mean_rel_error for s in stats if s.predictor]
    limits: Counter[str] = Counter()
    for s in stats:
        limits.update(s.admission_limits)
    return RunResult(
        scheduler, 0.0, rps, len(results), summary.finished, run_digest(requests),
        summary.ttft_s.get("p50"), summary.ttft_s.get("p99"), summary.tpot_s.get("p50"),
        summary.throughput_tokens_per_s, good / elapsed, summary.slo_attainment or 0.0, jain, spread,
        sum(s.num_preemptions for s in stats), sum(s.num_squashes for s in stats), sum(s.num_bypasses for s in stats),
        float(np.mean(errors)) if errors else None,
        *wait_and_small_p99(requests), admission_limits=dict(limits),
        idle=sum((s.idle for s in stats), IdleCapacity()),
        idle_admissions=sum(s.num_idle_admissions for s in stats),
        ahead=sum(started_ahead(run.requests) for run in runs),
        ttft_p99_over_time_s=p99_over_time(runs), rounds=len(runs), steps=sum(run.steps for run in runs),
        step_ms=1e3 * sum(run.elapsed_s for run in runs) / max(1, sum(run.steps for run in runs)),
        adapter_loads=sum(run.adapter_loads for run in runs),
        execute_ms=1e3 * sum(run.execute_s for run in runs) / max(1, sum(run.steps for run in runs)),
        execute_us_per_token=1e6 * sum(run.execute_s for run in runs) / max(1, sum(run.executed_tokens for run in runs)))


def p99_over_time(runs: list[Observed], windows: int = 5) -> list[float | None]:
    """P99 TTFT of the requests arriving in each of `windows` equal parts of their run's arrival window
    (the paper's Fig. 15: does the tail grow without bound?); a request not started counts as infinite."""
    parts: list[list[float]] = [[] for _ in range(windows)]
    for run in runs:
        for r in run.results:
            i = min(windows - 1, int(r.arrival_s / run.duration_s * windows)) if run.duration_s > 0 else 0
            parts[i].append(math.inf if r.ttft_s is None else r.ttft_s)
    return [float(np.percentile(p, 99)) if p else None for p in parts]


def wait_and_small_p99(requests: list[Request]) -> tuple[float | None, float | None]:
    """(P99 of arrival-to-admission, P99 TTFT of the requests below the median size)."""
    started = [r for r in requests if r.first_token_time is not None]
    if not started:
        return None, None
    waits = [r.first_scheduled_time - r.arrival_time for r in started if r.first_scheduled_time is not None]
    median = float(np.median([r.num_prompt_tokens + len(r.output_token_ids) for r in started]))
    small = [r.first_token_time - r.arrival_time for r in started
             if r.num_prompt_tokens + len(r.output_token_ids) < median]
    return (float(np.percentile(waits, 99)) if waits else None,
            float(np.percentile(small, 99)) if small else None)


def started_ahead(requests: list[Request]) -> int:
    """Requests started before some request that arrived earlier (one never started waits for ever):
    0 is FIFO's order exactly. When a scheduler's count is 0 its admissions were FIFO's, so any TTFT
    difference from FIFO's run is the step times', not the order's."""
    ahead, latest = 0, -math.inf
    for r in sorted(requests, key=lambda r: (r.arrival_time, r.request_id)):
        started = math.inf if r.first_scheduled_time is None else r.first_scheduled_time
        ahead += started < latest
        latest = max(latest, started)
    return ahead


def fairness(results: list[RequestResult]) -> tuple[float | None, float | None]:
    """(Jain's index, max/min) over adapters of their mean TTFT. TTFT, not E2E per token: decode time,
    which no admission order changes, dominates E2E and would hide who waits."""
    per: dict[str | None, list[float]] = defaultdict(list)
    for r in results:
        if r.ttft_s is not None:
            per[r.adapter].append(r.ttft_s)
    means = np.array([np.mean(v) for v in per.values() if len(v) >= FAIRNESS_MIN_REQUESTS])
    if len(means) < 2 or not means.min() > 0:
        return None, None
    return float(means.sum() ** 2 / (len(means) * (means ** 2).sum())), float(means.max() / means.min())


def run_digest(requests: list[Request]) -> str:
    rows = sorted((r.request_id, r.adapter.name if r.adapter else "", r.num_prompt_tokens, len(r.output_token_ids))
                  for r in requests)
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


# ---- the sweep, shared by both sides ----------------------------------------------------------------

def sweep(block: Block, run_at: RunAt, schedulers: list[str], loads: list[float], search: bool,
          repeats: int = 1, run_round: RunRound | None = None) -> None:
    """Every scheduler at every load (`repeats` rounds in ABBA order, each reported and then pooled),
    the ratios to FIFO, and each one's throughput at the SLO. A round runs the schedulers one after
    the other with `run_at`, or all at once with `run_round`."""
    run_round = run_round or _one_at_a_time(block, run_at)
    for load in loads:
        observed: dict[str, list[Observed]] = defaultdict(list)
        for round_, pairs in groupby(abba(schedulers, repeats), key=itemgetter(0)):
            tag = f", round {round_ + 1} of {repeats}" if repeats > 1 else ""
            for name, run in run_round([name for _, name in pairs], load, tag).items():
                observed[name].append(run)
                if repeats > 1:
                    block.rounds.append(_result(block, [run], name, load, round_))
        block.runs += [_result(block, observed[name], name, load) for name in schedulers]
    add_ratios(block.runs)
    for round_ in range(repeats if repeats > 1 else 0):
        add_ratios([r for r in block.rounds if r.round == round_])
    for name in schedulers:
        grid = {r.load: r.ttft_p99_s for r in block.runs if r.scheduler == name}
        p99_at = ((lambda load, n=name: _result(block, [_at_load(block, run_at, n, load)], n, load).ttft_p99_s)
                  if search else None)
        block.slo_throughput.append(slo_throughput(name, grid, block.slo_ttft_s, block.saturation_rps, p99_at))
    base = next(k for k in block.slo_throughput if k.scheduler == BASELINE)
    for k in block.slo_throughput:  # a capped rate is a lower bound: no ratio of it means anything
        uncapped = not (k.capped or base.capped) and k.rps is not None
        k.vs_fifo = k.rps / base.rps if uncapped and base.rps else None


def _one_at_a_time(block: Block, run_at: RunAt) -> RunRound:
    def run_round(order: list[str], load: float, tag: str) -> dict[str, Observed]:
        return {name: _at_load(block, run_at, name, load, tag) for name in order}

    return run_round


def _at_load(block: Block, run_at: RunAt, scheduler: str, load: float, tag: str = "") -> Observed:
    stage(f"{block.side} ({block.memory_policy}): {scheduler} at {load:.3g} x saturation{tag} ...")
    return run_at(scheduler, load * block.saturation_rps)


def _result(block: Block, runs: list[Observed], scheduler: str, load: float, round_: int | None = None) -> RunResult:
    result = measure(runs, scheduler, float(np.mean([run.rps for run in runs])), block.slo_ttft_s)
    result.load, result.round = load, round_
    return result


def add_ratios(runs: list[RunResult]) -> None:
    """Each run against FIFO's at the same load among `runs` (one round, or the pooled rows)."""
    fifo = {r.load: r for r in runs if r.scheduler == BASELINE}
    for r in runs:
        base = fifo.get(r.load)
        if base is not None:
            r.p99_ttft_vs_fifo = _ratio(r.ttft_p99_s, base.ttft_p99_s)
            r.goodput_vs_fifo = _ratio(r.goodput_tokens_per_s, base.goodput_tokens_per_s)
            r.p50_ttft_vs_fifo = _ratio(r.ttft_p50_s, base.ttft_p50_s)
            r.small_p99_vs_fifo = _ratio(r.small_ttft_p99_s, base.small_ttft_p99_s)
            r.throughput_vs_fifo = _ratio(r.throughput_tokens_per_s, base.throughput_tokens_per_s)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def slo_throughput(name: str, grid: dict[float, float | None], slo_s: float, saturation_rps: float,
                   p99_at: Callable[[float], float | None] | None) -> SloThroughput:
    """The highest load meeting the SLO below the first that misses it: from the grid, refined by
    geometric bisection when `p99_at` can run more loads."""
    probes = dict(grid)

    def meets(load: float) -> bool:
        if load not in probes:
            probes[load] = p99_at(load) if p99_at else None
        return probes[load] is not None and probes[load] <= slo_s

    lo, hi = _bracket(grid, slo_s)
    capped = lo is not None and hi is None  # met at every load tried: the throughput is at least lo's
    if p99_at is not None:
        lo, hi, capped = _widen(lo, hi, meets)
        while lo is not None and hi is not None and hi / lo > 1 + KNEE_TOL:
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return SloThroughput(name, "search" if p99_at else "grid", lo, None if lo is None else lo * saturation_rps,
                         capped=capped, probes=sorted(probes.items()))


def _bracket(grid: dict[float, float | None], slo_s: float) -> tuple[float | None, float | None]:
    """(the highest load meeting the SLO below the lowest that misses it, that lowest miss)."""
    misses = [load for load, p99 in grid.items() if p99 is None or p99 > slo_s]
    hi = min(misses, default=None)
    lo = max((load for load in grid if load not in misses and (hi is None or load < hi)), default=None)
    return lo, hi


Bracket = tuple[float | None, float | None, bool]  # (lo, hi, capped)


def _widen(lo: float | None, hi: float | None, meets: Callable[[float], bool]) -> Bracket:
    """Extend the bracket beyond the grid: halve below a grid that always misses, x1.5 above one that never does."""
    while lo is None and hi is not None:
        if hi / 2 < KNEE_MIN_LOAD:
            return None, hi, False
        lo, hi = (hi / 2, hi) if meets(hi / 2) else (None, hi / 2)
    while hi is None and lo is not None:
        if lo * 1.5 > KNEE_MAX_LOAD:
            return lo, None, True
        lo, hi = (lo * 1.5, None) if meets(lo * 1.5) else (lo, lo * 1.5)
    return lo, hi, False


# ---- arguments ------------------------------------------------------------------------------

def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--side", choices=["twin", "engine", "both"], default="both")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")
    add_plots_arg(p, "TTFT p99, TBT p50, throughput, goodput and SLO attainment against the load, per scheduler, "
                  "for each side and memory policy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", default=PAPER_WORKLOAD, metavar="NAME,...|all",
                   help=f"workloads, each with its own saturation, SLO and table: {', '.join(WORKLOADS)} "
                        "(paper: the flags below; the others: the workload generator's, not tuned on); both sides")
    p.add_argument("--schedulers", default=",".join(DEFAULT_SCHEDULERS), help="comma-separated; fifo is required")
    p.add_argument("--loads", default="0.5,0.8,1.0,1.2", help="fractions of FIFO's saturation rate")
    p.add_argument("--memory-policy", default="unified",
                   help="comma-separated memory policies; each gets its own saturation, SLO and table")
    p.add_argument("--baseline-policy", default=None, metavar="POLICY",
                   help="run the FIFO baseline on this memory policy (e.g. lru-static: vLLM's fixed slots, "
                        "or no-cache: S-LoRA's) while the other schedulers run on --memory-policy; loads, "
                        "SLO and ratios are then relative to that baseline")
    p.add_argument("--slo-factor", type=float, default=5.0, help="TTFT SLO = this x FIFO's unloaded mean --slo-basis")
    p.add_argument("--slo-basis", choices=["ttft", "e2e"], default="ttft",
                   help="ttft (issue 11) or e2e (the paper: 5x the mean execution time at low load)")
    p.add_argument("--max-tokens", default="context", metavar="context|exact|N",
                   help="max_tokens clients send: the context left, the true length (the predictor's clamp "
                        "then knows it), or N; requests stop at their trace length either way")
    p.add_argument("--scheduler-option", action="append", default=[], metavar="SCHED:KEY=VALUE",
                   help="a knob of one scheduler, e.g. chameleon:slo_s=2 (repeatable)")
    w = p.add_argument_group("workload (both sides)")
    w.add_argument("--adapters", type=int, default=100)
    w.add_argument("--ranks", default="8,16,32,64,128", help="adapter ranks, equal counts, each rank equally popular")
    w.add_argument("--zipf", type=float, default=1.0, help="popularity exponent over the adapters of one rank")
    w.add_argument("--lengths", choices=["azure23_conv", "azure23_code", "uniform"], default="azure23_conv")
    w.add_argument("--traces-dir", default=None, help="folder of the Azure 2023 CSVs (default: the ones shipped in the package)")
    t = p.add_argument_group("twin")
    t.add_argument("--profile", default="whatif-h100-llama8b", help="profile name or file")
    t.add_argument("--requests", type=int, default=2000, help="requests of the trace (twin)")
    t.add_argument("--length-scale", type=float, default=1.0, help="multiply token counts (twin)")
    t.add_argument("--saturation-rps", type=float, default=None,
                   help="the rate loads are fractions of, for every twin block (default: each block's FIFO "
                        "saturation, measured); pins the blocks of several memory policies to one baseline's rate")
    t.add_argument("--unloaded-requests", type=int, default=200, help="requests timed alone for the SLO (twin)")
    t.add_argument("--slo-throughput", choices=["search", "grid"], default="search",
                   help="throughput at the SLO by bisection, or the best of --loads (twin; the engine uses grid)")
    e = p.add_argument_group("real engine (tiny CPU model)")
    e.add_argument("--engine-requests", type=int, default=150)
    e.add_argument("--engine-length-scale", type=float, default=0.25, help="multiply token counts")
    e.add_argument("--engine-unloaded-requests", type=int, default=20)
    e.add_argument("--engine-clock", choices=list(CLOCKS), default="steps",
                   help="; ".join(f"{k}: {v}" for k, v in CLOCKS.items()))
    e.add_argument("--engine-repeats", type=int, default=1,
                   help="rounds of every scheduler at each load, in ABBA order: each round is reported, then pooled")
    e.add_argument("--engine-saturation-rps", type=float, default=None,
                   help="FIFO's saturation rate (default: measured, requests/s of a burst of the trace)")
    e.add_argument("--engine-num-blocks", type=int, default=None,
                   help="pages of the pool (default: the twin's pool scaled so that adapters take the same share)")
    e.add_argument("--engine-max-num-seqs", type=int, default=32)
    e.add_argument("--engine-max-batched-tokens", type=int, default=512)
    e.add_argument("--emulate-h2d-gbps", type=float, default=None, metavar="GBPS",
                   help="EMULATED host->device bandwidth (default: calibrated as in `bench memory`)")
    e.add_argument("--device", default="cpu", help="cpu, cuda or auto (on CUDA copies are real, not emulated)")
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_memory_args(p)


def parse_list(text: str, flag: str, kind: type) -> list:
    try:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(f"{flag} must be comma-separated {kind.__name__} values, not {text!r}") from None
    if not values:
        raise CommandError(f"{flag} is empty")
    return values


def schedulers_of(args: argparse.Namespace) -> list[str]:
    names = parse_list(args.schedulers, "--schedulers", str)
    unknown = sorted(set(names) - set(SCHEDULERS))
    if unknown:
        raise CommandError(f"--schedulers: unknown {unknown}; choose from {sorted(SCHEDULERS)}")
    if BASELINE not in names:
        raise CommandError("--schedulers must include fifo: every ratio is to it")
    return list(dict.fromkeys(names))


def scheduler_options(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """SCHED:KEY=VALUE flags by scheduler; the scheduler checks the knobs when it is built."""
    grouped: dict[str, list[str]] = defaultdict(list)
    for item in args.scheduler_option:
        name, sep, pair = item.partition(":")
        if not sep or name not in SCHEDULERS:
            raise CommandError(f"--scheduler-option {item!r} is not SCHED:KEY=VALUE with SCHED in {sorted(SCHEDULERS)}")
        grouped[name].append(pair)
    try:
        return {name: parse_scheduler_options(pairs) for name, pairs in grouped.items()}
    except ValueError as exc:
        raise CommandError(f"--scheduler-option: {exc}") from None


def check_options(options: dict[str, dict[str, str]]) -> None:
    """Build each scheduler with its knobs once, so that a bad knob fails before any run."""
    for name, knobs in options.items():
        config = EngineConfig(scheduler=name, scheduler_options=knobs)
        clock = ManualClock()
        try:
            make_scheduler(config, make_memory(config, no_adapter_pages, clock), lambda _: 0, clock)
        except ValueError as exc:
            raise CommandError(f"--scheduler-option {name}: {exc}") from None


def workloads_of(args: argparse.Namespace) -> list[str]:
    names = list(WORKLOADS) if args.workloads == "all" else parse_list(args.workloads, "--workloads", str)
    unknown = sorted(set(names) - set(WORKLOADS))
    if unknown:
        raise CommandError(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)} or all")
    return list(dict.fromkeys(names))


def check_args(args: argparse.Namespace) -> None:
    schedulers_of(args)
    workloads_of(args)
    check_options(scheduler_options(args))
    policies = parse_list(args.memory_policy, "--memory-policy", str)
    if set(policies) - set(MEMORY_POLICIES):
        raise CommandError(f"--memory-policy {args.memory_policy!r}: choose from {sorted(MEMORY_POLICIES)}")
    if args.baseline_policy is not None and args.baseline_policy not in MEMORY_POLICIES:
        raise CommandError(f"--baseline-policy {args.baseline_policy!r}: choose from {sorted(MEMORY_POLICIES)}")
    loads = parse_list(args.loads, "--loads", float)
    if min(loads) <= 0:
        raise CommandError(f"--loads must be positive, not {args.loads!r}")
    ranks = parse_list(args.ranks, "--ranks", int)
    if min(ranks) < 1 or args.max_lora_rank < max(ranks):
        raise CommandError(f"--ranks must be >= 1 and at most --max-lora-rank {args.max_lora_rank}, not {args.ranks!r}")
    if args.max_tokens not in ("context", "exact") and not (args.max_tokens.isdigit() and int(args.max_tokens) > 0):
        raise CommandError(f"--max-tokens must be context, exact or a positive integer, not {args.max_tokens!r}")
    positive = ("adapters", "requests", "saturation_rps", "unloaded_requests", "engine_requests", "engine_unloaded_requests",
                "slo_factor", "length_scale", "engine_length_scale", "engine_max_num_seqs",
                "engine_max_batched_tokens", "engine_saturation_rps", "engine_repeats", "engine_num_blocks", "emulate_h2d_gbps",
                "threads", "max_loras")
    for name in positive:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise CommandError(f"--{name.replace('_', '-')} must be positive, not {value}")
    if args.zipf < 0 or (args.host_blocks is not None and args.host_blocks < 0):
        raise CommandError("--zipf and --host-blocks must not be negative")


def policy_of(args: argparse.Namespace, block_policy: str, scheduler: str) -> str:
    """The memory policy `scheduler` runs on in a block of `block_policy`."""
    return args.baseline_policy if scheduler == BASELINE and args.baseline_policy else block_policy


def trace_spec(args: argparse.Namespace, side: str, max_model_len: int) -> TraceSpec:
    engine = side == "engine"
    return TraceSpec(requests=args.engine_requests if engine else args.requests, adapters=args.adapters,
                     ranks=tuple(parse_list(args.ranks, "--ranks", int)), zipf_s=args.zipf, lengths=args.lengths,
                     length_scale=args.engine_length_scale if engine else args.length_scale,
                     max_model_len=max_model_len, seed=args.seed)


# ---- the twin -------------------------------------------------------------------------------

def run_twin(args: argparse.Namespace) -> list[Block]:
    try:
        profile = load_profile(args.profile)
    except (FileNotFoundError, ValueError) as exc:
        raise CommandError(str(exc)) from None
    spec = trace_spec(args, "twin", int(profile.engine["max_model_len"]))
    blocks = []
    for workload in workloads_of(args):
        trace = unit_workload(workload, spec, args.traces_dir)
        for policy in parse_list(args.memory_policy, "--memory-policy", str):
            twin = TwinSide(profile, args, policy)
            block = Block("twin", policy, {"workload": workload, "profile": profile.name,
                                           "requests": len(trace.requests), "length_scale": args.length_scale,
                                           "max_tokens": args.max_tokens, "max_lora_rank": args.max_lora_rank,
                                           "spec": trace.workload},
                          baseline_policy=policy_of(args, policy, BASELINE))
            twin.calibrate(block, trace)
            loads = parse_list(args.loads, "--loads", float)
            sweep(block, twin.run_at(trace), schedulers_of(args), loads,
                  args.slo_throughput == "search")
            blocks.append(block)
    return blocks


class TwinSide:
    """Fresh twin engines of one profile and memory policy, one per run."""

    def __init__(self, profile: Profile, args: argparse.Namespace, policy: str) -> None:
        self.profile = profile
        self.args = args
        self.policy = policy
        self.options = scheduler_options(args)

    def config(self, scheduler: str) -> EngineConfig:
        args = self.args
        extra: dict[str, Any] = {} if args.max_loras is None else {"max_loras": args.max_loras}
        if args.host_blocks is not None:
            extra["num_host_blocks"] = args.host_blocks
        try:  # the policy is passed always: a profile that names none means lru-static
            return self.profile.engine_config(memory_policy=policy_of(args, self.policy, scheduler),
                                              max_lora_rank=args.max_lora_rank,
                                              scheduler=scheduler, scheduler_options=self.options.get(scheduler, {}),
                                              **extra)
        except ValueError as exc:
            raise CommandError(f"twin, {self.policy}, {scheduler}: {exc}") from None

    def engine(self, scheduler: str, trace: Trace) -> tuple[EngineCore, WaitUntil, dict[str, AdapterId]]:
        config = self.config(scheduler)
        try:
            core, clock = make_sim_engine(self.profile, config)
            check_fits(trace, config.max_model_len, config.max_lora_rank)
        except ValueError as exc:  # e.g. a bad scheduler option, or lru-static slots that leave no KV
            raise CommandError(f"twin, {self.policy}, {scheduler}: {exc}") from None

        def jump(t: float) -> None:
            clock.advance(max(0.0, t - clock.now()))

        return core, jump, register_adapters(core, trace.adapters())

    def calibrate(self, block: Block, trace: Trace) -> None:
        """The SLO (from FIFO unloaded) and FIFO's saturation rate."""
        core, _, ids = self.engine(BASELINE, trace)
        set_slo(block, core, trace.requests[:self.args.unloaded_requests], ids, sim_prompt, self.args)
        if self.args.saturation_rps:
            block.saturation_rps, block.saturation_method = self.args.saturation_rps, "given (--saturation-rps)"
            return
        stage(f"twin ({self.policy}): FIFO's saturation rate ...")
        with cyclic_gc_paused():  # FIFO never reads max_tokens, so simulate_server's exact ones serve
            block.saturation_rps = saturation_rps(self.profile, lambda rps: at_rate(trace, rps), self.config(BASELINE))
        block.saturation_method = "bisection: the highest rate whose window throughput is >= 90% of the offered"

    def run_at(self, trace: Trace) -> RunAt:
        def run(scheduler: str, rps: float) -> Observed:
            scaled = at_rate(trace, rps)
            core, jump, ids = self.engine(scheduler, scaled)
            with cyclic_gc_paused():
                log = drive(core, scaled, ids, sim_prompt, jump, self.args.max_tokens, TWIN_STOP_ID)
            return observe(core, log, scaled)

        return run


# ---- report ---------------------------------------------------------------------------------

def print_block(block: Block) -> None:
    shown = {k: v for k, v in block.settings.items() if k not in ("spec", "calibration")}
    fifo_on = f" (fifo on {block.baseline_policy})" if block.baseline_policy != block.memory_policy else ""
    print(f"\n== {block.side}, memory_policy={block.memory_policy}{fifo_on}: "
          + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))
    print(f"FIFO saturation {block.saturation_rps:.3g} req/s ({block.saturation_method}); TTFT SLO "
          f"{block.slo_ttft_s * 1e3:.1f} ms = {block.slo_ttft_s / block.unloaded_mean_s:g} x FIFO's unloaded mean "
          f"{block.slo_basis.upper()} {block.unloaded_mean_s * 1e3:.1f} ms")
    print(f"{'load':>5}{'req/s':>8} {'scheduler':<10}{'done':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TBT p50':>9}"
          f"{'tok/s':>9}{'good tok/s':>11}{'SLO met':>8}{'Jain':>6}{'p99/FIFO':>9}{'good/FIFO':>10}")
    for r in block.runs:
        print(f"{r.load:>5.2f}{r.rps:>8.3g} {r.scheduler:<10}{r.finished:>6}{_ms(r.ttft_p50_s):>10}"
              f"{_ms(r.ttft_p99_s):>10}{_ms(r.tbt_p50_s):>9}{r.throughput_tokens_per_s:>9.0f}"
              f"{r.goodput_tokens_per_s:>11.0f}{r.slo_attainment:>8.1%}{_num(r.fairness_jain, '.3f'):>6}"
              f"{_change(r.p99_ttft_vs_fifo):>9}{_num(r.goodput_vs_fifo, '.2f', 'x'):>10}")
    print("(times in ms; TBT = a request's mean time between tokens; tok/s = prompt + output tokens; good = of "
          "requests meeting the TTFT SLO; Jain = fairness index over the adapters' mean TTFTs)")
    print_slo_throughput(block)


def print_ratios(blocks: list[Block]) -> None:
    """Every run against FIFO at the same load, one line each: the scheduler-only summary (issue 28)."""
    print("\n== ratios to FIFO at the same load (each block's own FIFO; < 1 is better)")
    print(f"{'side':<7}{'workload':<23}{'memory':<12}{'load':>5} {'scheduler':<10}{'tok/s':>7}{'p99 TTFT':>9}"
          f"{'p50 TTFT':>9}{'small p99':>10}{'wait p99 s':>11}{'ahead':>6}  {'idle steps/seats/tokens':<24}waiting steps by limit")
    for block in blocks:
        workload = block.settings.get("workload", PAPER_WORKLOAD)
        for r in block.runs:
            memory = block.baseline_policy if r.scheduler == BASELINE else block.memory_policy
            print(f"{block.side:<7}{workload:<23}{memory:<12}{r.load:>5.2f} {r.scheduler:<10}"
                  f"{_num(r.throughput_vs_fifo, '.3f'):>7}{_num(r.p99_ttft_vs_fifo, '.2f'):>9}"
                  f"{_num(r.p50_ttft_vs_fifo, '.2f'):>9}{_num(r.small_p99_vs_fifo, '.2f'):>10}"
                  f"{_num(r.wait_p99_s, '.3f'):>11}{r.ahead:>6}  {_idle(r):<24}{_counts(r.admission_limits)}")
    print("(tok/s: throughput over FIFO's; small p99: TTFT P99 of the requests below the median prompt + output; "
          "wait: arrival to admission; ahead: requests started before an earlier arrival (0: FIFO's order); idle: steps ending with a free seat and unused budget while a waiting "
          "request fitted, the seats and tokens left so, and why the scheduler held it; limits: steps that left "
          "requests waiting, by what ended admission — budget, seats, kv, adapter, policy)")


def print_rounds(block: Block) -> None:
    """Each round of --engine-repeats alone, against FIFO of the same round (the pooled rows are above)."""
    if not block.rounds:
        return
    workload = block.settings.get("workload", PAPER_WORKLOAD)
    print(f"\n== {block.side}, {workload}, memory_policy={block.memory_policy}: each round (ABBA order) against "
          "FIFO's of the same round")
    print(f"{'round':>5}{'load':>6}{'req/s':>7} {'scheduler':<10}{'tok/s':>7}{'vs FIFO':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'vs FIFO':>8}{'small p99':>10}{'vs FIFO':>8}{'steps':>7}{'step ms':>8}{'exec ms':>8}{'us/tok':>7}"
          f"{'loads':>6}{'ahead':>6}  idle steps/seats/tokens")
    for r in sorted(block.rounds, key=lambda r: (r.load, r.round, r.scheduler != BASELINE)):
        print(f"{r.round + 1:>5}{r.load:>6.2f}{r.rps:>7.3g} {r.scheduler:<10}{r.throughput_tokens_per_s:>7.0f}"
              f"{_num(r.throughput_vs_fifo, '.3f'):>8}{_ms(r.ttft_p50_s):>10}{_ms(r.ttft_p99_s):>10}"
              f"{_num(r.p99_ttft_vs_fifo, '.2f'):>8}{_ms(r.small_ttft_p99_s):>10}{_num(r.small_p99_vs_fifo, '.2f'):>8}"
              f"{r.steps:>7}{r.step_ms:>8.1f}{r.execute_ms:>8.1f}{r.execute_us_per_token:>7.1f}{r.adapter_loads:>6}"
              f"{r.ahead:>6}  {_idle(r)}")
    print("(req/s: the rate of the round's arrivals, load x the saturation rate it used; times in ms; step ms: the run's time over its steps, exec ms: of which in the executor (both on the run's clock); us/tok: "
          "executor microseconds per token it ran (what the clock charged for the same work); loads: adapter "
          "copies; ahead: requests started before an earlier arrival, 0 when the order was FIFO's; pooled over the "
          "rounds: the block's table above)")


def _idle(r: RunResult) -> str:
    reasons = f" ({_counts(r.idle.reasons)})" if r.idle.reasons else ""
    return f"{r.idle.steps}/{r.idle.seats}/{r.idle.tokens}{reasons}"


def _counts(counts: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1]))


def print_over_time(blocks: list[Block]) -> None:
    """P99 TTFT per fifth of the arrival window at each block's highest load (the paper's Fig. 15)."""
    print("\n== P99 TTFT (s) over time at the highest load, per fifth of the arrival window")
    for block in blocks:
        top = max((r.load for r in block.runs), default=None)
        workload = block.settings.get("workload", PAPER_WORKLOAD)
        for r in (r for r in block.runs if r.load == top):
            cells = " ".join(f"{_num(v, '.2f'):>7}" for v in r.ttft_p99_over_time_s)
            memory = block.baseline_policy if r.scheduler == BASELINE else block.memory_policy
            print(f"{block.side:<7}{workload:<23}{memory:<12}{r.load:>5.2f} {r.scheduler:<10}{cells}")


def print_slo_throughput(block: Block) -> None:
    how = {"search": "bisection", "grid": "the best of the loads run"}
    parts = []
    for k in block.slo_throughput:
        rate = "not met" if k.rps is None else f"{'>= ' if k.capped else ''}{k.rps:.3g} req/s ({k.load:.2f} x sat)"
        parts.append(f"{k.scheduler} {rate}{'' if k.vs_fifo is None else f' = {k.vs_fifo:.2f}x FIFO'}")
    method = how[block.slo_throughput[0].method] if block.slo_throughput else ""
    print(f"throughput at the SLO (highest rate with P99 TTFT <= SLO, {method}): " + "; ".join(parts))
    chameleon = next((k for k in block.slo_throughput if k.scheduler == "chameleon"), None)
    top = max((r for r in block.runs if r.scheduler == "chameleon"), key=lambda r: r.load, default=None)
    if chameleon is not None and top is not None:
        print(f"chameleon vs fifo: P99 TTFT {_change(top.p99_ttft_vs_fifo)} at {top.load:g} x sat (goal "
              f"{GOAL['p99_ttft_change']:.0%}, paper {PAPER['p99_ttft_change']:.1%} without the adapter cache); "
              f"SLO throughput {_num(chameleon.vs_fifo, '.2f', 'x')} (goal {GOAL['slo_throughput_ratio']:g}x, "
              f"paper {PAPER['slo_throughput_ratio']:g}x)")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _change(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio - 1:+.1%}"


def write_json(path: Path, args: argparse.Namespace, blocks: list[Block]) -> None:
    write_bench_json(path, "bench schedulers", args, {"goal": GOAL, "paper": PAPER,
                                                       "blocks": [asdict(b) for b in blocks]})


# ---- the command ----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    check_args(args)
    blocks = []
    if args.side in ("twin", "both"):
        blocks += run_twin(args)
    if args.side in ("engine", "both"):
        blocks += _engine_side()(args)
    for block in blocks:
        print_block(block)
        print_rounds(block)
    print_ratios(blocks)
    print_over_time(blocks)
    if args.json:
        write_json(Path(args.json), args, blocks)
    if args.plots:
        plot_series([one for block in blocks for one in block_series(block)], Path(args.plots))
    return 0


BLOCK_METRICS = (("ttft_p99_s", "TTFT p99 (s)"), ("tbt_p50_s", "TBT p50 (s)"),
                 ("throughput_tokens_per_s", "throughput (tokens/s)"), ("goodput_tokens_per_s", "goodput (tokens/s)"),
                 ("slo_attainment", "SLO attainment (fraction)"))


def block_series(block: Block) -> list[Series]:
    """A figure per metric of one side and memory policy: the metric against the load, a line per scheduler."""
    where = f"{block.side}-{block.memory_policy}"
    return [Series(f"schedulers-{where}-{slug(metric)}-vs-load",
                   f"{block.side} ({block.memory_policy}): {label}", "load (x FIFO's saturation rate)", label,
                   group_points(block.runs, "scheduler", "load", metric)) for metric, label in BLOCK_METRICS]


def _engine_side() -> Callable[[argparse.Namespace], list[Block]]:
    try:  # torch and the agent load only when the real engine runs
        from loraplex_bench.scheduler_engine import run_engine
    except ImportError as exc:
        raise CommandError(f"the real-engine side needs the agent and torch ({exc}); run with --side twin") from None
    return run_engine
