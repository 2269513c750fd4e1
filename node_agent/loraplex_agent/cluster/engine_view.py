"""What the cluster side (cluster/member.py) reads of the serving engine, declared once: the agent's
AsyncEngine and a vLLM server seen through loraplex_agent.vllm_backend.engine.VllmEngine both implement
ClusterEngine, so the member calls its methods and probes no attribute of either."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from loraplex.engine.request import Request, RequestStatus
from loraplex.routing.records import ServerBatch, ServerLoad
from loraplex.spec.adapter import AdapterInfo


class ClusterEngine(Protocol):
    adapters: Mapping[str, Any]  # the servable ones by name; each has `info` (AdapterInfo) and `path` (its folder)

    @property
    def healthy(self) -> bool:
        """False: the member leaves the registry until it is True again."""
        ...

    def health_problem(self) -> str | None:
        """Why it cannot serve now, or None."""
        ...

    @property
    def kv_block_size(self) -> int:
        """Tokens per KV block (prefix-aware routing); 0: unknown."""
        ...

    def cluster_report(self) -> tuple[ServerLoad, tuple[str, ...], ServerBatch | None]:
        """(load, GPU-resident adapter names, the open requests by rank or None) for the heartbeat."""
        ...

    def busy_adapters(self) -> frozenset[str]:
        """Adapters with requests running or waiting there, never evicted under them."""
        ...

    async def add_adapter(self, name: str, path: str | Path) -> AdapterInfo: ...

    async def remove_adapter(self, name: str) -> AdapterInfo: ...


def open_batch(requests: Iterable[Request], ranks: Mapping[str, int]) -> ServerBatch:
    """The open requests (running and waiting) by rank, for rank-aware routing; `ranks` of the loaded
    adapters by name."""
    return ServerBatch.from_requests(
        (ranks.get(r.adapter.name, 0) if r.adapter else 0, r.adapter.name if r.adapter else None,
         max(0, r.num_prompt_tokens - r.num_computed_tokens), r.num_tokens)
        for r in requests if r.status is not RequestStatus.FINISHED)
