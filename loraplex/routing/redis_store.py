"""The RoutingStore over Redis (redis-py). This is the only module of loraplex.routing that imports
redis; policies never import it. Key layout: loraplex.routing.keys.PoolKeys (docs/cluster.md)."""

from __future__ import annotations

import functools
import json
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

# A superseded table stays readable this long, for readers between the pointer and the table. Only
# the last superseded one is kept: a burst of publishes must not keep a full copy per version.
DEFAULT_RETAIN_S = 30
DEMAND_WINDOWS_KEPT = 60  # demand buckets live long enough to be read as any of the last 60 windows
_DELETE_BATCH = 500

# Locations of every adapter live in one HASH (adapter -> JSON list of server ids), so the whole
# registry is read with two commands. Adding and removing a holder are atomic read-modify-writes.
_ADD_LOCATION = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
local ids = held and cjson.decode(held) or {}
for _, id in ipairs(ids) do if id == ARGV[2] then return 0 end end
table.insert(ids, ARGV[2])
table.sort(ids)
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(ids))
return 1
"""
# Returns 0 (and changes nothing) when the server is the adapter's last holder.
_REMOVE_LOCATION = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 1 end
local keep, found = {}, false
for _, id in ipairs(cjson.decode(held)) do
  if id == ARGV[2] then found = true else table.insert(keep, id) end
end
if not found then return 1 end
if #keep == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(keep))
return 1
"""

F = TypeVar("F", bound=Callable[..., Any])


def _unavailable_on_redis_error(method: F) -> F:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailableError(f"redis unavailable: {exc}") from exc
    return wrapper  # type: ignore[return-value]


def _holders(held: str | None) -> frozenset[str]:
    return frozenset(json.loads(held)) if held else frozenset()


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
        self._add_location = client.register_script(_ADD_LOCATION)
        self._remove_location = client.register_script(_REMOVE_LOCATION)
        self._cached: RoutingTable | None = None  # the last table read; tables never change once written
        # The records of the last registry read by their raw values: a pool of thousands of adapters
        # is re-read every few seconds, and decodes only what changed.
        self._parsed: dict[str, tuple[tuple[str, str | None], AdapterRecord]] = {}

    @classmethod
    def from_url(cls, url: str, pool: str, window_s: float = DEFAULT_WINDOW_S,
                 retain_s: int = DEFAULT_RETAIN_S, timeout_s: float = 2.0,
                 password: str | None = None) -> RedisRoutingStore:
        """`password` is used when the URL carries none (kept out of URLs that land in manifests)."""
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s, health_check_interval=30,
                                      password=password or None)
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
                pipe.watch(current_key, self.keys.previous_version)
                current = pipe.get(current_key)
                previous = pipe.get(self.keys.previous_version)
                if current is not None and int(current) >= table.version:
                    raise StaleVersionError(f"version {table.version} is not newer than current {current}")
                pipe.multi()
                pipe.set(self.keys.table(table.version), payload)
                pipe.set(current_key, table.version)
                if current is not None:
                    pipe.expire(self.keys.table(int(current)), self._retain_s)
                    pipe.set(self.keys.previous_version, current)
                if previous is not None:
                    pipe.delete(self.keys.table(int(previous)))
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
        # Tables are immutable once written, so pointer-then-table is consistent (and the last one
        # read is reused while it stays current); the one race is a table that expired between the
        # two reads, which a second look at the pointer resolves.
        for _ in range(2):
            current = self.current_version()
            if current is None:
                return None
            cached = self._cached
            if cached is not None and cached.version == current:
                return cached
            table = self._decode(self._client.get(self.keys.table(current)))
            if table is not None:
                self._cached = table
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
            pipe.hdel(self.keys.locations, name)
            pipe.execute()

    @_unavailable_on_redis_error
    def get_adapter(self, name: str) -> AdapterRecord | None:
        with self._client.pipeline(transaction=False) as pipe:
            pipe.hget(self.keys.adapters, name)
            pipe.hget(self.keys.locations, name)
            payload, held = pipe.execute()
        return AdapterRecord.from_json(payload, _holders(held)) if payload is not None else None

    @_unavailable_on_redis_error
    def adapters(self) -> list[AdapterRecord]:
        with self._client.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.keys.adapters)
            pipe.hgetall(self.keys.locations)
            records, locations = pipe.execute()
        result, parsed = [], {}
        for name in sorted(records):
            raw = (records[name], locations.get(name))
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == raw:  # unchanged since the last read: no JSON decode
                parsed[name] = cached
                result.append(cached[1])
                continue
            try:
                record = AdapterRecord.from_json(raw[0], _holders(raw[1]))
            except RecordError:
                log.exception("ignoring a malformed adapter record %r in pool %s", name, self.pool)
                continue
            parsed[name] = (raw, record)
            result.append(record)
        self._parsed = parsed
        return result

    @_unavailable_on_redis_error
    def add_location(self, adapter: str, server_id: str) -> None:
        self._add_location(keys=[self.keys.locations], args=[adapter, validate_server_id(server_id)])

    @_unavailable_on_redis_error
    def remove_location(self, adapter: str, server_id: str) -> bool:
        return bool(self._remove_location(keys=[self.keys.locations], args=[adapter, server_id]))

    @_unavailable_on_redis_error
    def clear(self) -> None:
        batch: list[str] = []
        pattern = f"{self.keys.prefix}*"  # the pool name is a DNS label: no glob characters
        for key in self._client.scan_iter(match=pattern, count=_DELETE_BATCH):
            batch.append(key)
            if len(batch) >= _DELETE_BATCH:
                self._client.unlink(*batch)
                batch.clear()
        if batch:
            self._client.unlink(*batch)
        self._cached = None

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
