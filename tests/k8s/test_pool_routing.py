"""An AdapterPool's `spec.routing`: the API server takes a good block and refuses an unknown profile;
the pool's placement controller publishes the choice in its routing table (a change is placed at the
next tick, not at the placement interval) and the pool turns Failed/InvalidRouting, publishing
nothing, for a choice the routers could not build."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from loraplex_operator import handlers
from operator_world import NS, World, bump

from loraplex.pool import INVALID_ROUTING, spec_failure
from loraplex.routing.choice import RoutingChoice
from loraplex.spec.crd import AdapterPoolSpec, parse_resource

pytest.importorskip("cel", reason="the CEL rules are checked with the `cel` package (common-expression-language)")

POOL_SPEC = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"},
             "servers": {"minReplicas": 2, "maxReplicas": 2, "gpusPerServer": 0},
             "placement": {"intervalSeconds": 30, "autoscale": False}}
RANK_AWARE = {"profile": "rank-aware", "options": {"slo_tpot_s": "0.05", "latency_profile": "cpu-tiny"}}


def _pool(routing: dict[str, Any] | None) -> dict[str, Any]:
    spec = {**POOL_SPEC, **({"routing": routing} if routing is not None else {})}
    return {"apiVersion": "loraplex.io/v1alpha1", "kind": "AdapterPool", "metadata": {"name": "tiny"}, "spec": spec}


@pytest.mark.parametrize("routing", [RANK_AWARE, {"profile": "least-loaded"}, {"profile": "loraserve", "options": {}}])
def test_the_api_server_takes_a_routing_block(routing, api_server_errors) -> None:
    assert api_server_errors(_pool(routing)) == []
    parse_resource(_pool(routing))


@pytest.mark.parametrize(("routing", "fragment"), [
    ({"profile": "fastest"}, "fastest"),
    ({"options": {"slo_tpot_s": "0.05"}}, "profile"),
    ({"profile": "rank-aware", "options": {"slo_tpot_s": 0.05}}, "0.05"),  # options are strings
])
def test_the_api_server_refuses_an_unknown_profile_or_a_malformed_block(routing, fragment, api_server_errors) -> None:
    errors = api_server_errors(_pool(routing))
    assert any(fragment in e for e in errors), errors


@pytest.mark.parametrize(("routing", "fragment"), [
    ({"profile": "rank-aware", "options": {"slo": "1"}}, "unknown rank-aware options ['slo']"),
    ({"profile": "rank-aware", "options": {"slo_tpot_s": "fast"}}, "is not a number"),
    ({"profile": "fastest"}, "unknown routing profile 'fastest'"),  # got past an older or newer CRD
])
def test_a_choice_the_routers_would_refuse_fails_the_pool(routing, fragment) -> None:
    reason, message = spec_failure(AdapterPoolSpec.model_validate(_pool(routing)["spec"]))
    assert reason == INVALID_ROUTING and message.startswith("routing: ") and fragment in message, message


@pytest.fixture
def world() -> World:
    w = World("http://127.0.0.1:1")
    w.create("AdapterPool", "tiny", copy.deepcopy(POOL_SPEC), "pool-uid")
    w.call(handlers.pool_changed, "AdapterPool", "tiny")
    spec = {"pool": "tiny", "adapter": {"source": "file:///adapters/a", "sha256": "e" * 64, "rank": 8}}
    w.create("LoRADeployment", "a", spec, "a-uid")
    w.call(handlers.adapter_changed, "LoRADeployment", "a")
    for sid in ("tiny-0", "tiny-1"):
        w.heartbeat("tiny", sid)
    w.tick("tiny")
    return w


def _route(world: World, routing: dict[str, Any] | None) -> None:
    """The user edits spec.routing (None: removes it); the pool's next tick runs."""
    obj = world.kube.objects[("AdapterPool", NS, "tiny")]
    obj["spec"].pop("routing", None)
    if routing is not None:
        obj["spec"]["routing"] = routing
    obj["metadata"]["generation"] += 1
    bump(obj)
    world.clock.advance(5)  # a tick, not a placement (every 30 s)
    world.tick("tiny")


def _table(world: World):
    return world.stores["tiny"].read_table()


def test_the_operator_publishes_the_pools_choice_and_its_changes(world: World) -> None:
    before = _table(world)
    assert before.routing is None  # no spec.routing: each router's flags decide
    _route(world, RANK_AWARE)
    table = _table(world)
    assert table.version == before.version + 1 and table.same_routes(before)
    assert table.routing == RoutingChoice("rank-aware", RANK_AWARE["options"])
    _route(world, {"profile": "least-loaded"})
    assert _table(world).routing == RoutingChoice("least-loaded")
    _route(world, None)
    assert _table(world).routing is None
    assert world.status("AdapterPool", "tiny")["phase"] != "Failed"


def test_a_bad_choice_fails_the_pool_and_keeps_the_published_one(world: World) -> None:
    _route(world, {"profile": "least-loaded"})
    published = _table(world)
    _route(world, {"profile": "rank-aware", "options": {"slo_tpot_s": "fast"}})
    assert _table(world) == published
    status = world.status("AdapterPool", "tiny")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert status["phase"] == "Failed" and ready["reason"] == INVALID_ROUTING
    assert "slo_tpot_s='fast' is not a number" in ready["message"]
    assert INVALID_ROUTING in world.events.reasons("tiny")
    _route(world, {"profile": "rank-aware", "options": {"slo_tpot_s": "0.05"}})
    assert world.status("AdapterPool", "tiny")["phase"] != "Failed"
    assert _table(world).routing == RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})
