"""Outlier detection for the router: which servers to leave out of every pick for a while, and how
long a request may wait for its first byte. Pure, with an injected clock (Envoy's outlier detection,
cut to what a pool of LLM servers needs).

A server is ejected when

- `consecutive` of the router's attempts on it in a row failed: no first byte within the deadline,
  or the connection broke before it (the count starts again at its first answer);
- at once, when a connection to it could not be made (refused or timed out: nothing listens);
- at once, when it is *silent*: an attempt has waited longer than the server's heartbeat may be late,
  and its heartbeat is late too. The whole process has stopped (SIGSTOP, a long pause, a frozen node).

The k-th ejection in a row lasts k × `base_ejection_s`, at most `max_ejection_s` ("in a row": begun
within `max_ejection_s` of the end of the one before). A server that heartbeats but answers nothing
(a stuck GPU behind a live event loop) is out for that whole time: its heartbeat says nothing about
its answers. A silent server is out until a heartbeat newer than the last one seen before the
ejection arrives (the process runs again), or for `max_ejection_s` at most.

At most `max_ejected_fraction` of the servers are ejected at once (at least one, never all), counting
ejected servers that have left the registry meanwhile (the router drops silent ones from it): an
ejection beyond that does not happen and is reported as an overflow, so the router's own judgement
never empties the pool, nor takes out server after server while the pool re-places.
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from loraplex.routing.records import ServerRecord


class Failure(enum.Enum):
    """Why an attempt on a server failed before its first byte."""

    DEADLINE = "deadline"    # no first byte within the time-to-first-byte deadline
    TRANSPORT = "transport"  # the connection broke (reset, closed) before the first byte
    CONNECT = "connect"      # no connection could be made: ejects at once
    SILENT = "silent"        # waited past a late heartbeat: ejects at once, ends at the next heartbeat
    UNRESPONSIVE = "unresponsive"  # a non-streamed request past the deadline, and /health did not answer

    @property
    def ejects_at_once(self) -> bool:
        return self in (Failure.CONNECT, Failure.SILENT)


class Outcome(enum.Enum):
    COUNTED = "counted"    # counted; the server is not ejected (yet, or already was)
    EJECTED = "ejected"    # this failure ejected the server
    OVERFLOW = "overflow"  # it would have, but `max_ejected_fraction` of the pool is out already


@dataclass(frozen=True)
class OutlierConfig:
    consecutive: int = 3              # failures in a row that eject a server; 0: never eject
    base_ejection_s: float = 5.0      # the first ejection's length
    max_ejection_s: float = 60.0      # no ejection lasts longer (unless base_ejection_s is longer)
    max_ejected_fraction: float = 0.5

    def validate(self) -> OutlierConfig:
        if self.consecutive < 0:
            raise ValueError(f"consecutive failures must be >= 0 (0: never eject), got {self.consecutive}")
        if not self.base_ejection_s > 0 or not self.max_ejection_s > 0:
            raise ValueError("ejection times must be positive")
        if not 0.0 <= self.max_ejected_fraction <= 1.0:
            raise ValueError(f"the max ejected fraction must be in [0, 1], got {self.max_ejected_fraction}")
        return self

    @property
    def enabled(self) -> bool:
        return self.consecutive > 0 and self.max_ejected_fraction > 0

    def limit(self, live: int) -> int:
        """How many of `live` servers may be ejected at once: the fraction, at least one, never all."""
        if live <= 1 or self.max_ejected_fraction <= 0:
            return 0
        return min(live - 1, max(1, math.floor(self.max_ejected_fraction * live)))

    def ejection_s(self, in_a_row: int) -> float:
        return min(self.base_ejection_s * in_a_row, max(self.base_ejection_s, self.max_ejection_s))


@dataclass
class _State:
    failures: int = 0                  # consecutive failures since the last answer or ejection
    in_a_row: int = 0                  # ejections in a row (sets the next one's length)
    until: float = 0.0                 # ejected until this time; 0: not ejected
    ended_at: float = -math.inf        # when the last ejection ended
    silent_heartbeat: float | None = None  # a silent server's heartbeat_at when it was ejected


class OutlierDetector:
    """Counts failures per server and decides ejections. `servers` arguments are the live servers
    (the router's snapshot of the registry): the fraction is of them, and their heartbeats end
    silent servers' ejections."""

    def __init__(self, config: OutlierConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = (config or OutlierConfig()).validate()
        self.clock = clock
        self._states: dict[str, _State] = {}

    def ejected(self, servers: Mapping[str, ServerRecord]) -> frozenset[str]:
        """The live servers ejected now. Ends the ejections that are over first."""
        return frozenset(s for s in self._all_ejected(servers) if s in servers)

    def _all_ejected(self, servers: Mapping[str, ServerRecord]) -> list[str]:
        """Every server ejected now, live or not, after ending the ejections that are over."""
        now = self.clock()
        out = []
        for server, state in self._states.items():
            if not state.until:
                continue
            if self._over(state, servers.get(server), now):
                state.until, state.ended_at, state.silent_heartbeat, state.failures = 0.0, now, None, 0
            else:
                out.append(server)
        return out

    def record_success(self, server: str) -> None:
        """The server answered (a first byte): its count of failures in a row starts again."""
        state = self._states.get(server)
        if state is not None:
            state.failures = 0

    def record_failure(self, server: str, failure: Failure, servers: Mapping[str, ServerRecord]) -> Outcome:
        if not self.config.enabled:
            return Outcome.COUNTED
        ejected = self._all_ejected(servers)
        if server in ejected:
            return Outcome.COUNTED
        state = self._states.setdefault(server, _State())
        state.failures += 1
        if not failure.ejects_at_once and state.failures < self.config.consecutive:
            return Outcome.COUNTED
        if len(ejected) >= self.config.limit(len(set(servers) | set(ejected))):
            return Outcome.OVERFLOW
        self._eject(state, failure, servers.get(server))
        return Outcome.EJECTED

    def ejection_ends_in(self, server: str) -> float | None:
        """Seconds left of the server's ejection by time (a heartbeat may end it sooner); None if not ejected."""
        state = self._states.get(server)
        return max(0.0, state.until - self.clock()) if state is not None and state.until else None

    def _eject(self, state: _State, failure: Failure, record: ServerRecord | None) -> None:
        now = self.clock()
        state.in_a_row = state.in_a_row + 1 if now - state.ended_at <= self.config.max_ejection_s else 1
        silent = failure is Failure.SILENT and record is not None
        state.until = now + self.config.ejection_s(math.inf if silent else state.in_a_row)
        state.silent_heartbeat = record.heartbeat_at if silent else None
        state.failures = 0

    @staticmethod
    def _over(state: _State, record: ServerRecord | None, now: float) -> bool:
        if now >= state.until:
            return True
        return (state.silent_heartbeat is not None and record is not None
                and record.heartbeat_at > state.silent_heartbeat)


class TtfbDeadline:
    """The time-to-first-byte deadline of streamed requests: `floor_s`, or `factor` × the p90 of the
    last `window` first-byte times when that is longer. When every server's prefills get slow, the
    deadline grows with them, instead of cutting every request and sending it again (which would add
    load where there is too much already). `floor_s` <= 0: no deadline."""

    def __init__(self, floor_s: float, factor: float = 4.0, window: int = 256, min_samples: int = 20,
                 every: int = 16) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.min_samples = min_samples
        self.every = every
        self._times: deque[float] = deque(maxlen=window)
        self._since = 0
        self._current = floor_s if floor_s > 0 else math.inf

    def observe(self, seconds: float) -> None:
        self._times.append(seconds)
        self._since += 1
        if self._since >= self.every and len(self._times) >= self.min_samples:
            self._since = 0
            self._current = self._recompute()

    def current(self) -> float:
        """Seconds an attempt may wait for its first byte; inf when there is no deadline."""
        return self._current

    def _recompute(self) -> float:
        if self.floor_s <= 0:
            return math.inf
        ordered = sorted(self._times)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        return max(self.floor_s, self.factor * p90)
