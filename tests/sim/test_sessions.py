"""Multi-turn chat sessions: the seeded generator, the token ids, and the driver on the twin (each
turn extends the previous prompt with its actual output, after the think time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.latency.profile import load_profile
from loraplex.sim.replay import register_adapters
from loraplex.sim.server import make_sim_engine
from loraplex.sim.sessions import (
    DEFAULT_RANKS,
    PromptTokens,
    SessionSpec,
    make_sessions,
    run_sessions,
    summarize_sessions,
)

SPEC = SessionSpec(num_adapters=20, num_sessions=60, rate=2.0, think_mean_s=1.0, length_scale=0.25,
                   max_model_len=2048, seed=3)


def test_the_generator_is_seeded():
    a, b = make_sessions(SPEC), make_sessions(SPEC)
    assert a == b
    assert make_sessions(replace(SPEC, seed=4)).sessions != a.sessions
    assert len(a.sessions) == 60 and len(a.adapters) == 20
    assert set(a.adapters.values()) <= set(DEFAULT_RANKS)
    arrivals = [s.arrival_s for s in a.sessions]
    assert arrivals == sorted(arrivals) and 15 < arrivals[-1] < 50  # 60 sessions at 2/s


def test_turns_fit_the_context_and_the_first_has_no_think_time():
    workload = make_sessions(replace(SPEC, max_model_len=300, length_scale=1.0, num_sessions=200))
    for session in workload.sessions:
        total = SPEC.system_prompt_tokens + sum(t.user_tokens + t.output_tokens for t in session.turns)
        assert 1 <= len(session.turns) <= SPEC.max_turns and total <= 300
        assert session.turns[0].think_s == 0.0 and session.turns[0].user_tokens >= 2
    turns = [len(s.turns) for s in make_sessions(replace(SPEC, num_sessions=2000, max_model_len=100_000)).sessions]
    assert sum(turns) / len(turns) == pytest.approx(SPEC.mean_turns, rel=0.1)


def test_popularity_follows_zipf():
    workload = make_sessions(replace(SPEC, num_sessions=3000, zipf_s=1.0))
    counts = sorted((sum(s.adapter == name for s in workload.sessions) for name in workload.adapters), reverse=True)
    assert counts[0] / len(workload.sessions) == pytest.approx(1 / sum(1 / i for i in range(1, 21)), rel=0.15)
    assert counts[0] > 5 * counts[-1]


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="rate"):
        SessionSpec(rate=0)


def test_token_ids_are_deterministic_and_sessions_are_tagged_apart():
    tokens = PromptTokens(vocab_size=100, seed=1)
    assert tokens.user(5, 2, 10) == tokens.user(5, 2, 10) != tokens.user(5, 3, 10)
    firsts = {tuple(tokens.user(s, 0, 4)[:2]) for s in range(97 * 97)}
    assert len(firsts) == 97 * 97  # every session opens with its own two tokens
    assert all(3 <= t < 100 for t in tokens.system(0, 50))
    with pytest.raises(ValueError, match="vocabulary"):
        tokens.user(97 * 97, 0, 4)


def run_twin(spec: SessionSpec, policy: str = "unified"):
    profile = load_profile("whatif-h100-llama8b")
    core, clock = make_sim_engine(profile, profile.engine_config(memory_policy=policy, max_lora_rank=128))
    workload = make_sessions(spec)
    register_adapters(core, workload.adapters)

    def jump(t: float) -> None:
        clock.advance(max(0.0, t - clock.now()))

    return workload, run_sessions(core, workload, jump, PromptTokens(32000, seed=spec.seed))


def test_each_turn_extends_the_previous_prompt_with_its_output():
    workload, run = run_twin(SPEC)
    assert len(run.records) == workload.num_turns and all(r.request.is_finished for r in run.records)
    by_turn = {(r.session, r.turn): r for r in run.records}
    tokens = PromptTokens(32000, seed=SPEC.seed)
    for (session, turn), record in by_turn.items():
        request = record.request
        spec_turn = workload.sessions[session].turns[turn]
        assert len(request.output_token_ids) == spec_turn.output_tokens
        assert len(record.token_times) == spec_turn.output_tokens
        if turn == 0:
            assert request.arrival_time - run.origin == pytest.approx(workload.sessions[session].arrival_s)
            continue
        before = by_turn[(session, turn - 1)].request
        new = tokens.user(session, turn, spec_turn.user_tokens)
        assert request.prompt_token_ids == before.prompt_token_ids + before.output_token_ids + new
        assert request.arrival_time == pytest.approx(before.finished_time + spec_turn.think_s)


def test_sessions_of_one_adapter_share_only_the_system_prompt():
    workload, run = run_twin(SPEC)
    firsts = {}
    for record in run.records:
        if record.turn == 0:
            firsts.setdefault(record.adapter, []).append(record.request.prompt_token_ids)
    system = SPEC.system_prompt_tokens
    shared = [p for p in firsts.values() if len(p) > 1]
    assert shared  # some adapter has two sessions
    for prompts in shared:
        assert all(p[:system] == prompts[0][:system] for p in prompts)
        assert len({tuple(p[system:system + 2]) for p in prompts}) == len(prompts)


def test_the_summary_reads_latencies_and_the_memory_stats():
    _, run = run_twin(SPEC)
    summary = summarize_sessions(run)
    assert summary.turns == summary.finished == len(run.records)
    assert 0 < summary.ttft_mean_s <= summary.ttft_p99_s and summary.tbt_p50_s > 0
    assert summary.prefix_hit_rate > 0.3 and summary.prefix_hit_tokens > 0  # later turns reuse their history
    assert summary.invalid_kv_pages == 0 and summary.copied_bytes > 0
    _, no_cache = run_twin(SPEC, "no-cache")
    assert summarize_sessions(no_cache).prefix_hit_rate == 0.0
