"""The clock policies read. Production injects the monotonic clock; the simulator a virtual one."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class WallClock:
    """Seconds since the epoch: the placement controller keys demand windows by wall time, which
    every router and agent shares."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that only moves when told to: tests and the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock cannot go back")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        """Move to `t` exactly (a sum of steps taken at once lands where adding them one by one would)."""
        if t < self._now:
            raise ValueError("a clock cannot go back")
        self._now = t
