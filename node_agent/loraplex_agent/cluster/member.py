"""An agent as a member of its pool: registration and heartbeats, assignment, prefetch and eviction.

- Every `heartbeat_interval_s` the agent writes its ServerRecord (URL, max rank, load, adapters in
  GPU and host memory, its live batch by rank for rank-aware routing, the activated LoRAs whose
  registry record lacks their invocation) with a TTL; a dead agent drops out of the registry when
  the TTL runs out.
- On every new table version (pub/sub, or seen by polling) it prefetches the adapters assigned to
  it into host memory and records itself as a location; an adapter no longer assigned for two
  passes in a row is dropped, unless this is its last copy (LoRAServe's rule: never delete it).
- `ensure(name)` is the lazy path for a request that arrives before the prefetch: fetch from a peer
  that holds the adapter (else from its source), load, then serve. One load per adapter at a time.

Store outages are logged and retried on the next tick; the agent goes on serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator

from loraplex.routing.records import AdapterRecord, ServerRecord
from loraplex.routing.store import RoutingStore, StoreUnavailableError, Subscription
from loraplex.routing.table import RoutingTable
from loraplex.spec.errors import AdapterError, ConflictError, LoraplexError, NotFoundError, OverloadedError
from loraplex_agent.cluster.engine_view import ClusterEngine
from loraplex_agent.cluster.fetcher import AdapterFetcher
from loraplex_agent.cluster.settings import ClusterSettings

log = logging.getLogger("loraplex.agent.cluster")


class ClusterMember:
    def __init__(self, settings: ClusterSettings, store: RoutingStore, engine: ClusterEngine, fetcher: AdapterFetcher,
                 max_rank: int, base_model: str, *, backend: str = "loraplex", serving_url: str | None = None,
                 max_adapters: int = 0) -> None:
        """`serving_url`: where the router sends requests when it is not this agent (backend vllm: the
        vLLM server; peers still fetch adapters from the agent). `max_adapters`: adapters the engine
        holds at once (0: no limit), which the placement honours."""
        self.settings = settings
        self.store = store
        self.engine = engine
        self.fetcher = fetcher
        self.max_rank = max_rank
        self.base_model = base_model
        self.backend = backend
        self.serving_url = serving_url
        self.max_adapters = max_adapters
        self.version: int | None = None
        self._table: RoutingTable | None = None  # the table `_assigned` was read from
        self._registered = False
        self._assigned: set[str] = set()
        self._unassigned_once: set[str] = set()
        self._managed: dict[str, AdapterRecord] = {}  # adapters this member fetched, by name
        self._refused: dict[str, tuple[str, str]] = {}  # name -> (digest, why) the engine refused to load
        self._loading: dict[str, asyncio.Task] = {}
        self._pins: Counter[str] = Counter()  # requests in flight per adapter: never evicted under them
        self._unloading: dict[str, asyncio.Event] = {}  # set when the unload is done
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._subscription: Subscription | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        await self._heartbeat()
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="loraplex-heartbeat"),
                       asyncio.create_task(self._assignment_loop(), name="loraplex-assignment")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._close_subscription()
        try:
            await asyncio.to_thread(self.store.deregister_server, self.settings.server_id)
        except StoreUnavailableError as exc:
            log.warning("could not deregister (the heartbeat TTL will): %s", exc)

    # ---- heartbeat --------------------------------------------------------------------------

    def record(self) -> ServerRecord:
        load, gpu, batch = self.engine.cluster_report()
        url, agent_url = self.settings.advertise_url, ""
        if self.serving_url and self.serving_url != url:
            url, agent_url = self.serving_url, self.settings.advertise_url
        return ServerRecord(id=self.settings.server_id, url=url, max_rank=self.max_rank,
                            base_model=self.base_model, capabilities=("peer-fetch",), load=load,
                            gpu_adapters=gpu, host_adapters=tuple(sorted(self.engine.adapters)),
                            heartbeat_at=time.time(), batch=batch, backend=self.backend, agent_url=agent_url,
                            max_adapters=self.max_adapters, block_size=self.engine.kv_block_size,
                            refused=tuple((n, d, why) for n, (d, why) in sorted(self._refused.items())),
                            invocations=self._invocations())

    def _invocations(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        """The activated LoRAs loaded here whose registry record did not say so (a source the pool's
        driver cannot read): the driver writes the invocation into the record."""
        found = []
        for name, record in sorted(self._managed.items()):
            loaded = self.engine.adapters.get(name)
            if (not record.invocation_tokens and loaded is not None and loaded.info.id.digest == record.digest
                    and loaded.info.invocation_tokens):
                found.append((name, record.digest, tuple(loaded.info.invocation_tokens)))
        return tuple(found)

    async def _heartbeat(self) -> None:
        """Register (renew the TTL) while the engine is healthy; leave the registry while it is not."""
        try:
            if self.engine.healthy:
                await asyncio.to_thread(self.store.register_server, self.record(), self.settings.heartbeat_ttl_s)
                self._registered = True
            elif self._registered:
                await asyncio.to_thread(self.store.deregister_server, self.settings.server_id)
                self._registered = False
                log.warning("the engine cannot serve (%s): left the registry until it can",
                            self.engine.health_problem() or "unhealthy")
        except StoreUnavailableError as exc:
            log.warning("heartbeat failed: %s", exc)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._heartbeat()

    # ---- assignment -------------------------------------------------------------------------

    async def _assignment_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                if self._subscription is None:
                    self._subscription = await asyncio.to_thread(
                        self.store.watch_versions, lambda v: loop.call_soon_threadsafe(self._wake.set))
                await self.reconcile()
            except StoreUnavailableError as exc:
                log.warning("routing store unavailable, keeping the current adapters: %s", exc)
                self._close_subscription()
            except Exception:  # a bug in one pass must not stop the member; the next pass retries
                log.exception("reconciling the assignment failed")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.settings.poll_interval_s)
            self._wake.clear()

    async def reconcile(self) -> None:
        """Bring host memory in line with the current table: prefetch assigned, drop unassigned."""
        # The store's table: the same object while unchanged, else the deltas since its last read applied.
        table = await asyncio.to_thread(self.store.read_table)
        if table is not None and table is not self._table:
            self._assigned = set(table.assignments(self.settings.server_id))
            self._table, self.version = table, table.version
        # only the records of what this server is assigned or holds: not the whole registry every pass
        wanted = self._assigned | self._managed.keys()
        records = {r.name: r for r in await asyncio.to_thread(self.store.adapters, wanted)}
        self._refused = {n: r for n, r in self._refused.items() if n in records and records[n].digest == r[0]}
        self._managed.update([(n, records[n]) for n, r in self._managed.items() if n in records
                              and records[n].digest == r.digest])  # e.g. now with the invocation it reported
        await self._prefetch([records[n] for n in sorted(self._assigned) if n in records])
        await self._evict(records)
        await self._assert_locations(records)

    async def _prefetch(self, records: list[AdapterRecord]) -> None:
        limit = asyncio.Semaphore(self.settings.prefetch_concurrency)

        async def one(record: AdapterRecord) -> None:
            async with limit:
                try:
                    await self.ensure(record.name)
                except LoraplexError as exc:
                    log.error("prefetching adapter %s failed: %s", record.name, exc.message)
        await asyncio.gather(*(one(r) for r in records if self._needs(r)))

    def _needs(self, record: AdapterRecord) -> bool:
        """Not loaded at this version, nor refused at it (a request for it still tries again)."""
        if self._refused.get(record.name, ("",))[0] == record.digest:
            return False
        loaded = self.engine.adapters.get(record.name)
        return loaded is None or loaded.info.id.digest != record.digest

    async def _evict(self, records: dict[str, AdapterRecord]) -> None:
        stale = {n for n in self._managed if n not in self._assigned}
        me = self.settings.server_id
        busy = self.engine.busy_adapters()
        for name in sorted(stale & self._unassigned_once):
            if self._pins[name] or name in busy:
                continue  # requests are on their way to it: the next pass looks again
            if not await asyncio.to_thread(self.store.remove_location, name, me):
                log.info("keeping adapter %s: this is its last copy", name)
            elif self._pins[name]:  # a request arrived while the store answered
                await asyncio.to_thread(self.store.add_location, name, me)
            else:
                await self._unload(name)
        self._unassigned_once = stale
        for name, record in records.items():  # a new version replaced the one loaded here
            managed = self._managed.get(name)
            if managed and managed.digest != record.digest and name not in self._loading and not self._pins[name]:
                await self._unload(name)

    async def _assert_locations(self, records: dict[str, AdapterRecord]) -> None:
        """Record this server as a location of what it holds again, if the store forgot (a restart)."""
        me = self.settings.server_id
        for name in self._managed:
            if name in records and me not in records[name].locations and name in self.engine.adapters:
                await asyncio.to_thread(self.store.add_location, name, me)

    async def _unload(self, name: str) -> None:
        record = self._managed.pop(name)
        done = self._unloading[name] = asyncio.Event()
        try:
            with contextlib.suppress(NotFoundError):  # already gone
                await self.engine.remove_adapter(name)
            self.fetcher.remove(record)
        finally:
            del self._unloading[name]
            done.set()  # requests that came meanwhile load it again
        log.info("dropped adapter %s from host memory", name)

    # ---- lazy load --------------------------------------------------------------------------

    @contextlib.contextmanager
    def pinned(self, name: str) -> Iterator[None]:
        """Keep adapter `name` from being evicted while a request for it is in flight here."""
        self.pin(name)
        try:
            yield
        finally:
            self.unpin(name)

    def pin(self, name: str) -> None:
        """One more request for adapter `name` in flight here (from before its load until its answer
        ends): no pass evicts the adapter under it. `unpin` ends it."""
        self._pins[name] += 1

    def unpin(self, name: str) -> None:
        """One request that `pin` counted has ended (a name not pinned is left alone)."""
        if self._pins[name] <= 1:
            self._pins.pop(name, None)
        else:
            self._pins[name] -= 1

    async def ensure(self, name: str) -> None:
        """Make sure the pool's adapter `name` is loaded here (503 if the registry does not know it).
        An adapter being unloaded here right now is loaded again once that is done: the request may
        have no other server to go to (the last one left in its pool)."""
        while (unloading := self._unloading.get(name)) is not None:
            await unloading.wait()
        if name in self.engine.adapters and name not in self._loading:
            return
        task = self._loading.get(name)
        if task is None:
            task = asyncio.create_task(self._load(name))
            self._loading[name] = task
            task.add_done_callback(lambda t: self._load_done(name, t))
        await asyncio.shield(task)

    def _load_done(self, name: str, task: asyncio.Task) -> None:
        self._loading.pop(name, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: a waiter that went away must not leave it unread

    async def _load(self, name: str) -> None:
        record = await asyncio.to_thread(self.store.get_adapter, name)
        if record is None:
            # The router knows the adapter, the registry does not (yet): e.g. Redis restarted and the
            # deployments are being applied again. 503 lets the router try a server that holds it.
            raise OverloadedError(f"adapter {name!r} is not in the pool's registry right now",
                                  code="adapter_not_registered")
        loaded = self.engine.adapters.get(name)
        if loaded is not None and loaded.info.id.digest == record.digest:
            return
        path = await self.fetcher.fetch(record, await self._peers(record))
        try:
            await self.engine.add_adapter(name, str(path))
        except ConflictError:
            loaded = self.engine.adapters.get(name)
            if loaded is None or loaded.info.id.digest != record.digest:
                raise  # the old version is still draining; the next pass retries
        except AdapterError as exc:  # fetched and verified, and still not servable here: the heartbeat says so
            self._refused[name] = (record.digest, exc.message)
            raise
        self._refused.pop(name, None)
        self._managed[name] = record
        await asyncio.to_thread(self.store.add_location, name, self.settings.server_id)
        log.info("adapter %s (%s) is in host memory", name, record.digest[:19])

    async def _peers(self, record: AdapterRecord) -> list[str]:
        holders = set(record.locations) - {self.settings.server_id}
        if not holders:
            return []
        servers = await asyncio.to_thread(self.store.healthy_servers)
        return [s.peer_url for s in servers if s.id in holders]

    def _close_subscription(self) -> None:
        if self._subscription is not None:
            try:
                self._subscription.close()
            except Exception:
                log.debug("closing the version subscription failed", exc_info=True)
            self._subscription = None
