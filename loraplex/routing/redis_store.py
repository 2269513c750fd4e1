"""The RoutingStore over Redis (redis-py). This is the only module of loraplex.routing that imports
redis; policies never import it. Key layout: loraplex.routing.keys.PoolKeys (docs/cluster.md)."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import redis

from loraplex.routing.demand import DEFAULT_WINDOW_S, DemandWindows, bucket_of, bucket_ttl_s, complete_buckets
from loraplex.routing.keys import PoolKeys
from loraplex.routing.records import AdapterRecord, RecordError, ServerRecord, validate_server_id
from loraplex.routing.store import StaleVersionError, StoreUnavailableError
from loraplex.routing.table import RoutingTable, RoutingTableError, decode_table, encode_table

log = logging.getLogger(__name__)

DEFAULT_RETAIN_S = 300  # a superseded table stays readable this long (readers mid-swap, rollback)
DEMAND_WINDOWS_KEPT = 60  # demand buckets live long enough to be read as any of the last 60 windows
_WATCH_RETRIES = 8

F = TypeVar("F", bound=Callable[..., Any])


def _unavailable_on_redis_error(method: F) -> F:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc
    return wrapper  # type: ignore[return-value]


class _PubSubSubscription:
    def __init__(self, thread: Any) -> None:
        self._thread = thread

    def close(self) -> None:
        self._thread.stop()


class RedisRoutingStore:
    """One pool's state in Redis. Build it with `from_url`; a client passed in directly must have
    been created with decode_responses=True."""

    def __init__(self, client: redis.Redis, pool: str, window_s: float = DEFAULT_WINDOW_S,
                 retain_s: int = DEFAULT_RETAIN_S) -> None:
        if not client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisRoutingStore needs a client created with decode_responses=True")
        self.keys = PoolKeys(pool)
        self.pool = pool
        self.window_s = window_s
        self._retain_s = retain_s
        self._client = client

    @classmethod
    def from_url(cls, url: str, pool: str, window_s: float = DEFAULT_WINDOW_S,
                 retain_s: int = DEFAULT_RETAIN_S, timeout_s: float = 2.0) -> RedisRoutingStore:
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s, health_check_interval=30)
        return cls(client, pool, window_s, retain_s)

    def close(self) -> None:
        self._client.close()

    # routing table
    @_unavailable_on_redis_error
    def publish_table(self, table: RoutingTable) -> None:
        payload = encode_table(table.validate())
        current_key = self.keys.current_version
        with self._client.pipeline() as pipe:
            try:
                # WATCH makes the version check and the swap one step: a concurrent publisher makes
                # EXEC fail instead of moving `current` backwards.
                pipe.watch(current_key)
                current = pipe.get(current_key)
                if current is not None and int(current) >= table.version:
                    raise StaleVersionError(f"version {table.version} is not newer than current {current}")
                pipe.multi()
                pipe.set(self.keys.table(table.version), payload)
                pipe.set(current_key, table.version)
                if current is not None:
                    pipe.expire(self.keys.table(int(current)), self._retain_s)
                pipe.publish(self.keys.versions_channel, table.version)
                pipe.execute()
            except redis.WatchError as exc:
                raise StaleVersionError(f"another writer published while version {table.version} was written") from exc

    @_unavailable_on_redis_error
    def current_version(self) -> int | None:
        value = self._client.get(self.keys.current_version)
        return int(value) if value is not None else None

    @_unavailable_on_redis_error
    def read_table(self, version: int | None = None) -> RoutingTable | None:
        if version is not None:
            return self._decode(self._client.get(self.keys.table(version)))
        # Tables are immutable once written, so pointer-then-table is consistent; the one race is a
        # table that expired between the two reads, which a second look at the pointer resolves.
        for _ in range(2):
            current = self.current_version()
            if current is None:
                return None
            table = self._decode(self._client.get(self.keys.table(current)))
            if table is not None:
                return table
        return None

    def _decode(self, payload: str | None) -> RoutingTable | None:
        if payload is None:
            return None
        try:
            return decode_table(payload)
        except RoutingTableError:
            log.exception("ignoring a malformed routing table in pool %s", self.pool)
            return None

    @_unavailable_on_redis_error
    def watch_versions(self, callback: Callable[[int], None]) -> _PubSubSubscription:
        def on_message(message: dict[str, Any]) -> None:
            try:
                version = int(message["data"])
            except (TypeError, ValueError):
                log.warning("ignoring announcement %r on %s", message.get("data"), self.keys.versions_channel)
                return
            callback(version)

        def on_error(exc: BaseException, pubsub: Any, thread: Any) -> None:
            # The worker keeps running; the next get_message reconnects and re-subscribes.
            log.warning("pub/sub for pool %s: %s; retrying", self.pool, exc)
            threading.Event().wait(1.0)

        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(**{self.keys.versions_channel: on_message})
        thread = pubsub.run_in_thread(sleep_time=0.5, daemon=True, exception_handler=on_error)
        return _PubSubSubscription(thread)

    # server registry
    @_unavailable_on_redis_error
    def register_server(self, record: ServerRecord, ttl_s: float) -> None:
        record.validate()
        if ttl_s <= 0:
            raise ValueError(f"heartbeat ttl must be positive, got {ttl_s}")
        with self._client.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.server(record.id), record.to_json(), px=max(1, round(ttl_s * 1000)))
            pipe.sadd(self.keys.servers, record.id)
            pipe.execute()

    @_unavailable_on_redis_error
    def deregister_server(self, server_id: str) -> None:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.server(server_id))
            pipe.srem(self.keys.servers, server_id)
            pipe.execute()

    @_unavailable_on_redis_error
    def healthy_servers(self) -> list[ServerRecord]:
        ids = sorted(self._client.smembers(self.keys.servers))
        if not ids:
            return []
        payloads = self._client.mget([self.keys.server(i) for i in ids])
        expired = [i for i, p in zip(ids, payloads, strict=True) if p is None]
        if expired:
            self._client.srem(self.keys.servers, *expired)
        return [rec for rec in (self._parse_server(p) for p in payloads if p is not None) if rec is not None]

    def _parse_server(self, payload: str) -> ServerRecord | None:
        try:
            return ServerRecord.from_json(payload)
        except RecordError:
            log.exception("ignoring a malformed server record in pool %s", self.pool)
            return None

    # adapter registry
    @_unavailable_on_redis_error
    def put_adapter(self, record: AdapterRecord) -> None:
        self._client.hset(self.keys.adapters, record.validate().name, record.to_json())

    @_unavailable_on_redis_error
    def remove_adapter(self, name: str) -> None:
        with self._client.pipeline(transaction=True) as pipe:
            pipe.hdel(self.keys.adapters, name)
            pipe.delete(self.keys.locations(name))
            pipe.execute()

    @_unavailable_on_redis_error
    def get_adapter(self, name: str) -> AdapterRecord | None:
        with self._client.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.adapters, name)
            pipe.smembers(self.keys.locations(name))
            payload, locations = pipe.execute()
        return AdapterRecord.from_json(payload, frozenset(locations)) if payload is not None else None

    @_unavailable_on_redis_error
    def adapters(self) -> list[AdapterRecord]:
        records = self._client.hgetall(self.keys.adapters)
        names = sorted(records)
        with self._client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.smembers(self.keys.locations(name))
            locations = pipe.execute()
        result = []
        for name, held in zip(names, locations, strict=True):
            try:
                result.append(AdapterRecord.from_json(records[name], frozenset(held)))
            except RecordError:
                log.exception("ignoring a malformed adapter record %r in pool %s", name, self.pool)
        return result

    @_unavailable_on_redis_error
    def add_location(self, adapter: str, server_id: str) -> None:
        self._client.sadd(self.keys.locations(adapter), validate_server_id(server_id))

    @_unavailable_on_redis_error
    def remove_location(self, adapter: str, server_id: str) -> bool:
        key = self.keys.locations(adapter)
        for _ in range(_WATCH_RETRIES):
            with self._client.pipeline() as pipe:
                pipe.watch(key)  # the count check and the SREM must see the same set
                if not pipe.sismember(key, server_id):
                    return True
                if pipe.scard(key) <= 1:
                    return False
                pipe.multi()
                pipe.srem(key, server_id)
                try:
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue  # another holder changed the set; look again
        raise StoreUnavailableError(f"locations of {adapter!r} kept changing; gave up after {_WATCH_RETRIES} tries")

    # demand
    @_unavailable_on_redis_error
    def add_demand(self, tokens: Mapping[str, int], now: float) -> None:
        if not tokens:
            return
        key = self.keys.demand(bucket_of(now, self.window_s))
        with self._client.pipeline(transaction=False) as pipe:
            for name, count in tokens.items():
                pipe.hincrby(key, name, int(count))
            pipe.expire(key, bucket_ttl_s(self.window_s, DEMAND_WINDOWS_KEPT))
            pipe.execute()

    @_unavailable_on_redis_error
    def demand_windows(self, now: float, count: int) -> DemandWindows:
        if count > DEMAND_WINDOWS_KEPT:
            raise ValueError(f"at most {DEMAND_WINDOWS_KEPT} demand windows are kept, asked for {count}")
        with self._client.pipeline(transaction=False) as pipe:
            for bucket in complete_buckets(now, self.window_s, count):
                pipe.hgetall(self.keys.demand(bucket))
            windows = pipe.execute()
        return DemandWindows.from_counts(self.window_s, [{k: int(v) for k, v in w.items()} for w in windows])
