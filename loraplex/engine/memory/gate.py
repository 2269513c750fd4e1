"""Whether a waiting request's adapter can get device memory: the seam a scheduler's bypass and
squash decisions ask through, answered by the engine's memory policy (`DeviceMemory`): pages of
the unified pool, or a fixed slot under `lru-static`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from loraplex.engine.memory.device_memory import DeviceMemory
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId


class MemoryGate(Protocol):
    def holds(self, adapter: AdapterId) -> bool:
        """`adapter` already has its memory (a request of it needs none for the adapter)."""

    def can_admit(self, adapter: AdapterId | None) -> bool:
        """A request of `adapter` could get the memory for its adapter now."""

    def release_set(self, adapter: AdapterId | None, holders: Sequence[Request]) -> list[Request] | None:
        """The fewest of the running `holders` whose release would let `adapter` get memory; None
        when releasing them all would not help."""

    def competes(self, adapter: AdapterId | None) -> bool:
        """Admitting a request of `adapter` now takes memory a blocked request may be waiting for."""

    def loading(self, adapter: AdapterId | None) -> bool:
        """`adapter` has its memory and its copy is in flight: a request of it waits for nothing else."""


class PageGate:
    """An adapter gets memory when it is on the device or the policy can make room for it. Releasing
    holders helps when they are every request of their adapter: its weights become evictable."""

    def __init__(self, memory: DeviceMemory) -> None:
        self.memory = memory

    def holds(self, adapter: AdapterId) -> bool:
        return self.memory.holds(adapter)

    def can_admit(self, adapter: AdapterId | None) -> bool:
        return adapter is None or self.memory.can_acquire(adapter)

    def release_set(self, adapter: AdapterId | None, holders: Sequence[Request]) -> list[Request] | None:
        by_adapter: dict[AdapterId, list[Request]] = {}
        for request in {r.request_id: r for r in holders}.values():  # each request once
            if request.adapter is not None:
                by_adapter.setdefault(request.adapter, []).append(request)
        freeing = [group for a, group in by_adapter.items() if self.memory.pins(a) == len(group)]
        if not freeing:
            return None
        return min(freeing, key=lambda group: sum(r.num_computed_tokens for r in group))  # least work lost

    def loading(self, adapter: AdapterId | None) -> bool:
        return adapter is not None and self.memory.loading(adapter)

    def competes(self, adapter: AdapterId | None) -> bool:
        # in a shared pool every admission takes pages the head may need; with fixed slots only a
        # request whose adapter needs a slot competes
        return self.memory.shares_pool or (adapter is not None and not self.holds(adapter))
