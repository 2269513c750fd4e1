"""`lru-static`: vLLM's behaviour. `max_loras` adapter slots, each big enough for `max_lora_rank`,
are carved out of the page pool up front; the KV cache gets the rest. Adapters take a slot by LRU
and are copied in synchronously, in the step that first needs them. The prefix cache evicts its KV
by LRU, independently of the slots, so KV of an adapter that lost its slot stays behind (FastLibra's
invalid KV, counted in the stats)."""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.adapter_residency import LruResidency
from loraplex.engine.memory.dependency_tree import NodeKind, Tier
from loraplex.engine.memory.dependency_tree import TreeNode as Node
from loraplex.engine.memory.page_pool import PageKind
from loraplex.engine.memory.paged_memory import AdapterPages, PagedMemory
from loraplex.engine.memory.stats import ResidentAdapter
from loraplex.engine.messages import AdapterLoad
from loraplex.engine.options import options_for
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.util.clock import Clock

LARGEST_ADAPTER = AdapterId("largest-adapter", "")  # sizes a slot: max_lora_rank, every target module


class LruStaticMemory(PagedMemory):
    policy = "lru-static"
    shares_pool = False
    async_loads = False

    def __init__(self, config: EngineConfig, adapter_pages: AdapterPages, clock: Clock) -> None:
        super().__init__(config, adapter_pages, clock)
        options_for(config.memory_options, what="memory")  # takes none
        self.slots = LruResidency(config.max_loras)
        per_slot = adapter_pages(AdapterInfo(LARGEST_ADAPTER, config.max_lora_rank, 0))
        if per_slot * config.max_loras >= self.pool.num_pages:
            raise ValueError(f"{config.max_loras} adapter slots of rank {config.max_lora_rank} need "
                             f"{per_slot * config.max_loras} of the {self.pool.num_pages} pages, leaving nothing "
                             "for the KV cache; lower max_loras or max_lora_rank, or give it more memory")
        self._slot_pages = [self.pool.allocate(per_slot, PageKind.ADAPTER) for _ in range(config.max_loras)]

    def add_adapter(self, info: AdapterInfo, pinned: bool = False) -> None:
        if self._unretire(info.id):
            return
        self.infos[info.id] = info
        node = self.tree.add_adapter(info.id, 0)  # KV hangs below it; its weights live in a slot
        self.tree.begin_load(node, [])
        self.tree.finish_load(node)

    def adapter_pages(self, adapter: AdapterId) -> int:
        return 0  # slots are outside the shared pages

    def holds(self, adapter: AdapterId) -> bool:
        return self.slots.slot_of(adapter) is not None

    def can_acquire(self, adapter: AdapterId) -> bool:
        return self.slots.can_acquire(adapter)

    def loading(self, adapter: AdapterId) -> bool:
        return False  # a slot's load is synchronous: it is done within the step that grants it

    def pins(self, adapter: AdapterId) -> int:
        return self.slots.pins(adapter)

    def resident(self) -> list[AdapterId]:
        return self.slots.resident()

    def acquire_adapter(self, adapter: AdapterId) -> int | None:
        grant = self.slots.acquire(adapter)
        if grant is None:
            return None
        self.counts["adapter_queries"] += 1
        if grant.loaded:
            info = self.infos[adapter]
            pages = self._slot_pages[grant.slot][:self.adapter_pages_of(info)]
            self._loads.append(AdapterLoad(grant.slot, adapter, info.rank, pages))
            self.counts["adapter_loads"] += 1
            if grant.evicted is not None:
                self.counts["adapter_evictions"] += 1
        else:
            self.counts["adapter_hits"] += 1
        return grant.slot

    def release_adapter(self, adapter: AdapterId) -> None:
        self.slots.release(adapter)
        self._try_retire(adapter)

    def _try_retire(self, adapter: AdapterId) -> None:
        if adapter not in self._retiring or self.slots.pins(adapter) or self.queued(adapter):
            return
        slot = self.slots.retire(adapter)
        if slot is not None:
            self._evictions.append(slot)
        node = self.tree.adapter_node(adapter)
        if node is not None and not node.lock_ref:
            released = self.tree.remove_adapter(adapter)
            self.pool.free(released.device_pages)
            if released.host_pages:
                self.host.free(released.host_pages)
            self._retiring.discard(adapter)
            self.infos.pop(adapter, None)

    def _evictable(self, node: Node) -> bool:
        return node.kind is NodeKind.BLOCK  # slots are managed by LRU on their own

    def _eviction_candidates(self) -> list[Node]:
        return self.tree.evictable_device_leaves(NodeKind.BLOCK)

    def _adapter_page_count(self) -> int:
        return sum(len(pages) for pages in self._slot_pages)

    def _invalid_kv_pages(self) -> int:
        held = set(self.slots.resident())
        return sum(1 for adapter in self.tree.adapter_nodes() if not adapter.is_base and adapter.key not in held
                   for node in self.tree.subtree(adapter) if node.kind is NodeKind.BLOCK and node.tier is Tier.DEVICE)

    def _adapter_list(self) -> list[ResidentAdapter]:
        held = set(self.slots.resident())
        return [ResidentAdapter(a.name, info.rank, "gpu" if a in held else "cpu", False) for a, info in self.infos.items()]
