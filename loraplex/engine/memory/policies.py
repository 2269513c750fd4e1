"""Memory policies by name: what `EngineConfig.memory_policy` and `--memory-policy` choose from."""

from __future__ import annotations

from loraplex.engine.config import EngineConfig
from loraplex.engine.memory.lru_static import LruStaticMemory
from loraplex.engine.memory.no_cache import NoCacheMemory
from loraplex.engine.memory.paged_memory import AdapterPages, PagedMemory
from loraplex.engine.memory.unified import UnifiedMemory
from loraplex.util.clock import Clock

MEMORY_POLICIES: dict[str, type[PagedMemory]] = {"unified": UnifiedMemory, "lru-static": LruStaticMemory,
                                                  "no-cache": NoCacheMemory}


def make_memory(config: EngineConfig, adapter_pages: AdapterPages, clock: Clock) -> PagedMemory:
    try:
        cls = MEMORY_POLICIES[config.memory_policy]
    except KeyError:
        raise ValueError(f"unknown memory policy {config.memory_policy!r}; choose from {sorted(MEMORY_POLICIES)}") from None
    return cls(config, adapter_pages, clock)
