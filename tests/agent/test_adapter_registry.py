"""The agent's one adapter registry (loraplex_agent.adapters.registry): each adapter's weights, folder
and state in one map, which is also the engine core's table; changed by the engine thread and read by
the event loop."""

from __future__ import annotations

import threading

import pytest
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.registry import AdapterRecord, AdapterRegistry

from loraplex.spec.adapter import AdapterId, AdapterInfo
from loraplex.spec.errors import ConflictError, NotFoundError


def _record(name: str, digest: str = "sha256:a") -> AdapterRecord:
    info = AdapterInfo(AdapterId(name, digest), rank=8, size_bytes=1000)
    return AdapterRecord(HostAdapter(info, scaling=1.0, weights={}), f"/adapters/{name}")


def _load(registry: AdapterRegistry, record: AdapterRecord) -> None:
    """As `LLM.register` with an engine that accepts it: held, then admitted by the core."""
    registry.hold(record)
    registry.admit(record.info)


def test_an_adapter_goes_held_servable_unloading_held_gone() -> None:
    registry, a = AdapterRegistry(), _record("a")
    registry.hold(a)
    assert "a" not in registry and registry.serving("a") is None and registry.host(a.info.id) is a.host
    with pytest.raises(ConflictError, match="being loaded"):
        registry.hold(_record("a", "sha256:new"))
    registry.admit(a.info)
    assert registry["a"] is a and registry.serving("a") == a.info
    assert registry.begin_unload("a") == a.info
    assert "a" not in registry and registry.get("a") is None and registry.unloading() == {"a": a.info}
    assert registry.serving("a") == a.info  # still in the engine: its accepted requests run
    with pytest.raises(ConflictError, match="still being unloaded"):
        registry.hold(_record("a", "sha256:new"))
    with pytest.raises(NotFoundError):
        registry.begin_unload("a")
    with pytest.raises(ConflictError, match="retire it first"):
        registry.release(a.info.id)
    assert registry.retire("a") == a.info and registry.serving("a") is None and registry.unloading() == {}
    assert registry.host(a.info.id) is a.host  # held until released
    registry.release(a.info.id)
    assert not registry.holds(a.info.id)
    with pytest.raises(NotFoundError):
        registry.host(a.info.id)
    _load(registry, _record("a", "sha256:new"))
    assert registry["a"].info.id.digest == "sha256:new"


def test_weights_answer_only_the_identity_they_were_read_as() -> None:
    registry = AdapterRegistry()
    _load(registry, _record("a", "sha256:old"))
    with pytest.raises(NotFoundError):
        registry.host(AdapterId("a", "sha256:new"))
    with pytest.raises(NotFoundError):
        registry.admit(_record("a", "sha256:new").info)  # only a held adapter of that identity
    with pytest.raises(NotFoundError):
        registry.release(AdapterId("a", "sha256:new"))
    assert registry.retire("nope") is None


def test_a_taken_name_is_refused_before_anything_changes() -> None:
    registry, a = AdapterRegistry(), _record("a")
    _load(registry, a)
    with pytest.raises(ConflictError, match="already loaded"):
        registry.hold(_record("a", "sha256:a"))  # the same identity again
    assert registry["a"] is a and registry.host(a.info.id) is a.host


def test_the_loops_reads_hold_while_the_engine_thread_unloads() -> None:
    """items() and iteration are copies: an adapter unloaded meanwhile raises nothing in a reader."""
    registry = AdapterRegistry()
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            records = [_record(f"a{i}") for i in range(50)]
            for record in records:
                _load(registry, record)
            for record in records:
                registry.begin_unload(record.info.id.name)
                registry.retire(record.info.id.name)
                registry.release(record.info.id)

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
