"""Whether a waiting request's adapter can get device memory: the seam a scheduler's bypass and
squash decisions ask through.

Today adapters live in device slots (`AdapterResidency`), so "memory" is a slot. The unified page
pool of adapters and KV (FastLibra, issue 10) will answer the same two questions in pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from loraplex.engine.adapter_residency import AdapterResidency
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


class SlotGate:
    """Memory is a slot: an adapter gets one when it is resident, a slot is free, or some resident
    adapter has no running request. Releasing holders frees a slot when they are every pin of
    their adapter."""

    def __init__(self, residency: AdapterResidency) -> None:
        self.residency = residency

    def holds(self, adapter: AdapterId) -> bool:
        return self.residency.slot_of(adapter) is not None

    def can_admit(self, adapter: AdapterId | None) -> bool:
        return adapter is None or self.residency.can_acquire(adapter)

    def release_set(self, adapter: AdapterId | None, holders: Sequence[Request]) -> list[Request] | None:
        by_adapter: dict[AdapterId, list[Request]] = {}
        for request in {r.request_id: r for r in holders}.values():  # each request once
            if request.adapter is not None:
                by_adapter.setdefault(request.adapter, []).append(request)
        freeing = [group for a, group in by_adapter.items() if self.residency.pins(a) == len(group)]
        if not freeing:
            return None
        return min(freeing, key=lambda group: sum(r.num_computed_tokens for r in group))  # least work lost

    def competes(self, adapter: AdapterId | None) -> bool:
        # joining a resident adapter takes no slot; KV blocks are not what a blocked head waits for
        return adapter is not None and not self.holds(adapter)
