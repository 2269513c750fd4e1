"""Adapters live in the KV page pool: the pool is the whole memory budget, an adapter's pages
follow its rank and modules, and lru-static carves its slots out of the same pool."""

from __future__ import annotations

import math

import pytest
import torch
from loraplex_agent.adapters.peft import load_peft_adapter
from loraplex_agent.runtime.device import (
    adapter_bytes_per_rank,
    kv_block_bytes,
    kv_token_bytes,
    kv_tokens_per_slot_rank,
    num_kv_blocks,
)
from loraplex_agent.runtime.llm import LLM
from loraplex_agent.runtime.model.config import LORA_MODULES, ModelConfig

CPU = torch.device("cpu")


def test_adapter_bytes_are_a_and_b_of_every_module_of_every_layer(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    per_layer = sum(sum(config.module_shape(m)) for m in LORA_MODULES)
    assert adapter_bytes_per_rank(config, torch.bfloat16) == per_layer * config.num_hidden_layers * 2
    assert kv_tokens_per_slot_rank(config, torch.float32, 64) == pytest.approx(
        adapter_bytes_per_rank(config, torch.float32) / kv_token_bytes(config, torch.float32))


def test_the_memory_budget_is_all_pages(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    sizing = dict(block_size=16, max_model_len=2048, max_num_seqs=10_000, kv_cache_memory_gib=0.125)
    assert num_kv_blocks(config, CPU, torch.float32, **sizing) == (1 << 27) // kv_block_bytes(config, 16, torch.float32)
    assert num_kv_blocks(config, CPU, torch.float32, num_blocks=7, **sizing) == 7


def test_an_adapters_pages_follow_its_rank(tiny_model):
    llm = LLM(tiny_model.base_dir, device="cpu", kv_cache_memory=0.0625, max_model_len=256, max_num_seqs=64)
    page = llm.executor.page_bytes
    for name, path in tiny_model.adapters.items():
        host = load_peft_adapter(name, path, llm.model_config, max_rank=llm.engine_config.max_lora_rank)
        per_rank = sum(a.numel() + b.numel() for a, b in host.weights.values()) * 4 / host.rank
        assert llm.executor.adapter_pages(host) == math.ceil(host.rank * per_rank / page)


def test_lru_static_carves_its_slots_out_of_the_pool(tiny_model):
    llm = LLM(tiny_model.base_dir, device="cpu", kv_cache_memory=0.0625, max_model_len=256, max_num_seqs=10_000,
              max_loras=4, max_lora_rank=32, memory_policy="lru-static")
    stats = llm.core.memory_stats()
    assert stats.adapter_pages == 4 * llm.executor.pages_for_rank(32)
    assert stats.free_pages == stats.num_pages - stats.adapter_pages
    with pytest.raises(ValueError, match="leaving nothing for the KV cache"):
        LLM(tiny_model.base_dir, device="cpu", num_blocks=40, max_model_len=256, max_loras=64, max_lora_rank=64,
            memory_policy="lru-static")
