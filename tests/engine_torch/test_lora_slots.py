"""Device adapter slots: rank-class locations, reuse of freed indices, and per-module ranks."""

from __future__ import annotations

import torch
from loraplex_agent.adapters import load_peft_adapter
from loraplex_agent.host_adapter import HostAdapter
from loraplex_agent.model.lora_slots import LoraSlots
from loraplex_agent.model_config import ModelConfig


def host(tiny_model, name: str, config: ModelConfig) -> HostAdapter:
    return load_peft_adapter(name, tiny_model.adapters[name], config, max_rank=64)


def test_slots_get_consecutive_indices_per_rank_class_and_reuse_freed_ones(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    slots = LoraSlots(config, 4, torch.device("cpu"), torch.float32)
    r8, r16, other_r8 = (host(tiny_model, n, config) for n in ("lora00-r8", "lora01-r16", "lora04-r8"))
    slots.load(0, r8)
    slots.load(1, r16)
    slots.load(2, other_r8)
    assert [slots.location(s) for s in (0, 1, 2)] == [(8, 0), (16, 0), (8, 1)]
    slots.evict(0)
    assert slots.locations[0] is None and slots.adapters[0] is None
    slots.load(3, r8)
    assert slots.location(3) == (8, 0)  # the freed index is reused, so the class stays dense
    slots.load(2, r16)  # a slot reloaded with another adapter moves to that adapter's class
    assert slots.location(2) == (16, 1)
    q_proj = slots.layers[0]["qkv"]
    a, b = r16.weights[(0, "q_proj")]
    torch.testing.assert_close(q_proj.a[16][0][1], a.t())
    torch.testing.assert_close(q_proj.b[16][0][1], (b * r16.scaling).t())


def test_an_adapter_with_per_module_ranks_lives_in_the_class_of_its_largest(tiny_model):
    config = ModelConfig.from_dir(tiny_model.base_dir)
    slots = LoraSlots(config, 2, torch.device("cpu"), torch.float32)
    adapter = host(tiny_model, "lora00-r8", config)
    a, b = adapter.weights[(1, "v_proj")]
    adapter.weights[(1, "v_proj")] = (torch.cat([a, a]), torch.cat([b, b], dim=1))  # rank 16 there
    slots.load(0, adapter)
    assert slots.location(0) == (16, 0)
    qkv = slots.layers[1]["qkv"]
    torch.testing.assert_close(qkv.a[16][2][0], torch.cat([a, a]).t())  # v_proj: all 16 columns
    assert qkv.a[16][0][0][:, 8:].abs().sum() == 0 and qkv.b[16][0][0][8:].abs().sum() == 0  # q_proj padded
