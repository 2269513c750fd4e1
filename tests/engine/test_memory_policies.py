"""The memory policies under random request streams: exact page accounting, the dependency
invariant, no KV shared across adapters, prefix reuse, and outputs that never depend on memory."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_executor import ToyExecutor

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import Request, RequestStatus
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.util.clock import ManualClock

POLICIES = ["unified", "lru-static", "no-cache"]
ADAPTERS = [AdapterInfo(AdapterId(f"m{i}", f"sha256:{i:064x}"), rank=8 << (i % 3), size_bytes=1000) for i in range(5)]
BLOCK = 4


def pages_of(info: AdapterInfo) -> int:
    return info.rank // 8  # rank 8 -> 1 page ... rank 32 -> 4 pages; a slot (max rank 32) takes 4


def make_engine(policy: str, num_blocks: int = 64, **overrides) -> tuple[EngineCore, ToyExecutor, ManualClock]:
    config = EngineConfig(max_model_len=96, block_size=BLOCK, num_blocks=num_blocks, max_lora_rank=32, max_loras=3,
                          memory_policy=policy, **overrides)
    clock = ManualClock()
    executor = ToyExecutor(BLOCK)
    core = EngineCore(config, executor, clock=clock, adapter_pages=pages_of)
    for info in ADAPTERS:
        core.add_adapter(info)
    return core, executor, clock


def conversation(rng: random.Random, n: int) -> list[tuple[int | None, list[int]]]:
    """Requests whose prompts extend earlier ones of the same adapter (multi-turn chats)."""
    histories: dict[int, list[int]] = {}
    out = []
    for _ in range(n):
        adapter = rng.choice([None, 0, 1, 2, 3, 4])
        key = -1 if adapter is None else adapter
        history = histories.get(key, []) if rng.random() < 0.7 else []
        prompt = history + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 12))]
        histories[key] = prompt
        out.append((adapter, prompt))
    return out


def requests_for(spec: list[tuple[int | None, list[int]]], max_tokens: int) -> list[Request]:
    return [Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    adapter=None if a is None else ADAPTERS[a].id) for i, (a, prompt) in enumerate(spec)]


def check_accounting(core: EngineCore) -> None:
    memory = core.memory
    memory.tree.check_invariants()
    owned = sum(len(r.block_ids) - memory._shared.get(r.request_id, 0) for r in core.scheduler.running)
    held = sum(memory.tree.device_pages_by_kind().values())
    slots = sum(len(p) for p in getattr(memory, "_slot_pages", []))
    assert memory.pool.num_free + owned + held + slots == memory.pool.num_pages
    if memory.policy != "lru-static":
        assert core.memory_stats().invalid_kv_pages == 0


def run(core: EngineCore, clock: ManualClock, requests: list[Request], stagger: int = 3) -> dict[str, list[int]]:
    pending = list(requests)
    for _ in range(20_000):
        for _ in range(min(stagger, len(pending))):
            core.add_request(pending.pop(0))
        if not pending and not core.has_unfinished():
            break
        core.step()
        clock.advance(0.01)
        check_accounting(core)
    assert not pending and not core.has_unfinished()
    return {r.request_id: r.output_token_ids for r in requests}


def reference(spec, max_tokens: int) -> dict[str, list[int]]:
    outputs = {}
    for request in requests_for(spec, max_tokens):
        core, _, clock = make_engine("no-cache", num_blocks=512)
        outputs.update(run(core, clock, [request]))
    return outputs


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("host_blocks", [0, 16])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(40, 96), stagger=st.integers(1, 6))
def test_outputs_and_accounting_under_memory_pressure(policy, host_blocks, seed, num_blocks, stagger):
    spec = conversation(random.Random(seed), 14)
    core, _, clock = make_engine(policy, num_blocks=num_blocks, num_host_blocks=host_blocks)
    assert run(core, clock, requests_for(spec, 6), stagger) == reference(spec, 6)
    stats = core.memory_stats()
    assert stats.running_kv_pages == 0


def test_a_second_turn_reuses_its_conversation_and_computes_only_the_new_tokens():
    core, executor, clock = make_engine("unified")
    first = requests_for([(1, list(range(1, 30)))], 8)[0]
    run(core, clock, [first])
    second_prompt = first.prompt_token_ids + first.output_token_ids + [5, 6, 7]
    second = Request("turn2", second_prompt, SamplingParams(max_tokens=8, ignore_eos=True), adapter=ADAPTERS[1].id)
    executor.steps.clear()
    run(core, clock, [second])
    computed = sum(c.num_tokens for step in executor.steps for c in step.chunks if c.request_id == "turn2")
    assert computed <= len(second_prompt) - 32 + 8  # 8 full blocks of the 37 known tokens came from the cache
    alone, _, aclock = make_engine("unified", prefix_cache=False)
    fresh = Request("turn2", second_prompt, SamplingParams(max_tokens=8, ignore_eos=True), adapter=ADAPTERS[1].id)
    assert run(alone, aclock, [fresh]) == {"turn2": second.output_token_ids}
    assert core.memory_stats().prefix_hit_tokens >= 32


def test_prefixes_are_never_shared_across_adapters_or_digests():
    core, _, clock = make_engine("unified")
    prompt = list(range(1, 40))
    run(core, clock, requests_for([(0, prompt)], 4))
    hits = core.memory_stats().prefix_hit_tokens
    run(core, clock, [Request("other", prompt, SamplingParams(max_tokens=4), adapter=ADAPTERS[2].id)])
    assert core.memory_stats().prefix_hit_tokens == hits
    core.remove_adapter("m0")
    reuploaded = AdapterInfo(AdapterId("m0", "sha256:" + "f" * 64), rank=8, size_bytes=1000)
    core.add_adapter(reuploaded)
    run(core, clock, [Request("new", prompt, SamplingParams(max_tokens=4), adapter=reuploaded.id)])
    assert core.memory_stats().prefix_hit_tokens == hits


def test_an_idle_adapter_stays_cached_until_kv_needs_its_pages():
    core, _, clock = make_engine("unified", num_blocks=24)
    run(core, clock, requests_for([(2, [1, 2, 3])], 2))  # rank 32: 4 pages
    assert ADAPTERS[2].id in core.memory.resident()
    big = requests_for([(None, list(range(1, 89)))], 2)
    run(core, clock, big)  # 23 pages of KV: the cache gives the adapter's pages up
    assert ADAPTERS[2].id not in core.memory.resident()
    assert core.memory_stats().adapter_evictions == 1


def test_no_cache_drops_an_adapter_when_its_last_request_ends():
    core, _, clock = make_engine("no-cache")
    run(core, clock, requests_for([(2, [1, 2, 3])], 2))
    assert core.memory.resident() == []


def test_a_pinned_adapter_is_loaded_at_once_and_never_evicted():
    core, _, clock = make_engine("unified", num_blocks=24)
    pinned = AdapterInfo(AdapterId("pinned", "sha256:" + "a" * 64), rank=16, size_bytes=1000)
    core.add_adapter(pinned, pinned=True)
    run(core, clock, requests_for([(None, list(range(1, 60)))], 2))
    assert pinned.id in core.memory.resident()
    assert any(a.pinned and a.name == "pinned" for a in core.memory_stats().adapters)


def test_a_waiting_request_does_not_block_ready_ones_while_its_adapter_loads():
    core, executor, clock = make_engine("unified")
    warm = requests_for([(0, [1, 2, 3])], 2)
    run(core, clock, warm)
    cold, ready = requests_for([(3, [4, 5, 6]), (0, [7, 8, 9])], 4)
    core.add_request(cold)
    core.add_request(ready)
    core.step()
    assert ready.status is RequestStatus.RUNNING and cold.status is RequestStatus.WAITING
    assert executor.steps[-1].adapter_loads[0].asynchronous
    run(core, clock, [])
    assert cold.is_finished


def test_lru_static_leaves_invalid_kv_behind_evicted_adapters():
    core, _, clock = make_engine("lru-static", num_blocks=128)
    run(core, clock, requests_for([(i, list(range(1, 20))) for i in range(5)], 2), stagger=1)
    assert core.memory_stats().invalid_kv_pages > 0
