"""A router in front of echo servers, all real HTTP servers on 127.0.0.1, over the in-process store."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from loraplex_bench.echo_server import EchoServer
from loraplex_router.app import RouterSettings, create_app
from loraplex_router.auth import KeyRing
from loraplex_router.extproc.server import ExtProcConfig, picker_service
from threaded_server import ThreadedServer

from loraplex.routing.memory_store import InMemoryRoutingStore
from loraplex.routing.outliers import OutlierConfig
from loraplex.routing.pipeline import make_profile
from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.store import RoutingStore
from loraplex.routing.table import RoutingTable, make_entry
from loraplex.util.clock import MonotonicClock

BASE = "tiny-base"
DIGEST = "sha256:" + "0" * 64


@dataclass
class RouterEnv:
    store: RoutingStore
    router: ThreadedServer
    echoes: dict[str, ThreadedServer]
    app: object
    version: int = 0
    extra: list[ThreadedServer] = field(default_factory=list)

    def publish(self, weights: dict[str, dict[str, float]]) -> int:
        """Publish a table {adapter: {server: φ}} and wait until the router uses it."""
        self.version += 1
        entries = {a: make_entry(a, DIGEST, 8, w.items()) for a, w in weights.items()}
        self.store.publish_table(RoutingTable(self.version, time.time(), entries))
        wait_for(lambda: httpx.get(self.router.url + "/health").json()["routing_version"] == self.version)
        return self.version

    wait_for = staticmethod(lambda condition, timeout_s=30.0: wait_for(condition, timeout_s))

    def register(self, server_id: str, url: str) -> None:
        self.store.register_server(ServerRecord(server_id, url, max_rank=64, base_model=BASE), ttl_s=600)


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def make_env(free_port, keys: KeyRing | None = None, num_echoes: int = 3, seed: int = 0,
             profile: str = "loraserve", block_size: int = 0, store: RoutingStore | None = None,
             extproc: ExtProcConfig | None = None) -> RouterEnv:
    """`block_size`: the KV block size the servers report; `store`: the in-process one unless given;
    `extproc`: also serve the endpoint picker."""
    store = store or InMemoryRoutingStore("test", MonotonicClock(), window_s=1.0)
    echoes = {f"s{i}": ThreadedServer(EchoServer(f"s{i}"), free_port()).start() for i in range(num_echoes)}
    for sid, server in echoes.items():
        store.register_server(ServerRecord(sid, server.url, max_rank=64, base_model=BASE, block_size=block_size),
                              ttl_s=600)
    for name in ("a", "b", "c"):
        store.put_adapter(AdapterRecord(name, DIGEST, 8, 1000, f"file:///adapters/{name}"))
    settings = RouterSettings(profile=make_profile(profile, rng=random.Random(seed)), profile_name=profile,
                              keys=keys or KeyRing(), poll_interval_s=0.05, outliers=OutlierConfig(base_ejection_s=60))
    services = [picker_service(extproc, settings.keys, settings.poll_interval_s)] if extproc else []
    app = create_app(store, settings, services)
    router = ThreadedServer(app, free_port()).start()
    env = RouterEnv(store, router, echoes, app)
    env.publish({"a": {"s0": 1.0}, "b": {"s0": 0.2, "s1": 0.3, "s2": 0.5}, "c": {"s1": 0.5, "s2": 0.5}})
    return env


def stop_env(env: RouterEnv) -> None:
    env.router.stop()
    for server in [*env.echoes.values(), *env.extra]:
        server.stop()


@pytest.fixture(scope="session")
def wait():
    """`wait(condition, timeout_s=30.0)`: polls until the condition holds, else fails the test."""
    return wait_for


@pytest.fixture
def router_env(free_port) -> Iterator[RouterEnv]:
    env = make_env(free_port)
    yield env
    stop_env(env)


@pytest.fixture
def make_router_env(free_port):
    """A factory: make_router_env(keys=KeyRing(...)) -> RouterEnv, stopped after the test."""
    envs: list[RouterEnv] = []

    def make(**kwargs) -> RouterEnv:
        envs.append(make_env(free_port, **kwargs))
        return envs[-1]

    yield make
    for env in envs:
        stop_env(env)
