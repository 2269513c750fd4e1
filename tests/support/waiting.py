"""Waiting, in the end-to-end tests, for what a running system does in its own time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_until(condition: Callable[[], object], timeout_s: float = 60.0, interval_s: float = 0.1,
               explain: Callable[[], str] | None = None) -> float:
    """Seconds it took; fails if `condition()` is not true within the (generous) bound, saying
    `explain()` when given (what the system was doing meanwhile)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"condition not met within {timeout_s} s" + (f": {explain()}" if explain else ""))
        time.sleep(interval_s)
    return time.monotonic() - start


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 60.0, interval: float = 0.5) -> Any:
    """The first truthy value of `probe()`; fails the test with `what` when none comes in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
