import math
import random

import pytest
from placement_cases import OP, flat, random_input

from loraplex.placement import PlacementAdapter, PlacementInput, PlacementServer, make_policy


def _servers(n: int = 4) -> list[PlacementServer]:
    return [PlacementServer(f"s{i}", 128) for i in range(n)]


def _adapters(n: int = 10) -> list[PlacementAdapter]:
    return [PlacementAdapter(f"a{i}", "sha256:a", (8, 16, 32, 64, 128)[i % 5], 100.0 * i) for i in range(n)]


def test_replicate_all_puts_everything_everywhere():
    placement = make_policy("replicate-all").place(PlacementInput(_servers(), _adapters(), OP))
    assert all(routes == dict.fromkeys(("s0", "s1", "s2", "s3"), 0.25) for routes in placement.weights.values())


def test_random_is_reproducible_and_static():
    inp = PlacementInput(_servers(), _adapters(50), OP)
    first = make_policy("random", random.Random(7)).place(inp)
    assert first.weights == make_policy("random", random.Random(7)).place(inp).weights
    assert all(len(r) == 1 for r in first.weights.values())
    table = first.to_table(1, 0.0, inp.adapters)
    servers = [*_servers()[:3], PlacementServer("s3", 128, healthy=False)]
    second = make_policy("random", random.Random(99)).place(PlacementInput(servers, inp.adapters, OP, table))
    for name, routes in first.weights.items():
        if "s3" not in routes:
            assert second.weights[name] == routes  # static: only the dead server's adapters move
        else:
            assert "s3" not in second.weights[name]


def test_random_needs_an_injected_rng():
    with pytest.raises(ValueError, match="random.Random"):
        make_policy("random")


def test_contiguous_cuts_rank_sorted_chunks():
    placement = make_policy("contiguous").place(PlacementInput(_servers(), _adapters(20), OP))
    ranks_by_server: dict[str, list[int]] = {}
    for a in _adapters(20):
        (server,) = placement.weights[a.name]
        ranks_by_server.setdefault(server, []).append(a.rank)
    assert [len(ranks_by_server[s]) for s in ("s0", "s1", "s2", "s3")] == [5, 5, 5, 5]
    assert max(ranks_by_server["s0"]) <= min(ranks_by_server["s1"])
    assert min(ranks_by_server["s3"]) == 64


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="loraserve"):
        make_policy("best")


@pytest.mark.parametrize("name", ["replicate-all", "random", "contiguous"])
@pytest.mark.parametrize("seed", range(40))
def test_baseline_invariants(name, seed):
    rng = random.Random(seed)
    inp = random_input(rng)
    placement = make_policy(name, random.Random(seed)).place(inp)
    healthy = {s.id for s in inp.servers if s.healthy}
    assert set(placement.weights) == {a.name for a in inp.adapters}
    for routes in placement.weights.values():
        assert set(routes) <= healthy and math.fsum(routes.values()) == pytest.approx(1.0)
    placement.to_table(1, 0.0, inp.adapters)
    again = make_policy(name, random.Random(seed + 1)).place(
        PlacementInput(inp.servers, inp.adapters, OP, placement.to_table(1, 0.0, inp.adapters)))
    assert flat(again.weights) == pytest.approx(flat(placement.weights))
