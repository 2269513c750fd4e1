"""Adapter slots (a vLLM server's max_cpu_loras): no server is assigned more adapters than it holds,
whatever the policy; what no capable server has a slot for is unplaceable, never squeezed in."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.placement import (
    DEFAULT_CPU,
    PlacementAdapter,
    PlacementInput,
    PlacementServer,
    cap_slots,
    make_policy,
)
from loraplex.placement.controller import build_input
from loraplex.pool import PoolPolicy
from loraplex.routing.demand import DemandWindows
from loraplex.routing.records import AdapterRecord, ServerRecord


def adapters(count: int, rank: int = 8, tps: float = 10.0, min_replicas: int = 1) -> list[PlacementAdapter]:
    return [PlacementAdapter(f"a{i:02d}", f"sha256:{i:064x}", rank, tps * (i + 1), min_replicas=min_replicas)
            for i in range(count)]


def held(weights) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for adapter, routes in weights.items():
        for server in routes:
            out.setdefault(server, set()).add(adapter)
    return out


def test_servers_without_a_limit_are_left_alone():
    inp = PlacementInput([PlacementServer("s0", 64), PlacementServer("s1", 64)], adapters(10), DEFAULT_CPU)
    placement = make_policy("loraserve").place(inp)
    assert cap_slots(placement, inp) is placement


def test_a_full_server_passes_adapters_to_one_with_free_slots():
    servers = [PlacementServer("s0", 64, max_adapters=3), PlacementServer("s1", 64, max_adapters=8)]
    inp = PlacementInput(servers, adapters(9), DEFAULT_CPU)
    placement = cap_slots(make_policy("contiguous").place(inp), inp)  # contiguous: 5 + 4 before the cap
    counts = {s: len(a) for s, a in held(placement.weights).items()}
    assert counts["s0"] <= 3 and counts["s1"] <= 8 and sum(counts.values()) == 9
    assert placement.unplaceable == () and placement.stats["slot_moves"] >= 2


def test_replicas_leave_before_single_copies_move():
    servers = [PlacementServer("s0", 64, max_adapters=2), PlacementServer("s1", 64, max_adapters=4)]
    inp = PlacementInput(servers, adapters(3, min_replicas=2), DEFAULT_CPU)
    placement = cap_slots(make_policy("replicate-all").place(inp), inp)
    assert len(held(placement.weights)["s0"]) == 2
    assert all(abs(sum(r.values()) - 1) < 1e-9 for r in placement.weights.values())
    assert set(placement.weights) == {"a00", "a01", "a02"}  # the one leaving s0 still has s1


def test_what_no_server_has_a_slot_for_is_unplaceable():
    servers = [PlacementServer("s0", 64, max_adapters=2), PlacementServer("s1", 16, max_adapters=5)]
    inp = PlacementInput(servers, adapters(4, rank=32), DEFAULT_CPU)  # only s0 holds rank 32
    placement = PoolPolicy(make_policy("loraserve"), dict).place(inp)
    assert len(placement.weights) == 2 and len(placement.unplaceable) == 2
    assert set(placement.unplaceable) == {"a00", "a01"}  # the coldest leave first
    table = placement.to_table(1, 0.0, inp.adapters)
    assert table.servers() == {"s0"}


def test_the_limit_travels_from_the_heartbeat_to_the_placement():
    records = [ServerRecord("s0", "http://s0", 64, backend="vllm", agent_url="http://s0-agent", max_adapters=4)]
    adapter_records = [AdapterRecord(f"a{i}", f"sha256:{i:064x}", 8, 1, "file:///a") for i in range(3)]
    inp = build_input(records, adapter_records, DemandWindows(10.0, {}), DEFAULT_CPU, None)
    assert inp.servers[0].max_adapters == 4
    assert ServerRecord.from_json(records[0].to_json()) == records[0]
    assert records[0].peer_url == "http://s0-agent" and ServerRecord("s1", "http://s1", 8).peer_url == "http://s1"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.data())
def test_no_server_holds_more_than_its_slots(num_servers, num_adapters, data):
    policy_name = data.draw(st.sampled_from(["loraserve", "replicate-all", "random", "contiguous"]))
    servers = [PlacementServer(f"s{i}", data.draw(st.sampled_from([8, 16, 64])),
                               max_adapters=data.draw(st.integers(0, 12))) for i in range(num_servers)]
    pool = [PlacementAdapter(f"a{i:02d}", f"sha256:{i:064x}", data.draw(st.sampled_from([8, 16, 64])),
                             data.draw(st.floats(0, 500)), min_replicas=data.draw(st.integers(1, 3)))
            for i in range(num_adapters)]
    inp = PlacementInput(servers, pool, DEFAULT_CPU)
    placement = PoolPolicy(make_policy(policy_name, random.Random(0)), dict).place(inp)
    limits = {s.id: s.max_adapters for s in servers}
    for server, names in held(placement.weights).items():
        assert not limits[server] or len(names) <= limits[server]
    ranks = {s.id: s.max_rank for s in servers}
    for a in pool:
        assert (a.name in placement.weights) != (a.name in placement.unplaceable)
        if a.name in placement.weights:
            assert sum(placement.weights[a.name].values()) == pytest.approx(1.0)
            assert all(ranks[s] >= a.rank for s in placement.weights[a.name])
