"""Batches across kopf's handlers without a worker thread each: a handler hands its item to a queue
and awaits; one drain at a time takes everything queued so far and runs the batch function in a
thread; whatever arrives meanwhile makes the next batch, which starts `gap_s` after the last one
began at the earliest. So ten thousand LoRADeployments created at once are registered in batches as
wide as the arrivals of one gap, whatever kopf's worker count, and a batch's fixed cost (a table
version) is paid at most once a gap; a lone item after a quiet spell goes at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class BatchQueue(Generic[T, R]):
    def __init__(self, work: Callable[[Sequence[T]], Sequence[R]], gap_s: float = 0.0) -> None:
        self._work = work  # one result per item, in order
        self._gap_s = gap_s
        self._last_start = float("-inf")  # loop time
        self._pending: list[tuple[T, asyncio.Future[R]]] = []
        self._drain_task: asyncio.Task[None] | None = None
        self.batches = 0  # batches run so far

    async def submit(self, item: T) -> R:
        """The item's result, from the first batch that starts after this call."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[R] = loop.create_future()
        self._pending.append((item, future))
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            wait = self._last_start + self._gap_s - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_start = loop.time()
            batch, self._pending = self._pending, []
            try:
                results = await asyncio.to_thread(self._work, [item for item, _ in batch])
            except asyncio.CancelledError:  # shutting down: nobody waits for these any more
                for _, future in batch:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 (each caller gets the batch's error)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:
                self.batches += 1
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
