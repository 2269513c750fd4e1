"""The agent's one adapter registry (loraplex_agent.adapters.registry): what is servable, what is being
unloaded and where each one's folder is, changed by the engine thread and read by the event loop."""

from __future__ import annotations

import threading

import pytest
from loraplex_agent.adapters.registry import AdapterRecord, AdapterRegistry

from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import ConflictError, NotFoundError


def _record(name: str, digest: str = "sha256:a") -> AdapterRecord:
    return AdapterRecord(AdapterInfo(AdapterId(name, digest), rank=8, size_bytes=1000), f"/adapters/{name}")


def test_an_unloading_adapter_is_not_servable_and_its_name_not_free_until_forgotten() -> None:
    registry = AdapterRegistry()
    registry.add(_record("a"))
    registry.add(_record("b"))
    assert dict(registry.items()) == {"a": _record("a"), "b": _record("b")} and "a" in registry
    with pytest.raises(ConflictError, match="already loaded"):
        registry.add(_record("a", "sha256:new"))
    assert registry.begin_unload("a") == _record("a").info
    assert "a" not in registry and registry.get("a") is None and list(registry) == ["b"]
    assert registry.unloading() == {"a": _record("a").info}
    with pytest.raises(ConflictError, match="still being unloaded"):
        registry.add(_record("a", "sha256:new"))
    with pytest.raises(NotFoundError):
        registry.begin_unload("a")
    registry.forget("a")
    registry.add(_record("a", "sha256:new"))
    assert registry["a"].info.id.digest == "sha256:new" and registry.unloading() == {}


def test_the_loops_reads_hold_while_the_engine_thread_unloads() -> None:
    """items() and iteration are copies: an adapter unloaded meanwhile raises nothing in a reader."""
    registry = AdapterRegistry()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            for i in range(50):
                registry.add(_record(f"a{i}"))
            for i in range(50):
                registry.begin_unload(f"a{i}")
                registry.forget(f"a{i}")

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(2000):
            ranks = {name: record.info.rank for name, record in registry.items()}
            assert set(ranks.values()) <= {8}
            assert all(isinstance(name, str) for name in registry)
    finally:
        stop.set()
        thread.join()
