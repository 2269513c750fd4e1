"""The RoutingStore over Redis (redis-py). This is the only module of loraplex.routing that imports
redis; policies never import it. Key layout: loraplex.routing.keys.PoolKeys (docs/cluster.md)."""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

import redis

from loraplex.routing.delta import (
    DeltaGapError,
    TableDelta,
    apply_deltas,
    decode_delta,
    diff_tables,
    encode_delta,
    validate_delta,
)
from loraplex.routing.demand import DEFAULT_WINDOW_S, DemandWindows, bucket_of, bucket_ttl_s, complete_buckets
from loraplex.routing.keys import PoolKeys
from loraplex.routing.records import AdapterRecord, RecordError, ServerRecord, validate_server_id
from loraplex.routing.store import StaleVersionError, StoreUnavailableError
from loraplex.routing.table import RoutingTable, RoutingTableError, decode_table, encode_table

log = logging.getLogger(__name__)

# The table is a snapshot plus one delta per version. The writer compacts (writes the current table
# as the new snapshot) every SNAPSHOT_EVERY versions, or once the deltas since the snapshot would pass
# MAX_LOG_RATIO of its size; a delta bigger than that is not kept at all (readers read the snapshot).
DEFAULT_SNAPSHOT_EVERY = 100
DEFAULT_MAX_LOG_RATIO = 0.5
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

# The snapshot and the deltas after it, up to version ARGV[1] ('' : the current one), in one atomic
# read. Returns {} when there is no table, else {current, epoch, snapshot, {delta, ...}}.
_READ_SNAPSHOT = """
local current = redis.call('GET', KEYS[1])
local snapshot = redis.call('GET', KEYS[2])
local log = redis.call('HMGET', KEYS[3], 'snapshot', 'epoch')
if not current or not snapshot or not log[1] or not log[2] then return {} end
local upto = ARGV[1]
if upto == '' then upto = current end
return {current, log[2], snapshot, redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. log[1], upto)}
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
                 snapshot_every: int = DEFAULT_SNAPSHOT_EVERY, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO) -> None:
        """`snapshot_every` and `max_log_ratio`: when the writer compacts (see DEFAULT_SNAPSHOT_EVERY)."""
        if not client.get_connection_kwargs().get("decode_responses"):
            raise ValueError("RedisRoutingStore needs a client created with decode_responses=True")
        self.keys = PoolKeys(pool)
        self.pool = pool
        self.window_s = window_s
        if snapshot_every < 1 or max_log_ratio <= 0:
            raise ValueError(f"snapshot_every must be >= 1 and max_log_ratio > 0, got {snapshot_every}, "
                             f"{max_log_ratio}")
        self._snapshot_every, self._max_log_ratio = snapshot_every, max_log_ratio
        self._client = client
        self._add_location = client.register_script(_ADD_LOCATION)
        self._remove_location = client.register_script(_REMOVE_LOCATION)
        self._read_snapshot = client.register_script(_READ_SNAPSHOT)
        # The last current table read or published, with the epoch of its delta chain: the base the
        # next deltas apply to, while the chain is the same one.
        self._held: tuple[str, RoutingTable] | None = None
        # The records of the last registry read by their raw values: a pool of thousands of adapters
        # is re-read every few seconds, and decodes only what changed.
        self._parsed: dict[str, tuple[tuple[str, str | None], AdapterRecord]] = {}

    @classmethod
    def from_url(cls, url: str, pool: str, window_s: float = DEFAULT_WINDOW_S,
                 snapshot_every: int = DEFAULT_SNAPSHOT_EVERY, max_log_ratio: float = DEFAULT_MAX_LOG_RATIO,
                 timeout_s: float = 2.0, password: str | None = None) -> RedisRoutingStore:
        """`password` is used when the URL carries none (kept out of URLs that land in manifests)."""
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s, health_check_interval=30,
                                      password=password or None)
        return cls(client, pool, window_s, snapshot_every, max_log_ratio)

    def close(self) -> None:
        self._client.close()

    # routing table
    @_unavailable_on_redis_error
    def publish_table(self, table: RoutingTable) -> None:
        """Validates what changed since the current version (the whole table when there is none)."""
        with self._client.pipeline() as pipe:
            try:
                # WATCH makes the version check and the write one step: a concurrent publisher makes
                # EXEC fail instead of moving `current` backwards or forking the delta chain.
                pipe.watch(self.keys.current_version)
                current = pipe.get(self.keys.current_version)
                if current is not None and int(current) >= table.version:
                    raise StaleVersionError(f"version {table.version} is not newer than current {current}")
                base = self.read_table(int(current)) if current is not None else None
                delta = validate_delta(diff_tables(base, table)) if base is not None else None
                epoch = self._write(pipe, table.validate() if delta is None else table, delta)
            except redis.WatchError as exc:
                raise StaleVersionError(f"another writer published while version {table.version} was written") from exc
        self._held = (epoch, table)

    def _write(self, pipe: Any, table: RoutingTable, delta: TableDelta | None) -> str:
        """Queues and runs the MULTI that publishes `table`: its delta, a new snapshot when it is time
        to compact, the pointer and the announcement. Returns the epoch of the delta chain: a new one
        when the table does not follow from the current version (the first, or Redis lost it)."""
        since, log_bytes, epoch = pipe.hmget(self.keys.table_log, "snapshot", "bytes", "epoch")
        bound = self._max_log_ratio * (pipe.strlen(self.keys.snapshot) or 0)
        text = encode_delta(delta) if delta is not None and since is not None else ""
        kept = 0 < len(text) <= bound
        compact = not kept or (int(log_bytes or 0) + len(text) > bound
                               or pipe.zcount(self.keys.deltas, f"({since}", "+inf") + 1 >= self._snapshot_every)
        pipe.multi()
        if kept:
            pipe.zadd(self.keys.deltas, {text: table.version})
        if compact:
            pipe.set(self.keys.snapshot, encode_table(table))
            if not text or epoch is None:  # no chain from the last version: the old deltas lead nowhere
                pipe.delete(self.keys.deltas)
                epoch = secrets.token_hex(8)
            else:  # keep the last period's deltas, for readers a little behind
                pipe.zremrangebyscore(self.keys.deltas, "-inf", since)
            pipe.hset(self.keys.table_log, mapping={"snapshot": table.version, "bytes": 0, "epoch": epoch})
        else:
            pipe.hincrby(self.keys.table_log, "bytes", len(text))
        pipe.set(self.keys.current_version, table.version)
        pipe.publish(self.keys.versions_channel, table.version)
        pipe.execute()
        return epoch

    @_unavailable_on_redis_error
    def current_version(self) -> int | None:
        value = self._client.get(self.keys.current_version)
        return int(value) if value is not None else None

    @_unavailable_on_redis_error
    def read_table(self, version: int | None = None) -> RoutingTable | None:
        """The deltas after the last table read are applied to it (one MULTI); the snapshot is read
        only at the start, after a gap (a compaction passed this reader by, Redis lost the table: a
        new epoch) or for a version older than the last one read. Unchanged: the same object."""
        held = self._held
        if held is None or (version is not None and version < held[1].version):
            return self._read_whole(version)
        epoch, cached = held
        with self._client.pipeline(transaction=True) as pipe:
            pipe.get(self.keys.current_version)
            pipe.hget(self.keys.table_log, "epoch")
            pipe.zrangebyscore(self.keys.deltas, f"({cached.version}", "+inf" if version is None else version)
            current, chain, texts = pipe.execute()
        if current is None:
            return None
        if chain != epoch:
            return self._read_whole(version)
        target = int(current) if version is None else version
        if target == cached.version:
            return cached
        try:
            return self._remember(self._chain(cached, texts, target), int(current), epoch)
        except DeltaGapError as exc:
            log.debug("pool %s: %s; reading the snapshot", self.pool, exc)
        except RoutingTableError:
            log.exception("ignoring a malformed routing table delta in pool %s; reading the snapshot", self.pool)
        return self._read_whole(version)

    def _read_whole(self, version: int | None) -> RoutingTable | None:
        reply = self._read_snapshot(keys=[self.keys.current_version, self.keys.snapshot, self.keys.table_log,
                                          self.keys.deltas], args=["" if version is None else version])
        if not reply:
            return None
        current, epoch, snapshot, texts = reply
        target = int(current) if version is None else version
        try:
            return self._remember(self._chain(decode_table(snapshot), texts, target), int(current), epoch)
        except DeltaGapError as exc:  # a version older than the snapshot, or one never published
            log.debug("pool %s: no version %s: %s", self.pool, version, exc)
        except RoutingTableError:
            log.exception("ignoring a malformed routing table in pool %s", self.pool)
        return None

    @staticmethod
    def _chain(table: RoutingTable, texts: list[str], target: int) -> RoutingTable:
        table = apply_deltas(table, (decode_delta(t) for t in texts))
        if table.version != target:
            raise DeltaGapError(f"the deltas reach version {table.version}, not {target}")
        return table

    def _remember(self, table: RoutingTable, current: int, epoch: str) -> RoutingTable:
        if table.version == current:
            self._held = (epoch, table)
        return table

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
    def adapters(self, names: Collection[str] | None = None) -> list[AdapterRecord]:
        if names is not None:
            return self._some_adapters(sorted(set(names)))
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
            record = self._parse_adapter(name, raw)
            if record is not None:
                parsed[name] = (raw, record)
                result.append(record)
        self._parsed = parsed
        return result

    def _some_adapters(self, names: list[str]) -> list[AdapterRecord]:
        if not names:
            return []
        with self._client.pipeline(transaction=False) as pipe:
            pipe.hmget(self.keys.adapters, names)
            pipe.hmget(self.keys.locations, names)
            records, locations = pipe.execute()
        found = (self._parse_adapter(n, (r, h)) for n, r, h in zip(names, records, locations, strict=True) if r)
        return [record for record in found if record is not None]

    def _parse_adapter(self, name: str, raw: tuple[str, str | None]) -> AdapterRecord | None:
        try:
            return AdapterRecord.from_json(raw[0], _holders(raw[1]))
        except RecordError:
            log.exception("ignoring a malformed adapter record %r in pool %s", name, self.pool)
            return None

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
        self._held = None

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
