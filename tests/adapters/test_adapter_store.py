"""The host store keeps adapters by id; a name answers its most recent version."""

from __future__ import annotations

import threading

import pytest
from loraplex_agent.adapters.peft import AdapterStore, load_peft_adapter

from loraplex.spec.errors import NotFoundError


def test_store_versions(tiny_model, model_config) -> None:
    store = AdapterStore()
    old = load_peft_adapter("chat", tiny_model.adapters["lora00-r8"], model_config, 64)
    new = load_peft_adapter("chat", tiny_model.adapters["lora01-r16"], model_config, 64)
    other = load_peft_adapter("sql", tiny_model.adapters["lora02-r32"], model_config, 64)
    for adapter in (old, new, other):
        store.add(adapter)
    assert store.names() == ["chat", "sql"] and len(store) == 3
    assert store.by_name("chat") is new and store.get(old.id) is old
    assert store.remove(new.id) is new
    assert store.by_name("chat") is old
    store.remove(old.id)
    assert store.by_name("chat") is None and store.names() == ["sql"]
    assert old.id not in store and other.id in store
    with pytest.raises(NotFoundError):
        store.get(old.id)
    with pytest.raises(NotFoundError):
        store.remove(old.id)


def test_store_concurrent_adds(tiny_model, model_config) -> None:
    store = AdapterStore()
    adapters = [load_peft_adapter(f"a{i}", tiny_model.adapters["lora00-r8"], model_config, 64) for i in range(16)]
    threads = [threading.Thread(target=store.add, args=(a,)) for a in adapters]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.names() == sorted(f"a{i}" for i in range(16))
    assert store.total_bytes() == sum(a.info.size_bytes for a in adapters)
