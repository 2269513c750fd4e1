"""Closed-loop clients: the load that the benchmarks and the end-to-end tests put on a local stack."""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any


class ClosedLoop:
    """`clients` threads, each sending its next request when its last one is answered, until the `with`
    block ends (the requests under way finish first). Client k sends requests number k, k + clients,
    k + 2 clients, ...: a subclass picks the kind of request from its number, so the clients together
    send every kind. With `rate`, request i waits until i / rate seconds after the start: a steady rate
    over all the clients, while the answers keep up with it."""

    def __init__(self, clients: int, rate: float | None = None) -> None:
        self.clients = clients
        self.rate = rate
        self.lock = threading.Lock()  # for what the subclass records from every client
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def now(self) -> float:
        """Seconds since the load was made."""
        return time.monotonic() - self.t0

    def session(self) -> AbstractContextManager[Any]:
        """What each client opens once and hands to every send() (an HTTP client); default: nothing."""
        return nullcontext()

    def send(self, session: Any, i: int) -> None:
        """Send request number `i` and record its outcome (under self.lock)."""
        raise NotImplementedError

    def __enter__(self) -> ClosedLoop:
        # Daemons: a benchmark interrupted with Ctrl-C exits without waiting for their requests.
        self._threads = [threading.Thread(target=self._client, args=(k,), daemon=True) for k in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _client(self, first: int) -> None:
        with self.session() as session:
            for i in itertools.count(first, self.clients):
                if self._stop.wait(self._until_due(i)):
                    return
                self.send(session, i)

    def _until_due(self, i: int) -> float:
        return max(0.0, i / self.rate - self.now()) if self.rate else 0.0
