"""Pools whose servers have different max ranks: no policy may fail while some healthy server can
hold each adapter; loraserve overflows (and reports overload) only when the servers able to hold a
rank are all full."""

import math
import random

import pytest
from placement_cases import OP, flat, random_input, server_loads

from loraplex.placement import PlacementAdapter, PlacementInput, PlacementServer, make_policy

MIXES = ((8, 16, 32, 64, 128), (64, 128), (16, 128), (32, 64))


def _check_routes(inp: PlacementInput, placement) -> None:
    healthy = {s.id: s for s in inp.servers if s.healthy}
    top = max(s.max_rank for s in healthy.values())
    by_name = {a.name: a for a in inp.adapters}
    assert set(placement.unplaceable) == {a.name for a in inp.adapters if a.rank > top}
    assert set(placement.weights) == {a.name for a in inp.adapters if a.rank <= top}
    for name, routes in placement.weights.items():
        assert routes and math.fsum(routes.values()) == pytest.approx(1.0)
        for server, phi in routes.items():
            assert phi > 0 and healthy[server].max_rank >= by_name[name].rank
    placement.to_table(1, 0.0, inp.adapters)


@pytest.mark.parametrize("seed", range(200))
def test_loraserve_never_fails_and_overloads_only_when_capable_servers_are_full(seed):
    rng = random.Random(seed)
    inp = random_input(rng, capabilities=MIXES[seed % len(MIXES)])
    policy = make_policy("loraserve", hysteresis=(0.0, 0.1)[seed % 2])
    placement = policy.place(inp)
    _check_routes(inp, placement)
    target = placement.stats["target_util"]
    limit = target * (1 + policy.hysteresis)
    loads = server_loads(inp, placement.weights)
    healthy = [s for s in inp.servers if s.healthy]
    assert {s for s, load in loads.items() if load > limit + 1e-6} <= set(placement.overloaded)
    by_name = {a.name: a for a in inp.adapters}
    for server in placement.overloaded:
        assert loads[server] > limit - 1e-6
        # every adapter left on an overloaded server had nowhere else to go
        for name, routes in placement.weights.items():
            if server in routes and inp.load(by_name[name]) > 0:
                capable = [s.id for s in healthy if s.max_rank >= by_name[name].rank]
                assert all(loads.get(s, 0.0) >= limit - 1e-6 for s in capable)
    # stable demand: placing again changes nothing
    again = policy.place(PlacementInput(inp.servers, inp.adapters, OP, placement.to_table(1, 0.0, inp.adapters)))
    assert flat(again.weights) == pytest.approx(flat(placement.weights))


def test_the_issue_inputs_all_place():
    """The issue: 17 of 100 random inputs with mixed max ranks raised PlacementError."""
    for seed in range(100):
        inp = random_input(random.Random(seed), capabilities=(8, 16, 32, 64, 128))
        for hysteresis in (0.0, 0.1):
            _check_routes(inp, make_policy("loraserve", hysteresis=hysteresis).place(inp))


def test_high_ranks_use_the_high_rank_servers_and_low_ranks_the_others():
    servers = [PlacementServer("big", 128), PlacementServer("small-0", 16), PlacementServer("small-1", 16)]
    adapters = [PlacementAdapter("r128", "sha256:a", 128, 2000.0),        # u = 1.0
                *(PlacementAdapter(f"r8-{i}", "sha256:b", 8, 2000.0) for i in range(4))]  # u = 0.5 each
    placement = make_policy("loraserve").place(PlacementInput(servers, adapters, OP))
    assert placement.weights["r128"] == {"big": 1.0}
    assert not placement.overloaded
    loads = server_loads(PlacementInput(servers, adapters, OP), placement.weights)
    assert loads == pytest.approx({"big": 1.0, "small-0": 1.0, "small-1": 1.0})


def test_too_few_high_rank_servers_is_overload_not_failure():
    servers = [PlacementServer("big", 128), *(PlacementServer(f"small-{i}", 8) for i in range(3))]
    adapters = [PlacementAdapter(f"r128-{i}", "sha256:a", 128, 2000.0) for i in range(3)]
    adapters.append(PlacementAdapter("r8", "sha256:b", 8, 4000.0))
    placement = make_policy("loraserve").place(PlacementInput(servers, adapters, OP))
    assert placement.overloaded == ("big",)
    assert all(placement.weights[f"r128-{i}"] == pytest.approx({"big": 1.0}) for i in range(3))
    assert set(placement.weights["r8"]) <= {"small-0", "small-1", "small-2"}


def test_adapter_above_every_healthy_max_rank_is_unplaceable_not_fatal():
    servers = [PlacementServer("big", 128, healthy=False), PlacementServer("s0", 32), PlacementServer("s1", 64)]
    adapters = [PlacementAdapter("huge", "sha256:h", 128, 500.0), PlacementAdapter("mid", "sha256:m", 64, 500.0),
                PlacementAdapter("low", "sha256:l", 8, 500.0)]
    for name in ("loraserve", "replicate-all", "random", "contiguous"):
        placement = make_policy(name, random.Random(0)).place(PlacementInput(servers, adapters, OP))
        assert placement.unplaceable == ("huge",), name
        assert set(placement.weights["mid"]) == {"s1"}, name
        assert set(placement.weights) == {"mid", "low"}, name


@pytest.mark.parametrize("name", ["replicate-all", "random", "contiguous"])
@pytest.mark.parametrize("seed", range(30))
def test_baselines_never_fail_on_mixed_max_ranks(name, seed):
    inp = random_input(random.Random(seed), capabilities=MIXES[seed % len(MIXES)])
    _check_routes(inp, make_policy(name, random.Random(seed)).place(inp))
