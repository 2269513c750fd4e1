"""Group commit: many threads ask for the same work (re-sync a pool's routing table with its
registry); one runs it for everyone who asked before it started, the others wait for that run, and
whoever asks while it runs gets the next one. So a thousand LoRADeployments created at once cost a
handful of table versions, each caller still returns only after a run that saw its change."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Coalescer(Generic[T]):
    def __init__(self, work: Callable[[], T]) -> None:
        self._work = work
        self._cond = threading.Condition()
        self._asked = 0     # tickets handed out
        self._covered = 0   # every ticket up to this one has its run's outcome
        self._running = False
        self._outcome: tuple[T | None, BaseException | None] = (None, None)

    def __call__(self) -> T:
        with self._cond:
            self._asked += 1
            ticket = self._asked
            while self._covered < ticket and self._running:
                self._cond.wait()
            if self._covered >= ticket:
                return self._result()
            self._running = True
            upto = self._asked  # this run starts after every ticket so far was handed out
        result: T | None = None
        error: BaseException | None = None
        try:
            result = self._work()
        except BaseException as exc:  # handed to every caller this run covers
            error = exc
        with self._cond:
            self._running = False
            self._covered = upto
            self._outcome = (result, error)
            self._cond.notify_all()
            return self._result()

    def _result(self) -> T:
        result, error = self._outcome
        if error is not None:
            raise error
        return result  # type: ignore[return-value]
