"""`loraplex profile`: time the real engine over a grid and fit the twin's step-latency model.

Every engine step is timed whole (schedule + execute + update, the time the twin must
reproduce) and described by the features of `loraplex.latency.features`. The grid has closed batches
(batch sizes x prompt lengths x adapter counts and ranks), short prompt chunks over a long cached
prefix (context lengths x chunk lengths x batch sizes) and open-loop Poisson replays in which
more adapters than device slots force adapter loads. `--check PROFILE` instead replays the same
trace on the real engine and on the twin at three loads and prints the errors (docs/simulator.md).

Time is the engine thread's CPU time by default (torch runs single-threaded here), so other
processes on a shared machine do not leak into the profile or the comparison; `--wall-clock`
measures wall time instead. On an idle machine the two agree.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from loraplex.engine.core import EngineCore
from loraplex.engine.messages import ExecutorResult, SchedulerOutput
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request
from loraplex.latency.features import SlotRanks, StepFeatures
from loraplex.latency.profile import PROFILE_VERSION, Memory, Profile, load_profile
from loraplex.sim.capacity import saturation_rps
from loraplex.sim.fit import fit_latency
from loraplex.sim.metrics import Summary, offered_tokens, result_of, summarize, trace_duration
from loraplex.sim.replay import replay
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate
from loraplex.spec.errors import CommandError
from loraplex.util.clock import MonotonicClock
from loraplex_agent.runtime.executor import TorchExecutor
from loraplex_agent.runtime.llm import LLM

Sample = tuple[StepFeatures, float]


class RecordingExecutor:
    """Passes steps to the real executor and keeps the features of the step in flight."""

    def __init__(self, inner: TorchExecutor) -> None:
        self.inner = inner
        self.slots = SlotRanks()
        self.last: StepFeatures | None = None

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        self.slots.apply(output)
        self.last = self.slots.features(output)
        return self.inner.execute(output)


class CpuClock:
    """The engine thread's CPU time, plus the idle gaps the replay jumps over: a clock that ignores
    time the engine spent waiting for a CPU another process held."""

    def __init__(self) -> None:
        self._offset = -time.thread_time()

    def now(self) -> float:
        return time.thread_time() + self._offset

    def jump_to(self, t: float) -> None:
        self._offset += max(0.0, t - self.now())


def use_clock(core: EngineCore, clock: object) -> None:
    core.clock = clock
    core.scheduler.clock = clock  # the scheduler stamps first-token and finish times with it


class TimedCore:
    """An EngineCore whose every executed step is timed whole and recorded as a sample."""

    def __init__(self, core: EngineCore, recorder: RecordingExecutor, wall_clock: bool = False) -> None:
        self.core = core
        self.recorder = recorder
        self.timer = time.perf_counter if wall_clock else time.thread_time
        self.samples: list[Sample] = []

    def __getattr__(self, name: str):
        return getattr(self.core, name)

    def step(self):
        self.recorder.last = None
        start = self.timer()
        outputs = self.core.step()
        elapsed = self.timer() - start
        if self.recorder.last is not None:
            self.samples.append((self.recorder.last, elapsed))
        return outputs


def instrument(llm: LLM, wall_clock: bool = False) -> TimedCore:
    recorder = RecordingExecutor(llm.executor)
    llm.core.executor = recorder
    return TimedCore(llm.core, recorder, wall_clock)


# ---- replaying a trace on the real engine ------------------------------------------------------

def bind_adapters(trace: Trace, llm: LLM) -> Trace:
    """Map the trace's adapters, in name order, onto the adapters loaded in `llm` (their real ranks)."""
    names = sorted(trace.adapters())
    loaded = sorted(llm.adapters)
    if len(names) > len(loaded):
        raise CommandError(f"the trace uses {len(names)} adapters but only {len(loaded)} are loaded")
    ranks = {name: llm.adapters[name].info.rank for name in loaded}
    mapping = dict(zip(names, loaded[:len(names)], strict=True))
    requests = [TraceRequest(r.request_id, r.arrival_s, mapping.get(r.adapter),
                             ranks[mapping[r.adapter]] if r.adapter else 0, r.prompt_len, r.output_len)
                for r in trace.requests]
    return Trace(requests, trace.workload)


_RUNS = itertools.count()  # replays in this process; each draws prompts no earlier one used


def random_prompts(vocab_size: int, seed: int = 0):
    """Fresh random prompts per replay: the prefix cache keeps earlier runs' prompts, and a replay that
    repeated them would be served from it while the twin (whose prompts are unique) is not."""
    rng = random.Random(f"{seed}/{next(_RUNS)}")
    return lambda r: [rng.randrange(3, vocab_size) for _ in range(r.prompt_len)]


def run_real(llm: LLM, core: EngineCore | TimedCore, trace: Trace, seed: int = 0, wall_clock: bool = False
             ) -> Summary:
    """Replay `trace` on the real engine, open loop, and summarise it like the twin. In wall time
    it sleeps until each arrival; in CPU time (`CpuClock`) it jumps to it."""
    ids = {name: llm.adapters[name].info.id for name in trace.adapters()}
    if wall_clock:
        clock = MonotonicClock()

        def wait_until(t: float) -> None:
            time.sleep(max(0.0, t - clock.now()))
    else:
        clock = CpuClock()
        wait_until = clock.jump_to
    use_clock(llm.core, clock)
    log = replay(core, trace, ids, random_prompts(llm.model_config.vocab_size, seed), wait_until)
    results = [result_of(r, log.origin, r.adapter.name if r.adapter else None) for r in log.requests]
    return summarize(results, trace_duration(trace), log.end - log.origin, None, offered_tokens(trace))


# ---- the grid ------------------------------------------------------------------------------------

def closed_batch(llm: LLM, core: TimedCore, batch: int, prompt_len: int, output_len: int,
                 adapters: list[str | None], rng: random.Random) -> None:
    vocab = llm.model_config.vocab_size
    ids = [llm.adapters[a].info.id if a else None for a in adapters]
    requests = [Request(f"grid-{rng.random()}", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0),
                        adapter=ids[i % len(ids)]) for i in range(batch)]
    for request in requests:
        core.add_request(request)
    while core.has_unfinished():
        core.step()
    for name in {a for a in adapters if a}:  # re-register: the next batch loads them again (timed)
        core.core.add_adapter(core.core.remove_adapter(name))


def cached_context(llm: LLM, core: TimedCore, context_len: int, chunk_len: int, batch: int,
                   rng: random.Random) -> None:
    """`batch` prompts that share a `context_len`-token prefix, sent once it is cached: each step
    prefills `chunk_len` tokens attending over the cached KV (a follow-up turn, an aLoRA checker)."""
    vocab = llm.model_config.vocab_size
    prefix = [rng.randrange(3, vocab) for _ in range(context_len)]
    sampling = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    for prompts in ([prefix], [prefix + [rng.randrange(3, vocab) for _ in range(chunk_len)] for _ in range(batch)]):
        for prompt in prompts:
            core.add_request(Request(f"grid-{rng.random()}", prompt, sampling))
        while core.has_unfinished():
            core.step()


def run_grid(llm: LLM, core: TimedCore, quick: bool, seed: int) -> None:
    rng = random.Random(seed)
    names = sorted(llm.adapters)
    batches = (1, 16, 64) if quick else (1, 2, 4, 8, 16, 32, 64)
    prompts = (16, 256) if quick else (16, 64, 256, 768)
    adapter_sets: list[list[str | None]] = [[None], names] if quick else [[None], names[:1], names[:4], names]
    for batch in batches:
        for prompt_len in prompts:
            for adapters in adapter_sets:
                if batch <= llm.engine_config.max_num_seqs:
                    closed_batch(llm, core, batch, prompt_len, 16 if quick else 32, adapters, rng)
    longest = llm.engine_config.max_model_len - 64
    for context_len in (512,) if quick else (256, 768, 1536):
        for chunk_len in (16, 64):
            for batch in (1, 4):
                cached_context(llm, core, min(context_len, longest), chunk_len, batch, rng)


def run_open_loop(llm: LLM, core: TimedCore, quick: bool, seed: int, max_model_len: int,
                  wall_clock: bool = False) -> None:
    """Poisson replays with Azure-conv lengths; more adapters than slots makes the engine load some."""
    # the last rate overloads the tiny CPU model: large batches with long contexts are measured too
    for i, rps in enumerate((4.0, 10.0, 30.0) if quick else (3.0, 8.0, 16.0, 24.0, 40.0)):
        spec = fidelity_spec(rps, 6.0 if quick else 30.0, seed + i, len(llm.adapters), max_model_len)
        run_real(llm, core, bind_adapters(generate(spec), llm), seed, wall_clock)


def fidelity_spec(rps: float, duration_s: float, seed: int, adapters: int, max_model_len: int) -> WorkloadSpec:
    """The fidelity workload: Poisson, Azure conv lengths scaled for a tiny CPU model, uniform popularity."""
    return WorkloadSpec(seed=seed, duration_s=duration_s, rps=rps,
                        lengths=Lengths(profile="azure23_conv", scale=0.125, max_model_len=max_model_len),
                        adapters=Adapters(count=adapters, popularity={"mode": "uniform"}))


# ---- the command ---------------------------------------------------------------------------------

def build_llm(args: argparse.Namespace) -> LLM:
    torch.set_num_threads(args.threads)
    llm = LLM.from_args(args)
    folder = Path(args.adapters) if args.adapters else Path(args.model).parent / "adapters"
    if not folder.is_dir():
        raise CommandError(f"{folder} is not a folder of PEFT adapters; pass --adapters")
    for path in sorted(p for p in folder.iterdir() if (p / "adapter_config.json").is_file()):
        llm.add_adapter(path.name, path)
    if not llm.adapters:
        raise CommandError(f"no PEFT adapters found in {folder}")
    return llm


def profile_engine(llm: LLM, quick: bool, seed: int, name: str, threads: int, wall_clock: bool = False) -> Profile:
    core = instrument(llm, wall_clock)
    run_grid(llm, core, quick, seed)
    run_open_loop(llm, core, quick, seed, llm.engine_config.max_model_len, wall_clock)
    return make_profile(llm, core.samples, name, threads, wall_clock)


def make_profile(llm: LLM, samples: list[Sample], name: str, threads: int, wall_clock: bool = False) -> Profile:
    coefficients, report = fit_latency(samples)
    config = asdict(llm.engine_config)
    memory = Memory(kv_tokens_base=config.pop("num_blocks") * config["block_size"])
    mc = llm.model_config
    return Profile(
        profile_version=PROFILE_VERSION, name=name, engine=config, memory=memory,
        model=f"{Path(llm.model_dir).name} (hidden {mc.hidden_size}, {mc.num_hidden_layers} layers, "
              f"vocab {mc.vocab_size}, {llm.executor.dtype})",
        hardware=f"{llm.executor.device.type}: {platform.processor() or platform.machine()}, "
                 f"{os.cpu_count()} cores, torch threads {threads}, {'wall' if wall_clock else 'thread CPU'} time",
        coefficients=coefficients, fit=report)


LOADS = (0.25, 0.5, 0.75)
CAPACITY_TRACE_S = 120.0


def check(llm: LLM, profile: Profile, duration_s: float, seed: int, loads: tuple[float, ...] = LOADS,
          wall_clock: bool = False) -> list[dict]:
    """Real engine vs twin on the same trace at `loads` x the twin's saturation rate."""
    max_len = llm.engine_config.max_model_len
    adapters = len(llm.adapters)
    # a long twin-only trace: short ones under-read throughput at the window's edges
    capacity = saturation_rps(profile, lambda rps: bind_adapters(
        generate(fidelity_spec(rps, CAPACITY_TRACE_S, seed, adapters, max_len)), llm), llm.engine_config)
    rows = []
    core = instrument(llm, wall_clock)
    for load in loads:
        trace = bind_adapters(generate(fidelity_spec(load * capacity, duration_s, seed, adapters, max_len)), llm)
        core.samples.clear()
        real = run_real(llm, core, trace, seed, wall_clock)
        twin = simulate_server(trace, profile, llm.engine_config).summary
        speed = machine_speed(profile, core.samples)
        at_speed = simulate_server(trace, profile.scaled(speed), llm.engine_config).summary
        rows.append(compare(load, load * capacity, real, twin)
                    | {"step_model_error": 1 / speed - 1, "machine_speed": speed}
                    | {f"at_speed_{k}": v for k, v in compare(load, load * capacity, real, at_speed).items()
                       if k.startswith(("twin_", "throughput_error", "ttft_p50_error"))})
    return rows


def machine_speed(profile: Profile, samples: list[Sample]) -> float:
    """Measured / predicted total time of the real run's own steps: how much slower (> 1) this run
    was than the profile says, on exactly the batches it executed. A shared machine's speed drifts
    (here ±10% from minute to minute), and at 60% load a few percent of step time moves the P50 TTFT
    several times as much: the `at_speed_` errors compare the twin at the run's own speed, so they
    measure how the twin forms batches and queues, not the machine's drift."""
    predicted = sum(profile.step_seconds(f) for f, _ in samples)
    return sum(t for _, t in samples) / predicted if predicted else 1.0


def compare(load: float, rps: float, real: Summary, twin: Summary) -> dict:
    def error(a: float, b: float) -> float:
        return abs(b - a) / a if a else float("inf")
    return {"load": load, "rps": round(rps, 3), "requests": real.requests,
            "real_throughput": real.throughput_tokens_per_s, "twin_throughput": twin.throughput_tokens_per_s,
            "throughput_error": error(real.throughput_tokens_per_s, twin.throughput_tokens_per_s),
            "real_ttft_p50": real.ttft_s["p50"], "twin_ttft_p50": twin.ttft_s["p50"],
            "ttft_p50_error": error(real.ttft_s["p50"], twin.ttft_s["p50"])}


def parse_loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CommandError(f"--loads must be comma-separated numbers, not {text!r}") from None
    if not loads or not all(0 < x < 2 for x in loads):
        raise CommandError("--loads must be fractions of the saturation rate between 0 and 2")
    return loads


def run(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    if args.check:
        rows = check(llm, load_profile(args.check), args.duration, args.seed, parse_loads(args.loads),
                     args.wall_clock)
        print(json.dumps(rows, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
        return 0
    if not args.out:
        raise CommandError("--out FILE is required when profiling")
    started = time.perf_counter()
    profile = profile_engine(llm, args.quick, args.seed, args.name or Path(args.out).stem, args.threads,
                             args.wall_clock)
    profile.save(args.out)
    print(f"profiled {profile.fit.samples} steps in {time.perf_counter() - started:.0f} s; "
          f"R^2 {profile.fit.r2:.3f}, step MAPE {profile.fit.mape:.1%}, "
          f"total-time error {profile.fit.total_time_error:+.1%}; wrote {args.out}")
    return 0
