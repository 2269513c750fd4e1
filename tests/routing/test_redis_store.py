"""Redis-specific behaviour: key layout on the server, expiry of superseded versions, outages."""

import pytest
import redis

from loraplex.routing import PoolKeys, RoutingTable, ServerRecord, StoreUnavailableError, make_entry
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
