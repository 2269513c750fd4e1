"""The single-server twin: the real EngineCore on a virtual clock, timed by a profile."""

from __future__ import annotations

import pytest

from loraplex.engine.config import EngineConfig
from loraplex.latency.features import StepFeatures
from loraplex.latency.profile import Memory, Profile, load_profile
from loraplex.sim.capacity import saturation_rps
from loraplex.sim.fit import fit_latency
from loraplex.sim.metrics import RequestResult, Slo, summarize, tokens_by
from loraplex.sim.server import simulate_server
from loraplex.sim.trace import Trace, TraceRequest
from loraplex.sim.workload import Adapters, Lengths, WorkloadSpec, generate

ENGINE = dict(max_model_len=2048, block_size=16, max_num_seqs=64, max_num_batched_tokens=512,
              max_loras=4, max_lora_rank=64, scheduler="fifo", residency="lru")


def make_profile(**coefficients: float) -> Profile:
    return Profile(name="test", model="m", hardware="h", engine=ENGINE, memory=Memory(kv_tokens_base=32768),
                   coefficients=coefficients or {"intercept": 0.01, "batch": 0.001, "prefill_tokens": 1e-4})


def one(request_id: str, at: float, prompt: int, output: int, adapter: str | None = "a", rank: int = 8) -> TraceRequest:
    return TraceRequest(request_id, at, adapter, rank if adapter else 0, prompt, output)


def test_a_lone_request_is_timed_by_the_profile():
    profile = make_profile(intercept=0.01, batch=0.001, prefill_tokens=1e-4, loads=0.05)
    run = simulate_server(Trace([one("r", 1.0, 100, 5)]), profile)
    [r] = run.results
    prefill = 0.01 + 0.001 + 100 * 1e-4 + 0.05  # includes the adapter's first load
    decode = 0.01 + 0.001
    assert r.ttft_s == pytest.approx(prefill)
    assert r.e2e_s == pytest.approx(prefill + 4 * decode)
    assert r.generated == 5 and r.arrival_s == 1.0
    assert run.stats.adapter_loads_total == 1


def test_the_executor_applies_every_term_of_the_profile():
    from loraplex.engine.messages import AdapterLoad, ScheduledChunk, SchedulerOutput
    from loraplex.engine.output.sampling import SamplingParams
    from loraplex.latency.features import FEATURES
    from loraplex.sim.executor import SimExecutor
    from loraplex.spec.adapter import AdapterId
    from loraplex.util.clock import ManualClock

    profile = make_profile(**{name: (i + 1) * 1e-4 for i, name in enumerate(FEATURES)})
    clock = ManualClock()
    executor = SimExecutor(profile, clock)
    chunk = ScheduledChunk("a", [1] * 30, 5, [0, 1, 2], 0, True, SamplingParams())
    decode = ScheduledChunk("b", [1], 40, [3, 4, 5], 1, False, SamplingParams(), num_output_tokens=3)
    output = SchedulerOutput([chunk, decode], [AdapterLoad(0, AdapterId("x", "d"), 16), AdapterLoad(1, AdapterId("y", "d"), 8)])
    result = executor.execute(output)
    features = executor.slots.features(output)
    assert features.prefill_context == 30 * 5  # the prompt chunk's rows over the 5 positions before it
    expected = profile.step_seconds(features)
    assert result.elapsed_s == pytest.approx(expected) and clock.now() == pytest.approx(expected)
    assert set(result.sampled) == {"a"}


def test_chunked_prefill_and_batching_come_from_the_real_scheduler():
    profile = make_profile(intercept=0.01, prefill_tokens=1e-4)
    run = simulate_server(Trace([one("long", 0.0, 1200, 2), one("short", 0.0, 10, 2, adapter=None)]), profile)
    by_id = {r.request_id: r for r in run.results}
    # 1200 tokens at a 512-token budget: three steps before the first token (512, 512, 176 + short's 10)
    assert by_id["long"].ttft_s == pytest.approx(3 * 0.01 + 1210 * 1e-4)
    assert by_id["short"].ttft_s == pytest.approx(by_id["long"].ttft_s)


def test_adapter_slots_limit_what_runs_together():
    profile = make_profile(intercept=0.01, loads=0.1)
    config = profile.engine_config(max_loras=1)
    trace = Trace([one("x", 0.0, 10, 3, "a"), one("y", 0.0, 10, 3, "b", 16)])
    run = simulate_server(trace, profile, config)
    by_id = {r.request_id: r for r in run.results}
    assert by_id["y"].ttft_s > by_id["x"].e2e_s  # b waits for a's slot
    assert run.stats.adapter_loads_total == 2


def test_overload_starves_and_light_load_does_not():
    profile = make_profile()
    spec = WorkloadSpec(duration_s=60, rps=2, lengths=Lengths(profile="fixed", prompt_len=64, output_len=32),
                        adapters=Adapters(count=8))
    light = simulate_server(generate(spec), profile, slo=Slo(ttft_s=0.5)).summary
    heavy = simulate_server(generate(spec.model_copy(update={"rps": 200})), profile, horizon_s=90).summary
    assert not light.starved and light.slo_attainment > 0.95
    assert light.throughput_tokens_per_s == pytest.approx(light.offered_tokens_per_s, rel=0.1)
    assert heavy.starved and heavy.finished < heavy.requests


def test_saturation_rate_is_between_light_and_heavy():
    profile = make_profile()
    spec = WorkloadSpec(duration_s=30, lengths=Lengths(profile="fixed", prompt_len=64, output_len=32),
                        adapters=Adapters(count=4))
    rps = saturation_rps(profile, lambda r: generate(spec.model_copy(update={"rps": r})))
    assert 2 < rps < 200


def test_the_fit_recovers_known_coefficients():
    truth = {"intercept": 0.005, "batch": 2e-4, "adapters": 1e-3, "prefill_tokens": 3e-5, "loads": 0.02}
    profile = make_profile(**truth)
    samples = []
    for batch in (1, 2, 4, 8, 16, 32):
        for adapters in (0, 1, 4):
            for tokens in (0, 16, 256):
                f = StepFeatures(batch=batch, adapters=min(adapters, batch), prefill_tokens=tokens, loads=adapters % 2)
                samples.append((f, profile.step_seconds(f)))
    coefficients, report = fit_latency(samples)
    assert report.r2 > 0.999
    for name, value in truth.items():
        assert coefficients[name] == pytest.approx(value, rel=1e-6)


def test_a_scaled_profile_is_the_same_model_on_a_slower_machine():
    profile = make_profile(intercept=0.005, batch=2e-4, prefill_tokens=3e-5)
    features = StepFeatures(batch=4, prefill_tokens=100)
    assert profile.scaled(1.1).step_seconds(features) == pytest.approx(1.1 * profile.step_seconds(features))
    assert profile.coefficients["batch"] == 2e-4  # the original is left alone
    with pytest.raises(ValueError, match="must be positive"):
        profile.scaled(0.0)


def test_profiles_are_versioned_and_validated(tmp_path):
    profile = make_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path) == profile
    path.write_text(path.read_text().replace('"profile_version": 1', '"profile_version": 9'))
    with pytest.raises(ValueError, match="profile_version 9 is not supported"):
        load_profile(path)
    with pytest.raises(FileNotFoundError, match="neither a file nor one of"):
        load_profile("no-such-profile")
    with pytest.raises(ValueError, match="unknown latency terms"):
        make_profile(warp_speed=1.0)


def test_shipped_cpu_profile_loads():
    profile = load_profile("cpu-tiny")
    assert profile.fit is not None and profile.fit.samples > 100
    assert isinstance(profile.engine_config(), EngineConfig)


def test_starvation_is_judged_within_the_arrival_window():
    # 10 s of arrivals, one request a second; each takes 100 prompt tokens and 50 output tokens at
    # 0.1 s per token, so the last replies drain 5 s past the window: not starvation.
    results = [RequestResult(f"r{i}", None, float(i), 100, 50, 50, ttft_s=0.1, e2e_s=0.1 + 49 * 0.1, tpot_s=0.1)
               for i in range(10)]
    summary = summarize(results, duration_s=10.0, elapsed_s=14.9)
    assert summary.throughput_tokens_per_s < 0.9 * summary.offered_tokens_per_s  # drain included
    assert not summary.starved
    assert tokens_by(results[9], 10.0) == pytest.approx(100 + 1 + 0.9 / 0.1)
    # the same requests served ten times slower fall behind within the window: starvation
    slow = [RequestResult(r.request_id, None, r.arrival_s, 100, 50, 50, ttft_s=1.0, e2e_s=1.0 + 49, tpot_s=1.0)
            for r in results]
    assert summarize(slow, duration_s=10.0, elapsed_s=59.0).starved
