"""LoRADeployment replica bounds inside the pool's placement: the min through the placement core,
the max by trimming the policy's placement, both in the one table the controller publishes."""

from __future__ import annotations

import pytest

from loraplex.placement import (
    DEFAULT_CPU,
    Placement,
    PlacementAdapter,
    PlacementController,
    PlacementInput,
    PlacementServer,
    make_policy,
)
from loraplex.placement.max_replicas import cap_placement, cap_routes
from loraplex.pool.bounds import ReplicaBounds, replica_bounds
from loraplex.pool.policy import MAX_SERVER_LOAD, PoolPolicy, server_loads
from loraplex.routing import AdapterRecord, InMemoryRoutingStore, ServerRecord
from loraplex.spec.crd import ReplicasSpec
from loraplex.util.clock import ManualClock

D = "sha256:" + "a" * 64


def test_bounds_keep_only_what_differs_from_the_default() -> None:
    bounds = replica_bounds([("a", ReplicasSpec(min=2)), ("b", ReplicasSpec(max=3)), ("c", ReplicasSpec())])
    assert bounds == ReplicaBounds({"a": 2}, {"b": 3})


def test_cap_routes_keeps_the_heaviest_and_renormalises() -> None:
    assert cap_routes({"s0": 0.5, "s1": 0.3, "s2": 0.2}, 2) == pytest.approx({"s0": 0.625, "s1": 0.375})
    assert cap_routes({"s1": 0.5, "s0": 0.5}, 1) == {"s0": 1.0}  # ties by server id
    with pytest.raises(ValueError, match="at least one route"):
        cap_routes({"s0": 1.0}, 0)


def test_cap_placement_touches_only_adapters_over_their_max() -> None:
    placement = Placement("p", {"a": {"s0": 0.5, "s1": 0.5}, "b": {"s0": 0.6, "s1": 0.4}}, 1, ("u",))
    assert cap_placement(placement, {"a": 2}) is placement
    capped = cap_placement(placement, {"b": 1, "missing": 1})
    assert capped.weights == {"a": {"s0": 0.5, "s1": 0.5}, "b": {"s0": 1.0}}
    assert capped.unplaceable == ("u",) and capped.required_servers == 1


def test_pool_policy_caps_and_measures_the_busiest_server() -> None:
    servers = [PlacementServer(f"s{i}", 64) for i in range(3)]
    # 760 tokens/s of rank 16 on CPU operating points (380 tokens/s a server) is two servers' load.
    adapters = [PlacementAdapter("hot", D, 16, 760.0), PlacementAdapter("cold", D, 16)]
    inp = PlacementInput(servers, adapters, DEFAULT_CPU)
    plain = make_policy("loraserve").place(inp)
    assert len(plain.weights["hot"]) > 1
    capped = PoolPolicy(make_policy("loraserve"), lambda: {"hot": 1}).place(inp)
    assert list(capped.weights["hot"].values()) == [1.0]
    assert capped.stats[MAX_SERVER_LOAD] == pytest.approx(2.0)  # all of it on one server: twice its capacity
    assert server_loads(inp, capped.weights)[next(iter(capped.weights["hot"]))] == pytest.approx(2.0)
    assert capped.policy == PoolPolicy(make_policy("loraserve"), dict).name == "loraserve"


def test_controller_publishes_one_version_with_both_bounds() -> None:
    clock = ManualClock(1000.0)
    store = InMemoryRoutingStore("p", clock)
    for i in range(4):
        store.register_server(ServerRecord(f"s{i}", f"http://s{i}", 64, heartbeat_at=clock.now()), ttl_s=60)
    store.put_adapter(AdapterRecord("pinned", D, 16, 10, "s3://b/p"))
    store.put_adapter(AdapterRecord("capped", D, 16, 10, "s3://b/c", expected_tps=1140.0))  # 3 servers' worth
    bounds = ReplicaBounds({"pinned": 3}, {"capped": 2})
    controller = PlacementController(store, PoolPolicy(make_policy("loraserve"), lambda: bounds.maximum), clock,
                                     60, DEFAULT_CPU, min_replicas=lambda: bounds.minimum)
    published: list[int] = []
    store.watch_versions(published.append)
    report = controller.run_once()
    table = store.read_table()
    assert published == [report.version] == [table.version]
    assert len(table.routes("pinned")) == 3 and len(table.routes("capped")) == 2
    assert controller.run_once().outcome == "unchanged" and published == [table.version]
