"""Single-server mode: one real EngineCore with a SimExecutor on a virtual clock."""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.engine.clock import ManualClock
from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore, EngineStats
from loraplex.sim.executor import SimExecutor
from loraplex.sim.gc_pause import cyclic_gc_paused
from loraplex.sim.metrics import (
    RequestResult,
    Slo,
    Summary,
    offered_tokens,
    result_of,
    summarize,
    trace_duration,
)
from loraplex.sim.profile import Profile
from loraplex.sim.replay import check_fits, register_adapters, replay
from loraplex.sim.trace import Trace, TraceRequest


@dataclass
class ServerRun:
    results: list[RequestResult]
    summary: Summary
    stats: EngineStats


def sim_prompt(request: TraceRequest) -> list[int]:
    return [1] * request.prompt_len  # content never matters to a simulated step


def make_sim_engine(profile: Profile, config: EngineConfig | None = None) -> tuple[EngineCore, ManualClock]:
    clock = ManualClock()
    config = config or profile.engine_config()
    return EngineCore(config, SimExecutor(profile, clock), clock), clock


def simulate_server(trace: Trace, profile: Profile, config: EngineConfig | None = None,
                    slo: Slo | None = None, horizon_s: float | None = None) -> ServerRun:
    core, clock = make_sim_engine(profile, config)
    check_fits(trace, core.config.max_model_len, core.config.max_lora_rank)
    ids = register_adapters(core, trace.adapters())

    def jump(t: float) -> None:
        clock.advance(max(0.0, t - clock.now()))

    with cyclic_gc_paused():
        log = replay(core, trace, ids, sim_prompt, jump, horizon_s)
    results = [result_of(req, log.origin, req.adapter.name if req.adapter else None) for req in log.requests]
    summary = summarize(results, trace_duration(trace), log.end - log.origin, slo, offered_tokens(trace))
    return ServerRun(results, summary, core.stats())
