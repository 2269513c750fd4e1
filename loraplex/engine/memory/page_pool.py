"""The device page pool: equal-size pages, each owned by one kind of data.

KV blocks take pages today; adapter weights are the other kind a unified pool holds (FastLibra),
so ownership is tracked per kind from the start. Pages are ints; the tensors behind them belong to
the executor.
"""

from __future__ import annotations

import enum
from collections import Counter, deque


class PageKind(enum.Enum):
    KV = "kv"
    ADAPTER = "adapter"


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("a page pool needs at least one page")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._kind: dict[int, PageKind] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_by_kind(self) -> dict[PageKind, int]:
        counts = Counter(self._kind.values())
        return {kind: counts.get(kind, 0) for kind in PageKind}

    def allocate(self, count: int, kind: PageKind) -> list[int] | None:
        """`count` free pages, or None (and nothing taken) when too few are free."""
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._kind[page] = kind
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if self._kind.pop(page, None) is None:
                raise ValueError(f"page {page} is not allocated")
            self._free.append(page)
