"""A restart that resumes ten thousand objects: one waiter per kopf readiness wait.

When the operator starts with objects in place, kopf gives each listed object a toggle in one
`ToggleSet` ("indexed") and each object's worker, once it has indexed its object, waits until every
toggle is on. kopf's `ToggleSet.wait_for` waits on one asyncio.Condition that every toggle change
notifies: N waiting workers are woken N times, O(N²) task wake-ups before the first handler runs and
before kopf watches again (2,000 objects: 40 s; 10,000: more than the 120 s the bench waited).
`share_toggle_waits` makes concurrent waits for the same state of the same set share one waiter on
the condition, and return when it does (the state held then, as when kopf's own wait returns).
Same result, O(N) wake-ups. Applied once, before kopf runs. It replaces a method of a kopf-internal
class: a kopf without it keeps kopf's own wait (a slower restart, said once in the log), and
tests/k8s/test_kopf_startup.py fails, so an upgrade that moved it is seen in CI."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)
_waits: weakref.WeakKeyDictionary[Any, dict[bool, asyncio.Future[None]]] = weakref.WeakKeyDictionary()


def share_toggle_waits() -> None:
    try:
        from kopf._cogs.aiokits.aiotoggles import ToggleSet
        original: Callable[[Any, bool], Coroutine[Any, Any, None]] = ToggleSet.wait_for
    except (ImportError, AttributeError):
        log.warning("this kopf has no ToggleSet.wait_for: restarts with thousands of objects resume slowly")
        return
    if getattr(original, "shared", False):
        return

    async def wait_for(self: Any, state: bool, /) -> None:
        state = bool(state)
        if self.is_on() == state:
            return
        shared = _waits.setdefault(self, {})
        waiter = shared.get(state)
        if waiter is None or waiter.done() or waiter.get_loop() is not asyncio.get_running_loop():
            waiter = shared[state] = asyncio.ensure_future(original(self, state))
        await asyncio.shield(waiter)  # a cancelled caller leaves the shared waiter to the others

    wait_for.shared = True  # type: ignore[attr-defined]
    ToggleSet.wait_for = wait_for  # type: ignore[method-assign]
