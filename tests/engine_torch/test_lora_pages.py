"""Adapters paged in the KV pool: the registry writes a host adapter into its pages of every layer,
serves it by handle, forgets it on eviction, and sizes it by its own rank and modules."""

from __future__ import annotations

import pytest
import torch
from loraplex_agent.adapters.host import HostAdapter
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.runtime.model.config import ModelConfig
from loraplex_agent.runtime.model.lora_pages import PagedAdapters, adapter_rank, full_row_len, lora_groups
from loraplex_kernels.lora_pages import read_adapter


def host(tiny_model, name: str, config: ModelConfig) -> HostAdapter:
    return load_peft_adapter(name, tiny_model.adapters[name], config, max_rank=64)


def pool(config: ModelConfig, num_pages: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_pages, 16, config.num_key_value_heads, config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]


def test_a_loaded_adapter_is_read_back_from_its_pages_in_every_layer(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    adapters = PagedAdapters(config, pool(config, 64))
    r16 = host(tiny_model, "lora01-r16", config)
    needed = adapters.pages_needed(r16)
    assert needed == adapters.pages_for_rank(16)  # the tiny adapters wrap every target module
    pages = list(range(63, 63 - needed, -1))  # any pages, in any order
    moved = adapters.load(5, r16, pages)
    assert moved == needed * adapters.page_bytes
    record = adapters.resident[5]
    assert record.pages == tuple(pages) and record.rank == 16
    q = record.layout.span("q_proj")
    for layer, (k, v) in enumerate(adapters.kv_caches):
        rows = read_adapter(k, v, record)
        a, b = r16.weights[(layer, "q_proj")]
        torch.testing.assert_close(rows[:, q.a_offset:q.b_offset], a)
        torch.testing.assert_close(rows[:, q.b_offset:q.end], b.t() * r16.scaling)
    adapters.evict(5)
    assert 5 not in adapters.resident


def test_pages_follow_the_adapters_own_rank_and_modules(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    adapters = PagedAdapters(config, pool(config, 8))
    adapter = host(tiny_model, "lora00-r8", config)
    a, b = adapter.weights[(1, "v_proj")]
    adapter.weights[(1, "v_proj")] = (torch.cat([a, a]), torch.cat([b, b], dim=1))  # rank 16 there
    for layer in range(config.num_hidden_layers):  # and no MLP at all
        for module in ("gate_proj", "up_proj", "down_proj"):
            del adapter.weights[(layer, module)]
    assert adapter_rank(adapter) == 16
    row_len = sum(sum(config.module_shape(m)) for m in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert row_len < full_row_len(config)
    assert adapters.pages_needed(adapter) == -(-16 * row_len // adapters.page_elements)
    record, write = adapters.copy_job(adapter, list(range(adapters.pages_needed(adapter))))
    assert record.layout.span("v_proj").rank == 16 and record.layout.span("q_proj").rank == 8
    assert record.layout.span("down_proj") is None
    write()
    rows = read_adapter(*adapters.kv_caches[0], record)
    q = record.layout.span("q_proj")
    assert not rows[8:, q.a_offset:q.end].any()  # q_proj's rank is 8: zero rows beyond


def test_a_copy_job_writes_nothing_until_it_runs(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    adapters = PagedAdapters(config, pool(config, 32))
    record, write = adapters.copy_job(host(tiny_model, "lora00-r8", config), list(range(20)))
    assert len(record.pages) == adapters.pages_needed(host(tiny_model, "lora00-r8", config)) < 20
    assert not any(k.any() or v.any() for k, v in adapters.kv_caches) and not adapters.resident
    assert write() > 0
    assert adapters.kv_caches[0][0][0].any()


def test_too_few_or_foreign_pages_are_refused(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    adapters = PagedAdapters(config, pool(config, 32))
    r16 = host(tiny_model, "lora01-r16", config)
    with pytest.raises(ValueError, match=r"needs \d+ pages, the load gives 3"):
        adapters.load(0, r16, [0, 1, 2])
    with pytest.raises(ValueError, match="outside the pool"):
        adapters.load(0, r16, list(range(40)))
    assert not adapters.resident


def test_groups_carry_the_models_output_widths(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    groups = lora_groups(config)
    assert groups["qkv"].out_features == tuple(config.module_shape(m)[1] for m in ("q_proj", "k_proj", "v_proj"))
    assert groups["qkv"].columns == (0, config.module_shape("q_proj")[1],
                                     config.module_shape("q_proj")[1] + config.module_shape("k_proj")[1])
    assert groups["down"].modules == ("down_proj",)
