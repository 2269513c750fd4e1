"""BatchQueue: handlers awaiting one pool's registrations are served in batches as wide as what
arrived during the previous run, whatever the number of worker threads."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

import pytest
from loraplex_operator.batching import BatchQueue


def test_everything_queued_during_a_run_is_the_next_batch() -> None:
    release = threading.Event()
    batches: list[list[int]] = []

    def work(items: Sequence[int]) -> list[int]:
        batches.append(list(items))
        if len(batches) == 1:
            release.wait(5)  # the first batch runs while 500 more arrive
        return [i * 10 for i in items]

    async def main() -> list[int]:
        queue: BatchQueue[int, int] = BatchQueue(work)
        first = asyncio.ensure_future(queue.submit(0))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(queue.submit(i)) for i in range(1, 501)]
        await asyncio.sleep(0.05)
        release.set()
        return [await first, *[await r for r in rest]]

    results = asyncio.run(main())
    assert results == [i * 10 for i in range(501)]
    assert batches == [[0], list(range(1, 501))]  # two runs for 501 callers


def test_a_failed_batch_fails_each_of_its_callers_and_the_next_batch_runs() -> None:
    calls = []

    def work(items: Sequence[str]) -> list[str]:
        calls.append(list(items))
        if len(calls) == 1:
            raise RuntimeError("store down")
        return list(items)

    async def main() -> None:
        queue: BatchQueue[str, str] = BatchQueue(work)
        with pytest.raises(RuntimeError, match="store down"):
            await queue.submit("a")
        assert await queue.submit("b") == "b"

    asyncio.run(main())
    assert calls == [["a"], ["b"]]


def test_batches_start_a_gap_apart_and_a_lone_item_goes_at_once() -> None:
    starts: list[float] = []

    def work(items: Sequence[int]) -> list[int]:
        starts.append(time.monotonic())
        return list(items)

    async def main() -> None:
        queue: BatchQueue[int, int] = BatchQueue(work, gap_s=0.3)
        t0 = time.monotonic()
        await queue.submit(1)  # nothing ran before: at once
        assert starts[0] - t0 < 0.2
        await asyncio.gather(queue.submit(2), queue.submit(3))  # one batch, a gap after the first
        assert len(starts) == 2 and starts[1] - starts[0] >= 0.29

    asyncio.run(main())


def test_the_pool_ticks_every_tick_seconds_and_every_second_while_registrations_are_recent() -> None:
    from loraplex_operator.pool_reconcile import tick_due

    assert tick_due(100.0, None, None, 5.0)  # never ticked
    assert not tick_due(101.0, 100.0, None, 5.0)  # at rest: once every 5 s
    assert tick_due(105.0, 100.0, None, 5.0)
    assert tick_due(101.0, 100.0, 99.5, 5.0)  # a batch just ran: its adapters turn Ready soon
    assert tick_due(104.0, 103.0, 99.5, 5.0)
    assert not tick_due(106.0, 105.5, 99.5, 5.0)  # the batch is older than a tick: back to rest


def test_an_empty_batch_is_no_registration(tmp_path: object) -> None:
    from loraplex_operator.adapter_reconcile import register_adapters
    from loraplex_operator.config import OperatorConfig
    from loraplex_operator.deps import Deps
    from loraplex_operator.inspect_source import SourceInspector

    from loraplex.routing import InMemoryRoutingStore
    from loraplex.util.clock import ManualClock

    clock = ManualClock(10.0)
    deps = Deps(OperatorConfig(), None, None, clock, lambda pool: InMemoryRoutingStore(pool, clock),  # type: ignore[arg-type]
                SourceInspector())
    assert register_adapters("tiny", [], deps) == []
    assert "tiny" not in deps.registered  # the tick's re-registration of nobody: the pool stays at rest
