"""Adapter slots are paid for before the KV cache: the accounting matches the tensors LoraSlots
allocates, a memory budget is split slots-first, and slots alone over the budget are an error."""

from __future__ import annotations

import pytest
import torch
from loraplex_agent.adapters import load_peft_adapter
from loraplex_agent.device import kv_block_bytes, kv_token_bytes, kv_tokens_per_slot_rank, num_kv_blocks
from loraplex_agent.llm import LLM
from loraplex_agent.model.lora_slots import LoraSlots, lora_slots_bytes, slot_bytes_per_rank, slot_rank_units
from loraplex_agent.model_config import LORA_MODULES, ModelConfig

CPU = torch.device("cpu")


def allocated_bytes(slots: LoraSlots) -> int:
    return sum(t.numel() * t.element_size()
               for layer in slots.layers for stack in layer.values()
               for buffers in (*stack.a.values(), *stack.b.values()) for t in buffers)


def test_slot_bytes_are_a_and_b_of_every_module_of_every_layer(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    per_layer = sum(sum(config.module_shape(m)) for m in LORA_MODULES)
    assert slot_bytes_per_rank(config, torch.bfloat16) == per_layer * config.num_hidden_layers * 2
    assert [slot_rank_units(r) for r in (1, 8, 48, 64)] == [1, 15, 127, 127]  # classes 1 + 2 + ... + 64


@pytest.mark.parametrize("num_slots, max_rank", [(3, 64), (8, 16), (1, 8)])
def test_accounting_matches_the_tensors_lora_slots_allocates(tiny_model, num_slots, max_rank):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    slots = LoraSlots(config, num_slots, CPU, torch.float32, max_lora_rank=max_rank)
    expected = lora_slots_bytes(config, torch.float32, num_slots, max_rank)
    assert allocated_bytes(slots) == expected
    fitting = [n for n in tiny_model.adapters if int(n.split("-r")[1]) <= max_rank]
    for i, name in enumerate(fitting * 2):  # fill every slot, then reload them: nothing grows
        slots.load(i % num_slots, load_peft_adapter(name, tiny_model.adapters[name], config, max_rank=max_rank))
    assert allocated_bytes(slots) == expected


def test_kv_tokens_per_slot_rank_is_slot_bytes_over_kv_token_bytes(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    per_slot_rank = kv_tokens_per_slot_rank(config, torch.float32, 64)
    slot = lora_slots_bytes(config, torch.float32, 1, 64)
    assert per_slot_rank == pytest.approx(slot / 64 / kv_token_bytes(config, torch.float32))
    # the profile's linear model then gives the KV tokens a budget leaves after 8 slots of rank 64
    budget_gib = 0.25
    blocks = num_kv_blocks(config, CPU, torch.float32, block_size=16, max_model_len=2048, max_num_seqs=10_000,
                           kv_cache_memory_gib=budget_gib, max_loras=8, max_lora_rank=64)
    base_tokens = int(budget_gib * (1 << 30)) // kv_token_bytes(config, torch.float32)
    assert blocks * 16 == pytest.approx(base_tokens - per_slot_rank * 8 * 64, abs=16)


def test_a_memory_budget_pays_for_the_slots_first(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    sizing = dict(block_size=16, max_model_len=2048, max_num_seqs=10_000, kv_cache_memory_gib=0.125)
    slots = lora_slots_bytes(config, torch.float32, 4, 64)
    with_slots = num_kv_blocks(config, CPU, torch.float32, max_loras=4, max_lora_rank=64, **sizing)
    assert with_slots == ((1 << 27) - slots) // kv_block_bytes(config, 16, torch.float32)
    assert num_kv_blocks(config, CPU, torch.float32, num_blocks=7, max_loras=4, max_lora_rank=64, **sizing) == 7
    with pytest.raises(ValueError, match="adapter slots of rank 64 need .* leaving nothing for the KV cache"):
        num_kv_blocks(config, CPU, torch.float32, max_loras=100_000, max_lora_rank=64, **sizing)


def test_the_engine_sizes_its_kv_cache_after_its_slots(tiny_model):
    llm = LLM(tiny_model.base_dir, device="cpu", kv_cache_memory=0.0625, max_model_len=256, max_num_seqs=10_000,
              max_loras=4, max_lora_rank=32)
    config = llm.model_config
    kv = sum(t.numel() * t.element_size() for pair in llm.executor.kv_caches for t in pair)
    assert allocated_bytes(llm.executor.lora) == lora_slots_bytes(config, torch.float32, 4, 32)
    assert kv + allocated_bytes(llm.executor.lora) <= 0.0625 * (1 << 30)
    assert kv + allocated_bytes(llm.executor.lora) > 0.0625 * (1 << 30) - kv_block_bytes(config, 16, torch.float32)
