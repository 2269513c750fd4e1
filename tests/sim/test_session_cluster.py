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
