"""What the cluster side needs from the serving engine (the agent's AsyncEngine satisfies it)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from loraplex.routing.records import ServerLoad
from loraplex.spec.adapter import AdapterInfo


class LoadedAdapter(Protocol):
    info: AdapterInfo
    path: str


class ServingEngine(Protocol):
    adapters: dict[str, LoadedAdapter]  # in host memory, by name

    async def add_adapter(self, name: str, path: str | Path) -> AdapterInfo: ...

    async def remove_adapter(self, name: str) -> AdapterInfo: ...


def engine_load(engine) -> tuple[ServerLoad, tuple[str, ...]]:
    """(load, GPU-resident adapter names) from the engine's last step snapshot."""
    snap = engine.snapshot()
    stats = snap.stats
    load = ServerLoad(running=stats.num_running, waiting=stats.num_waiting, kv_usage=round(stats.kv_usage, 4))
    return load, tuple(snap.resident_adapters)
