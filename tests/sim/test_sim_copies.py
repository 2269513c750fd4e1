"""The twin's host <-> device copies: synchronous ones lengthen the step, background ones run on one
FIFO link and are reported once by the first step that ends after them; profiles size adapters in
pages. Older profiles (no bandwidth) keep the per-load coefficients."""

from __future__ import annotations

import json

import pytest

from loraplex.engine.messages import AdapterLoad, KVCopy, KVSwapIn, ScheduledChunk, SchedulerOutput
from loraplex.engine.output.sampling import SamplingParams
from loraplex.latency.profile import PROFILES_DIR, Memory, Profile, load_profile
from loraplex.sim.executor import SimExecutor
from loraplex.sim.whatif import NAME as WHATIF
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.util.clock import ManualClock

ENGINE = dict(max_model_len=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
              max_loras=4, max_lora_rank=64, scheduler="fifo", residency="lru")
GBPS = 1.0  # 1 byte per ns: a copy of B bytes lasts B * 1e-9 s
PER_RANK = 1_000_000  # bytes per adapter rank: a rank-8 adapter copies in 8 ms
KV_TOKEN = 1000  # bytes per KV token: one 16-token page copies in 16 us
STEP = 0.01  # intercept: every step with a chunk lasts 10 ms (plus copies)


def profile(bandwidth: bool = True, loads: float = 0.05) -> Profile:
    memory = Memory(kv_tokens_base=32768, kv_token_bytes=KV_TOKEN, adapter_bytes_per_rank=PER_RANK,
                    h2d_gbps=GBPS if bandwidth else None)
    return Profile(name="t", model="m", hardware="h", engine=ENGINE, memory=memory,
                   coefficients={"intercept": STEP, "loads": loads, "load_rank_sum": 0.001})


def chunk(request_id: str = "r", slot: int = -1) -> ScheduledChunk:
    return ScheduledChunk(request_id, [1], 5, [0], slot, True, SamplingParams(), num_output_tokens=1)


def load(rank: int, job: int = -1, slot: int = 0) -> AdapterLoad:
    return AdapterLoad(slot, AdapterId(f"a{slot}", "d"), rank, [], asynchronous=job >= 0, job=job)


def executor(p: Profile | None = None) -> tuple[SimExecutor, ManualClock]:
    clock = ManualClock()
    return SimExecutor(p or profile(), clock), clock


def test_a_synchronous_load_adds_its_copy_time_and_replaces_the_load_terms():
    ex, clock = executor()
    result = ex.execute(SchedulerOutput([chunk()], [load(8)]))
    assert result.elapsed_s == pytest.approx(STEP + 8 * PER_RANK / (GBPS * 1e9))  # 10 + 8 ms; no `loads` term
    assert clock.now() == pytest.approx(result.elapsed_s)
    assert result.copy_bytes == 8 * PER_RANK and result.copies_done == []


def test_swap_outs_are_synchronous_and_counted_in_pages():
    ex, _ = executor()
    out = SchedulerOutput([chunk()], kv_swap_out=[KVCopy(1, 0), KVCopy(2, 1)])
    result = ex.execute(out)
    page = 16 * KV_TOKEN
    assert result.elapsed_s == pytest.approx(STEP + 2 * page * 1e-9) and result.copy_bytes == 2 * page


def test_an_async_load_runs_in_the_background_and_is_reported_once():
    ex, clock = executor()
    first = ex.execute(SchedulerOutput([chunk()], [load(32, job=7)]))  # 32 ms of copy, a 10 ms step
    assert first.elapsed_s == pytest.approx(STEP) and first.copies_done == [] and first.copy_bytes == 32 * PER_RANK
    reported = [ex.execute(SchedulerOutput([chunk()])).copies_done for _ in range(4)]  # steps end at 20..50 ms
    assert reported == [[], [], [7], []]  # the step ending at 40 ms is the first one at or after 32 ms
    assert clock.now() == pytest.approx(5 * STEP)


def test_background_copies_share_one_link_in_submission_order():
    ex, _ = executor()
    swap = KVSwapIn(job=2, copies=[KVCopy(5, 0)] * 625)  # 625 pages of 16 kB: 10 ms
    first = ex.execute(SchedulerOutput([chunk()], [load(8, job=1)], kv_swap_in=[swap]))
    assert first.copies_done == [1]  # done at 8 ms, inside the 10 ms step
    assert [done for done, _ in ex.link.pending] == pytest.approx([0.018])  # the swap-in waited for the load
    assert ex.execute(SchedulerOutput([chunk()])).copies_done == [2]  # the step ends at 20 ms


def test_an_idle_step_waits_for_the_next_copy():
    ex, clock = executor()
    result = ex.execute(SchedulerOutput(adapter_loads=[load(16, job=3), load(8, job=4, slot=1)]))
    assert result.elapsed_s == pytest.approx(0.016) and result.copies_done == [3]  # no model runs: no intercept
    assert ex.execute(SchedulerOutput()).copies_done == [4]
    assert clock.now() == pytest.approx(0.024)
    assert ex.execute(SchedulerOutput()).elapsed_s == 0.0  # nothing in flight, nothing to do


def test_older_profiles_keep_the_per_load_terms():
    ex, clock = executor(profile(bandwidth=False))
    result = ex.execute(SchedulerOutput([chunk()], [load(8), load(16, job=9, slot=1)]))
    assert result.elapsed_s == pytest.approx(STEP + 2 * 0.05 + 24 * 0.001)  # both loads, as before
    assert result.copies_done == [9]  # a background load completes with the step that issued it
    idle = ex.execute(SchedulerOutput(adapter_loads=[load(8, job=10, slot=2)]))
    assert idle.elapsed_s == pytest.approx(0.05 + 8 * 0.001) and idle.copies_done == [10]  # no intercept
    bare = Profile(name="t", model="m", hardware="h", engine=ENGINE, memory=Memory(kv_tokens_base=32768),
                   coefficients={"intercept": STEP})
    assert SimExecutor(bare, ManualClock()).execute(SchedulerOutput([chunk()], [load(8)])).copy_bytes == 0


def test_profiles_size_adapters_in_pages():
    p = profile()
    assert p.adapter_pages(8, 16) == 500 and p.adapter_bytes(8) == 8 * PER_RANK  # 8e6 / 16e3
    assert p.copy_seconds(25e9) == pytest.approx(25.0)
    slots_only = Profile(name="t", model="m", hardware="h", engine=ENGINE, coefficients={},
                         memory=Memory(kv_tokens_base=32768, kv_tokens_per_slot_rank=48.0))
    assert slots_only.adapter_pages(8, 16) == 24 and slots_only.copy_seconds(1e9) == 0.0  # 8 * 48 tokens


def test_the_whatif_copy_terms_follow_llama_8b_in_bf16():
    memory = load_profile(WHATIF).memory
    assert memory.kv_token_bytes == 2 * 32 * 8 * 128 * 2
    per_layer = (4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096)
    assert memory.adapter_bytes_per_rank == 32 * 2 * per_layer == 5 * 2**20
    assert memory.h2d_gbps == 25.0
    assert load_profile(WHATIF).adapter_pages(128, 16) == 320  # 640 MiB in 2 MiB pages


def test_cpu_tiny_bytes_follow_the_tiny_models_shapes():
    hidden, layers, heads, kv_heads, mlp, fp32 = 256, 4, 4, 2, 4 * 256, 4  # loraplex_agent.tools.tiny_model
    head_dim = hidden // heads
    memory = load_profile("cpu-tiny").memory
    assert memory.kv_token_bytes == 2 * layers * kv_heads * head_dim * fp32
    per_layer = 2 * (hidden + hidden) + 2 * (hidden + kv_heads * head_dim) + 3 * (hidden + mlp)
    assert memory.adapter_bytes_per_rank == layers * fp32 * per_layer
    assert memory.h2d_gbps is None  # host and device are the same RAM


def test_an_older_profile_file_still_loads(tmp_path):
    raw = json.loads((PROFILES_DIR / "cpu-tiny.json").read_text())
    for key in ("kv_token_bytes", "adapter_bytes_per_rank", "h2d_gbps"):
        raw["memory"].pop(key, None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    old = load_profile(path)
    assert old.memory.kv_token_bytes is None and old.adapter_pages(64, 16) == 0


def test_the_twin_engine_pages_adapters_as_the_profile_says():
    from loraplex.engine.request import Request
    from loraplex.sim.server import make_sim_engine

    p = load_profile(WHATIF)
    core, _ = make_sim_engine(p, p.engine_config(memory_policy="unified", max_lora_rank=128))
    info = AdapterInfo(AdapterId("x", "sha256:x"), 64, 0)
    core.add_adapter(info)
    core.add_request(Request("r", [3] * 40, SamplingParams(max_tokens=2, ignore_eos=True), adapter=info.id))
    while core.has_unfinished():
        core.step()
    stats = core.memory_stats()
    assert stats.adapter_pages == p.adapter_pages(64, 16) == 160  # cached after its request, in the pool
    assert stats.h2d_bytes >= p.adapter_bytes(64)
