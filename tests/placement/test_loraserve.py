import math
import random

import pytest
from placement_cases import OP, check_invariants, flat, random_input, server_loads, total_load

from loraplex.placement import PlacementAdapter, PlacementInput, PlacementServer, make_policy
from loraplex.placement.binpack import rank_budgets, round_half_up

# The worked example of the LoRAServe notes §3.7: name -> (rank, demand tokens/s).
EXAMPLE = {"A1": (8, 5200), "A2": (8, 800), "A8": (8, 400), "A3": (16, 720), "A4": (32, 480),
           "A9": (32, 0), "A5": (64, 520), "A6": (128, 1600), "A7": (128, 200)}


def _example(previous=None, servers=("s0", "s1", "s2", "s3")) -> PlacementInput:
    return PlacementInput([PlacementServer(s, 128) for s in servers],
                          [PlacementAdapter(n, "sha256:" + n, r, d) for n, (r, d) in EXAMPLE.items()], OP, previous)


def test_worked_example_of_the_notes():
    inp = _example()
    placement = make_policy("loraserve").place(inp)
    w = placement.weights
    assert placement.stats["target_util"] == pytest.approx(0.7625)
    assert placement.required_servers == 4  # ceil(3.05)
    assert (placement.stats["budget_r8"], placement.stats["budget_r128"], placement.stats["budget_r16"]) == (2, 1, 0)
    assert w["A1"] == pytest.approx({"s0": 0.5865385, "s1": 0.4134615})
    assert w["A6"] == pytest.approx({"s2": 0.953125, "s3": 0.046875})
    assert w["A8"] == pytest.approx({"s1": 0.25, "s3": 0.75})
    for name in ("A2", "A3", "A4", "A5", "A7"):
        assert len(w[name]) == 1
    assert {n for n in w if "s3" in w[n] and n != "A9"} == {"A3", "A4", "A5", "A6", "A7", "A8"}  # the sparse server
    loads = server_loads(inp, w)
    assert all(load == pytest.approx(0.7625) for load in loads.values())


def test_budgets_round_half_up_and_reconcile():
    assert [round_half_up(x) for x in (0.5, 1.5, 2.5, 2.49)] == [1, 2, 3, 2]
    # three ranks each wanting 1.5 servers of 4: rounding asks for 6, two are taken back
    budgets = rank_budgets({8: 1.5, 16: 1.5, 32: 1.0}, 1.0, 4)
    assert sum(budgets.values()) == 4


def test_stable_demand_gives_zero_churn_even_with_relabelled_servers():
    first = make_policy("loraserve").place(_example())
    table = first.to_table(1, 0.0, _example().adapters)
    # the same servers listed in another order: bins must land where they were
    again = make_policy("loraserve").place(_example(table, servers=("s3", "s1", "s0", "s2")))
    assert flat(again.weights) == pytest.approx(flat(first.weights))


def test_dead_server_is_replaced_and_churn_is_limited():
    inp = _example()
    first = make_policy("loraserve").place(inp)
    table = first.to_table(1, 0.0, inp.adapters)
    servers = [PlacementServer("s0", 128), PlacementServer("s1", 128, healthy=False), PlacementServer("s2", 128),
               PlacementServer("s3", 128), PlacementServer("s4", 128)]
    second = make_policy("loraserve").place(PlacementInput(servers, inp.adapters, OP, table))
    assert all("s1" not in routes for routes in second.weights.values())
    # A6's dedicated server keeps it
    assert max(second.weights["A6"], key=second.weights["A6"].get) == "s2"


def test_cold_adapters_stay_where_they_were_and_spread_by_count():
    adapters = [PlacementAdapter(f"c{i}", "sha256:c", 16, 0.0) for i in range(40)]
    servers = [PlacementServer(f"s{i}", 64) for i in range(4)]
    first = make_policy("loraserve").place(PlacementInput(servers, adapters, OP))
    counts = [sum(1 for r in first.weights.values() if s.id in r) for s in servers]
    assert counts == [10, 10, 10, 10]
    assert first.required_servers == 1
    table = first.to_table(1, 0.0, adapters)
    more = [*servers, PlacementServer("s9", 64)]
    second = make_policy("loraserve").place(PlacementInput(more, adapters, OP, table))
    assert second.weights == first.weights


def test_cold_adapter_uses_an_existing_copy():
    adapters = [PlacementAdapter("c", "sha256:c", 16, 0.0, frozenset({"s2"}))]
    servers = [PlacementServer(f"s{i}", 64) for i in range(4)]
    assert make_policy("loraserve").place(PlacementInput(servers, adapters, OP)).weights == {"c": {"s2": 1.0}}


def test_adapters_above_every_max_rank_are_unplaceable():
    adapters = [PlacementAdapter("big", "sha256:b", 128, 100.0), PlacementAdapter("ok", "sha256:o", 8, 100.0)]
    placement = make_policy("loraserve").place(PlacementInput([PlacementServer("s", 64)], adapters, OP))
    assert placement.unplaceable == ("big",)
    assert placement.weights == {"ok": {"s": 1.0}}


def test_hot_adapter_is_split_over_several_servers():
    adapters = [PlacementAdapter("hot", "sha256:h", 8, 10 * 4000.0), PlacementAdapter("x", "sha256:x", 8, 400.0)]
    servers = [PlacementServer(f"s{i}", 128) for i in range(8)]
    placement = make_policy("loraserve").place(PlacementInput(servers, adapters, OP))
    assert len(placement.weights["hot"]) >= 7
    assert math.fsum(placement.weights["hot"].values()) == pytest.approx(1.0)


@pytest.mark.parametrize("seed", range(300))
def test_properties_on_random_inputs(seed):
    rng = random.Random(seed)
    inp = random_input(rng, capabilities=(128,) if seed % 3 else (64, 128))
    policy = make_policy("loraserve")
    try:
        placement = policy.place(inp)
    except Exception as exc:  # heterogeneous capabilities may not hold the bins: that must be explicit
        assert type(exc).__name__ == "PlacementError", exc
        assert seed % 3 == 0
        return
    check_invariants(inp, placement)
    healthy = [s for s in inp.servers if s.healthy]
    placed = [a for a in inp.adapters if a.name in placement.weights]
    total = math.fsum(inp.load(a) for a in placed)
    target = total / len(healthy)
    biggest = max((inp.load(a) for a in placed), default=0.0)
    loads = server_loads(inp, placement.weights)
    assert max(loads.values(), default=0.0) <= target + biggest + 1e-6
    assert math.fsum(loads.values()) == pytest.approx(total, abs=1e-6)
    assert placement.required_servers == max(1 if inp.adapters else 0, math.ceil(total_load(inp) - 1e-6))
    # placing again on the result with the same demand changes nothing
    table = placement.to_table(1, 0.0, inp.adapters)
    again = policy.place(PlacementInput(inp.servers, inp.adapters, inp.operating_points, table))
    assert flat(again.weights) == pytest.approx(
        flat(placement.weights))

