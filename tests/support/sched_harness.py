"""A small engine (toy executor, manual clock) for scheduler tests."""

from __future__ import annotations

from toy_executor import ToyExecutor

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request, RequestStatus
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.util.clock import ManualClock

SCHEDULER_NAMES = ["fifo", "sjf", "vtc", "chameleon"]
RANKS = {"a": 8, "b": 8, "c": 16, "d": 32, "e": 64}
ADAPTERS = {name: AdapterInfo(AdapterId(name, f"sha256:{i:064x}"), rank=rank, size_bytes=1000)
            for i, (name, rank) in enumerate(RANKS.items())}


def make_core(scheduler: str = "chameleon", options: dict | None = None, **overrides) -> tuple[EngineCore, ToyExecutor, ManualClock]:
    # fixed slots by default: these tests are about adapters competing for memory the old way
    fields = {"max_model_len": 256, "block_size": 4, "num_blocks": 256, "memory_policy": "lru-static", **overrides}
    config = EngineConfig(scheduler=scheduler, scheduler_options=dict(options or {}), **fields)
    executor = ToyExecutor(config.block_size)
    clock = ManualClock()
    core = EngineCore(config, executor, clock=clock)
    for info in ADAPTERS.values():
        core.add_adapter(info)
    return core, executor, clock


def req(request_id: str, prompt_len: int, max_tokens: int, adapter: str | None = None) -> Request:
    prompt = [(7 * i + len(request_id)) % 900 + 1 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   adapter=ADAPTERS[adapter].id if adapter else None)


def assert_no_running_kv(core: EngineCore) -> None:
    """Every page is free or held by the prefix cache or adapters: nothing is left to finished requests."""
    stats = core.memory_stats()
    assert stats.running_kv_pages == 0
    assert stats.free_pages + stats.cached_kv_pages + stats.adapter_pages == stats.num_pages


def running_ids(core: EngineCore) -> set[str]:
    return {r.request_id for r in core.scheduler.running}


def is_running(request: Request) -> bool:
    return request.status is RequestStatus.RUNNING


def drain(core: EngineCore, clock: ManualClock, dt: float = 0.01, max_steps: int = 100_000) -> None:
    for _ in range(max_steps):
        if not core.has_unfinished():
            return
        core.step()
        clock.advance(dt)
    raise AssertionError("the engine did not finish")
