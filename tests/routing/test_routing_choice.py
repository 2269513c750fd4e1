"""A pool's routing choice: built like the router's flags, carried by the routing table (old tables
without it still load), refused with the reason when it cannot be built."""

from __future__ import annotations

import json
import random

import pytest

from loraplex.routing import RoutingTable, decode_table, encode_table, make_entry
from loraplex.routing.choice import RoutingChoice, build_profile, pool_routing, routing_error
from loraplex.routing.pipeline import PROFILES, make_profile
from loraplex.spec.crd import ROUTING_PROFILES, AdapterPoolSpec

RANK_AWARE = RoutingChoice("rank-aware", {"slo_tpot_s": "0.05", "latency_profile": "cpu-tiny"})


def _table(routing: RoutingChoice | None) -> RoutingTable:
    return RoutingTable(3, 12.5, {"a": make_entry("a", "sha256:aa", 8, [("s1", 1.0)])}, "loraserve", 1,
                        routing=routing)


@pytest.mark.parametrize("routing", [None, RoutingChoice("least-loaded"), RANK_AWARE])
def test_the_table_round_trips_with_and_without_a_routing_choice(routing) -> None:
    table = _table(routing)
    assert decode_table(encode_table(table)) == table


def test_a_table_without_a_choice_is_written_as_before() -> None:
    assert "routing" not in json.loads(encode_table(_table(None)))


def test_a_table_written_before_the_field_existed_still_loads() -> None:
    old = ('{"adapters":{"a":{"digest":"sha256:aa","rank":8,"routes":[["s1",1.0]]}},"created_at":1.0,'
           '"meta":{},"policy":"loraserve","required_servers":1,"version":7}')
    table = decode_table(old)
    assert table.version == 7 and table.routing is None


def test_the_crd_knows_exactly_the_routers_profiles() -> None:
    assert set(ROUTING_PROFILES) == set(PROFILES)


def test_a_choice_builds_the_profile_its_flags_would() -> None:
    built = build_profile(RANK_AWARE, random.Random(0))
    assert [f.name for f in built.filters] == list(PROFILES["rank-aware"].filters)
    assert built.scorers[0][0].config.slo_tpot_s == 0.05
    assert built.scorers[0][0].config.model.name == "cpu-tiny"
    plain = build_profile(RoutingChoice("load-aware"))
    assert [(s.name, w) for s, w in plain.scorers] == [(s.name, w) for s, w in make_profile("load-aware").scorers]


@pytest.mark.parametrize(("choice", "fragment"), [
    (RoutingChoice("fastest"), "unknown routing profile 'fastest'"),
    (RoutingChoice("rank-aware", {"slo": "1"}), "unknown rank-aware options ['slo']"),
    (RoutingChoice("rank-aware", {"slo_tpot_s": "fast"}), "slo_tpot_s='fast' is not a number"),
    (RoutingChoice("rank-aware", {"slo_tpot_s": "-1"}), "slo_tpot_s must be positive"),
    (RoutingChoice("rank-aware", {"latency_profile": "no-such-profile"}), "no-such-profile"),
    (RoutingChoice("loraserve", {"slo_tpot_s": "0.05"}), "routing profile 'loraserve' takes no options"),
])
def test_a_choice_that_cannot_be_built_says_why(choice, fragment) -> None:
    assert fragment in routing_error(choice)
    with pytest.raises(ValueError, match="."):
        build_profile(choice)


def test_good_and_absent_choices_have_no_error() -> None:
    assert routing_error(None) == "" and routing_error(RANK_AWARE) == ""


def test_the_pool_spec_names_its_choice_or_none() -> None:
    base = {"baseModel": {"name": "tiny", "source": "file:///models/tiny"}}
    assert pool_routing(AdapterPoolSpec.model_validate(base)) is None
    spec = AdapterPoolSpec.model_validate({**base, "routing": {"profile": "rank-aware",
                                                               "options": {"slo_tpot_s": "0.05"}}})
    assert pool_routing(spec) == RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"})
    assert pool_routing(AdapterPoolSpec.model_validate({**base, "routing": {"profile": "loraserve"}})) == \
        RoutingChoice("loraserve")
