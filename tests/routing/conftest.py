"""A RoutingStore of each kind, with a way to let time pass for heartbeat TTLs."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from loraplex.routing import InMemoryRoutingStore, RoutingStore
from loraplex.util.clock import ManualClock


@dataclass
class StoreUnderTest:
    store: RoutingStore
    kind: str
    wait_until: Callable[[Callable[[], bool]], None]  # lets (virtual or real) time pass until true
    redis_url: str | None = None


def _poll(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.02)


@pytest.fixture(params=["memory", "redis"])
def store_under_test(request: pytest.FixtureRequest) -> Iterator[StoreUnderTest]:
    if request.param == "memory":
        clock = ManualClock(1000.0)

        def advance(condition: Callable[[], bool]) -> None:
            for _ in range(1000):
                if condition():
                    return
                clock.advance(0.1)
            raise AssertionError("condition not reached")

        yield StoreUnderTest(InMemoryRoutingStore("pool", clock), "memory", advance)
        return
    from loraplex.routing.redis_store import RedisRoutingStore

    url = request.getfixturevalue("redis_url")
    store = RedisRoutingStore.from_url(url, "pool", snapshot_every=4)
    yield StoreUnderTest(store, "redis", _poll, url)
    store.close()


@pytest.fixture
def poll() -> Callable[..., None]:
    return _poll
