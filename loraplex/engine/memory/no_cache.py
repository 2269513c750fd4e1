"""`no-cache`: S-LoRA's behaviour. Adapters and KV share the page pool and adapters are copied in
the background, but an adapter leaves the device as soon as no running or queued request needs it,
and a finished request's KV is dropped (no prefix cache)."""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.paged_memory import AdapterPages, PagedMemory
from loraplex.engine.options import options_for
from loraplex.spec.adapter import AdapterId
from loraplex.util.clock import Clock


class NoCacheMemory(PagedMemory):
    policy = "no-cache"

    def __init__(self, config: EngineConfig, adapter_pages: AdapterPages, clock: Clock) -> None:
        super().__init__(config, adapter_pages, clock)
        options_for(config.memory_options, what="memory")  # takes none
        self.keeps_prefixes = False

    def _on_idle(self, adapter: AdapterId) -> None:
        node = self.tree.adapter_node(adapter)
        if node is not None and not self.queued(adapter) and self.tree.is_evictable(node) and node.device_pages:
            self._evict(node)
