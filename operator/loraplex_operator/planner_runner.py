"""Runs the minimum-GPU planner off the handlers' path: a plan costs seconds of CPU (one twin run per
testing point), so a pool's tick only asks for one and reads the outcome at a later tick.

One worker thread for all pools: plans are CPU-bound, and several at once would only slow each
other down and starve the operator. Outcomes are kept by the digest of the plan's input, so an
unchanged workload is answered from the cache instead of being planned again."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from loraplex.sim.planner import Plan, PlanError

log = logging.getLogger(__name__)

PLAN_FAILED = "PlanFailed"      # the planner found no plan (an adapter starves a server on its own)
PLANNER_ERROR = "PlannerError"  # the planner itself raised: a bug, reported rather than hidden


@dataclass(frozen=True)
class PlanOutcome:
    key: str
    servers: int | None            # the plan's server count; None when it failed
    slots: tuple[int, ...] = ()    # adapter slots (A_max) per planned server
    adapters: int = 0              # adapters planned
    seconds: float = 0.0           # wall time the plan took
    reason: str = ""               # PLAN_FAILED or PLANNER_ERROR when it failed
    message: str = ""


def run_plan(key: str, job: Callable[[], Plan]) -> PlanOutcome:
    started = time.perf_counter()
    try:
        plan = job()
    except PlanError as exc:
        return PlanOutcome(key, None, (), 0, time.perf_counter() - started, PLAN_FAILED, str(exc))
    except Exception as exc:  # noqa: BLE001 (a worker thread: an escaped error would vanish)
        log.exception("the planner failed")
        return PlanOutcome(key, None, (), 0, time.perf_counter() - started, PLANNER_ERROR,
                           f"{type(exc).__name__}: {exc}")
    return PlanOutcome(key, plan.num_gpus, tuple(plan.a_max), len(plan.assignment), time.perf_counter() - started)


class PlannerRunner:
    def __init__(self, cache_size: int = 32) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be at least 1, got {cache_size}")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loraplex-planner")
        self._cache_size = cache_size
        self._done: OrderedDict[str, PlanOutcome] = OrderedDict()
        self._running: dict[str, Future[PlanOutcome]] = {}
        self._asked: dict[str, str] = {}  # pool -> the key it asked for last
        self._lock = threading.Lock()

    def ask(self, pool: str, key: str, job: Callable[[], Plan]) -> None:
        """Makes `key` the plan `pool` wants; runs `job` unless that plan is cached or running."""
        with self._lock:
            self._asked[pool] = key
            if key in self._done:
                self._done.move_to_end(key)
                return
            if key in self._running:
                return
            self._running[key] = self._executor.submit(self._run, key, job)

    def asked(self, pool: str) -> bool:
        with self._lock:
            return pool in self._asked

    def forget(self, pool: str) -> None:
        """`pool` wants no plan now (it has no adapters, or it left the planner)."""
        with self._lock:
            self._asked.pop(pool, None)

    def outcome(self, pool: str) -> PlanOutcome | None:
        """The outcome of the plan `pool` asked for last; None while it runs (or if none was asked)."""
        with self._lock:
            key = self._asked.get(pool)
            return self._done.get(key) if key is not None else None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the running plans finish; False if `timeout` passed first."""
        with self._lock:
            running = list(self._running.values())
        return not wait(running, timeout).not_done

    def close(self) -> None:
        """Drops queued plans and the cache; a running plan finishes in its thread."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._asked.clear()
            self._done.clear()
            self._running.clear()

    def _run(self, key: str, job: Callable[[], Plan]) -> PlanOutcome:
        """In the worker: the outcome is stored before the future completes, so `wait` sees it."""
        outcome = run_plan(key, job)
        log.info("plan %s: %s servers in %.2f s %s", outcome.key[:12], outcome.servers, outcome.seconds,
                 outcome.reason)
        with self._lock:
            self._running.pop(outcome.key, None)
            self._done[outcome.key] = outcome
            self._evict()
        return outcome

    def _evict(self) -> None:
        """Oldest first, but never a plan some pool asked for last (its tick still reads it)."""
        current = set(self._asked.values())
        spare = [k for k in self._done if k not in current]
        for key in spare[:max(0, len(self._done) - self._cache_size)]:
            del self._done[key]
