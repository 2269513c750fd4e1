"""Adapters kept in page-locked (pinned) host memory, laid out as the device pages hold them.

On CUDA a host -> device copy from pageable memory is not asynchronous: the driver copies it
through a bounce buffer of its own at the pageable rate, holding the copy worker. So for a CUDA
device the executor keeps each adapter's rows staged as its pages hold them (the pool's dtype,
padded to whole pages, `PagedAdapters.stage`) in pinned memory: a load is then one DMA per layer
on the copy engine's side stream, with no host work. An adapter is staged when it is registered
(while it fits) and again when a load finds it unstaged.

Pinned memory cannot be swapped out and is taken from the OS, so the staged bytes are bounded
(`--pinned-adapter-memory`): past the budget the adapters least recently loaded are dropped, and an
adapter larger than the budget (or refused pinned memory by the OS) loads from pageable memory,
laid out at each load, as on the CPU.
On a CPU-only machine nothing is pinned (`pins_adapters`).

A staged tensor is never reused while a copy reads it: a background copy job holds it until the
job's completion event, and torch's pinned host allocator records every non-blocking copy's
stream on the block, so a tensor dropped from here returns to the allocator only once the copies
that read it are done.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from loraplex.spec.adapter import AdapterId
from loraplex.spec.engine_settings import AGENT_SETTINGS

if TYPE_CHECKING:  # torch is not imported at runtime: the CLI reads the default without it
    import torch

    from loraplex_agent.adapters.host import HostAdapter
    from loraplex_agent.runtime.model.lora_pages import PagedAdapters

log = logging.getLogger(__name__)

DEFAULT_PINNED_ADAPTER_GIB: float = AGENT_SETTINGS["pinned_adapter_memory_gib"].default


def pins_adapters(device: torch.device) -> bool:
    """Stage adapters in pinned memory for `device`: only CUDA copies gain (and only CUDA torch can pin)."""
    return device.type == "cuda"


class PinnedAdapters:
    """Staged adapters of `pages`' pool by id, least recently loaded first, within `budget_bytes`;
    `pin_memory` is False only in tests on a CPU-only machine. Thread-safe: the engine thread
    registers adapters while the copy worker loads them."""

    def __init__(self, pages: PagedAdapters, budget_bytes: int, pin_memory: bool = True) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the pinned adapter budget must be >= 0 bytes, not {budget_bytes}")
        self.pages = pages
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory
        self._staged: OrderedDict[AdapterId, tuple[HostAdapter, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes staged now."""
        with self._lock:
            return self._used()

    def __len__(self) -> int:
        with self._lock:
            return len(self._staged)

    def add(self, adapter: HostAdapter) -> bool:
        """Stage a newly registered adapter if it fits without dropping another; says whether it is staged."""
        return self._get(adapter, evict=False) is not None

    def rows(self, adapter: HostAdapter) -> torch.Tensor | None:
        """The adapter's staged rows for a load (staged now, dropping the least recently loaded, if
        needed), or None when it is larger than the whole budget."""
        return self._get(adapter, evict=True)

    def discard(self, adapter_id: AdapterId) -> None:
        """Drop an unregistered adapter's rows."""
        with self._lock:
            self._staged.pop(adapter_id, None)

    def _get(self, adapter: HostAdapter, evict: bool) -> torch.Tensor | None:
        size = self.pages.pages_needed(adapter) * self.pages.page_bytes
        with self._lock:
            entry = self._staged.get(adapter.id)
            if entry is not None and entry[0] is adapter:
                self._staged.move_to_end(adapter.id)
                return entry[1]
            self._staged.pop(adapter.id, None)  # another adapter of that id was registered since
            if size > self.budget_bytes or (not evict and self._used() + size > self.budget_bytes):
                return None
        try:
            staged = self.pages.stage(adapter, self.pin_memory)  # outside the lock: it takes a while
        except RuntimeError:  # the OS refused page-locked memory: this load copies from pageable memory
            log.warning("could not stage adapter %s in pinned memory", adapter.id, exc_info=True)
            return None
        with self._lock:
            self._staged.pop(adapter.id, None)
            used = self._used()
            while used + size > self.budget_bytes:
                _, (_, dropped) = self._staged.popitem(last=False)
                used -= dropped.nbytes
            self._staged[adapter.id] = (adapter, staged)
        return staged

    def _used(self) -> int:
        return sum(t.nbytes for _, t in self._staged.values())
