from __future__ import annotations

import random

import pytest
from sched_harness import assert_no_running_kv
from toy_executor import ToyExecutor

from loraplex.engine.config import EngineConfig
from loraplex.engine.core import EngineCore
from loraplex.engine.output.sampling import SamplingParams
from loraplex.engine.request import FinishReason, Request
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import ConflictError, InvalidRequestError, NotFoundError
from loraplex.util.clock import ManualClock

SCHEDULERS = ["fifo", "sjf", "vtc", "chameleon"]
ADAPTERS = [AdapterInfo(AdapterId(f"a{i}", f"sha256:{i:064x}"), rank=8 * (i % 4 + 1), size_bytes=1000)
            for i in range(6)]


def make_engine(**overrides) -> tuple[EngineCore, ToyExecutor]:
    config = EngineConfig(**{"max_model_len": 256, "block_size": 4, "num_blocks": 256, **overrides})
    executor = ToyExecutor(config.block_size)
    core = EngineCore(config, executor, clock=ManualClock())
    for info in ADAPTERS:
        core.add_adapter(info)
    return core, executor


def run_all(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        core.add_request(request)
    for _ in range(10_000):
        if not core.has_unfinished():
            break
        core.step()
    assert not core.has_unfinished()
    return {r.request_id: r.output_token_ids for r in requests}


def make_requests(n: int, seed: int = 0, max_tokens: int = 12) -> list[Request]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        adapter = rng.choice([None, *[a.id for a in ADAPTERS]])
        prompt = [rng.randrange(1, 900) for _ in range(rng.randrange(1, 60))]
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens), adapter=adapter))
    return requests


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_request_gets_its_tokens_and_frees_its_blocks(scheduler):
    core, _ = make_engine(scheduler=scheduler)
    outputs = run_all(core, make_requests(20))
    assert all(len(tokens) == 12 for tokens in outputs.values())
    assert_no_running_kv(core)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_outputs_do_not_depend_on_batching_chunking_or_preemption(scheduler):
    alone = {}
    for request in make_requests(12):
        core, _ = make_engine()
        alone.update(run_all(core, [request]))
    for overrides in ({}, {"max_num_batched_tokens": 7}, {"num_blocks": 64, "max_num_batched_tokens": 13},
                      {"max_num_seqs": 3, "max_loras": 2}):
        core, _ = make_engine(scheduler=scheduler, **overrides)
        assert run_all(core, make_requests(12)) == alone, overrides


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_memory_pressure_preempts_and_recomputes(scheduler):
    # chameleon's quotas keep the KV cache within the pool while predictions hold; one that
    # predicts a single token leaves memory preemption as its safety net
    options = {"prior_tokens": 1, "adapter_tokens_per_rank": 0} if scheduler == "chameleon" else {}
    core, _ = make_engine(num_blocks=64, max_model_len=200, scheduler=scheduler, scheduler_options=options)
    requests = make_requests(10, max_tokens=40)
    run_all(core, requests)
    assert core.stats().num_preemptions > 0
    assert any(r.num_preemptions for r in requests)
    assert_no_running_kv(core)


def test_chameleon_quotas_avoid_memory_preemption_when_predictions_hold():
    # the quotas alone: the work-conserving fill, as FIFO, admits whatever fits its first chunk
    core, _ = make_engine(num_blocks=64, max_model_len=200, scheduler="chameleon",
                          scheduler_options={"work_conserving": False})
    run_all(core, make_requests(10, max_tokens=40))  # predicted: min(max_tokens, 128) = 40, exact
    assert core.stats().num_preemptions == 0


def test_chunked_prefill_respects_the_token_budget():
    core, executor = make_engine(max_num_batched_tokens=10)
    run_all(core, [Request("long", list(range(1, 95)), SamplingParams(max_tokens=3))])
    assert all(step.num_tokens <= 10 for step in executor.steps)
    assert sum(1 for step in executor.steps if step.chunks and not step.chunks[0].sample) == 9


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_short_prompt_joins_the_next_step_of_a_long_prefill_under_the_threshold(scheduler):
    """long_prefill_token_threshold: the long prompt takes at most that many tokens a step, so a short one
    arriving during its prefill gets the rest of the next step's budget instead of waiting for all of it.
    Without it (0) the long prefill takes the whole budget every step. The outputs are the same."""
    first_token_step = {}
    for threshold in (0, 32):
        core, executor = make_engine(max_num_batched_tokens=64, long_prefill_token_threshold=threshold,
                                     scheduler=scheduler)
        core.add_request(Request("long", list(range(1, 250)), SamplingParams(max_tokens=2)))
        core.step()
        core.add_request(Request("short", list(range(300, 320)), SamplingParams(max_tokens=2)))
        while core.has_unfinished():
            core.step()
        steps = executor.steps
        assert all(step.num_tokens <= 64 for step in steps)
        assert all(c.num_tokens <= (threshold or 64) for step in steps for c in step.chunks)
        first_token_step[threshold] = next(i for i, step in enumerate(steps)
                                           if any(c.request_id == "short" and c.sample for c in step.chunks))
    assert first_token_step[32] == 1 < first_token_step[0]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_adapter_slots_are_bounded_and_loaded_before_use(scheduler):
    core, executor = make_engine(max_loras=2, scheduler=scheduler, memory_policy="lru-static")
    run_all(core, make_requests(30, seed=3))
    for step in executor.steps:
        assert len({c.adapter_slot for c in step.chunks if c.adapter_slot >= 0}) <= 2
    assert core.stats().adapter_loads_total >= 3


def test_stop_token_and_eos_finish_with_stop():
    core, _ = make_engine()
    probe = Request("probe", [5, 6, 7], SamplingParams(max_tokens=5))
    first = run_all(core, [probe])["probe"][0]
    stop = Request("s", [5, 6, 7], SamplingParams(max_tokens=5, stop_token_ids=(first,)))
    eos = Request("e", [5, 6, 7], SamplingParams(max_tokens=5), eos_token_ids=(first,))
    ignore = Request("i", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True), eos_token_ids=(first,))
    run_all(core, [stop, eos, ignore])
    assert (stop.finish_reason, eos.finish_reason) == (FinishReason.STOP, FinishReason.STOP)
    assert len(stop.output_token_ids) == 1 and len(eos.output_token_ids) == 1
    assert ignore.finish_reason == FinishReason.LENGTH and len(ignore.output_token_ids) == 5


def test_context_length_bounds_generation():
    core, _ = make_engine(max_model_len=20, num_blocks=16)
    request = Request("r", list(range(1, 16)), SamplingParams(max_tokens=100))
    run_all(core, [request])
    assert request.finish_reason == FinishReason.LENGTH and request.num_tokens == 20


def test_bad_requests_are_refused_with_clear_errors():
    core, _ = make_engine(max_model_len=32, num_blocks=16)
    with pytest.raises(InvalidRequestError, match="maximum context length"):
        core.add_request(Request("long", list(range(40)), SamplingParams()))
    with pytest.raises(InvalidRequestError, match="empty"):
        core.add_request(Request("empty", [], SamplingParams()))
    with pytest.raises(NotFoundError):
        core.add_request(Request("x", [1], SamplingParams(), adapter=AdapterId("nope", "sha256:0")))
    with pytest.raises(ConflictError):
        core.add_adapter(ADAPTERS[0])
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=-1)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_abort_frees_everything(scheduler):
    core, _ = make_engine(scheduler=scheduler)
    requests = make_requests(6, max_tokens=50)
    for request in requests:
        core.add_request(request)
    core.step()
    core.step()
    for request in requests:
        core.abort_request(request.request_id)
    assert not core.has_unfinished()
    assert_no_running_kv(core)
    assert all(r.finish_reason == FinishReason.ABORT for r in requests)


def test_unloading_an_adapter_lets_running_requests_finish_and_frees_its_slot():
    core, executor = make_engine(max_loras=2)
    target = ADAPTERS[1]
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=8), adapter=target.id)
    core.add_request(request)
    core.step()
    core.remove_adapter(target.id.name)
    with pytest.raises(NotFoundError):
        core.add_request(Request("late", [1], SamplingParams(), adapter=target.id))
    while core.has_unfinished():
        core.step()
    assert len(request.output_token_ids) == 8
    core.step()  # the eviction is sent with the next step
    assert target.id not in core.memory.resident()
    assert any(step.adapter_evictions for step in executor.steps)


def test_same_name_new_digest_is_a_different_adapter():
    core, executor = make_engine()
    old = ADAPTERS[0]
    run_all(core, [Request("before", [1, 2], SamplingParams(max_tokens=2), adapter=old.id)])
    core.remove_adapter(old.id.name)
    new = AdapterInfo(AdapterId(old.id.name, "sha256:" + "f" * 64), rank=8, size_bytes=1000)
    core.add_adapter(new)
    run_all(core, [Request("after", [1, 2], SamplingParams(max_tokens=2), adapter=new.id)])
    loads = [load.adapter for step in executor.steps for load in step.adapter_loads]
    assert loads == [old.id, new.id]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_unloading_an_adapter_with_queued_requests_still_serves_them(scheduler):
    core, _ = make_engine(max_loras=1, max_num_seqs=1, scheduler=scheduler)
    first, second = ADAPTERS[0], ADAPTERS[1]
    running = Request("running", [1, 2], SamplingParams(max_tokens=4), adapter=first.id)
    queued = Request("queued", [3, 4], SamplingParams(max_tokens=4), adapter=second.id)
    core.add_request(running)
    core.add_request(queued)
    core.step()
    core.remove_adapter(second.id.name)
    while core.has_unfinished():
        core.step()
    assert len(queued.output_token_ids) == 4
