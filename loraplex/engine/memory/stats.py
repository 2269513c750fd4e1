"""A snapshot of the engine's memory side for metrics and benchmarks: pages, hit rates, copies."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ResidentAdapter:
    name: str
    rank: int
    level: str  # "gpu" (on the device, or being copied there) or "cpu" (host tier only)
    pinned: bool


@dataclass
class MemoryStats:
    policy: str  # unified, lru-static or no-cache
    num_pages: int  # device pages in the pool (KV blocks and adapter weights together)
    adapter_pages: int  # device pages holding adapter weights
    running_kv_pages: int  # KV pages of requests in the batch
    cached_kv_pages: int  # KV pages kept by the prefix cache (history), on the device
    free_pages: int
    host_kv_pages: int  # KV blocks swapped out to the host tier
    invalid_kv_pages: int  # device KV pages whose adapter is not on the device (FastLibra's waste)
    prefix_queries_tokens: int  # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # of those, tokens served from cached KV
    adapter_queries: int  # admissions of requests with an adapter
    adapter_hits: int  # of those, the adapter was already on the device
    adapter_loads: int  # host -> device adapter copies started
    adapter_evictions: int
    kv_evictions: int  # cached KV blocks dropped
    kv_swap_outs: int  # KV blocks copied device -> host
    kv_swap_ins: int  # KV blocks copied host -> device
    h2d_bytes: int  # host -> device bytes (adapters and KV)
    d2h_bytes: int  # device -> host bytes (KV)
    adapters: list[ResidentAdapter] = field(default_factory=list)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queries_tokens if self.prefix_queries_tokens else 0.0

    @property
    def adapter_hit_rate(self) -> float:
        return self.adapter_hits / self.adapter_queries if self.adapter_queries else 0.0

    @property
    def num_gpu_adapters(self) -> int:
        return sum(1 for a in self.adapters if a.level == "gpu")
