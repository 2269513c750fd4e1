"""Engines compared step by step in one process, each on its own clock of measured step times.

Two runs of the same trace one after the other on a shared machine see different machines: a
neighbour's job that slows the second run by a third puts a run at 0.9x of capacity past saturation.
Here every engine runs its own `replay` of the trace on a thread of its own, but only one step runs
at a time: the engine whose clock is behind (ties to the earlier one) always steps next. Its clock
(`StepClock`, virtual) moves by the wall time that step measured, and nothing else moves it but
`replay`'s jump to the next arrival when the engine is idle, so arrivals are admitted by the
engine's own time and a slow minute of the machine falls on the steps of every engine alike.

What the clock leaves out: the wall time between steps (the other engines' steps, waits for the
turn) and everything around the engine (HTTP, the serving loop). Background work of an engine
(its copy thread) may keep running while another engine steps. A slow-down shorter than a step (the
operating system giving the CPU to a neighbour for half a second) lands on one engine's step only;
a clock of the process's CPU time per step (`time.process_time`) leaves such stalls out, and with
them any sleep inside a step (a wait for a copy).

`time.process_time` counts every thread of the process, yet it charges a step with its own engine's
work only: a per-thread log of both engines (docs/benchmarks.md, issue 39, part 6) found the CPU of
an engine's steps on that engine's threads (its stepping thread, its torch worker, its copy thread;
each adapter copy started and finished within the step that started it), under 0.1% of it on the
other engine's. What it cannot remove is the machine's noise on the cost
of the same work: up to 4% more CPU for one engine's run than for the other's, over the same tokens
in batches of the same shape.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol, TypeVar, cast

from loraplex.engine.executor import Executor
from loraplex.engine.messages import ExecutorResult, RequestOutput, SchedulerOutput
from loraplex.engine.request import Request
from loraplex.util.clock import ManualClock

T = TypeVar("T")


class StepClock(ManualClock):
    """A virtual clock moved by measured time: `start` marks the start of a step, each `lap` adds the
    time `timer` measured since the last mark: wall time (`time.perf_counter`), or the CPU time of the
    process (`time.process_time`), which a neighbour that takes the CPU away in the middle of a step
    does not add to."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self.timer = timer
        self._mark = timer()

    def start(self) -> None:
        self._mark = self.timer()

    def lap(self) -> None:
        now = self.timer()
        self.advance(max(0.0, now - self._mark))
        self._mark = now


class Lapped:
    """An executor that laps its engine's clock when it returns: the scheduler's update then stamps
    the step's tokens with the time the step took."""

    def __init__(self, inner: Executor, clock: StepClock) -> None:
        self.inner = inner
        self.clock = clock

    def execute(self, output: SchedulerOutput) -> ExecutorResult:
        result = self.inner.execute(output)
        self.clock.lap()
        return result


class Baton:
    """Whose turn it is to step: no step runs beside another, and the next one is the one of the
    engine whose clock is behind among those not done."""

    def __init__(self, clocks: list[StepClock]) -> None:
        self.clocks = clocks
        self._done = [False] * len(clocks)
        self._busy = False
        self._failed = False
        self._cond = threading.Condition()

    def _is_turn(self, i: int) -> bool:
        mine = (self.clocks[i].now(), i)
        return self._failed or not self._busy and all(
            self._done[j] or mine <= (clock.now(), j) for j, clock in enumerate(self.clocks) if j != i)

    @contextmanager
    def turn(self, i: int) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: self._is_turn(i))
            if self._failed:
                raise RuntimeError("another engine of the interleaved run failed")
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def jump(self, i: int, t: float) -> None:
        """Engine `i` is idle until `t`: its clock goes there at once."""
        with self._cond:
            clock = self.clocks[i]
            clock.advance_to(max(t, clock.now()))
            self._cond.notify_all()

    def finish(self, i: int, failed: bool = False) -> None:
        with self._cond:
            self._done[i] = True
            self._failed = self._failed or failed
            self._cond.notify_all()


class Steps(Protocol):
    """What a lane drives: an EngineCore, or a client of one."""

    @property
    def num_steps(self) -> int: ...
    def add_request(self, request: Request) -> None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...


class Lane:
    """One engine as `replay` drives it (the methods it uses), its steps taken in turn."""

    def __init__(self, core: Steps, baton: Baton, index: int, clock: StepClock) -> None:
        self.core = core
        self.baton = baton
        self.index = index
        self.clock = clock

    def add_request(self, request: Request) -> None:
        self.core.add_request(request)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def step(self) -> list[RequestOutput]:
        with self.baton.turn(self.index):
            self.clock.start()
            outputs = self.core.step()
            self.clock.lap()
        return outputs

    @property
    def num_steps(self) -> int:
        return self.core.num_steps


def interleave(baton: Baton, runs: list[Callable[[], T]]) -> list[T]:
    """Each of `runs` (the i-th drives lane i of `baton`) on a thread of its own, to the end; their
    results in order. One that fails stops the others at their next turn, and its error is raised."""
    results: list[T | None] = [None] * len(runs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = runs[i]()
        except BaseException as exc:  # re-raised on the calling thread
            errors.append(exc)
            baton.finish(i, failed=True)
        else:
            baton.finish(i)

    threads = [threading.Thread(target=run, args=(i,), name=f"interleaved-{i}") for i in range(len(runs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return cast(list[T], results)
