import threading

import pytest
import redis

from loraplex.placement import DEFAULT_CPU, PlacementController, make_policy
from loraplex.routing import AdapterRecord, InMemoryRoutingStore, ServerRecord
from loraplex.util.clock import ManualClock

TTL = 5.0


def _server(i: int) -> ServerRecord:
    return ServerRecord(f"s{i}", f"http://127.0.0.1:{9000 + i}", 64)


def _adapter(name: str, rank: int = 8, expected: float = 0.0) -> AdapterRecord:
    return AdapterRecord(name, "sha256:" + name, rank, 1000, f"file:///{name}", expected_tps=expected)


@pytest.fixture
def setup():
    clock = ManualClock(1_000_000.0)
    store = InMemoryRoutingStore("pool", clock)
    for i in range(3):
        store.register_server(_server(i), TTL)
    for name, rank in (("a", 8), ("b", 16), ("c", 32), ("d", 64)):
        store.put_adapter(_adapter(name, rank))
    controller = PlacementController(store, make_policy("loraserve"), clock, interval_s=60, operating_points=DEFAULT_CPU)
    return clock, store, controller


def test_run_once_publishes_then_reports_unchanged(setup):
    clock, store, controller = setup
    report = controller.run_once()
    assert report.outcome == "published" and report.version == 1
    table = store.read_table()
    assert set(table.entries) == {"a", "b", "c", "d"} and table.policy == "loraserve"
    assert table.entries["b"].digest == "sha256:b" and table.entries["b"].rank == 16
    assert controller.run_once().outcome == "unchanged"
    assert store.current_version() == 1


def test_demand_moves_placement(setup):
    clock, store, controller = setup
    controller.run_once()
    for _ in range(6):  # "a" becomes hot: 3 servers' worth of rank-8 tokens
        store.add_demand({"a": int(3 * DEFAULT_CPU.tps(8) * store.window_s)}, clock.now())
        clock.advance(store.window_s)
        for i in range(3):
            store.register_server(_server(i), TTL)
    report = controller.run_once()
    assert report.outcome == "published" and report.required_servers == 3
    assert len(store.read_table().routes("a")) == 3


def test_step_reacts_to_membership_and_interval(setup):
    clock, store, controller = setup
    assert controller.step().outcome == "published"
    assert controller.step() is None  # nothing changed, interval not over
    store.put_adapter(_adapter("e", 8, expected=50.0))
    report = controller.step()
    assert report.outcome == "published" and "e" in store.read_table().entries
    clock.advance(TTL + 1)  # every heartbeat expires except the ones renewed below
    store.register_server(_server(0), TTL)
    store.register_server(_server(2), TTL)
    report = controller.step()
    assert report.outcome == "published"
    assert store.read_table().servers() <= {"s0", "s2"}
    clock.advance(30)
    store.register_server(_server(0), TTL)
    store.register_server(_server(2), TTL)
    assert controller.step() is None
    clock.advance(31)
    store.register_server(_server(0), TTL)
    store.register_server(_server(2), TTL)
    assert controller.step().outcome == "unchanged"  # the interval passed; routes are the same


def test_no_servers_keeps_the_last_table(setup):
    clock, store, controller = setup
    controller.run_once()
    clock.advance(TTL + 1)
    report = controller.run_once()
    assert report.outcome == "no-servers" and store.current_version() == 1


def test_no_adapters_publishes_nothing():
    clock = ManualClock(0.0)
    store = InMemoryRoutingStore("pool", clock)
    store.register_server(_server(0), TTL)
    controller = PlacementController(store, make_policy("replicate-all"), clock, 10, DEFAULT_CPU)
    assert controller.run_once().outcome == "no-adapters" and store.current_version() is None


def test_a_lost_table_is_republished_with_a_newer_version(redis_url):
    from loraplex.routing.redis_store import RedisRoutingStore

    clock = ManualClock(1_000_000.0)
    store = RedisRoutingStore.from_url(redis_url, "pool")
    store.register_server(_server(0), 60)
    store.put_adapter(_adapter("a"))
    controller = PlacementController(store, make_policy("loraserve"), clock, 60, DEFAULT_CPU)
    assert controller.step().version == 1
    client = redis.Redis.from_url(redis_url)
    client.flushall()  # what a Redis restart without persistence leaves
    client.close()
    store.register_server(_server(0), 60)  # agents re-register on their next heartbeat
    store.put_adapter(_adapter("a"))
    report = controller.step()
    assert report.outcome == "published" and report.version == 2 and store.read_table().version == 2
    store.close()


def test_run_forever_places_until_stopped(setup):
    clock, store, controller = setup
    stop = threading.Event()
    thread = threading.Thread(target=controller.run_forever, args=(stop, 0.01))
    thread.start()
    try:
        for _ in range(1000):
            if store.current_version() is not None:
                break
            stop.wait(0.01)
    finally:
        stop.set()
        thread.join()
    assert store.current_version() == 1


def test_interval_must_be_positive(setup):
    _, store, _ = setup
    with pytest.raises(ValueError, match="interval"):
        PlacementController(store, make_policy("loraserve"), ManualClock(), 0, DEFAULT_CPU)


def test_min_replicas_provider_reaches_the_table(setup):
    clock, store, _ = setup
    controller = PlacementController(store, make_policy("loraserve"), clock, interval_s=60,
                                     operating_points=DEFAULT_CPU, min_replicas=lambda: {"a": 3, "b": 2})
    report = controller.run_once()
    table = store.read_table()
    assert [len(table.routes(n)) for n in ("a", "b", "c", "d")] == [3, 2, 1, 1]
    assert report.overloaded == ()
