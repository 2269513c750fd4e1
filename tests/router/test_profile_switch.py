"""The router follows the routing profile its table names (an AdapterPool's spec.routing), over a
real Redis and real HTTP: a table naming another choice switches the profile for the next requests,
one naming none gives the flags' back, and one naming a choice the router cannot build is logged
once while the profile in use goes on routing."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from loraplex_bench.echo_server import EchoServer
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing
from threaded_server import ThreadedServer

from loraplex.routing.choice import RoutingChoice
from loraplex.routing.pipeline import make_profile
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.redis_store import RedisRoutingStore
from loraplex.routing.table import RoutingTable, make_entry

DIGEST = "sha256:" + "0" * 64
# φ all but excludes s1 (LoRAServe's profile practically never picks it); least-loaded ignores φ, and
# with both queues empty it picks either server at random.
WEIGHTS = [("s0", 0.9999), ("s1", 0.0001)]


class Router:
    def __init__(self, redis_url: str, free_port) -> None:
        self.store = RedisRoutingStore.from_url(redis_url, "switch")
        self.echoes = {sid: ThreadedServer(EchoServer(sid), free_port()).start() for sid in ("s0", "s1")}
        for sid, echo in self.echoes.items():
            self.store.register_server(ServerRecord(sid, echo.url, max_rank=64, base_model="base"), ttl_s=600)
        self.store.put_adapter(AdapterRecord("a", DIGEST, 8, 1000, "file:///adapters/a"))
        settings = RouterSettings(profile=make_profile("loraserve", rng=random.Random(0)), profile_name="loraserve",
                                  keys=KeyRing(), poll_interval_s=0.05)
        self.server = ThreadedServer(create_app(self.store, settings), free_port()).start()
        self.version = 0

    def publish(self, routing: RoutingChoice | None) -> None:
        self.version += 1
        entries = {"a": make_entry("a", DIGEST, 8, WEIGHTS)}
        self.store.publish_table(RoutingTable(self.version, time.time(), entries, routing=routing))
        _wait(lambda: httpx.get(self.server.url + "/health").json()["routing_version"] == self.version)

    def profile_line(self) -> str:
        text = httpx.get(self.server.url + "/metrics").text
        return next(line for line in text.splitlines() if line.startswith("loraplex_router_routing_profile_info"))

    def servers_picked(self, n: int = 40) -> Counter[str]:
        picked: Counter[str] = Counter()
        with httpx.Client(base_url=self.server.url) as http:
            for _ in range(n):
                answer = http.post("/v1/completions", json={"model": "a", "prompt": "x", "max_tokens": 1})
                assert answer.status_code == 200, answer.text
                picked[answer.headers["x-loraplex-server"]] += 1
        return picked

    def stop(self) -> None:
        self.server.stop()
        for echo in self.echoes.values():
            echo.stop()
        self.store.close()


def _wait(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _uses(router: Router, profile: str, source: str) -> None:
    _wait(lambda: router.profile_line() == f'loraplex_router_routing_profile_info{{profile="{profile}",'
                                           f'source="{source}"}} 1.0')


@pytest.fixture
def router(redis_url: str, free_port) -> Iterator[Router]:
    made = Router(redis_url, free_port)
    yield made
    made.stop()


def test_the_router_switches_to_the_tables_profile_and_back(router: Router) -> None:
    router.publish(None)
    _uses(router, "loraserve", "flags")
    assert set(router.servers_picked()) == {"s0"}
    router.publish(RoutingChoice("least-loaded"))
    _uses(router, "least-loaded", "table")
    assert set(router.servers_picked()) == {"s0", "s1"}
    router.publish(None)  # spec.routing removed: the flags decide again
    _uses(router, "loraserve", "flags")
    assert set(router.servers_picked()) == {"s0"}


@pytest.mark.parametrize("bad", [RoutingChoice("rank-aware", {"slo_tpot_s": "fast"}), RoutingChoice("fastest")])
def test_a_choice_the_router_cannot_build_keeps_the_profile_in_use(router: Router, bad: RoutingChoice,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    router.publish(RoutingChoice("least-loaded"))
    _uses(router, "least-loaded", "table")
    with caplog.at_level(logging.ERROR, logger="loraplex.router"):
        router.publish(bad)
        router.publish(bad)  # the same choice again: not logged again
        assert set(router.servers_picked()) == {"s0", "s1"}  # still least-loaded, every request served
    refusals = [r.getMessage() for r in caplog.records if "cannot build" in r.getMessage()]
    assert len(refusals) == 1 and bad.profile in refusals[0], refusals
    _uses(router, "least-loaded", "table")
    router.publish(RoutingChoice("rank-aware", {"slo_tpot_s": "0.05"}))  # a good one is taken again
    _uses(router, "rank-aware", "table")
    with caplog.at_level(logging.ERROR, logger="loraplex.router"):
        router.publish(bad)  # refused before, then another one taken: tried (and logged) again
        _wait(lambda: len([r for r in caplog.records if "cannot build" in r.getMessage()]) == 2)
    _uses(router, "rank-aware", "table")
