"""What the memory policies share: one device page pool for KV blocks (and adapter weights), a host
tier for swapped-out KV, the dependency tree that is the prefix cache, and the queue of copies and
evictions that goes out with the next step.

A request's block table starts with the cache's blocks it matched (owned and locked by the tree),
followed by its own. When it leaves the batch its computed full blocks join the tree and the rest
are freed, so a later request of the same adapter and digest (or the same request after a
preemption) starts from them. When pages run short, `_make_room` evicts unlocked device leaves of
the tree in the policy's order: a KV leaf moves to the host tier while it has room (else it is
dropped), an adapter leaves the device (the host tier keeps every loaded adapter). A policy file
says which adapters live in the pool, how they are copied in and in which order things leave.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from itertools import count

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.dependency_tree import DependencyTree, NodeKind, Tier
from loraplex.engine.memory.dependency_tree import TreeNode as Node
from loraplex.engine.memory.kv_cache import blocks_for
from loraplex.engine.memory.page_pool import PageKind, PagePool
from loraplex.engine.memory.stats import MemoryStats, ResidentAdapter
from loraplex.engine.messages import AdapterLoad, ExecutorResult, KVCopy, KVSwapIn, SchedulerOutput
from loraplex.engine.request import Request
from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.util.clock import Clock

AdapterPages = Callable[[AdapterInfo], int]
"""Device pages an adapter's weights take (the executor knows the layout; the twin, its profile)."""


def no_adapter_pages(info: AdapterInfo) -> int:
    """Adapters that cost no pages: for tests and tools that model no adapter memory."""
    return 0


class PagedMemory:
    policy = "base"
    shares_pool = True  # adapters and KV take the same pages (so every admission competes)
    async_loads = True  # adapters are copied in the background while ready requests run

    def __init__(self, config: EngineConfig, adapter_pages: AdapterPages, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.block_size = config.block_size
        self.pool = PagePool(config.num_blocks)
        self.host = PagePool(config.num_host_blocks) if config.num_host_blocks > 0 else None
        self.tree = DependencyTree(config.block_size, clock)
        self.keeps_prefixes = config.prefix_cache
        self._evict_batch = max(1, config.num_blocks // 64)  # pages freed at least when KV runs short
        self.adapter_pages_of = adapter_pages
        self.infos: dict[AdapterId, AdapterInfo] = {}
        self.queued: Callable[[AdapterId], bool] = lambda adapter: False  # set by the scheduler
        self._pins: dict[AdapterId, int] = {}
        self._retiring: set[AdapterId] = set()
        self._handles: dict[AdapterId, int] = {}
        self._free_handles: list[int] = []  # a min-heap of handles given back
        self._next_handle = count()
        self._shared: dict[str, int] = {}  # request_id -> leading blocks of its table owned by the tree
        self._locks: dict[str, list[Node]] = {}  # request_id -> the deepest tree nodes it holds
        self._jobs: dict[int, Node] = {}  # background copies in flight
        self._swap_in_nodes: dict[int, list[Node]] = {}  # KV swap-in job -> its nodes, top down
        self._fresh: set[AdapterId] = set()  # loaded on demand and not used yet: the next use was a miss
        self._job_ids = count()
        self._loads: list[AdapterLoad] = []
        self._evictions: list[int] = []
        self._swap_out: list[KVCopy] = []
        self._swap_in: list[KVSwapIn] = []
        self.counts = dict.fromkeys(("prefix_queries_tokens", "prefix_hit_tokens", "adapter_queries",
                                     "adapter_hits", "adapter_loads", "adapter_evictions", "kv_evictions",
                                     "kv_swap_outs", "kv_swap_ins"), 0)
        self._page_bytes = 0  # set by the engine when the executor knows it (stats only)

    # ---- registration ---------------------------------------------------------------------------

    def add_adapter(self, info: AdapterInfo, pinned: bool = False) -> None:
        if self._unretire(info.id):
            return
        self.infos[info.id] = info
        node = self.tree.add_adapter(info.id, self.adapter_pages_of(info), pinned=pinned)
        if pinned:
            self._load(node, on_demand=False)  # without room now, it loads at first use

    def adapter_pages(self, adapter: AdapterId) -> int:
        node = self.tree.adapter_node(adapter)
        return node.size if node is not None else 0

    def _unretire(self, adapter: AdapterId) -> bool:
        """The same weights were loaded again while the old copy waited to be unloaded: keep it."""
        if adapter not in self.infos:
            return False
        self._retiring.discard(adapter)
        return True

    def retire_adapter(self, adapter: AdapterId) -> None:
        self._retiring.add(adapter)
        self._try_retire(adapter)

    def _try_retire(self, adapter: AdapterId) -> None:
        node = self.tree.adapter_node(adapter)
        if (adapter not in self._retiring or self._pins.get(adapter) or self.queued(adapter) or node is None
                or node.lock_ref):
            return  # queued requests of an unloaded adapter are still served
        if node.tier is Tier.LOADING or any(self._adapter_node_of(n) is node for n in self._jobs.values()):
            return  # its copies finish first: their target pages must not be reused (on_result retires it)
        self._forget_adapter(adapter)

    @staticmethod
    def _adapter_node_of(node: Node) -> Node | None:
        while node is not None and node.kind is not NodeKind.ADAPTER:
            node = node.parent
        return node

    def _forget_adapter(self, adapter: AdapterId) -> None:
        released = self.tree.remove_adapter(adapter)
        self.pool.free(released.device_pages)
        if released.host_pages:
            self.host.free(released.host_pages)
        self._drop_handle(adapter)
        self._retiring.discard(adapter)
        self.infos.pop(adapter, None)
        self._pins.pop(adapter, None)

    # ---- adapters -------------------------------------------------------------------------------

    @property
    def assists_loads(self) -> bool:
        """A request may run while its adapter is copied in (the executor assists from the CPU)."""
        return self.config.cpu_assist and self.async_loads

    def holds(self, adapter: AdapterId) -> bool:
        node = self.tree.adapter_node(adapter)
        return node is not None and node.tier is Tier.DEVICE

    def pins(self, adapter: AdapterId) -> int:
        return self._pins.get(adapter, 0)

    def resident(self) -> list[AdapterId]:
        return [n.key for n in self.tree.adapter_nodes() if n.key is not None and n.tier is Tier.DEVICE]

    def can_acquire(self, adapter: AdapterId) -> bool:
        node = self.tree.adapter_node(adapter)
        if node is None:
            return False
        if node.tier is Tier.HOST:
            return self._reclaimable() >= node.size
        return node.tier is Tier.DEVICE or (node.tier is Tier.LOADING and self.assists_loads)

    def loading(self, adapter: AdapterId) -> bool:
        node = self.tree.adapter_node(adapter)
        return node is not None and node.tier is Tier.LOADING

    def acquire_adapter(self, adapter: AdapterId) -> int | None:
        node = self.tree.adapter_node(adapter)
        if node is None:
            raise ValueError(f"adapter {adapter} is not registered with the memory policy")
        if node.tier is Tier.HOST:
            self._load(node, on_demand=True)
        if node.tier is not Tier.DEVICE and not (node.tier is Tier.LOADING and self.assists_loads):
            return None  # its copy is in flight (or no memory yet): asked again next step
        self.counts["adapter_queries"] += 1  # once per admission, not on every try
        if adapter in self._fresh:
            self._fresh.discard(adapter)
        else:
            self.counts["adapter_hits"] += 1
        self.tree.lock(node)
        node.visits += 1
        node.last_access = self.clock.now()
        self._pins[adapter] = self._pins.get(adapter, 0) + 1
        return self._handles[adapter]

    def release_adapter(self, adapter: AdapterId) -> None:
        pins = self._pins.get(adapter, 0) - 1
        if pins < 0:
            raise ValueError(f"adapter {adapter} released more often than acquired")
        self._pins[adapter] = pins
        node = self.tree.adapter_node(adapter)
        self.tree.unlock(node)
        node.last_access = self.clock.now()
        if pins == 0:
            self._on_idle(adapter)
            self._try_retire(adapter)

    def _on_idle(self, adapter: AdapterId) -> None:
        """The last running request of `adapter` left: a policy may drop its weights now."""

    def _load(self, node: Node, on_demand: bool) -> None:
        """Start copying the adapter of `node` to the device if pages can be found. A load a request
        asked for makes that request's admission a miss; a prefetch does not."""
        pages_needed = node.size
        short = pages_needed - self.pool.num_free
        if short > 0 and (not on_demand or not self._make_room(short)):
            return  # a prefetch takes free pages only
        pages = self.pool.allocate(pages_needed, PageKind.ADAPTER)
        handle = self._take_handle(node.key)
        info = self.infos[node.key]
        self.counts["adapter_loads"] += 1
        if on_demand:
            self._fresh.add(node.key)
        if not self.async_loads:
            self.tree.begin_load(node, pages)
            self.tree.finish_load(node)
            self._loads.append(AdapterLoad(handle, node.key, info.rank, pages))
            return
        job = next(self._job_ids)
        self.tree.begin_load(node, pages)
        self._jobs[job] = node
        self._loads.append(AdapterLoad(handle, node.key, info.rank, pages, asynchronous=True, job=job))

    def _take_handle(self, adapter: AdapterId) -> int:
        handle = heapq.heappop(self._free_handles) if self._free_handles else next(self._next_handle)
        self._handles[adapter] = handle
        return handle

    def _drop_handle(self, adapter: AdapterId) -> None:
        handle = self._handles.pop(adapter, None)
        if handle is not None:
            heapq.heappush(self._free_handles, handle)
            self._evictions.append(handle)

    # ---- KV -------------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.pool.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    def begin(self, request: Request) -> bool:
        if not self.keeps_prefixes or not request.reuses_cached_prefix:
            return True
        usable = (request.num_tokens - 1) // self.block_size  # one token is always computed: it samples
        chain = self._match(request, request.token_slice(0, usable * self.block_size))
        on_device = next((i for i, n in enumerate(chain) if n.tier is not Tier.DEVICE), len(chain))
        if on_device < len(chain):
            anchors = self._ends(request, chain[:on_device]) if on_device else []
            for anchor in anchors:  # making room for the copy must not evict the prefix above it
                self.tree.lock(anchor)
            waiting = self._start_swap_in(chain[on_device:])
            for anchor in anchors:
                self.tree.unlock(anchor)
            if waiting:
                return False  # waits for its prefix to come back, other requests run
        chain = chain[:on_device]
        self.counts["prefix_queries_tokens"] += request.num_prompt_tokens
        self.counts["prefix_hit_tokens"] += min(len(chain) * self.block_size, request.num_prompt_tokens)
        if not request.num_preemptions:  # what the client saved: its first admission's hit
            request.num_cached_tokens = len(chain) * self.block_size
        if chain:
            locks = self._ends(request, chain)
            for node in locks:
                self.tree.lock(node)
            self._locks[request.request_id] = locks
            self._shared[request.request_id] = len(chain)
            request.block_ids = [n.device_pages[0] for n in chain]
            request.num_computed_tokens = len(chain) * self.block_size
        return True

    def _match(self, request: Request, tokens: list[int]) -> list[Node]:
        """The cached chain of `tokens`: an activated LoRA's base blocks, then its own from the block
        holding its start (only after every base block before it)."""
        adapter, start = request.cache_key
        head = start // self.block_size
        chain = self.tree.match(None, tokens[:head * self.block_size]).blocks if head else []
        if len(chain) < head:
            return chain
        return chain + self.tree.match(adapter, tokens, start).blocks

    def _ends(self, request: Request, chain: list[Node]) -> list[Node]:
        """The deepest nodes of `chain` in each subtree it crosses (an aLoRA's: the base's and its own)."""
        head = request.cache_key[1] // self.block_size
        return [chain[head - 1], chain[-1]] if 0 < head < len(chain) else [chain[-1]]

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        if request.num_computed_tokens + num_new_tokens <= len(request.block_ids) * self.block_size:
            return True  # the common decode step: the last block still has room
        needed = blocks_for(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if self.pool.num_free < needed:
            # a full pool of cache would otherwise rebuild the eviction heap for every new block
            self._make_room(max(needed - self.pool.num_free, self._evict_batch))
            if self.pool.num_free < needed:
                return False
        request.block_ids.extend(self.pool.allocate(needed, PageKind.KV))
        return True

    def release(self, request: Request) -> None:
        shared = self._shared.pop(request.request_id, 0)
        locked = self._locks.pop(request.request_id, [])
        own = request.block_ids[shared:]
        if self.keeps_prefixes:
            kept = self._insert(request)
            own = [page for page in own if page not in kept]
        self.pool.free(own)
        for node in locked:
            self.tree.unlock(node)
        request.block_ids = []

    def _insert(self, request: Request) -> set[int]:
        """Offers the request's computed full blocks to the tree (an activated LoRA's base blocks as
        the base model's, the rest as its own); returns the pages the tree holds now."""
        adapter, start = request.cache_key
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        head = min(start // self.block_size, full)
        tokens = request.token_slice(0, full * self.block_size)
        pages = request.block_ids[:full]
        offered = [(None, tokens[:head * self.block_size], pages[:head], 0)] if head else []
        if adapter not in self._retiring:
            offered.append((adapter, tokens, pages[head:], start))
        kept: set[int] = set()
        for key, keyed_tokens, keyed_pages, keyed_start in offered:
            inserted = self.tree.insert(key, keyed_tokens, keyed_pages, keyed_start)
            kept |= set(keyed_pages) - set(inserted.unadopted)
        return kept

    def _start_swap_in(self, nodes: list[Node]) -> bool:
        """Bring a matched host prefix back, top down; True when the request should wait for it."""
        if any(n.tier is Tier.LOADING for n in nodes):
            return True
        if self.pool.num_free < len(nodes) and not self._make_room(len(nodes) - self.pool.num_free):
            return False
        copies = []
        for node in nodes:
            page = self.pool.allocate(1, PageKind.KV)[0]
            copies.append(KVCopy(page, node.host_page))
            self.tree.begin_swap_in(node, page)
        job = next(self._job_ids)
        self._jobs[job] = nodes[-1]
        self._swap_in.append(KVSwapIn(job, copies))
        self.counts["kv_swap_ins"] += len(copies)
        self._swap_in_nodes[job] = nodes
        return True

    # ---- eviction -------------------------------------------------------------------------------

    def _eviction_key(self, node: Node) -> tuple:
        """Ascending: what leaves the device first; of the node's own state, not its children's.
        Policies override."""
        return (node.last_access,)

    def _evictable(self, node: Node) -> bool:
        """Whether this policy may take `node` off the device (the tree already says it is a leaf)."""
        return bool(node.device_pages)

    def _eviction_candidates(self) -> list[Node]:
        """Today's evictable leaves of the tree this policy may take."""
        return [n for n in self.tree.evictable_device_leaves() if self._evictable(n)]

    def _reclaimable(self) -> int:
        """Free pages plus the pages of today's evictable leaves: a lower bound on what eviction
        could free now (evicting a leaf can expose its parent as well)."""
        return self.pool.num_free + sum(len(n.device_pages) for n in self._eviction_candidates())

    def _make_room(self, pages: int) -> bool:
        """Evict unlocked device leaves in the policy's order until `pages` more pages are free."""
        tiebreak = count()
        heap = [(self._eviction_key(n), next(tiebreak), n) for n in self._eviction_candidates()]
        heapq.heapify(heap)
        freed = 0
        while freed < pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self.tree.is_evictable(node):
                continue  # became locked or gained a device child since the heap was built
            while node is not None:
                node = self._run_top(node, pages - freed, heap[0][0] if heap else None)
                parent = node.parent
                freed += self._evict(node)
                node = None
                if freed < pages and parent is not None and self.tree.is_evictable(parent) and self._evictable(parent):
                    key = self._eviction_key(parent)
                    if heap and not key < heap[0][0]:
                        heapq.heappush(heap, (key, next(tiebreak), parent))
                    else:  # it would be popped next (a tie goes behind what is queued): no round trip
                        node = parent
        return freed >= pages

    def _run_top(self, leaf: Node, wanted: int, head: tuple | None) -> Node:
        """The topmost of `leaf` and the parents `_make_room` would evict right after it, one by one:
        each the only child of an evictable block that is still wanted and sorts before the heap's
        `head`. Where eviction drops blocks (no host tier), dropping that one drops them all at once
        (a finished request's chain is one run: one drop instead of one per page)."""
        if self.host is not None or leaf.kind is not NodeKind.BLOCK:
            return leaf
        node = leaf
        while wanted > 1:  # evicting `node` frees its page: its parent is wanted only if more are
            parent = node.parent
            if (parent is None or parent.kind is not NodeKind.BLOCK or len(parent.children) != 1
                    or parent.tier is not Tier.DEVICE or parent.lock_ref or not self._evictable(parent)
                    or (head is not None and not self._eviction_key(parent) < head)):
                break
            node, wanted = parent, wanted - 1
        return node

    def _evict(self, node: Node) -> int:
        """Move a device leaf off the device (with `_run_top`'s run above it, when `node` is the
        run's top); returns the device pages freed."""
        if node.kind is NodeKind.ADAPTER:
            pages = self.tree.evict_adapter(node)
            self._drop_handle(node.key)
            self.counts["adapter_evictions"] += 1
        elif self.host is not None and self.host.num_free > 0:
            host_page = self.host.allocate(1, PageKind.KV)[0]
            page = self.tree.swap_out(node, host_page)
            self._swap_out.append(KVCopy(page, host_page))
            pages = [page]
            self.counts["kv_swap_outs"] += 1
        else:
            released = self.tree.drop(node)
            pages = released.device_pages
            if released.host_pages:
                self.host.free(released.host_pages)
            self.counts["kv_evictions"] += len(pages)
        self.pool.free(pages)
        return len(pages)

    # ---- per step -------------------------------------------------------------------------------

    @property
    def copies_in_flight(self) -> bool:
        return bool(self._jobs)

    def drain(self, out: SchedulerOutput, num_running: int) -> None:
        for adapter in list(self._retiring):  # its last queued request may have been aborted
            self._try_retire(adapter)
        self._upkeep(num_running)
        out.adapter_loads.extend(self._loads)
        out.adapter_evictions.extend(self._evictions)
        out.kv_swap_out.extend(self._swap_out)
        out.kv_swap_in.extend(self._swap_in)
        self._loads, self._evictions, self._swap_out, self._swap_in = [], [], [], []

    def _upkeep(self, num_running: int) -> None:
        """Background work a policy does every step (the swapper)."""

    def quiet_until(self) -> float:
        """Until when steps that only decode leave the policy nothing to do (no copy in flight, no
        adapter waiting to be unloaded); a policy with clock-driven upkeep says when it next acts."""
        return -math.inf if self._jobs or self._retiring else math.inf

    def note_decode_steps(self, starts: Sequence[float], num_running: int) -> None:
        """Steps of plain decodes ran at once (`BatchScheduler.advance_decodes`), starting at `starts`
        with `num_running` requests: what the upkeep of each would have recorded."""

    def on_result(self, result: ExecutorResult) -> None:
        for job in result.copies_done:
            node = self._jobs.pop(job, None)
            if node is None:
                continue
            if node.kind is NodeKind.ADAPTER:
                self.tree.finish_load(node)
                self._try_retire(node.key)
                continue
            for swapped in self._swap_in_nodes.pop(job):
                host_page = self.tree.finish_swap_in(swapped)
                self.host.free([host_page])
            adapter = self._adapter_node_of(node)
            if adapter is not None and adapter.key is not None:
                self._try_retire(adapter.key)

    # ---- stats ----------------------------------------------------------------------------------

    def stats(self) -> MemoryStats:
        cached_kv = self.tree.device_pages_by_kind()[PageKind.KV]
        running_kv = self.pool.pages_by_kind()[PageKind.KV] - cached_kv
        return MemoryStats(
            policy=self.policy, num_pages=self.pool.num_pages, adapter_pages=self._adapter_page_count(),
            running_kv_pages=running_kv, cached_kv_pages=cached_kv, free_pages=self.pool.num_free,
            host_kv_pages=self.tree.num_host_pages, invalid_kv_pages=self._invalid_kv_pages(),
            h2d_bytes=0, d2h_bytes=0, adapters=self._adapter_list(), **self.counts)

    def _adapter_page_count(self) -> int:
        return self.pool.pages_by_kind()[PageKind.ADAPTER]

    def _invalid_kv_pages(self) -> int:
        """Cached KV on the device whose adapter is not: impossible under the dependency tree."""
        return 0

    def _adapter_list(self) -> list[ResidentAdapter]:
        return [ResidentAdapter(n.key.name, self.infos[n.key].rank,
                                "gpu" if n.tier is not Tier.HOST else "cpu", n.pinned)
                for n in self.tree.adapter_nodes() if n.key is not None and n.key in self.infos]
