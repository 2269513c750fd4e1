"""`unified`: FastLibra's unified pool with Chameleon's adapter cache (the default policy).

Adapters and KV share the device pages; an adapter stays on the device after its last request for
as long as nothing needs its pages (the cache grows into idle memory and shrinks the moment KV or a
new adapter needs room); a request's KV outlives it in the prefix cache. Eviction takes unlocked
leaves of the dependency tree (so no KV stays behind its adapter), adapters of queued requests last,
lowest score first: FastLibra's Eval by default, Chameleon's weighted score by option. Every
`interval_s` the swapper looks at usage: above `busy` it evicts down to it; below `idle` it brings
back, best score first, what left earlier (adapters, and KV swapped to the host tier).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.dependency_tree import NodeKind, Tier
from loraplex.engine.memory.dependency_tree import TreeNode as Node
from loraplex.engine.memory.eviction_scores import (
    NodeUse,
    adapter_reward,
    chameleon_scores,
    expected_batch_adapters,
    fastlibra_log_score,
)
from loraplex.engine.memory.paged_memory import AdapterPages, PagedMemory
from loraplex.engine.options import options_for
from loraplex.util.clock import Clock

SCORES = ("fastlibra", "chameleon", "lru")


@dataclass(frozen=True)
class UnifiedOptions:
    interval_s: float = 0.1  # FastLibra's monitor interval
    busy: float = 0.95  # usage above which the swapper evicts
    idle: float = 0.70  # usage below which it brings things back
    tau_s: float = 1.0  # time scale of the recency decay
    batch_window_s: float = 5.0  # window of the mean batch size behind Low_lora
    max_prefetch: int = 4  # copies the swapper starts per interval
    score: str = "fastlibra"  # fastlibra, chameleon or lru (FastLibra's WOS ablation)

    def __post_init__(self) -> None:
        if not 0.0 < self.idle <= self.busy <= 1.0:
            raise ValueError(f"memory options need 0 < idle <= busy <= 1, got idle={self.idle} busy={self.busy}")
        if self.score not in SCORES:
            raise ValueError(f"memory option score={self.score!r}: choose from {', '.join(SCORES)}")
        if self.interval_s <= 0 or self.tau_s <= 0 or self.batch_window_s <= 0 or self.max_prefetch < 0:
            raise ValueError("memory options interval_s, tau_s and batch_window_s must be positive")


class UnifiedMemory(PagedMemory):
    policy = "unified"

    def __init__(self, config: EngineConfig, adapter_pages: AdapterPages, clock: Clock) -> None:
        super().__init__(config, adapter_pages, clock)
        (self.options,) = options_for(config.memory_options, UnifiedOptions, what="memory")
        self._batch_sizes: deque[tuple[float, int]] = deque()
        self._next_tick = -math.inf
        self._score_context: tuple = ()

    # ---- eviction order -------------------------------------------------------------------------

    def _eviction_key(self, node: Node) -> tuple:
        queued = node.kind is NodeKind.ADAPTER and self.queued(node.key)
        return (queued, self._score(node), node.last_access)

    def _make_room(self, pages: int) -> bool:
        self._score_context = self._context()
        return super()._make_room(pages)

    def _context(self) -> tuple:
        adapters = [n for n in self.tree.adapter_nodes() if not n.is_base]
        total = sum(n.visits for n in adapters) or 1
        low = expected_batch_adapters((n.visits for n in adapters), self._mean_batch())
        reward = adapter_reward(low, self.tree.num_device_adapters)
        now = self.clock.now()
        top = (max((n.visits for n in adapters), default=1), max((now - n.last_access for n in adapters), default=1.0),
               max((n.size for n in adapters), default=1))
        return total, reward, now, top

    def _score(self, node: Node) -> float:
        total, reward, now, top = self._score_context or self._context()
        use = NodeUse(pages=node.size, visits=node.visits, idle_s=max(0.0, now - node.last_access),
                      is_adapter=node.kind is NodeKind.ADAPTER)
        if self.options.score == "lru":
            return node.last_access
        if self.options.score == "chameleon":
            reference = NodeUse(pages=top[2], visits=top[0], idle_s=top[1], is_adapter=True)
            return chameleon_scores([use, reference])[0]
        return fastlibra_log_score(use, total, reward, self.options.tau_s)

    def _mean_batch(self) -> float:
        sizes = self._batch_sizes
        return sum(n for _, n in sizes) / len(sizes) if sizes else 1.0

    # ---- the swapper ----------------------------------------------------------------------------

    def _upkeep(self, num_running: int) -> None:
        now = self.clock.now()
        self._note_batch(now, num_running)
        if now < self._next_tick:
            return
        self._next_tick = now + self.options.interval_s
        usage = 1.0 - self.pool.num_free / self.pool.num_pages
        if usage > self.options.busy:
            self._make_room(math.ceil((usage - self.options.busy) * self.pool.num_pages))
        elif usage < self.options.idle:
            self._prefetch()

    def _note_batch(self, now: float, num_running: int) -> None:
        self._batch_sizes.append((now, num_running))
        while self._batch_sizes and self._batch_sizes[0][0] < now - self.options.batch_window_s:
            self._batch_sizes.popleft()

    def quiet_until(self) -> float:
        return min(super().quiet_until(), self._next_tick)

    def note_decode_steps(self, starts: Sequence[float], num_running: int) -> None:
        for now in starts:
            self._note_batch(now, num_running)

    def _prefetch(self) -> None:
        """Bring back, best first, what the host tier holds, while usage stays at most `busy`."""
        self._score_context = self._context()
        candidates = [n for n in self.tree.swap_in_candidates()
                      if n.visits > 0 and (n.kind is NodeKind.ADAPTER or self.host is not None)]
        candidates.sort(key=self._score, reverse=True)
        room = self.pool.num_free - math.ceil((1.0 - self.options.busy) * self.pool.num_pages)
        started = 0
        for node in candidates:
            if started >= self.options.max_prefetch:
                break
            if node.size > room or node.tier is not Tier.HOST:
                continue
            if node.kind is NodeKind.ADAPTER:
                self._load(node, on_demand=False)
            else:
                self._start_swap_in([node])
            room -= node.size
            started += 1
