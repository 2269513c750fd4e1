"""Single-server mode: one real EngineCore with a SimExecutor on a virtual clock."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore, EngineStats
from loraplex.engine.memory.paged_memory import no_adapter_pages
from loraplex.latency.profile import Profile
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
from loraplex.sim.replay import check_fits, register_adapters, replay
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.spec.adapter import AdapterInfo
from loraplex.util.clock import ManualClock


@dataclass
class ServerRun:
    results: list[RequestResult]
    summary: Summary
    stats: EngineStats


def sim_prompt(request: TraceRequest) -> list[int]:
    """Token ids of no meaning whose first block is unique to the request: a trace has no content, so no
    two of its requests may share a cached prefix (a prefix path starts at the first block, so the
    rest can be one shared id: a long run's prompts and cached blocks hold no per-token objects)."""
    return [(zlib.crc32(request.request_id.encode()) + 1) << 24] + [0] * (request.prompt_len - 1)


def make_sim_engine(profile: Profile, config: EngineConfig | None = None) -> tuple[EngineCore, ManualClock]:
    """The real EngineCore on a virtual clock; adapters take pages of the pool as the profile sizes them."""
    clock = ManualClock()
    config = config or profile.engine_config()
    block_size = config.block_size

    def adapter_pages(info: AdapterInfo) -> int:
        return profile.adapter_pages(info.rank, block_size)

    executor = SimExecutor(profile, clock, block_size)
    # under lru-static the profile's KV memory is already net of the slots: they take no pages
    pages = no_adapter_pages if config.memory_policy == "lru-static" else adapter_pages
    return EngineCore(config, executor, clock, adapter_pages=pages), clock


def simulate_server(trace: Trace, profile: Profile, config: EngineConfig | None = None,
                    slo: Slo | None = None, horizon_s: float | None = None, exact: bool = False,
                    progress: Callable[[float], None] | None = None) -> ServerRun:
    """`exact`: run every step through the engine (the reference); by default spans of plain decode
    steps run at once (`sim.spans`). `progress` is told the trace time now and then."""
    core, clock = make_sim_engine(profile, config)
    check_fits(trace, core.config.max_model_len, core.config.max_lora_rank)
    ids = register_adapters(core, trace.adapters())

    def jump(t: float) -> None:
        clock.advance(max(0.0, t - clock.now()))

    with cyclic_gc_paused():
        log = replay(core, trace, ids, sim_prompt, jump, horizon_s, None if exact else core.executor, progress)
    results = [result_of(req, log.origin, req.adapter.name if req.adapter else None) for req in log.requests]
    summary = summarize(results, trace_duration(trace), log.end - log.origin, slo, offered_tokens(trace))
    return ServerRun(results, summary, core.stats())
