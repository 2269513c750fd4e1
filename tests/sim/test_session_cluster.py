"""Multi-turn sessions on twin servers behind the real router policy: every turn is played once, and
prefix-aware routing keeps conversations where their KV is."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loraplex.latency.profile import load_profile
from loraplex.placement import OperatingPoints
from loraplex.sim.metrics import trace_duration
from loraplex.sim.session_cluster import (
    SessionClusterConfig,
    place_sessions,
    session_demand,
    session_trace,
    simulate_session_cluster,
    summarize_session_cluster,
)
from loraplex.sim.sessions import SessionSpec, make_sessions

PROFILE = load_profile("whatif-h100-llama8b")
POINTS = OperatingPoints({r: 20000.0 for r in (8, 16, 32, 64, 128)}, "test")


def run(routing: str, **spec):
    workload = make_sessions(SessionSpec(num_adapters=6, num_sessions=30, rate=4.0, think_mean_s=1.0,
                                         max_model_len=4096, seed=3, **spec))
    config = SessionClusterConfig(servers=4, routing=routing, replicas=3, placement="min-cost-flow",
                                  operating_points=POINTS, engine_overrides={"max_lora_rank": 128})
    return workload, simulate_session_cluster(workload, PROFILE, config)


def test_every_turn_is_played_once_in_order() -> None:
    workload, result = run("loraserve")
    assert len(result.turns) == workload.num_turns
    assert {(t.session, t.turn) for t in result.turns} == {(s.index, k) for s in workload.sessions
                                                           for k in range(len(s.turns))}
    assert all(len(result.table.routes(a)) >= 3 for a in workload.adapters)
    assert result.predicted_hit_rate is None


def test_prefix_aware_routing_keeps_conversations_on_their_kv() -> None:
    workload, base = run("loraserve")
    _, ours = run("prefix-aware")
    first = {}
    for t in ours.turns:
        first.setdefault(t.session, t.server)
    stayed = sum(t.server == first[t.session] for t in ours.turns if t.turn > 0)
    later = sum(t.turn > 0 for t in ours.turns)
    assert stayed >= 0.75 * later  # the load ceiling moves some (to servers that often hold the prefix too)
    assert ours.prefix_hit_rate > base.prefix_hit_rate
    assert 0 < ours.predicted_hit_rate <= 1
    assert summarize_session_cluster(ours).ttft_later_mean_s < summarize_session_cluster(base).ttft_later_mean_s


def test_demand_under_a_prefix_profile_leaves_out_the_history_the_index_holds() -> None:
    workload = make_sessions(SessionSpec(num_adapters=3, num_sessions=20, rate=4.0, max_model_len=4096, seed=3))
    trace = session_trace(workload)
    duration = trace_duration(trace)
    every = session_demand(workload, 0, duration)  # no prefix index: prompt + output, as before
    total = sum(r.prompt_len + r.output_len for r in trace.requests) / duration
    assert sum(every.values()) == pytest.approx(total)
    cached = session_demand(workload, 16, duration)
    assert cached.keys() == every.keys() and all(cached[a] < every[a] for a in every)
    # a later turn counts its prompt less the previous turn's prompt in full blocks of 16 tokens
    s = next(s for s in workload.sessions if len(s.turns) >= 2)
    s = replace(s, turns=s.turns[:2])
    one = replace(workload, sessions=[s])
    first = workload.spec.system_prompt_tokens + s.turns[0].user_tokens
    second = first + s.turns[0].output_tokens + s.turns[1].user_tokens
    expected = first + s.turns[0].output_tokens + second - first // 16 * 16 + s.turns[1].output_tokens
    assert session_demand(one, 16, 1.0) == {s.adapter: pytest.approx(expected)}


def test_the_placement_sizes_a_prefix_aware_pool_for_less_demand() -> None:
    workload = make_sessions(SessionSpec(num_adapters=6, num_sessions=60, rate=8.0, max_model_len=4096, seed=3))
    small = OperatingPoints({r: 2000.0 for r in (8, 16, 32, 64, 128)}, "test")

    def estimate(routing: str) -> int:
        config = SessionClusterConfig(1, routing, operating_points=small)
        return place_sessions(workload, PROFILE, config, 128).required_servers

    assert estimate("prefix-aware") < estimate("loraserve")
    assert estimate("prefix-rank-aware") == estimate("prefix-aware")
    assert estimate("rank-aware") == estimate("loraserve")


def test_activated_lora_sessions_are_routed_and_cached_as_the_base_models_conversation(monkeypatch) -> None:
    """`alora_adapters`: the twin's router gets each such turn with the alora flag (its extra slack) and
    the base model's keys before the invocation, as the real router does from the registry record; the
    engines key that history as the base model's, so a later turn hits it even though the previous
    answer was the adapter's."""
    import loraplex.sim.session_cluster as session_cluster

    seen = []

    def spying(*args, **kwargs):
        profile = make_profile(*args, **kwargs)
        pick = profile.pick
        profile.pick = lambda route, candidates: seen.append(route) or pick(route, candidates)
        return profile

    make_profile = session_cluster.make_profile
    monkeypatch.setattr(session_cluster, "make_profile", spying)
    workload, result = run("prefix-aware", alora_adapters=3)
    assert workload.alora == frozenset(list(workload.adapters)[:3])
    assert len(seen) == workload.num_turns
    assert {r.adapter for r in seen if r.alora} == workload.alora
    assert all(r.alora == (r.adapter in workload.alora) for r in seen)
    assert result.prefix_hit_rate > 0 and 0 < result.predicted_hit_rate <= 1
    later = [t for t in result.turns if t.turn > 0 and t.adapter in workload.alora]
    assert later and sum(t.predicted_blocks for t in later) > 0


def test_activated_lora_sessions_carry_the_invocation_in_every_user_message() -> None:
    from loraplex.sim.sessions import INVOCATION_TOKENS, PromptTokens

    plain = make_sessions(SessionSpec(num_adapters=4, num_sessions=20, seed=3))
    mixed = make_sessions(SessionSpec(num_adapters=4, num_sessions=20, seed=3, alora_adapters=2))
    assert [s.adapter for s in plain.sessions] == [s.adapter for s in mixed.sessions]
    for a, b in zip(plain.sessions, mixed.sessions, strict=True):
        extra = INVOCATION_TOKENS if b.adapter in mixed.alora else 0
        assert [t.user_tokens + extra for t in a.turns[:len(b.turns)]] == [t.user_tokens for t in b.turns]
    tokens = PromptTokens(32000)
    first, later = tokens.user(5, 0, 10, invoked=True), tokens.user(5, 1, 10, invoked=True)
    assert first[2:2 + INVOCATION_TOKENS] == tokens.invocation() == later[:INVOCATION_TOKENS]
    assert first[:2] == tokens.user(5, 0, 10)[:2]  # the session's tag still opens it
