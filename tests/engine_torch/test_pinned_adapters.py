"""Adapters staged in pinned host memory for CUDA loads: pinned only for a CUDA device, written to
the pages exactly as the pageable path writes them, bounded by a byte budget (least recently loaded
dropped first), and on a CUDA machine really page-locked and safe to drop while a copy is in flight."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.lora_pages import PagedAdapters
from loraplex_agent.runtime.pinned_adapters import PinnedAdapters, pins_adapters
from loraplex_kernels.lora_pages import read_adapter

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")


def host(tiny_model, name: str, config: ModelConfig) -> HostAdapter:
    return load_peft_adapter(name, tiny_model.adapters[name], config, max_rank=64)


def pool(config: ModelConfig, num_pages: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_pages, 16, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape, device=device), torch.zeros(shape, device=device))
            for _ in range(config.num_hidden_layers)]


def test_only_a_cuda_device_pins_adapters():
    assert not pins_adapters(torch.device("cpu"))
    assert pins_adapters(torch.device("cuda", 0))


def test_a_staged_adapter_fills_its_pages_as_the_pageable_path_does(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pageable, staged = PagedAdapters(config, pool(config, 64)), PagedAdapters(config, pool(config, 64))
    adapter = host(tiny_model, "lora01-r16", config)
    pages = list(range(40, 40 - staged.pages_needed(adapter), -1))
    pinned = PinnedAdapters(staged, budget_bytes=1 << 30, pin_memory=False)
    moved = pageable.load(1, adapter, pages)
    record, write = staged.copy_job(adapter, pages, staged=pinned.rows)
    assert write() == moved and len(pinned) == 1
    for (k, v), (k2, v2) in zip(pageable.kv_caches, staged.kv_caches, strict=True):
        assert torch.equal(read_adapter(k, v, pageable.resident[1]), read_adapter(k2, v2, record))
        assert torch.equal(k, k2) and torch.equal(v, v2)  # the padding of its last page too


def test_the_budget_drops_the_least_recently_loaded_adapter_first(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pages = PagedAdapters(config, pool(config, 64))
    a, b, c = (host(tiny_model, n, config) for n in ("lora00-r8", "lora04-r8", "lora02-r32"))
    size = pages.pages_needed(a) * pages.page_bytes
    assert pages.pages_needed(b) * pages.page_bytes == size
    e = dataclasses.replace(b, info=dataclasses.replace(b.info, id=dataclasses.replace(b.id, name="e")))
    pinned = PinnedAdapters(pages, budget_bytes=2 * size, pin_memory=False)
    assert pinned.add(a) and pinned.add(b) and pinned.nbytes == 2 * size
    assert not pinned.add(e)  # registering never drops another adapter
    assert pinned.rows(a) is pinned.rows(a)  # a is now the most recently loaded
    assert pinned.rows(c) is None  # larger than the whole budget: loads from pageable memory
    assert pinned.rows(e) is not None and len(pinned) == 2
    assert pinned.add(a) and not pinned.add(b)  # b, least recently loaded, was dropped for e
    pinned.discard(e.id)
    assert pinned.nbytes == size


def test_an_adapter_registered_again_under_its_id_is_staged_again(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pages = PagedAdapters(config, pool(config, 64))
    first = host(tiny_model, "lora00-r8", config)
    pinned = PinnedAdapters(pages, budget_bytes=1 << 30, pin_memory=False)
    old = pinned.rows(first)
    again = dataclasses.replace(first, scaling=2 * first.scaling)
    assert pinned.rows(again) is not old and len(pinned) == 1


def test_a_staged_tensor_of_another_shape_is_refused(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pages = PagedAdapters(config, pool(config, 64))
    r8, r16 = host(tiny_model, "lora00-r8", config), host(tiny_model, "lora01-r16", config)
    _, write = pages.copy_job(r16, list(range(pages.pages_needed(r16))), staged=lambda _: pages.stage(r8))
    with pytest.raises(ValueError, match="staged adapter"):
        write()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where pinned memory is refused")
def test_pinned_memory_refused_leaves_the_load_on_pageable_memory(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pages = PagedAdapters(config, pool(config, 64))
    pinned = PinnedAdapters(pages, budget_bytes=1 << 30)  # CPU-only torch refuses to pin
    adapter = host(tiny_model, "lora00-r8", config)
    assert pinned.rows(adapter) is None and not pinned.add(adapter) and len(pinned) == 0
    _, write = pages.copy_job(adapter, list(range(pages.pages_needed(adapter))), staged=pinned.rows)
    assert write() == pages.pages_needed(adapter) * pages.page_bytes


def test_a_cpu_engine_keeps_its_adapters_in_pageable_memory(tiny_model):
    from loraplex_agent.runtime.llm import LLM

    llm = LLM(tiny_model.base_dir, device="cpu", num_blocks=64, max_model_len=256)
    try:
        llm.add_adapter("sql", tiny_model.adapters["lora00-r8"])
        assert llm.executor.pinned is None
    finally:
        llm.executor.close()


@cuda
def test_on_cuda_staged_adapters_are_page_locked_and_copied_asynchronously(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    pageable, staged = PagedAdapters(config, pool(config, 64)), PagedAdapters(config, pool(config, 64, "cuda"))
    adapter = host(tiny_model, "lora01-r16", config)
    pinned = PinnedAdapters(staged, budget_bytes=1 << 30)
    rows = pinned.rows(adapter)
    assert rows is not None and rows.is_pinned()
    pages = list(range(staged.pages_needed(adapter)))
    pageable.load(1, adapter, pages)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        _, write = staged.copy_job(adapter, pages, staged=pinned.rows)
        write()
        pinned.discard(adapter.id)  # dropped while its copy may be in flight
        del rows
        # new pinned buffers must not take the dropped one's block before its copy is done
        for _ in range(4):
            torch.full((staged.pages_needed(adapter) * staged.page_bytes // 4,), 7.0, pin_memory=True)
    side.synchronize()
    for (k, v), (k2, v2) in zip(pageable.kv_caches, staged.kv_caches, strict=True):
        assert torch.equal(k, k2.cpu()) and torch.equal(v, v2.cpu())


@cuda
def test_a_cuda_engine_stages_a_registered_adapter_in_pinned_memory(tiny_model):
    from loraplex_agent.runtime.llm import LLM

    llm = LLM(tiny_model.base_dir, device="cuda", dtype="float32", num_blocks=64, max_model_len=256)
    try:
        info = llm.add_adapter("sql", tiny_model.adapters["lora00-r8"])
        assert llm.executor.pinned is not None and len(llm.executor.pinned) == 1
        assert llm.executor.pinned.rows(llm.adapters.host(info.id)).is_pinned()
        llm.remove_adapter("sql")
        assert len(llm.executor.pinned) == 0
    finally:
        llm.executor.close()
