"""Keeping under the API server's priority-and-fairness limits, quietly.

Both of the operator's clients (kopf's aiohttp session and the Kubernetes client of `KubernetesApi`)
take a token from one bucket before each request, so a storm of ten thousand objects reaches the
API server at a steady rate instead of all at once. A request the API server still answers 429 is
retried after its Retry-After; instead of one ERROR line per retry (kopf's own), the log gets one
line when throttling starts, one summary line per window while it lasts, and one when it ends."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("loraplex_operator.throttle")


class TokenBucket:
    """`qps` requests a second on average, `burst` at once; qps <= 0: no limit. Thread-safe."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.qps, self.burst, self._clock = qps, max(1, burst), clock
        self._tokens, self._at = float(self.burst), clock()
        self._lock = threading.Lock()

    def reserve(self) -> float:
        """Takes one request's token; returns the seconds to wait before sending the request."""
        if self.qps <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps) - 1.0
            self._at = now
            return 0.0 if self._tokens >= 0 else -self._tokens / self.qps


@dataclass
class ThrottleCount:
    """The 429 answers between two summary lines. Pure: the caller logs the lines it returns."""

    every_s: float = 30.0
    pending: int = 0          # 429s since the last summary
    total: int = 0            # 429s in the current throttled spell
    since: float | None = None  # when the current summary window began; None: not throttled

    def note(self, now: float) -> str | None:
        """Counts one 429; the first of a spell returns the line that announces it."""
        self.pending += 1
        self.total += 1
        if self.since is not None:
            return None
        self.since = now
        return (f"the API server is throttling this operator (HTTP 429): requests are retried after its "
                f"Retry-After, without a line each; a summary every {self.every_s:.0f} s while it lasts")

    def summary(self, now: float) -> str | None:
        """The line for the window that ended: how many 429s it saw, or that the spell is over;
        None while the window runs or when not throttled."""
        if self.since is None or now - self.since < self.every_s:
            return None
        window, count, self.pending, self.since = now - self.since, self.pending, 0, now
        if count:
            return f"the API server throttled {count} requests of this operator (HTTP 429) in the last " \
                   f"{window:.0f} s; each was retried"
        total, self.total, self.since = self.total, 0, None
        return f"the API server stopped throttling this operator ({total} requests answered 429, each retried)"


class Throttle:
    """The bucket and the count, shared by both clients; a reporter thread logs the summaries."""

    def __init__(self, qps: float, burst: int, every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket = TokenBucket(qps, burst, clock)
        self._count = ThrottleCount(every_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._reporter: threading.Thread | None = None

    def delay(self) -> float:
        return self.bucket.reserve()

    def throttled(self) -> None:
        """The API server answered one request 429 (it is retried)."""
        with self._lock:
            line = self._count.note(self._clock())
            if line and (self._reporter is None or not self._reporter.is_alive()):
                self._reporter = threading.Thread(target=self._report, name="throttle-report", daemon=True)
                self._reporter.start()
        if line:
            log.warning(line)

    def _report(self) -> None:
        while True:
            time.sleep(self._count.every_s)
            with self._lock:
                line = self._count.summary(self._clock())
                over = self._count.since is None
            if line:
                log.warning(line)
            if over:
                return


class QuietRetries(logging.Filter):
    """Drops kopf's ERROR line for each retry of a request the API server answered 429, counting it
    in the Throttle instead. Its lines for other failures, and a final give-up, stay."""

    def __init__(self, throttle: Throttle) -> None:
        super().__init__()
        self.throttle = throttle

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "failed; will retry" in message and "APITooManyRequestsError" in message:
            self.throttle.throttled()
            return False
        return True
