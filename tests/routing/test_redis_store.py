"""Redis-specific behaviour: the key layout on the server, the table as a snapshot and deltas, outages."""

import threading

import pytest
import redis
from routing_tables import partial_table

from loraplex.routing import (
    AdapterRecord,
    PoolKeys,
    RoutingTable,
    ServerRecord,
    StaleVersionError,
    StoreUnavailableError,
    decode_table,
    make_entry,
)
from loraplex.routing.redis_store import RedisRoutingStore


def _table(version: int) -> RoutingTable:
    return RoutingTable(version, 0.0, {"a": make_entry("a", "sha256:a", 8, [("s1", 1.0)])})


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url, decode_responses=True)
    yield c
    c.close()


def _writer(redis_url: str, last: int, **settings) -> RedisRoutingStore:
    """A writer of pool p1 that has published partial_table(1) to partial_table(last)."""
    writer = RedisRoutingStore.from_url(redis_url, "p1", **settings)
    for version in range(1, last + 1):
        writer.publish_table(partial_table(version))
    return writer


def _versions(client, keys) -> list[int]:
    return [int(score) for _, score in client.zrange(keys.deltas, 0, -1, withscores=True)]


def test_a_small_change_is_a_delta_that_readers_apply(redis_url, client):
    writer, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    keys = PoolKeys("p1")
    writer.publish_table(partial_table(1))
    first = reader.read_table()
    snapshot = client.get(keys.snapshot)
    writer.publish_table(partial_table(2))
    assert client.get(keys.snapshot) == snapshot and client.hget(keys.table_log, "snapshot") == "1"
    assert _versions(client, keys) == [2] and client.get(keys.current_version) == "2"
    assert len(client.zrange(keys.deltas, 0, -1)[0]) < len(snapshot) / 5
    second = reader.read_table()
    assert second == partial_table(2)
    assert second.entries["a0"] is first.entries["a0"]  # applied to the table it held, not re-read
    for store in (writer, reader):
        store.close()


def test_the_writer_compacts_every_k_versions_and_keeps_one_period_of_deltas(redis_url, client):
    writer, keys = _writer(redis_url, 10, snapshot_every=4), PoolKeys("p1")
    assert client.hget(keys.table_log, "snapshot") == "9"  # snapshots at 1, 5 and 9
    assert _versions(client, keys) == [6, 7, 8, 9, 10]
    assert decode_table(client.get(keys.snapshot)) == partial_table(9)
    fresh = RedisRoutingStore.from_url(redis_url, "p1")
    assert fresh.read_table() == partial_table(10) and fresh.read_table(9) == partial_table(9)
    assert fresh.read_table(8) is None  # older than the snapshot
    writer.close()
    fresh.close()


def test_the_delta_log_is_bounded_by_bytes(redis_url, client):
    writer, keys = _writer(redis_url, 7, max_log_ratio=0.25), PoolKeys("p1")
    snapshot_size = len(client.get(keys.snapshot))
    assert sum(len(d) for d in client.zrange(keys.deltas, 0, -1)) <= 3 * 0.25 * snapshot_size
    assert int(client.hget(keys.table_log, "snapshot")) > 1
    moved = RoutingTable(8, 8.0, {name: make_entry(name, e.digest, 8, [("s99", 1.0)])
                                  for name, e in partial_table(7).entries.items()})
    writer.publish_table(moved)  # every entry changed: no delta, a snapshot
    assert client.hget(keys.table_log, "snapshot") == "8" and 8 not in _versions(client, keys)
    assert RedisRoutingStore.from_url(redis_url, "p1").read_table() == moved
    writer.close()


def test_readers_behind_catch_up_by_deltas_or_by_the_snapshot(redis_url):
    writer = RedisRoutingStore.from_url(redis_url, "p1", snapshot_every=4)
    near, far = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    writer.publish_table(partial_table(1))
    far.read_table()
    for version in range(2, 7):
        writer.publish_table(partial_table(version))
    held = near.read_table()
    for version in range(7, 11):
        writer.publish_table(partial_table(version))
    caught_up = near.read_table()  # deltas 7..10 are in the log
    assert caught_up == partial_table(10) and caught_up.entries["a1"] is held.entries["a1"]
    assert far.read_table() == partial_table(10)  # the deltas after 1 were compacted away: the snapshot
    for store in (writer, near, far):
        store.close()


def test_writers_that_alternate_diff_against_the_current_version(redis_url):
    one, two, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(3))
    one.publish_table(partial_table(1))
    reader.read_table()
    two.publish_table(partial_table(2))  # two has read nothing: it reads version 1 to diff against it
    one.publish_table(partial_table(3))  # one's last table is 1: it reads 2 first
    assert reader.read_table() == partial_table(3)
    for store in (one, two, reader):
        store.close()


def test_racing_writers_lose_with_stale_version_and_the_chain_holds(redis_url):
    writers = [RedisRoutingStore.from_url(redis_url, "p1", snapshot_every=5) for _ in range(3)]
    writers[0].publish_table(partial_table(1))
    stale, published = [0], []

    def write(store: RedisRoutingStore) -> None:
        for _ in range(15):
            version = store.current_version() + 1
            try:
                store.publish_table(partial_table(version))
                published.append(version)
            except StaleVersionError:
                stale[0] += 1

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(published) == len(set(published))  # no version was published twice
    last = max(published)
    assert RedisRoutingStore.from_url(redis_url, "p1").read_table() == partial_table(last)
    for store in writers:
        assert store.read_table() == partial_table(last)
        store.close()


def test_after_a_redis_restart_readers_and_the_writer_start_over(redis_url, client):
    writer, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    for version in (1, 2, 3):
        writer.publish_table(partial_table(version))
    assert reader.read_table() == partial_table(3)
    client.flushall()  # what a restart without persistence leaves
    assert reader.read_table() is None and reader.current_version() is None
    writer.publish_table(partial_table(5))  # the controller republishes above its last version
    assert client.hget(PoolKeys("p1").table_log, "snapshot") == "5"
    writer.publish_table(partial_table(6))
    assert reader.read_table() == partial_table(6)
    for store in (writer, reader):
        store.close()


def test_a_version_number_reused_after_a_restart_is_a_new_chain(redis_url, client):
    one, two, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(3))
    for version in (1, 2, 3):
        one.publish_table(partial_table(version))
    assert reader.read_table() == partial_table(3)
    client.flushall()
    other = RoutingTable(3, 3.0, {"x": make_entry("x", "sha256:x", 8, [("s1", 1.0)])})
    two.publish_table(other)  # the same number, another table: a new epoch
    assert reader.read_table() == other
    one.publish_table(partial_table(4))  # one diffs against the table now at 3, not its own
    assert reader.read_table() == partial_table(4) == RedisRoutingStore.from_url(redis_url, "p1").read_table()
    for store in (one, two, reader):
        store.close()


def test_a_malformed_delta_is_not_served(redis_url, client):
    writer, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    keys = PoolKeys("p1")
    writer.publish_table(partial_table(1))
    assert reader.read_table() == partial_table(1)
    client.zadd(keys.deltas, {"{not json": 2})
    client.set(keys.current_version, 2)
    assert reader.read_table() is None  # the router keeps the table it has
    writer.publish_table(_table(3))  # a whole new table: a snapshot, the log starts over
    assert reader.read_table() == _table(3)
    for store in (writer, reader):
        store.close()


def test_registry_and_locations_are_two_hashes(redis_url, client):
    store = RedisRoutingStore.from_url(redis_url, "p1")
    keys = PoolKeys("p1")
    for name in ("a", "b"):
        store.put_adapter(AdapterRecord(name, "sha256:" + "a" * 64, 8, 1, "hf://o/a"))
    store.add_location("a", "s2")
    store.add_location("a", "s1")
    store.add_location("a", "s1")
    assert client.type(keys.locations) == "hash" and client.hget(keys.locations, "a") == '["s1","s2"]'
    assert {r.name: r.locations for r in store.adapters()} == {"a": {"s1", "s2"}, "b": frozenset()}
    assert store.remove_location("a", "s1") and not store.remove_location("a", "s2")  # the last copy stays
    assert store.get_adapter("a").locations == {"s2"}
    store.remove_adapter("a")
    assert client.hget(keys.locations, "a") is None
    store.close()


def test_clear_removes_every_key_of_the_pool_only(redis_url, client):
    one, two = RedisRoutingStore.from_url(redis_url, "one"), RedisRoutingStore.from_url(redis_url, "two")
    for store in (one, two):
        store.publish_table(_table(1))
        store.put_adapter(AdapterRecord("a", "sha256:" + "a" * 64, 8, 1, "hf://o/a"))
        store.register_server(ServerRecord("s1", "http://127.0.0.1:1", 8), ttl_s=20)
        store.add_demand({"a": 5}, 0.0)
    one.clear()
    assert list(client.scan_iter(match=f"{PoolKeys('one').prefix}*")) == []
    assert one.read_table() is None and one.adapters() == []
    assert two.read_table().version == 1 and [r.name for r in two.adapters()] == ["a"]
    one.close()
    two.close()


def test_heartbeat_sets_a_ttl_and_stale_ids_are_pruned(redis_url, client, free_port):
    store = RedisRoutingStore.from_url(redis_url, "p1")
    keys = PoolKeys("p1")
    store.register_server(ServerRecord("s1", "http://127.0.0.1:1", 8), ttl_s=20)
    assert 0 < client.pttl(keys.server("s1")) <= 20_000
    client.delete(keys.server("s1"))  # as if the TTL ran out
    assert store.healthy_servers() == []
    assert client.smembers(keys.servers) == set()
    store.close()


def test_pools_do_not_see_each_other(redis_url):
    one, two = RedisRoutingStore.from_url(redis_url, "one"), RedisRoutingStore.from_url(redis_url, "two")
    one.publish_table(_table(1))
    assert two.read_table() is None
    one.close()
    two.close()


def test_malformed_records_are_skipped(redis_url, client):
    store = RedisRoutingStore.from_url(redis_url, "p1")
    keys = PoolKeys("p1")
    store.register_server(ServerRecord("s1", "http://127.0.0.1:1", 8), ttl_s=20)
    client.set(keys.server("s2"), "{not json")
    client.sadd(keys.servers, "s2")
    client.hset(keys.adapters, "bad", "[]")
    assert [s.id for s in store.healthy_servers()] == ["s1"]
    assert store.adapters() == []
    store.close()


def test_unreachable_redis_raises_store_unavailable(free_port):
    store = RedisRoutingStore.from_url(f"redis://127.0.0.1:{free_port()}/0", "p1", timeout_s=0.5)
    with pytest.raises(StoreUnavailableError):
        store.current_version()
    with pytest.raises(StoreUnavailableError):
        store.add_demand({"a": 1}, 0.0)


def test_client_without_decoding_is_rejected(redis_url):
    with pytest.raises(ValueError, match="decode_responses"):
        RedisRoutingStore(redis.Redis.from_url(redis_url), "p1")
