"""Per-adapter demand (prompt + output tokens, notes §3.4) counted in memory and flushed to the store.

Counts survive a store outage: a failed flush keeps them for the next attempt."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping

Flush = Callable[[Mapping[str, int]], None]


class DemandCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens: Counter[str] = Counter()

    def add(self, adapter: str, tokens: int) -> None:
        if tokens > 0:
            with self._lock:
                self._tokens[adapter] += tokens

    def flush(self, write: Flush) -> None:
        """Hands the counts to `write`; on an exception they are put back and the exception re-raised."""
        with self._lock:
            pending, self._tokens = self._tokens, Counter()
        if not pending:
            return
        try:
            write(dict(pending))
        except Exception:
            with self._lock:
                self._tokens.update(pending)
            raise
