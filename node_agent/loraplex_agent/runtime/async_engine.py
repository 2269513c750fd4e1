"""The engine thread and its bridge to asyncio.

`EngineCore` is not thread-safe, so exactly one thread owns it: it runs the commands the server
queues (add a request, abort one, add or remove an adapter), steps the core while there is work,
sleeps when there is none, and hands each step's outputs to the asyncio queue of their request
with `loop.call_soon_threadsafe`. Reading an adapter from disk happens before its command is
queued, on a worker thread, so a slow load never stalls the batch.

An engine thread stuck in one iteration (a hung device, a deadlock) leaves the event loop answering
while no request moves: past `stall_timeout_s` the engine reports itself unhealthy, so /health
answers 503 and the pool member leaves the registry (the router sends the waiting requests
elsewhere) until the iteration ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from loraplex.engine.core import EngineStats
from loraplex.engine.memory.stats import MemoryStats
from loraplex.engine.messages import RequestOutput
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.scheduling.stats import SchedulerStats
from loraplex.routing.records import ServerBatch, ServerLoad
from loraplex.spec.adapter import AdapterInfo
from loraplex.spec.errors import LoraplexError, NotFoundError
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.cluster.engine_view import open_batch

if TYPE_CHECKING:
    from loraplex_agent.runtime.llm import LLM

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(LoraplexError):
    status = 503
    type = "service_unavailable"


@dataclass
class EngineSnapshot:
    """What /metrics reads; taken on the engine thread after each step, read from any thread."""

    stats: EngineStats
    running_adapters: list[str] = field(default_factory=list)
    waiting_adapters: list[str] = field(default_factory=list)
    resident_adapters: list[str] = field(default_factory=list)
    scheduler: SchedulerStats | None = None  # refreshed at most every SCHEDULER_STATS_PERIOD_S
    memory: MemoryStats | None = None  # refreshed with `scheduler`
    engine_cpu_s: float = 0.0  # CPU time (user + system) of the engine thread so far: its steps and commands
    taken_at: float = field(default_factory=time.time)


SCHEDULER_STATS_PERIOD_S = 1.0  # scheduler stats copy per-adapter tables: not on every step


@dataclass
class _Stream:
    request: Request
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, llm: LLM, stall_timeout_s: float) -> None:
        """`stall_timeout_s`: one iteration of the engine thread running longer than this makes the
        engine unhealthy until it ends; 0: never."""
        self.llm = llm
        self.stall_timeout_s = stall_timeout_s
        self.core = llm.core
        self.max_model_len = llm.core.config.max_model_len
        self.adapters = llm.adapters  # the one registry: servable by name; the engine thread changes it
        self.error: BaseException | None = None
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._iteration_started: float | None = None  # monotonic; None between iterations
        # owned by the engine thread
        self._streams: dict[str, _Stream] = {}
        self._scheduler_stats: SchedulerStats | None = None
        self._scheduler_stats_at = 0.0
        self._memory_stats: MemoryStats | None = None
        self._engine_cpu_s = 0.0  # time.thread_time() of the engine thread after its last iteration
        self._snapshot = self._take_snapshot()

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="loraplex-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def healthy(self) -> bool:
        return self.health_problem() is None

    def stalled_for(self) -> float:
        """Seconds the engine thread has been in its current iteration; 0 between iterations."""
        started = self._iteration_started
        return 0.0 if started is None else time.monotonic() - started

    @property
    def stalled(self) -> bool:
        return self.stall_timeout_s > 0 and self.stalled_for() > self.stall_timeout_s

    def health_problem(self) -> str | None:
        """Why the engine cannot serve now, or None."""
        if self.error is not None or self._thread is None or not self._thread.is_alive():
            return f"the engine is down: {self.error!r}"
        if self.stalled:
            return (f"the engine has been in one step for {self.stalled_for():.0f} s "
                    f"(more than the stall timeout of {self.stall_timeout_s:g} s)")
        return None

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ---- the cluster's view (loraplex_agent.cluster.engine_view.ClusterEngine) ---------------

    @property
    def kv_block_size(self) -> int:
        return self.core.config.block_size

    def cluster_report(self) -> tuple[ServerLoad, tuple[str, ...], ServerBatch | None]:
        """(load, GPU-resident adapters, open requests by rank) from the last step snapshot. Runs on the
        event loop while the engine thread steps: the request table is copied in one C-level call
        (atomic under the GIL) and a request's counters are plain ints, so the batch is at worst one
        step old. Ranks come from the loop's own view of the loaded adapters."""
        snap = self._snapshot
        stats = snap.stats
        load = ServerLoad(running=stats.num_running, waiting=stats.num_waiting, kv_usage=round(stats.kv_usage, 4))
        try:
            requests = [stream.request for stream in list(self._streams.values())]
        except RuntimeError:  # resized while copied (free-threaded Python): no batch this time
            return load, tuple(snap.resident_adapters), None
        ranks = {name: loaded.info.rank for name, loaded in self.adapters.items()}
        return load, tuple(snap.resident_adapters), open_batch(requests, ranks)

    def busy_adapters(self) -> frozenset[str]:
        """None beyond what the member pins itself (the adapters it routes): this engine's
        `remove_adapter` lets an adapter's running requests finish before it goes."""
        return frozenset()

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, request: Request, adapter: str | None) -> AsyncIterator[RequestOutput]:
        """Outputs of `request` as the engine produces them; leaving early aborts the request.

        `adapter` is resolved to its current identity on the engine thread, so an unload racing
        with this call either refuses the request or lets it finish, never half-way.
        """
        stream = _Stream(request, asyncio.Queue())
        finished = False
        try:
            await self._call(lambda: self._add_request(stream, adapter))
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit(lambda: self._abort(request.request_id))

    # ---- adapters ---------------------------------------------------------------------------

    async def add_adapter(self, name: str, path: str | Path, pinned: bool = False) -> AdapterInfo:
        """Read and validate the adapter off the engine thread, then register it on it; a pinned
        adapter is copied to the device now and never evicted."""
        self.adapters.check_free(name)  # again on the engine thread; here it spares reading the weights
        if not Path(path).exists():
            raise NotFoundError(f"adapter path {str(path)!r} does not exist", param="lora_path")
        host = await asyncio.to_thread(
            load_peft_adapter, name, path, self.llm.model_config, self.core.config.max_lora_rank,
            base_model_aliases=[self.llm.served_model_name])
        await self._call(lambda: self.llm.register(host, pinned, path=str(path)))
        return host.info

    async def remove_adapter(self, name: str) -> AdapterInfo:
        """New requests for `name` are refused at once; those already accepted finish first."""
        info, _ = await self.unload_adapter(name)
        return info

    async def unload_adapter(self, name: str) -> tuple[AdapterInfo, int]:
        """`remove_adapter`, also saying how many accepted requests still run on the adapter."""
        return await self._call(lambda: self._unload_adapter(name))

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                commands = self._wait_for_work()
                if commands is None:
                    return
                self._iteration_started = time.monotonic()
                for command in commands:
                    command()
                if self.core.has_unfinished():
                    self._dispatch(self.core.step())
                self._finish_unloads()
                self._engine_cpu_s = time.thread_time()
                self._snapshot = self._take_snapshot()
                self._iteration_started = None
        except BaseException as exc:  # the core's state is unknown now: fail everyone, stay down
            log.exception("the engine thread failed")
            self._fail_all(exc)

    def _wait_for_work(self) -> list[Callable[[], None]] | None:
        with self._wakeup:
            while not self._commands and not self.core.has_unfinished() and not self._stopping:
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        deliveries = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue  # aborted by the server while the step ran
            deliveries.append((stream.queue, output))
            if output.finished:
                del self._streams[output.request_id]
        if deliveries:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    def _add_request(self, stream: _Stream, adapter: str | None) -> None:
        if adapter is not None:
            record = self.adapters.get(adapter)
            if record is None:
                raise NotFoundError(f"the model {adapter!r} does not exist", param="model",
                                    code="model_not_found")
            stream.request.adapter = record.info.id
        self.core.add_request(stream.request)
        self._streams[stream.request.request_id] = stream

    def _abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self.core.abort_request(request_id)

    def _unload_adapter(self, name: str) -> tuple[AdapterInfo, int]:
        info = self.adapters.begin_unload(name)
        draining = sum(1 for s in self._streams.values() if s.request.adapter == info.id)
        self._finish_unloads()
        return info, draining

    def _finish_unloads(self) -> None:
        """Remove an unloading adapter from the engine once no accepted request uses it."""
        unloading = self.adapters.unloading()
        if not unloading:
            return
        busy = {s.request.adapter for s in self._streams.values()}
        for name, info in unloading.items():
            if info.id not in busy:
                self.llm.remove_adapter(name)

    def _take_snapshot(self) -> EngineSnapshot:
        running, waiting = set(), set()
        for stream in self._streams.values():
            adapter = stream.request.adapter
            if adapter is not None:
                target = running if stream.request.status == RequestStatus.RUNNING else waiting
                target.add(adapter.name)
        stats = self.core.stats()
        scheduler = self._scheduler_stats
        now = time.monotonic()
        # at most once a period while busy, and always when the engine goes idle (nothing refreshes it then)
        if (scheduler is None or now - self._scheduler_stats_at >= SCHEDULER_STATS_PERIOD_S
                or not self.core.has_unfinished()):
            scheduler = self._scheduler_stats = self.core.scheduler_stats()
            self._memory_stats = self.core.memory_stats()
            self._scheduler_stats_at = now
        return EngineSnapshot(stats=stats, running_adapters=sorted(running), waiting_adapters=sorted(waiting),
                              resident_adapters=sorted(a.name for a in stats.resident_adapters),
                              scheduler=scheduler, memory=self._memory_stats, engine_cpu_s=self._engine_cpu_s)

    def _fail_all(self, exc: BaseException) -> None:
        self.error = exc
        error = EngineDeadError(f"the engine failed: {exc!r}")
        with self._wakeup:
            commands = list(self._commands)
            self._commands.clear()
            self._stopping = True
        for command in commands:
            command()  # each fails its future with EngineDeadError now that `error` is set
        deliveries = [(s.queue, error) for s in self._streams.values()]
        self._streams.clear()
        if deliveries and self._loop is not None:
            self._loop.call_soon_threadsafe(_deliver, deliveries)

    # ---- commands ---------------------------------------------------------------------------

    def _submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return  # its caller gave up (a client disconnected) before the engine got to it
            if self.error is not None:
                future.set_exception(EngineDeadError(f"the engine failed: {self.error!r}"))
                return
            try:
                future.set_result(fn())
            except Exception as exc:  # a refused command; commands check before they change state
                future.set_exception(exc)

        with self._wakeup:
            if self._stopping or self.error is not None:
                future.set_exception(EngineDeadError("the engine is not running"))
                return future
            self._commands.append(command)
            self._wakeup.notify()
        return future

    async def _call(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self._submit(fn))


def _deliver(deliveries: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in deliveries:
        queue.put_nowait(item)
