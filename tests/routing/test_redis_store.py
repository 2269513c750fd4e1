"""Redis-specific behaviour: key layout on the server, expiry of superseded versions, outages."""

import pytest
import redis

from loraplex.routing import (
    AdapterRecord,
    PoolKeys,
    RoutingTable,
    ServerRecord,
    StoreUnavailableError,
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


def test_superseded_versions_expire_current_does_not(redis_url, client):
    store = RedisRoutingStore.from_url(redis_url, "p1", retain_s=30)
    keys = PoolKeys("p1")
    store.publish_table(_table(1))
    store.publish_table(_table(2))
    assert client.get(keys.current_version) == "2"
    assert 0 < client.ttl(keys.table(1)) <= 30
    assert client.ttl(keys.table(2)) == -1  # the current table never expires
    store.close()


def test_a_burst_of_publishes_keeps_at_most_two_tables(redis_url, client):
    store = RedisRoutingStore.from_url(redis_url, "p1", retain_s=30)
    keys = PoolKeys("p1")
    for version in range(1, 51):
        store.publish_table(_table(version))
    assert sorted(client.scan_iter(match=f"{keys.prefix}table:[0-9]*")) == [keys.table(49), keys.table(50)]
    assert client.get(keys.previous_version) == "49"
    assert store.read_table().version == 50
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
