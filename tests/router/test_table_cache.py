"""The router's table cache over a real redis-server: a new table version arrives as a delta, and
only the registry records of the adapters it changed are read with it."""

from __future__ import annotations

import time
from dataclasses import replace

from loraplex_router.demand import DemandCounter
from loraplex_router.metrics import RouterMetrics
from loraplex_router.table_cache import TableCache

from loraplex.routing import AdapterRecord, RoutingTable, make_entry
from loraplex.routing.redis_store import RedisRoutingStore


def _record(name: str, source: str = "hf://o/x") -> AdapterRecord:
    return AdapterRecord(name, "sha256:" + "a" * 64, 8, 1, source)


def _table(version: int, names: list[str], new_digest: tuple[str, ...] = (),
           moved: tuple[str, ...] = ()) -> RoutingTable:
    entries = {n: make_entry(n, "sha256:" + ("b" if n in new_digest else "a") * 64, 8,
                             [("s2" if n in moved else "s1", 1.0)]) for n in names}
    return RoutingTable(version, 0.0, entries)


def test_a_delta_reads_the_records_of_the_adapters_it_adds_drops_or_reversions(redis_url):
    writer, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    now = [1000.0]
    cache = TableCache(reader, RouterMetrics(), DemandCounter(), poll_interval_s=3600, adapters_every_s=60,
                       clock=lambda: now[0])
    names = [f"a{i}" for i in range(10)]
    for name in names:
        writer.put_adapter(_record(name))
    writer.publish_table(_table(1, names))
    cache.start()
    assert set(cache.snapshot.adapters) == set(names)
    held = cache.snapshot.table

    writer.put_adapter(_record("a3", "hf://o/a3-v2"))  # a new version of a3: a new digest in the table
    writer.put_adapter(_record("a5", "hf://o/a5-v2"))  # a5 and a6 keep their digests: their records wait
    writer.put_adapter(_record("a6", "hf://o/a6-v2"))  # for the periodic read, even though a6 moved
    writer.put_adapter(_record("new"))
    writer.remove_adapter("a2")
    writer.publish_table(_table(2, [*names[:2], *names[3:], "new"], new_digest=("a3",), moved=("a6",)))
    now[0] += 1
    assert cache.refresh() and cache.snapshot.version == 2
    adapters = cache.snapshot.adapters
    assert "new" in adapters and "a2" not in adapters
    assert adapters["a3"].source == "hf://o/a3-v2" and adapters["a5"].source == adapters["a6"].source == "hf://o/x"
    assert cache.snapshot.table.entries["a0"] is held.entries["a0"]  # the table came as a delta

    now[0] += 60
    assert cache.refresh() and cache.snapshot.adapters["a6"].source == "hf://o/a6-v2"
    cache.stop()
    for store in (writer, reader):
        store.close()


def test_a_table_that_changes_most_adapters_reads_the_whole_registry(redis_url):
    writer, reader = (RedisRoutingStore.from_url(redis_url, "p1") for _ in range(2))
    cache = TableCache(reader, RouterMetrics(), DemandCounter(), poll_interval_s=3600, adapters_every_s=3600,
                       clock=time.time)
    names = [f"a{i}" for i in range(200)]
    for name in names:
        writer.put_adapter(_record(name))
    writer.publish_table(_table(1, names))
    cache.start()
    for name in names:
        writer.put_adapter(replace(_record(name), source="hf://o/v2"))
    writer.publish_table(_table(2, names, new_digest=tuple(names[:100])))
    assert cache.refresh()
    assert {a.source for a in cache.snapshot.adapters.values()} == {"hf://o/v2"}
    cache.stop()
    for store in (writer, reader):
        store.close()
