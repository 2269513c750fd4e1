"""The behaviour every RoutingStore shares, run against the in-memory store and a real redis-server."""

import threading

import pytest
import redis
from routing_tables import partial_table

from loraplex.routing import (
    AdapterRecord,
    PoolKeys,
    Route,
    RoutingTable,
    RoutingTableError,
    ServerRecord,
    StaleVersionError,
    TableEntry,
    make_entry,
)


def _table(version: int, adapters: int = 3) -> RoutingTable:
    entries = {f"a{i}": make_entry(f"a{i}", f"sha256:{version}", 8, [("s1", 1.0)]) for i in range(adapters)}
    return RoutingTable(version, float(version), entries, "test")


def _adapter(name: str, rank: int = 8) -> AdapterRecord:
    return AdapterRecord(name, "sha256:" + name, rank, 1000, f"file:///adapters/{name}")


def test_publish_read_and_versions(store_under_test):
    store = store_under_test.store
    assert store.current_version() is None and store.read_table() is None
    store.publish_table(_table(1, adapters=10))
    second = RoutingTable(2, 2.0, {**_table(1, adapters=10).entries, "a0": _table(2, adapters=1).entries["a0"]})
    store.publish_table(second)
    assert store.current_version() == 2
    assert store.read_table() == second
    assert store.read_table(1) == _table(1, adapters=10)  # a superseded version stays readable a while
    assert store.read_table(3) is None
    for stale in (2, 1):
        with pytest.raises(StaleVersionError):
            store.publish_table(_table(stale))


def test_invalid_table_is_never_published(store_under_test):
    store = store_under_test.store
    half = TableEntry("a", "sha256:a", 8, (Route("s1", 0.5),))
    with pytest.raises(RoutingTableError):
        store.publish_table(RoutingTable(1, 0.0, {"a": half}))
    assert store.current_version() is None
    store.publish_table(_table(1))
    with pytest.raises(RoutingTableError):  # a change that breaks the table (in Redis: an invalid delta)
        store.publish_table(RoutingTable(2, 0.0, {**_table(1).entries, "a": half}))
    assert store.current_version() == 1 and store.read_table() == _table(1)


def test_announcements_reach_watchers(store_under_test, poll):
    store, seen = store_under_test.store, []
    subscription = store.watch_versions(seen.append)
    try:
        if store_under_test.redis_url:  # the subscriber thread subscribes asynchronously
            client = redis.Redis.from_url(store_under_test.redis_url)
            channel = PoolKeys("pool").versions_channel
            poll(lambda: client.pubsub_numsub(channel)[0][1] == 1)
            client.close()
        for version in (1, 2, 3):
            store.publish_table(_table(version))
        poll(lambda: seen == [1, 2, 3])
    finally:
        subscription.close()


def test_heartbeats_expire_and_renew(store_under_test):
    store = store_under_test.store
    store.register_server(ServerRecord("s1", "http://127.0.0.1:1", 64), ttl_s=0.5)
    store.register_server(ServerRecord("s2", "http://127.0.0.1:2", 64), ttl_s=60)
    assert [s.id for s in store.healthy_servers()] == ["s1", "s2"]
    store_under_test.wait_until(lambda: [s.id for s in store.healthy_servers()] == ["s2"])
    store.register_server(ServerRecord("s1", "http://127.0.0.1:1", 64), ttl_s=60)  # comes back
    assert [s.id for s in store.healthy_servers()] == ["s1", "s2"]
    store.deregister_server("s2")
    assert [s.id for s in store.healthy_servers()] == ["s1"]


def test_adapter_registry_and_locations(store_under_test):
    store = store_under_test.store
    store.put_adapter(_adapter("b", 16))
    store.put_adapter(_adapter("a"))
    store.add_location("a", "s1")
    store.add_location("a", "s2")
    store.put_adapter(_adapter("a", 32))  # replacing the record keeps its locations
    assert [(r.name, r.rank, r.locations) for r in store.adapters()] == [
        ("a", 32, frozenset({"s1", "s2"})), ("b", 16, frozenset())]
    assert store.adapters(["b", "a", "missing", "a"]) == store.adapters()  # only these: one read
    assert [(r.name, r.locations) for r in store.adapters(["a"])] == [("a", frozenset({"s1", "s2"}))]
    assert store.adapters([]) == []
    assert store.remove_location("a", "s1") is True
    assert store.remove_location("a", "s2") is False  # the last copy stays
    assert store.get_adapter("a").locations == frozenset({"s2"})
    store.remove_adapter("a")
    assert store.get_adapter("a") is None and [r.name for r in store.adapters()] == ["b"]


def test_demand_windows_sum_complete_windows(store_under_test):
    store = store_under_test.store
    width = store.window_s
    base = 1_000_000 * width  # the start of a window
    store.add_demand({"a": 100, "b": 5}, base + 1)
    store.add_demand({"a": 50}, base + width - 0.01)
    store.add_demand({"a": 30}, base + 2 * width + 0.5)
    store.add_demand({"a": 999}, base + 3 * width + 0.5)  # the current window: not complete yet
    windows = store.demand_windows(base + 3 * width + 1, 3)
    assert windows.rates["a"] == pytest.approx((150 / width, 0.0, 30 / width))
    assert windows.rates["b"] == pytest.approx((5 / width, 0.0, 0.0))


@pytest.mark.parametrize("change", ["every-entry", "a-tenth"])
def test_concurrent_readers_never_see_a_partial_table(store_under_test, change):
    """Versions that change every entry (in Redis: snapshots) or a tenth of them (deltas)."""
    store, errors, seen = store_under_test.store, [], set()
    make = _table if change == "every-entry" else partial_table
    tables = {v: make(v, 2000) for v in range(1, 21)}
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            table = store.read_table()
            if table is None:
                continue
            seen.add(table.version)
            if table != tables[table.version]:
                errors.append(table.version)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for version in range(1, 21):
            store.publish_table(tables[version])
    finally:
        stop.set()
        for r in readers:
            r.join()
    assert not errors
    assert seen  # the readers did read while versions were being swapped
