"""Fixed adapter slots with LRU replacement: what the `lru-static` memory policy keeps its adapters in.

A request takes a slot when it is admitted and gives it back when it leaves the running set. An
adapter with running requests is never evicted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from loraplex.spec.adapter import AdapterId


@dataclass
class SlotGrant:
    slot: int
    loaded: bool  # True when the adapter must be copied into the slot before it is used
    evicted: AdapterId | None = None


class LruResidency:
    """At most `num_slots` adapters resident; the least recently used unpinned one leaves first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("adapter residency needs at least one slot")
        self.num_slots = num_slots
        self._slots: OrderedDict[AdapterId, int] = OrderedDict()  # LRU order, oldest first
        self._pins: dict[AdapterId, int] = {}
        self._pinned = 0  # resident adapters with pins: when all are, no slot can be had (no scan)
        self._free_slots = list(range(num_slots))  # a min-heap: the lowest free slot is taken first

    def acquire(self, adapter: AdapterId) -> SlotGrant | None:
        if adapter in self._slots:
            self._slots.move_to_end(adapter)
            pins = self._pins.get(adapter, 0)
            self._pinned += pins == 0
            self._pins[adapter] = pins + 1
            return SlotGrant(self._slots[adapter], loaded=False)
        free = heapq.heappop(self._free_slots) if self._free_slots else None
        evicted = None
        if free is None:
            if self._pinned == len(self._slots):
                return None
            victim = next(a for a in self._slots if not self._pins.get(a))
            free = self._slots.pop(victim)
            evicted = victim
        self._slots[adapter] = free
        self._pins[adapter] = 1
        self._pinned += 1
        return SlotGrant(free, loaded=True, evicted=evicted)

    def release(self, adapter: AdapterId) -> None:
        pins = self._pins.get(adapter, 0) - 1
        if pins < 0:
            raise ValueError(f"adapter {adapter} released more often than acquired")
        self._pins[adapter] = pins
        self._pinned -= pins == 0 and adapter in self._slots

    def can_acquire(self, adapter: AdapterId) -> bool:
        return adapter in self._slots or bool(self._free_slots) or self._pinned < len(self._slots)

    def slot_of(self, adapter: AdapterId) -> int | None:
        return self._slots.get(adapter)

    def pins(self, adapter: AdapterId) -> int:
        return self._pins.get(adapter, 0)

    def retire(self, adapter: AdapterId) -> int | None:
        if adapter not in self._slots or self._pins.get(adapter):
            return None
        self._pins.pop(adapter, None)
        slot = self._slots.pop(adapter)
        heapq.heappush(self._free_slots, slot)
        return slot

    def resident(self) -> list[AdapterId]:
        return list(self._slots)
